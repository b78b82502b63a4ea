"""Figures of the simulator's experiments (simrd section 5), written with matplotlib.

- :func:`plot_overhead`: compute overhead vs budget ratio, one panel per log,
  one line per heuristic, with the last ratio before thrashing (dashed) or
  OOM (dotted) and the constants' / largest op's share shaded (Figure 4).
- :func:`plot_accesses`: storage accesses vs budget ratio, log scale (Figure 6).
- :func:`plot_ablation`: the h_DTR ablation grid (Figures 11-14).
- :func:`plot_chain_scaling`: chain extra computations vs n (Figures 2-3).
- :func:`plot_memory_traces`: chain memory traces (Figures 7-10).

matplotlib (Agg backend) is imported inside the functions only, so importing
this module stays cheap. The format follows the file extension: .png or .svg.
"""
from __future__ import annotations

import math
import os
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

from dtr.core import ReplayStatus
from dtr.errors import DtrError
from dtr.heuristics import COST_MODES, Heuristic, get_heuristic

__all__ = ["check_figure_path", "plot_overhead", "plot_accesses", "plot_ablation", "ablation_heuristics",
           "plot_chain_scaling", "plot_memory_traces", "last_ok_ratio", "shaded_shares", "HEURISTIC_COLORS",
           "HEURISTIC_MARKERS"]

FORMATS = ("png", "svg")

# Fixed colours so a heuristic looks the same in every figure.
HEURISTIC_COLORS: Dict[str, str] = {
    "dtr": "#d62728", "eqclass": "#1f77b4", "local": "#2ca02c", "lru": "#ff7f0e",
    "largest": "#9467bd", "random": "#7f7f7f",
}
HEURISTIC_MARKERS: Dict[str, str] = {
    "dtr": "o", "eqclass": "s", "local": "^", "lru": "v", "largest": "D", "random": "P",
}
_EXTRA_COLORS = ["#8c564b", "#e377c2", "#bcbd22", "#17becf", "#393b79", "#637939"]


def check_figure_path(path) -> str:
    """The figure format of ``path`` (``png`` or ``svg``, from its extension).

    Raises:
        DtrError: another extension, or a directory that does not exist.
    """
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if ext not in FORMATS:
        raise DtrError(f"{path}: unknown figure format {ext or '(no extension)'!r} (use .png or .svg)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise DtrError(f"{path}: directory {parent} does not exist")
    return ext


def _pyplot():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path) -> None:
    fmt = check_figure_path(path)
    fig.savefig(os.fspath(path), format=fmt, dpi=130, bbox_inches="tight")
    import matplotlib.pyplot as plt
    plt.close(fig)


def _color(name: str, order: Sequence[str]) -> str:
    if name in HEURISTIC_COLORS:
        return HEURISTIC_COLORS[name]
    return _EXTRA_COLORS[list(order).index(name) % len(_EXTRA_COLORS)]


def _by_log(rows) -> "OrderedDict[str, list]":
    groups: "OrderedDict[str, list]" = OrderedDict()
    for r in rows:
        groups.setdefault(r.log, []).append(r)
    return groups


def _heuristic_order(rows) -> List[str]:
    """Registered heuristics in registration order, then the others as they come."""
    from dtr.heuristics import heuristic_names
    present = list(dict.fromkeys(r.heuristic for r in rows))
    known = [h for h in heuristic_names() if h in present]
    return known + [h for h in present if h not in known]


def _marker(name: str) -> str:
    return HEURISTIC_MARKERS.get(name, "o")


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _panel_title(rows) -> str:
    r = rows[0]
    if r.cost_unit == "unit":  # the toy chain: unit-size tensors
        return f"{r.model}  (peak {r.baseline_peak_bytes} tensors without eviction)"
    return f"{r.model}  (peak {_fmt_bytes(r.baseline_peak_bytes)} without eviction)"


def last_ok_ratio(rows) -> Tuple[Optional[float], Optional[str]]:
    """Going down from the largest ratio, the last ratio that succeeded and why the next failed.

    Args:
        rows: the sweep rows of one log and one heuristic.

    Returns:
        ``(ratio, status)``: the smallest ratio r such that every ratio >= r is
        ``ok``, and the status (``thrash`` or ``oom``) of the ratio just below;
        ``(None, None)`` when every ratio succeeded (nothing to mark) or when
        even the largest failed.
    """
    ordered = sorted(rows, key=lambda r: -r.budget_ratio)
    last = None
    for r in ordered:
        if r.status != ReplayStatus.OK:
            return (last, r.status) if last is not None else (None, None)
        last = r.budget_ratio
    return None, None


def shaded_shares(rows) -> Tuple[float, float]:
    """The constants' share of the peak and (constants + largest op) / peak for one log.

    A run that stopped early has only seen part of the log, so its
    ``constant_bytes`` and ``largest_op_bytes`` can be smaller: the maxima over
    the rows are the log's figures.
    """
    peak = max(max(r.baseline_peak_bytes for r in rows), 1)
    const = max(r.constant_bytes for r in rows)
    op = max(r.largest_op_bytes for r in rows)
    return const / peak, (const + op) / peak


def _grid(plt, count: int, ncols: int, width: float = 5.2, height: float = 3.9, sharey: bool = False):
    ncols = max(1, min(ncols, count))
    nrows = math.ceil(count / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False, sharey=sharey)
    flat = [ax for row in axes for ax in row]
    for ax in flat[count:]:
        ax.set_visible(False)
    return fig, flat[:count]


def _series(rows, value):
    """x, y over ratios with NaN for runs that did not finish (the line breaks there)."""
    rows = sorted(rows, key=lambda r: r.budget_ratio)
    xs = [r.budget_ratio for r in rows]
    ys = [value(r) if r.status == ReplayStatus.OK else float("nan") for r in rows]
    return xs, ys


def _figure_legend(fig, handles, labels, ncol: int) -> None:
    fig.legend(handles, labels, loc="lower center", ncol=ncol, frameon=False, fontsize=9,
               bbox_to_anchor=(0.5, -0.01))


def _start(path, items, what: str):
    """Check the figure path and that there is something to draw; returns pyplot.

    Raises:
        DtrError: a bad figure path, or no ``items`` (the message names ``what``).
    """
    check_figure_path(path)
    if not items:
        raise DtrError(f"no {what} to plot")
    return _pyplot()


def _log_panels(rows, path, ncols: int):
    """Checks and the common setup of the per-log figures: (pyplot, rows by log, heuristic order, figure, axes).

    Raises:
        DtrError: no rows, or a bad figure path.
    """
    plt = _start(path, rows, "sweep rows")
    groups = _by_log(rows)
    fig, axes = _grid(plt, len(groups), ncols)
    return plt, groups, _heuristic_order(rows), fig, axes


def plot_overhead(rows, path, *, title: Optional[str] = None, ncols: int = 3) -> None:
    """Compute overhead vs budget ratio, one panel per log, one line per heuristic.

    Runs that thrashed or ran out of memory are not drawn; for each heuristic a
    vertical line marks the last ratio before a failure: dashed when the next
    lower ratio thrashed, dotted when it ran out of memory. The dark band is the
    constants' share of the peak, the grey band the largest single operator's
    working set on top of it: no budget below their sum can work.

    Args:
        rows: :class:`~dtr.sim.sweep.SweepRow` s (any logs, heuristics, ratios).
        path: the figure (.png or .svg).
        title: the figure's title (default: none beyond the panel titles).
        ncols: panels per row.

    Raises:
        DtrError: no rows, or a bad figure path.
    """
    from matplotlib.artist import Artist
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    plt, groups, order, fig, axes = _log_panels(rows, path, ncols)
    for ax, lrows in zip(axes, groups.values()):
        r0 = lrows[0]
        const, op = shaded_shares(lrows)
        ax.axvspan(0, const, color="black", alpha=0.75, lw=0, zorder=0)
        ax.axvspan(const, max(op, const), color="0.6", alpha=0.5, lw=0, zorder=0)
        limit = r0.thrash_limit
        top = 1.0
        for h in order:
            hrows = [r for r in lrows if r.heuristic == h]
            if not hrows:
                continue
            c = _color(h, order)
            xs, ys = _series(hrows, lambda r: r.overhead)
            ax.plot(xs, ys, "-", marker=_marker(h), color=c, ms=4, lw=1.5, label=h, zorder=3, alpha=0.9,
                    mfc="none" if h == "eqclass" else c)
            top = max([top] + [y for y in ys if y == y])
            ratio, why = last_ok_ratio(hrows)
            if ratio is not None:
                ax.axvline(ratio, color=c, lw=1.3, ls="--" if why == ReplayStatus.THRASH else ":", alpha=0.9, zorder=2)
        xmax = max(1.0, max(r.budget_ratio for r in lrows))
        ax.set_xlim(0, xmax + 0.02)
        cap = limit if math.isfinite(limit) else top
        ax.set_ylim(0.98, min(cap, top) * 1.04 + 0.02)
        ax.set_title(_panel_title(lrows), fontsize=10)
        ax.set_xlabel("budget (fraction of peak memory without eviction)")
        ax.set_ylabel("compute overhead (total / base compute, ×)")
        ax.grid(True, alpha=0.3)
    handles: List[Artist] = [Line2D([], [], color=_color(h, order), marker=_marker(h), ms=4.5, lw=1.5,
                      mfc="none" if h == "eqclass" else _color(h, order)) for h in order]
    labels = list(order)
    handles += [Line2D([], [], color="0.2", ls="--"), Line2D([], [], color="0.2", ls=":"),
                Patch(color="black", alpha=0.75), Patch(color="0.6", alpha=0.5)]
    labels += ["last ratio before thrash", "last ratio before OOM", "constants (weights, inputs)",
               "largest single op's working set"]
    _figure_legend(fig, handles, labels, ncol=min(len(labels), 5))
    thr = f"; runs stop at {limit:g}× compute (thrash)" if math.isfinite(limit) else ""
    fig.suptitle(title or f"Compute overhead vs memory budget{thr}", fontsize=12)
    fig.tight_layout(rect=(0, 0.07 + 0.03 * (len(labels) > 5), 1, 0.97))
    _save(fig, path)


def plot_accesses(rows, path, *, title: Optional[str] = None, ncols: int = 3) -> None:
    """Storage accesses vs budget ratio, log-scale y, one panel per log (Figure 6).

    Only runs that finished are drawn (a stopped run's count is partial), and
    runs with no access at all (nothing to evict) are left out of the log axis.

    Raises:
        DtrError: no rows, or a bad figure path.
    """
    from matplotlib.lines import Line2D
    plt, groups, order, fig, axes = _log_panels(rows, path, ncols)
    for ax, lrows in zip(axes, groups.values()):
        for h in order:
            hrows = [r for r in lrows if r.heuristic == h]
            if hrows:
                # a run that never evicted may touch no metadata at all: 0 has no place on a log axis
                xs, ys = _series(hrows, lambda r: r.storage_accesses if r.storage_accesses > 0 else float("nan"))
                ax.plot(xs, ys, "-", marker=_marker(h), color=_color(h, order), ms=4, lw=1.5, label=h,
                        mfc="none" if h == "eqclass" else _color(h, order))
        ax.set_yscale("log")
        ax.set_xlim(0, max(1.0, max(r.budget_ratio for r in lrows)) + 0.02)
        ax.set_title(_panel_title(lrows), fontsize=10)
        ax.set_xlabel("budget (fraction of peak memory without eviction)")
        ax.set_ylabel("storage accesses (count, log scale)")
        ax.grid(True, which="major", alpha=0.3)
    handles = [Line2D([], [], color=_color(h, order), marker=_marker(h), ms=4.5, lw=1.5,
                      mfc="none" if h == "eqclass" else _color(h, order)) for h in order]
    _figure_legend(fig, handles, order, ncol=len(order))
    fig.suptitle(title or "Storage accesses (heuristic evaluations and metadata upkeep) vs memory budget",
                 fontsize=12)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    _save(fig, path)


def ablation_heuristics(base: str = "dtr") -> List[Heuristic]:
    """The 16 ablations of the paper's Figures 11-14: cost in full/eqclass/local/none x size x staleness.

    The unablated one keeps its registered name (``dtr``); the others are named
    like ``dtr[local,nosize,stale]`` (see :meth:`Heuristic.ablate`).
    """
    b = get_heuristic(base)
    return [b.ablate(cost=c, size=s, staleness=t) for c in COST_MODES for s in (True, False) for t in (True, False)]


_ABLATION_STYLE = {  # (size, staleness) -> (label, colour, line style)
    (True, True): ("size + staleness", "#d62728", "-"),
    (True, False): ("size only", "#1f77b4", "--"),
    (False, True): ("staleness only", "#2ca02c", "-."),
    (False, False): ("neither", "#7f7f7f", ":"),
}
_COST_TITLES = {"full": "c = e* (full)", "eqclass": "c = EqClass", "local": "c = local", "none": "c = none"}


def plot_ablation(rows, path, *, base: str = "dtr", title: Optional[str] = None) -> None:
    """The ablation grid: rows = logs, columns = cost term, one line per (size, staleness).

    Args:
        rows: sweep rows whose heuristics come from :func:`ablation_heuristics`
            (other heuristics are ignored).
        path: the figure (.png or .svg).
        base: the heuristic the ablations were built from.

    Raises:
        DtrError: no ablation rows, or a bad figure path.
    """
    spec = {h.name: h for h in ablation_heuristics(base)}
    rows = [r for r in rows if r.heuristic in spec]
    plt = _start(path, rows, "ablation rows (run the heuristics of ablation_heuristics())")
    from matplotlib.lines import Line2D
    groups = _by_log(rows)
    fig, axes = plt.subplots(len(groups), len(COST_MODES), figsize=(4.2 * len(COST_MODES), 3.3 * len(groups)),
                             squeeze=False)
    for i, lrows in enumerate(groups.values()):
        limit = lrows[0].thrash_limit
        for j, cost in enumerate(COST_MODES):
            ax = axes[i][j]
            for (size, stale), (_, color, ls) in _ABLATION_STYLE.items():
                hrows = [r for r in lrows if spec[r.heuristic].cost == cost
                         and spec[r.heuristic].use_size == size and spec[r.heuristic].use_staleness == stale]
                if hrows:
                    xs, ys = _series(hrows, lambda r: r.overhead)
                    ax.plot(xs, ys, ls, marker="o", ms=3, color=color, lw=1.5)
            ax.set_xlim(0, 1.02)
            ax.set_ylim(0.98, (limit if math.isfinite(limit) else 3.0) * 1.02)
            ax.grid(True, alpha=0.3)
            if i == 0:
                ax.set_title(_COST_TITLES[cost], fontsize=11)
            if j == 0:
                ax.set_ylabel(f"{lrows[0].model}\noverhead (×)", fontsize=10)
            if i == len(groups) - 1:
                ax.set_xlabel("budget (fraction of peak)")
    handles = [Line2D([], [], color=c, ls=ls, marker="o", ms=3.5, lw=1.5) for _, c, ls in _ABLATION_STYLE.values()]
    _figure_legend(fig, handles, [v[0] for v in _ABLATION_STYLE.values()], ncol=4)
    fig.suptitle(title or "h_DTR ablation: cost term (columns) × size and staleness terms (lines); "
                          "only finished runs drawn", fontsize=12)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    _save(fig, path)


def plot_chain_scaling(points, path, *, title: Optional[str] = None) -> None:
    """Extra computations vs n on the toy chain, one panel per budget spec (Figures 2-3).

    Chen et al.'s n extra computations is drawn on the ``sqrt`` panel and an
    ``n log2 n`` reference (shape only) on the ``log`` panel; runs that did not
    finish are marked with a cross at their partial count.

    Args:
        points: :class:`~dtr.sim.trace.ChainPoint` s.
        path: the figure (.png or .svg).

    Raises:
        DtrError: no points, or a bad figure path.
    """
    plt = _start(path, points, "chain points")
    specs = list(dict.fromkeys(p.budget_spec for p in points))
    names = {"sqrt": "B = ceil(2 sqrt n)", "log": "B = ceil(log2 n)"}
    fig, axes = _grid(plt, len(specs), len(specs), width=5.6, height=4.3)
    for ax, spec in zip(axes, specs):
        pts = [p for p in points if p.budget_spec == spec]
        order = list(dict.fromkeys(p.heuristic for p in pts))
        ns = sorted({p.n for p in pts})
        for h in order:
            hp = sorted((p for p in pts if p.heuristic == h), key=lambda p: p.n)
            ok = [(p.n, max(p.extra_compute, 1)) for p in hp if p.status == ReplayStatus.OK]
            bad = [(p.n, max(p.extra_compute, 1)) for p in hp if p.status != ReplayStatus.OK]
            c = _color(h, order)
            if ok:
                ax.plot(*zip(*ok), "-", marker=_marker(h), color=c, ms=4.5, lw=1.6, label=h,
                        mfc="none" if h == "eqclass" else c)
            if bad:
                ax.plot(*zip(*bad), "x", color=c, ms=7, mew=2, label=f"{h} (stopped: thrash/OOM)")
        if spec == "sqrt":
            ax.plot(ns, ns, "k--", lw=1.2, label="Chen et al.: n")
        elif spec == "log":
            ax.plot(ns, [n * math.log2(n) for n in ns], "k--", lw=1.2, label="n log2 n (shape)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("layers n (log scale)")
        ax.set_ylabel("extra computations (unit ops, log scale)")
        ax.set_title(f"Toy chain, {names.get(spec, 'B = ' + spec)}", fontsize=11)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=9)
    fig.suptitle(title or "Toy chain: extra computations vs number of layers (banishing)", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    _save(fig, path)


def plot_memory_traces(traces, path, *, ncols: int = 2, title: Optional[str] = None) -> None:
    """Memory traces side by side: rows = tensors (layer 0 at the bottom), columns = time steps.

    Dark cells: a resident forward tensor; bright cells: a resident gradient.

    Args:
        traces: :class:`~dtr.sim.trace.MemoryTrace` s.
        path: the figure (.png or .svg).
        ncols: panels per row.

    Raises:
        DtrError: no traces, or a bad figure path.
    """
    plt = _start(path, traces, "memory traces")
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    cmap = ListedColormap(["#ffffff", "#1b2a6b", "#ffb000"])
    fig, axes = _grid(plt, len(traces), ncols, width=6.2, height=4.6)
    for ax, tr in zip(axes, traces):
        grid = np.array(tr.cells, dtype=np.int8)
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=2, origin="lower", aspect="auto", interpolation="nearest")
        ax.set_xlabel("time step (one per computation, recomputations included)")
        ax.set_ylabel("tensor (layer index)")
        ax.set_title(f"{tr.title}\n{tr.extra_compute:g} extra computations, {tr.status}", fontsize=10)
    fig.legend([Patch(color="#1b2a6b"), Patch(color="#ffb000"), Patch(facecolor="#ffffff", edgecolor="0.5")],
               ["forward tensor resident", "gradient resident", "not resident"], loc="lower center", ncol=3,
               frameon=False, fontsize=9)
    fig.suptitle(title or "Memory traces of the toy chain", fontsize=12)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    _save(fig, path)
