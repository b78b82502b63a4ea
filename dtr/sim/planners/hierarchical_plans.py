"""``hierarchical``'s plans: the sequence of a keep set, measured, then refined or repaired.

See Note [Refining the keep set] and Note [Repairing the peak]; the plan's
form is in Note [Hierarchical planning] in :mod:`dtr.sim.planners.hierarchical`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from dtr.sim.graph import PlanGraph
from dtr.sim.planners.hierarchical_chain import Split
from dtr.sim.planners.recompute import recompute_missing
from dtr.sim.schedule import sequence_profile, sequence_steps

__all__ = ["execute", "refine", "repair"]


def execute(pg: PlanGraph, sp: Split, keep: Sequence[bool], keep2: Optional[Sequence[bool]] = None) -> List[int]:
    """The compute sequence of a keep set (Note [Hierarchical planning] in dtr.sim.planners.hierarchical).

    The forward in the log's order; then the backward in the log's order,
    each dropped input recomputed first (recursively); then whatever is
    referenced at the end and not available.

    Args:
        pg: the planning graph.
        sp: its split.
        keep: per node, kept over T.
        keep2: per node, whether a recomputed copy (or a backward value)
            stays until its last use (default); False: it serves the
            backward node it was recomputed for (a backward value: the next
            backward node that reads it), and is recomputed again for the
            next one (Note [Repairing the peak]).
    """
    n, deps, pinned = pg.n, pg.deps, pg.pinned
    seq = list(range(sp.turn + 1))
    avail = bytearray(n)
    for v in range(sp.turn + 1):
        avail[v] = 1 if (pinned[v] or keep[v]) else 0
    fresh: List[int] = []

    for v in range(sp.turn + 1, n):
        for d in deps[v]:
            if not avail[d]:
                recompute_missing(deps, avail, d, seq, fresh)
        seq.append(v)
        avail[v] = 1
        if keep2 is not None:
            for d in deps[v]:
                if d > sp.turn and not keep2[d] and not pg.referenced_at_end[d]:
                    avail[d] = 0
        if fresh:
            if keep2 is not None:
                for x in fresh:
                    if not keep2[x]:
                        avail[x] = 0
            fresh.clear()
    for v in range(n):
        if pg.referenced_at_end[v] and not avail[v]:
            recompute_missing(deps, avail, v, seq, fresh)
    return seq


def _measure(pg: PlanGraph, seq: List[int]) -> Tuple[int, float]:
    return sequence_profile(pg, sequence_steps(pg, seq))


@dataclass
class _Plan:
    """A keep set with its measured sequence."""

    cost: float
    peak: int
    seq: List[int]
    keep: List[bool]
    keep2: List[bool]


def _plan_of(pg: PlanGraph, sp: Split, keep: List[bool], keep2: List[bool]) -> _Plan:
    seq = execute(pg, sp, keep, keep2)
    peak, cost = _measure(pg, seq)
    return _Plan(cost, peak, seq, keep, keep2)


# Note [Refining the keep set]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The chain DP's memory model is coarse (a part's whole saved bytes
# resident during its backward, outside inputs counted twice, one scalar
# calibration for all parts), so its plan usually leaves room under the
# budget. The refinement takes the values the plan recomputes, most
# expensive per byte first, and keeps them (over T, or a recomputed copy
# until its last use) while the plan still fits (measured, not modelled) and
# costs less: first the longest prefix of that order that fits (a
# bisection: few measurements on big graphs), then one by one; two passes
# at most, within the time limit. The cheapest REFINED chain plans (over
# the part sizes tried) are refined, each with an equal share of the time
# left.

def refine(pg: PlanGraph, sp: Split, plan: _Plan, budget: int, deadline: float) -> Tuple[_Plan, int]:
    """Keep more values while the plan still fits, one by one, measured (Note [Refining the keep set]).

    Returns:
        (the refined plan, how many values it keeps in addition).
    """
    count = [0] * pg.n
    for v in plan.seq:
        count[v] += 1
    cands = [(v, 1) for v in range(sp.turn + 1) if count[v] > 1 and not plan.keep[v]]
    cands += [(v, 2) for v in range(sp.turn + 1) if count[v] > 1 and not plan.keep2[v]]
    cands.sort(key=lambda c: (-(pg.cost[c[0]] / max(1, pg.mem[c[0]])), c))
    added = 0

    def with_prefix(k: int) -> _Plan:
        keep, keep2 = list(plan.keep), list(plan.keep2)
        for v, level in cands[:k]:
            (keep if level == 1 else keep2)[v] = True
        return _plan_of(pg, sp, keep, keep2)

    # the longest prefix of the candidates that still fits, by bisection (few measurements on big graphs)
    lo, hi = 0, len(cands)
    while lo < hi and time.perf_counter() < deadline:
        mid = (lo + hi + 1) // 2
        p2 = with_prefix(mid)
        if p2.peak <= budget:
            lo = mid
            if p2.cost < plan.cost - 1e-12:
                plan, added = p2, added + mid
                cands = cands[mid:]
                lo, hi = 0, len(cands)
        else:
            hi = mid - 1
    for _ in range(2):
        improved = False
        for v, level in cands:
            if (plan.keep if level == 1 else plan.keep2)[v]:
                continue
            if time.perf_counter() > deadline:
                return plan, added
            keep, keep2 = list(plan.keep), list(plan.keep2)
            (keep if level == 1 else keep2)[v] = True
            p2 = _plan_of(pg, sp, keep, keep2)
            if p2.peak <= budget and p2.cost < plan.cost - 1e-12:
                plan = p2
                added += 1
                improved = True
        if not improved:
            break
    return plan, added


# Note [Repairing the peak]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# One level of recomputation cannot go below a part's saved bytes plus the
# boundaries kept over T; a tight budget needs more (Rotor's recursion,
# rockmate.txt 3.4). When no chain plan fits, the repair starts from the one
# with the lowest peak and lowers its peak step by step, measured: among the
# forward values resident at the peak, it either drops a kept one (the
# backward recomputes it) or, for a copy the backward recomputed, lets it
# serve only the backward node it was recomputed for (keep2 false: the next
# reader recomputes it again, a second level of recomputation, as DTR
# does), or lets a backward value go after its next reader (recomputed,
# recursively, when another needs it). The lowest plans of the partitions
# are repaired in turn, lowest first, until one fits, each with half of the
# repair's time left (the last with all of it). The REPAIR_TRIES candidates cheapest
# per byte are measured at each step; the one that adds the least cost per
# byte of peak it removes is taken. It stops when the plan
# fits, when no candidate lowers the peak, or at the time limit; a plan that
# fits is then refined (Note [Refining the keep set]).

#: Candidates tried per repair step.
REPAIR_TRIES = 24


def _peak_residents(pg: PlanGraph, seq: List[int]) -> List[Tuple[int, int]]:
    """(node, position in seq of the computation) of each storage resident at the peak."""
    steps = sequence_steps(pg, seq)
    size = pg.graph.storage_size
    mem = peak = 0
    at = -1
    for i, (kind, x) in enumerate(steps):
        if kind == "compute":
            mem += pg.mem[x]
            if mem > peak:
                peak, at = mem, i
        else:
            mem -= size[x]
    alive: Dict[int, int] = {}
    pos = -1
    for kind, x in steps[:at + 1]:
        if kind == "compute":
            pos += 1
            for s in pg.storages[x]:
                alive[s] = pos
        else:
            alive.pop(x, None)
    return [(pg.storage_node[s], p) for s, p in alive.items()]


def repair(pg: PlanGraph, sp: Split, plan: _Plan, budget: int, deadline: float) -> Tuple[_Plan, int]:
    """Lower a plan's peak until it fits, one measured change at a time (Note [Repairing the peak]).

    Returns:
        (the lowest plan reached, changes made).
    """
    changes = 0
    while plan.peak > budget and time.perf_counter() < deadline:
        cands = set()
        for v, p in _peak_residents(pg, plan.seq):
            if pg.pinned[v] or pg.referenced_at_end[v]:
                continue
            if v > sp.turn:
                if plan.keep2[v]:
                    cands.add((v, 2))
            elif p <= sp.turn and plan.keep[v]:
                cands.add((v, 1))
            elif p > sp.turn and plan.keep2[v]:
                cands.add((v, 2))
        order = sorted(cands, key=lambda c: (pg.cost[c[0]] / max(1, pg.mem[c[0]]), c))
        nxt: Optional[_Plan] = None
        rate = math.inf
        for v, level in order[:REPAIR_TRIES]:
            if time.perf_counter() > deadline:
                break
            keep, keep2 = list(plan.keep), list(plan.keep2)
            (keep if level == 1 else keep2)[v] = False
            p2 = _plan_of(pg, sp, keep, keep2)
            if p2.peak < plan.peak:
                r = max(0.0, p2.cost - plan.cost) / (plan.peak - p2.peak)
                if r < rate:
                    nxt, rate = p2, r
                if r == 0.0:
                    break
        if nxt is None:
            break
        plan = nxt
        changes += 1
    return plan, changes
