"""Comparing static planners and DTR's heuristics on one log, through one evaluator."""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence, Union

from dtr.core import ReplayStatus
from dtr.sim.graph import Graph, PlanGraphError, graph_from_log, plan_graph
from dtr.sim.logs import Log, read_log

__all__ = ["CompareRow", "compare", "budget_range", "DTR_HEURISTICS", "plot_rows", "format_rows"]

#: The DTR heuristics every comparison includes.
DTR_HEURISTICS = ("dtr", "eqclass", "local", "lru")


@dataclass(frozen=True)
class CompareRow:
    """One planner (or DTR heuristic) at one budget.

    Attributes:
        planner: chen, rotor, checkmate, checkmate-lp, fastsa, hierarchical, or a
            heuristic's name.
        kind: ``static`` or ``dtr``.
        budget_bytes: the budget.
        budget_ratio: budget / the log's peak without eviction.
        status: ``optimal``, ``ok``, ``infeasible``, ``timeout``, ``oom``,
            ``thrash`` or ``n/a`` (a planner that does not apply to the graph,
            or a DTR run that cannot be exported over it; ``message`` says why).
        valid: the evaluator's verdict on the schedule (None: no schedule).
        peak_bytes: the schedule's peak (DTR without a schedule: the simulator's).
        total_compute: its total cost (likewise).
        base_compute: the log's compute.
        overhead: total / base (None without figures).
        solve_seconds: planning (or replay) time.
        gap: the ILP's relative gap (None for the others).
        message: the planner's remark.
    """

    planner: str
    kind: str
    budget_bytes: int
    budget_ratio: float
    status: str
    valid: Optional[bool]
    peak_bytes: Optional[int]
    total_compute: Optional[float]
    base_compute: float
    overhead: Optional[float]
    solve_seconds: float
    gap: Optional[float]
    message: str

    def to_dict(self) -> dict:
        return asdict(self)


_MAX_BUDGETS = 1000


def budget_range(spec: str) -> List[float]:
    """Ratios START:STOP:STEP, STOP inclusive.

    Raises:
        ValueError: a malformed range.
    """
    try:
        start, stop, step = (float(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"not a budget range: {spec!r} (use START:STOP:STEP ratios, e.g. 0.3:0.8:0.1)") from None
    if not (step > 0 and 0 < start <= stop and math.isfinite(stop)):
        raise ValueError(f"not a budget range: {spec!r} (need 0 < START <= STOP, all finite, and STEP > 0)")
    if (stop - start) / step > _MAX_BUDGETS:
        raise ValueError(f"not a budget range: {spec!r} (more than {_MAX_BUDGETS} budgets; use a larger STEP)")
    out, k = [], 0
    while start + k * step <= stop + 1e-9:
        out.append(round(start + k * step, 10))
        k += 1
    return out


def compare(log: Union[Log, str], budgets: Sequence[int], planners: Sequence[str], *,
            heuristics: Sequence[str] = DTR_HEURISTICS, options=None, thrash_limit: float = 3.0,
            baseline_peak: Optional[int] = None, graph: Optional[Graph] = None) -> List[CompareRow]:
    """Run every planner and DTR heuristic at every budget; evaluate every schedule.

    Args:
        log: a parsed log or a path.
        budgets: budgets in bytes.
        planners: registered planner names.
        heuristics: DTR heuristics (exported from the simulator's run).
        options: :class:`dtr.sim.planners.PlanOptions`.
        thrash_limit: the simulator's thrash limit.
        baseline_peak: the log's peak without eviction, if known.
        graph: the log's exact graph, if already extracted.

    Raises:
        ValueError: an unknown planner or heuristic.
    """
    from dtr.heuristics import get_heuristic
    from dtr.sim.export import ExportError, export_schedule
    from dtr.sim.planners import PlanOptions, get_planner, run_planner
    from dtr.sim.replay import baseline
    from dtr.sim.schedule import evaluate, plan_schedule
    for p in planners:
        get_planner(p)
    for h in heuristics:
        get_heuristic(h)
    if not isinstance(log, Log):
        log = read_log(log)
    options = options or PlanOptions()
    g = graph or graph_from_log(log)
    peak0 = baseline_peak if baseline_peak is not None else baseline(log)["peak_memory"]
    base = g.base_compute
    try:
        pg = plan_graph(g)
        why = ""
    except PlanGraphError as e:
        pg, why = None, str(e)
    rows: List[CompareRow] = []
    for b in budgets:
        ratio = b / peak0 if peak0 else math.inf
        for name in planners:
            if pg is None:
                rows.append(CompareRow(name, "static", b, ratio, "n/a", None, None, None, base, None, 0.0, None, why))
                continue
            r = run_planner(name, pg, b, options)
            valid = peak = total = ov = None
            msg = r.message
            if r.sequence is not None:
                ev = evaluate(g, plan_schedule(pg, r.sequence).steps, b)
                valid, peak, total, ov = ev.valid, ev.peak_bytes, ev.total_compute, ev.overhead
                if not ev.valid:
                    msg = f"{msg}; evaluator: {ev.error}".lstrip("; ")
            rows.append(CompareRow(name, "static", b, ratio, r.status, valid, peak, total, base, ov, r.solve_seconds,
                                   r.gap, msg))
        for h in heuristics:
            t0 = time.perf_counter()
            try:
                ex = export_schedule(log, h, b, thrash_limit=thrash_limit, graph=g)
            except ExportError as e:  # one run that is not a schedule over the graph: a row that says why
                rows.append(CompareRow(h, "dtr", b, ratio, "n/a", None, None, None, base, None,
                                       time.perf_counter() - t0, None, str(e)))
                continue
            dt = time.perf_counter() - t0
            if ex.status == ReplayStatus.OK:
                ev = evaluate(g, ex.schedule.steps, b)
                rows.append(CompareRow(h, "dtr", b, ratio, ex.status, ev.valid, ev.peak_bytes, ev.total_compute, base,
                                       ev.overhead, dt, None, "" if ev.valid else str(ev.error)))
            else:
                rows.append(CompareRow(h, "dtr", b, ratio, ex.status, None, ex.peak_bytes, ex.total_compute, base,
                                       ex.total_compute / base if base > 0 else None, dt, None,
                                       "stopped: figures at that moment"))
    return rows


def format_rows(rows: Sequence[CompareRow]) -> str:
    """A plain-text table of the rows."""
    head = f"{'budget':>14} {'ratio':>6} {'planner':<13} {'status':<10} {'valid':<6} {'peak':>14} " \
           f"{'overhead':>9} {'seconds':>8} {'gap':>8}"
    lines = [head]
    for r in rows:
        lines.append(f"{r.budget_bytes:>14} {r.budget_ratio:>6.3f} {r.planner:<13} {r.status:<10} "
                     f"{'-' if r.valid is None else str(r.valid).lower():<6} "
                     f"{'-' if r.peak_bytes is None else r.peak_bytes:>14} "
                     f"{'-' if r.overhead is None else format(r.overhead, '.4f'):>9} {r.solve_seconds:>8.2f} "
                     f"{'-' if r.gap is None else format(r.gap, '.2e'):>8}")
    return "\n".join(lines)


def plot_rows(rows: Sequence[CompareRow], path: str, title: str = "") -> None:
    """Overhead against budget ratio, one line per planner (valid schedules only)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    names = list(dict.fromkeys(r.planner for r in rows))
    markers = "osD^v<>px*h"
    for k, name in enumerate(names):
        pts = sorted((r.budget_ratio, r.overhead) for r in rows
                     if r.planner == name and r.valid and r.overhead is not None)
        if not pts:
            continue
        kind = next(r.kind for r in rows if r.planner == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[k % len(markers)],
                linestyle="--" if kind == "dtr" else "-", label=name)
    ax.set_xlabel("budget (fraction of the log's peak without eviction)")
    ax.set_ylabel("compute overhead (total / base)")
    ax.set_title(title or "rematerialization: static planners vs DTR")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
