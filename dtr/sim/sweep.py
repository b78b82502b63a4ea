"""Sweeps: every log x heuristic x budget ratio, replayed over several processes.

A sweep replays each log under each heuristic at budgets given as ratios of the
log's own peak memory without eviction, and yields one typed :class:`SweepRow`
per run: the fields of :class:`dtr.sim.replay.ReplayResult` plus ``model`` and
``budget_ratio``. With ``out`` the rows go to a CSV file, which doubles as a
checkpoint: rows already there are not run again. Every field is documented in
docs/results-fields.md.
"""
from __future__ import annotations

import csv
import math
import os
import re
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from dtr.errors import DtrError
from dtr.heuristics import Heuristic, get_heuristic, heuristic_names
from dtr.semantics import check_thrash_limit
from dtr.sim.replay import PLAN_FIELDS, ReplayResult

if TYPE_CHECKING:
    from dtr.sim.logs import Log

__all__ = ["SweepRow", "FIELDS", "sweep", "parse_ratios", "parse_heuristics", "read_rows", "model_label",
           "row_key"]

PathLike = Union[str, "os.PathLike[str]"]
HeuristicSpec = Union[str, Heuristic]
ProgressFn = Callable[[int, int, "SweepRow"], None]

# Ratios are compared (and keyed) after rounding to this many decimals, so
# 0.1 + 2 * 0.05 and 0.2 are the same budget.
_RATIO_DECIMALS = 6
_MAX_RATIOS = 10_000


@dataclass(frozen=True)
class SweepRow(ReplayResult):
    """One run of a sweep: one log, one heuristic, one budget ratio.

    A :class:`~dtr.sim.replay.ReplayResult` (same fields, names and meaning)
    plus ``model`` and ``budget_ratio``; the CSV columns are :data:`FIELDS`, in
    this order. See docs/results-fields.md.

    Attributes:
        log: the log's path, as given to :func:`sweep`.
        model: a label for the log: its v1 meta ``model`` (with ``batch`` and
            ``n`` when present), else the file name without ``.log``/``.gz``.
        budget_ratio: the budget as a fraction of ``baseline_peak_bytes``.
    """

    model: str = ""           # (defaults only because ReplayResult's last fields have them; sweep sets both)
    budget_ratio: float = 0.0

    @property
    def key(self) -> Tuple[str, str, float, float]:
        """``(log, heuristic, budget ratio, thrash limit)``: what makes a row unique in a file."""
        return row_key(self.log, self.heuristic, self.budget_ratio, self.thrash_limit)


# CSV column order: what identifies the run first, then the replay's fields.
FIELDS: Tuple[str, ...] = ("log", "model", "budget_ratio") + tuple(
    f.name for f in fields(ReplayResult) if f.name != "log" and f.name not in PLAN_FIELDS)

# Column -> (converter from CSV text, whether an empty cell means None).
_INT = {"budget_bytes", "baseline_peak_bytes", "peak_bytes", "evictions", "eager_evictions", "remats",
        "storage_accesses", "needed_bytes", "failed_line", "constant_bytes", "largest_op_bytes"}
_FLOAT = {"budget_ratio", "base_compute", "total_compute", "remat_compute", "overhead", "thrash_limit"}
_OPTIONAL = {"budget_bytes", "needed_bytes", "failed_line"}


def row_key(log: str, heuristic: str, ratio: float, thrash_limit: float) -> Tuple[str, str, float, float]:
    """The identity of a sweep run (the ratio rounded to 6 decimals)."""
    return (log, heuristic, round(float(ratio), _RATIO_DECIMALS), float(thrash_limit))


# Note [Budget ratio specs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# "START:STOP:STEP" includes STOP (the paper's figures run from 0.1 to 1.0), so
# the number of steps is computed with a small tolerance rather than by
# repeated float addition, and every ratio is rounded: "0.1:1.0:0.05" gives
# exactly 19 ratios 0.1, 0.15, ..., 1.0, whose keys match across reruns.


def parse_ratios(spec: str) -> List[float]:
    """Parse budget ratios: ``START:STOP:STEP`` (STOP included), a comma list, or one number.

    Args:
        spec: e.g. ``"0.1:1.0:0.05"`` (19 ratios), ``"0.2,0.5"`` or ``"0.4"``.

    Returns:
        The ratios, ascending, without duplicates, each > 0.

    Raises:
        ValueError: the spec is malformed; the message gives the expected form.
    """
    form = ("expected START:STOP:STEP with STOP included (e.g. 0.1:1.0:0.05), "
            "a comma-separated list (e.g. 0.2,0.5) or one ratio, all > 0")
    text = str(spec).strip()

    def number(part: str) -> float:
        try:
            x = float(part)
        except ValueError:
            raise ValueError(f"bad budget ratios {spec!r}: {part.strip()!r} is not a number; {form}") from None
        if not math.isfinite(x):
            why = "too large for a float" if math.isinf(x) else "not a number"
            raise ValueError(f"bad budget ratios {spec!r}: {part.strip()!r} is not finite ({why}); {form}")
        if x <= 0:
            raise ValueError(f"bad budget ratios {spec!r}: {part.strip()!r} is not > 0; {form}")
        return x

    if ":" in text:
        parts = text.split(":")
        if len(parts) != 3:
            raise ValueError(f"bad budget ratios {spec!r}: {form}")
        start, stop, step = (number(p) for p in parts)
        if stop < start:
            raise ValueError(f"bad budget ratios {spec!r}: STOP {stop:g} is below START {start:g}; {form}")
        count = int(math.floor((stop - start) / step + 1e-9)) + 1
        if count > _MAX_RATIOS:
            raise ValueError(f"bad budget ratios {spec!r}: {count} ratios (at most {_MAX_RATIOS}); {form}")
        ratios = [start + i * step for i in range(count)]
    elif text:
        ratios = [number(p) for p in text.split(",")]
    else:
        raise ValueError(f"bad budget ratios {spec!r}: empty; {form}")
    return sorted({round(r, _RATIO_DECIMALS) for r in ratios})


def parse_heuristics(spec: Union[str, Sequence[HeuristicSpec]]) -> List[Heuristic]:
    """Resolve ``"all"``, ``"dtr,lru"`` or a sequence of names / :class:`Heuristic` s.

    Raises:
        ValueError: an unknown name (the message lists the valid ones) or an empty list.
    """
    if isinstance(spec, str):
        names = heuristic_names() if spec.strip() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
        items: Sequence[HeuristicSpec] = names
    else:
        items = list(spec)
    if not items:
        raise ValueError(f"no heuristic given (use 'all' or a comma list of: {', '.join(heuristic_names())})")
    out: List[Heuristic] = []
    for h in items:
        h = get_heuristic(h) if isinstance(h, str) else h
        if h.name not in {x.name for x in out}:
            out.append(h)
    return out


def model_label(log) -> str:
    """A short label for a parsed :class:`~dtr.sim.logs.Log`: meta model (batch, n) or the file name."""
    meta = log.meta or {}
    if meta.get("model"):
        label = str(meta["model"])
        extras = [f"{k} {meta[k]}" for k in ("batch", "n") if meta.get(k) is not None]
        return f"{label} ({', '.join(extras)})" if extras else label
    name = os.path.basename(str(log.path))
    return re.sub(r"(\.(jsonl|json|log|txt))?(\.gz)?$", "", name) or name


# ---------------------------------------------------------------------------
# Running

# Note [One parse per worker]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Parsed logs hold a C++ Program, which does not pickle, and parsing a large
# log costs as much as several replays at generous budgets. So a task carries
# only the path; each worker process keeps the logs it has parsed in
# _WORKER_LOGS for its lifetime (one pool per sweep call). The main process
# parses each log once up front as well: that validates every log before any
# work starts (a bad log fails the sweep at once, naming its line) and gives
# the baseline peak, which the tasks carry so workers never replay it again.

_WORKER_LOGS: Dict[str, "Log"] = {}


@dataclass(frozen=True)
class _Task:
    log: str
    model: str
    peak: int
    heuristic: Heuristic
    ratio: float
    thrash_limit: float


def _run_task(task: _Task, cache: Optional[Dict[str, "Log"]] = None) -> SweepRow:
    from dtr.sim.logs import read_log
    from dtr.sim.replay import budget_from_ratio, replay
    cache = _WORKER_LOGS if cache is None else cache
    log = cache.get(task.log)
    if log is None:
        log = cache[task.log] = read_log(task.log)
    res = replay(log, task.heuristic, budget_from_ratio(task.peak, task.ratio), thrash_limit=task.thrash_limit,
                 baseline_peak=task.peak)
    d = asdict(res)
    d.update(log=task.log, model=task.model, budget_ratio=task.ratio, thrash_limit=float(task.thrash_limit))
    return SweepRow(**d)


def sweep(logs: Iterable[PathLike], heuristics: Union[str, Sequence[HeuristicSpec]],
          ratios: Union[str, Iterable[float]],
          *, thrash_limit: float = 3.0, jobs: Optional[int] = None, out: Optional[PathLike] = None,
          progress: Optional[ProgressFn] = None) -> List[SweepRow]:
    """Replay every log under every heuristic at every budget ratio.

    Args:
        logs: paths of v1 or simrd logs (gzip or not).
        heuristics: ``"all"``, ``"dtr,lru"``, or names / :class:`Heuristic` objects
            (e.g. ablations from :meth:`Heuristic.ablate`).
        ratios: budget ratios of each log's own peak without eviction, or a spec
            for :func:`parse_ratios`.
        thrash_limit: stop a run once its total compute passes this multiple of
            the log's compute (``math.inf``: never).
        jobs: worker processes (None: one per CPU; 1: run in this process).
        out: a CSV file; rows already in it (same log, heuristic, ratio and
            thrash limit) are not run again, the others are appended as they finish.
        progress: called as ``progress(done, total, row)`` after each new row.

    Returns:
        One row per (log, heuristic, ratio), in that nesting order, including
        the rows that were already in ``out``.

    Raises:
        LogFormatError: a log is missing or malformed.
        ValueError: an unknown heuristic, a bad ratio, a bad thrash limit or job count.
        DtrError: ``out`` exists but is not a sweep CSV.
    """
    from dtr.sim.logs import read_log
    from dtr.sim.replay import baseline, budget_from_ratio

    hs = parse_heuristics(heuristics)
    if isinstance(ratios, str):
        rs = parse_ratios(ratios)
    else:
        ratios = list(ratios)
        try:
            rs = sorted({round(float(r), _RATIO_DECIMALS) for r in ratios})
        except OverflowError:  # (an int past a float's range)
            rs = [math.inf]
    if not rs or any(not (r > 0 and math.isfinite(r)) for r in rs):
        raise ValueError(f"budget ratios must be finite and > 0 (got {rs})")
    thrash_limit = check_thrash_limit(thrash_limit)
    if jobs is not None and jobs < 1:
        raise ValueError(f"jobs must be at least 1 (got {jobs})")
    paths = list(dict.fromkeys(os.fspath(p) for p in logs))
    if not paths:
        raise ValueError("no log given")

    done: Dict[tuple, SweepRow] = {}
    if out is not None and os.path.exists(out):
        for row in read_rows(out):
            done[row.key] = row

    grid = [(p, h, r) for p in paths for h in hs for r in rs]
    todo_paths = {p for p, h, r in grid if row_key(p, h.name, r, thrash_limit) not in done}
    local_cache: Dict[str, "Log"] = {}
    info: Dict[str, Tuple[str, int]] = {}
    for p in paths:
        if p in todo_paths:
            log = local_cache[p] = read_log(p)
            info[p] = (model_label(log), baseline(log)["peak_memory"])
            budget_from_ratio(info[p][1], rs[-1])  # the largest budget fits the core, or fail before any run
    tasks = [_Task(p, info[p][0], info[p][1], h, r, thrash_limit) for p, h, r in grid
             if row_key(p, h.name, r, thrash_limit) not in done]
    # Low budgets take longest: start them first so the pool's tail is short.
    tasks.sort(key=lambda t: t.ratio)

    writer = _Appender(out) if out is not None and tasks else None
    try:
        def finished(row: SweepRow, count: int) -> None:
            done[row.key] = row
            if writer is not None:
                writer.write(row)
            if progress is not None:
                progress(count, len(tasks), row)

        workers = min(jobs or os.cpu_count() or 1, len(tasks))
        if workers <= 1:
            for i, t in enumerate(tasks, 1):
                finished(_run_task(t, local_cache), i)
        else:
            local_cache.clear()
            pool = ProcessPoolExecutor(max_workers=workers)
            try:
                pending = {pool.submit(_run_task, t) for t in tasks}
                count = 0
                while pending:
                    ready, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in ready:
                        count += 1
                        finished(fut.result(), count)
            except BaseException:
                # an error or ^C: drop the queued runs instead of finishing them first
                pool.shutdown(wait=True, cancel_futures=True)
                raise
            pool.shutdown(wait=True)
    finally:
        if writer is not None:
            writer.close()
    return [done[row_key(p, h.name, r, thrash_limit)] for p, h, r in grid]


# ---------------------------------------------------------------------------
# CSV

def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isinf(value) else repr(value)
    return str(value)


class _Appender:
    """Appends rows to a sweep CSV, writing the header into a new or empty file."""

    def __init__(self, path: PathLike):
        self.path = os.fspath(path)
        try:
            fresh = not os.path.exists(self.path) or os.path.getsize(self.path) == 0
            if not fresh:
                with open(self.path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    needs_newline = f.read(1) not in (b"\n", b"\r")
            self.f = open(self.path, "a", newline="", encoding="utf-8")
        except OSError as e:
            raise DtrError(f"{self.path}: cannot write the sweep CSV: {e.strerror or e}") from None
        if not fresh and needs_newline:
            self.f.write("\n")
        self.w = csv.writer(self.f)
        if fresh:
            self.w.writerow(FIELDS)
            self.f.flush()

    def write(self, row: SweepRow) -> None:
        self.w.writerow([_cell(getattr(row, k)) for k in FIELDS])
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def read_rows(path: PathLike) -> List[SweepRow]:
    """Read a sweep CSV written by :func:`sweep` (or ``dtr-sim sweep``).

    Args:
        path: the CSV file; its header must hold every column of :data:`FIELDS`
            (in any order; other columns are ignored).

    Returns:
        The rows, in file order.

    Raises:
        DtrError: the file is missing or unreadable, not a file or a pipe (a
            device), lacks columns, or a cell is not of its column's type (the
            message names the line and column).
    """
    from dtr.sim.logs import not_a_file

    path = os.fspath(path)
    try:
        with open(path, newline="", encoding="utf-8") as f:
            kind = not_a_file(f)
            if kind is not None:
                raise DtrError(f"{path}: not a sweep CSV: this is {kind}; give a CSV file (or a pipe)")
            lines = list(csv.reader(f))
    except OSError as e:
        raise DtrError(f"{path}: cannot read the sweep CSV: {e.strerror or e}") from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise DtrError(f"{path}: not a sweep CSV ({e})") from None
    if not lines:
        raise DtrError(f"{path}: empty file, not a sweep CSV (no header)")
    header = lines[0]
    missing = [k for k in FIELDS if k not in header]
    if missing:
        raise DtrError(f"{path}: not a sweep CSV: missing columns {', '.join(missing)}")
    index = {k: header.index(k) for k in FIELDS}
    rows = []
    for lineno, cells in enumerate(lines[1:], 2):
        if not cells:
            continue
        if len(cells) < len(header):
            raise DtrError(f"{path}:{lineno}: {len(cells)} cells, expected {len(header)} "
                           f"(an interrupted write? delete this line and rerun)")
        values: Dict[str, Any] = {}
        for k, i in index.items():
            text = cells[i]
            try:
                if text == "" and k in _OPTIONAL:
                    values[k] = None
                elif k == "thrash_limit":
                    values[k] = math.inf if text in ("", "inf") else float(text)
                elif k in _INT:
                    values[k] = int(text)
                elif k in _FLOAT:
                    values[k] = float(text)
                else:
                    values[k] = text
            except ValueError:
                raise DtrError(f"{path}:{lineno}: column {k}: {text!r} is not a number") from None
            if isinstance(values[k], float) and math.isnan(values[k]):
                raise DtrError(f"{path}:{lineno}: column {k}: {text!r} is not a number")
            if k == "budget_ratio" and not (0 < values[k] < math.inf):
                raise DtrError(f"{path}:{lineno}: column budget_ratio: {text!r} is not a ratio > 0")
        rows.append(SweepRow(**values))
    return rows
