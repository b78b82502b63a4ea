"""Replaying a log under a budget: the simulator's main entry point."""
from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass
from typing import Optional, Union

from dtr.core import ReplayStatus, replay_program
from dtr.errors import BudgetError
from dtr.heuristics import Heuristic, get_heuristic
from dtr.semantics import Semantics, check_thrash_limit
from dtr.sim.logs import Log, read_log
from dtr.sim.step_plan import StepPlan
from dtr.units import MAX_BYTES, parse_bytes

__all__ = ["ReplayResult", "PLAN_FIELDS", "replay", "resolve_budget", "budget_from_ratio", "baseline"]

BudgetSpec = Union[None, int, str]
_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


@dataclass(frozen=True)
class ReplayResult:
    """What one replay did. The fields are the JSON of ``dtr-sim replay --json``.

    Attributes:
        log: the log's path.
        heuristic: the heuristic's name.
        budget_bytes: the budget (None: no limit).
        baseline_peak_bytes: the log's peak memory when replayed without a limit.
        peak_bytes: this run's peak memory (at the moment it stopped, if it did).
        base_compute: the log's own compute (sum of its operators' costs).
        total_compute: compute carried out: first computations plus rematerializations.
        remat_compute: compute spent on rematerializations.
        overhead: total_compute / base_compute.
        evictions: evictions chosen by the heuristic.
        eager_evictions: storages freed because their last reference died.
        remats: operator recomputations.
        storage_accesses: metadata touched by heuristic evaluation and upkeep.
        status: ``ok``, ``oom`` (no eviction could make room) or ``thrash``.
        needed_bytes: for ``oom``, bytes that had to be resident when it failed.
        failed_line: for ``oom``/``thrash``, the log line being replayed (0: the
            output condition at the end).
        constant_bytes: memory of the log's constants (never evicted).
        largest_op_bytes: the largest single operator's working set (inputs + outputs).
        thrash_limit: the thrash limit X (stop once total compute passes X * base).
        cost_unit: unit of the compute figures.
        planner: with a plan (``--plan``), the planner that made it (None: online).
        plan_ops: with a plan, the ops that matched it.
        plan_diverged_at: with a plan, the first op (by ordinal) that did not (None: none).
        planned_evictions: evictions the plan made.
        predicted_remat: with a plan, the recomputation it predicted.
    """

    log: str
    heuristic: str
    budget_bytes: Optional[int]
    baseline_peak_bytes: int
    peak_bytes: int
    base_compute: float
    total_compute: float
    remat_compute: float
    overhead: float
    evictions: int
    eager_evictions: int
    remats: int
    storage_accesses: int
    status: str
    needed_bytes: Optional[int]
    failed_line: Optional[int]
    constant_bytes: int
    largest_op_bytes: int
    thrash_limit: float
    cost_unit: str
    planner: Optional[str] = None
    plan_ops: Optional[int] = None
    plan_diverged_at: Optional[int] = None
    planned_evictions: int = 0
    predicted_remat: Optional[float] = None

    def to_dict(self) -> dict:
        """The result as a JSON-ready dict (an infinite thrash limit becomes None)."""
        d = asdict(self)
        for k in ("thrash_limit", "predicted_remat"):
            if d[k] is not None and not math.isfinite(d[k]):
                d[k] = None
        return d


#: ReplayResult's fields that only a replay following a plan fills (a sweep has none).
PLAN_FIELDS = ("planner", "plan_ops", "plan_diverged_at", "planned_evictions", "predicted_remat")


def resolve_budget(spec: BudgetSpec, baseline_peak: int) -> Optional[int]:
    """Turn a budget spec into bytes.

    Args:
        spec: None (no limit), bytes (int), a size string (``"6GiB"``, ``"500MB"``)
            or ``"N%"`` of ``baseline_peak``.
        baseline_peak: the log's peak memory without eviction.

    Raises:
        BudgetError: the spec is not a budget.
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        m = _PERCENT.match(spec)
        if m:
            return budget_from_ratio(baseline_peak, float(m.group(1)) / 100.0, spec.strip())
    try:
        return parse_bytes(spec)
    except BudgetError as e:
        if str(e).startswith("not a whole number"):
            raise BudgetError(f"not a budget: {spec!r} is not a whole number of bytes (for a fraction of the "
                              f"log's peak write a percentage such as 40%; with a unit, fractions are fine: "
                              f"1.5GiB)") from None
        if "too large" in str(e):
            raise
        raise BudgetError(f"not a budget: {spec!r} (use bytes, a size such as 6GiB or 500MB, "
                          f"or a percentage of the log's peak such as 40%)") from None


def budget_from_ratio(baseline_peak: int, ratio: float, spec: object = None) -> int:
    """``ratio`` times ``baseline_peak`` in whole bytes (rounded down).

    Raises:
        BudgetError: the ratio is not a finite number >= 0, or the budget is
            more than the core can hold (2^63 - 1 bytes).
    """
    what = spec if spec is not None else f"ratio {ratio:g}"
    if not (math.isfinite(ratio) and ratio >= 0):
        raise BudgetError(f"not a budget: {what} (a ratio of the log's peak must be finite and >= 0)")
    budget = int(baseline_peak * ratio)
    if budget > MAX_BYTES:
        raise BudgetError(f"budget {what} of the log's peak ({baseline_peak} bytes) is more than the core "
                          f"can hold ({MAX_BYTES} bytes); use a smaller one")
    return budget


def baseline(log: Log) -> dict:
    """The log replayed without a memory limit (raw counters)."""
    return replay_program(log.program, "local", None, semantics=log.semantics)


def replay(log: Union[Log, str, os.PathLike], heuristic: Union[Heuristic, str] = "eqclass",
           budget: BudgetSpec = None, *, thrash_limit: float = 3.0, banish: bool = False,
           seed: int = 0, sample: int = 0, check: bool = False,
           baseline_peak: Optional[int] = None, semantics: Optional[Semantics] = None,
           plan: Optional[StepPlan] = None) -> ReplayResult:
    """Replay a log under a budget with one heuristic.

    Args:
        log: a parsed :class:`Log` or a path.
        heuristic: a registered name or a :class:`Heuristic` (e.g. an ablation).
        budget: see :func:`resolve_budget`; None replays without a limit.
        thrash_limit: stop once total compute passes this multiple of the log's
            compute (``math.inf``: never).
        banish: banish on last release instead of eager eviction.
        seed: seed for ``random`` and sampling.
        sample: score only this many random pool members per eviction (0: all).
        check: check the core's invariants after every instruction (slow).
        baseline_peak: the log's peak without limit, if already known.
        semantics: the rules to replay under (None: the log's own,
            :attr:`Log.semantics`; change one with ``log.semantics.replace(...)``).
            A heuristic whose ``split`` is set, such as ``eqclass-split``,
            always splits eqclass components.
        plan: a plan to follow (:func:`dtr.sim.step_plan.make_step_plan`;
            Note [Following a plan] in csrc/core_follow.cpp); one without
            steps (``plan.ok`` false) is followed too, and changes nothing.

    Raises:
        LogFormatError: ``log`` is a path to a bad log.
        BudgetError: a bad budget spec.
        ValueError: an unknown heuristic (the message lists the valid ones), or
            a thrash limit that is not a number >= 1.
    """
    thrash_limit = check_thrash_limit(thrash_limit)
    if not isinstance(log, Log):
        log = read_log(log)
    h = get_heuristic(heuristic) if isinstance(heuristic, str) else heuristic
    if baseline_peak is None:
        baseline_peak = baseline(log)["peak_memory"]
    budget_bytes = resolve_budget(budget, baseline_peak)
    raw = replay_program(log.program, h, budget_bytes, thrash_limit=thrash_limit, check=check,
                         banish=banish, seed=seed, sample=sample,
                         semantics=log.semantics if semantics is None else semantics,
                         plan=None if plan is None else plan.follow_plan())
    base = raw["base_total"]
    total = raw["base_compute"] + raw["remat_compute"]
    failed = raw["status"] != ReplayStatus.OK
    return ReplayResult(
        log=log.path, heuristic=h.name, budget_bytes=budget_bytes, baseline_peak_bytes=baseline_peak,
        peak_bytes=raw["peak_memory"], base_compute=base, total_compute=total,
        remat_compute=raw["remat_compute"], overhead=total / base if base > 0 else 1.0,
        evictions=raw["evictions"], eager_evictions=raw["eager_evictions"], remats=raw["remats"],
        storage_accesses=raw["storage_accesses"], status=raw["status"],
        needed_bytes=raw["needed_bytes"] if raw["status"] == ReplayStatus.OOM else None,
        failed_line=raw["failed_line"] if failed else None,
        constant_bytes=raw["constant_bytes"], largest_op_bytes=raw["largest_op_bytes"],
        thrash_limit=thrash_limit, cost_unit=log.cost_unit,
        planner=None if plan is None else plan.planner,
        plan_ops=None if plan is None else raw["plan_followed"],
        plan_diverged_at=None if plan is None or raw["plan_diverged_at"] < 0 else raw["plan_diverged_at"],
        planned_evictions=raw["planned_evictions"],
        predicted_remat=None if plan is None else plan.predicted_remat)
