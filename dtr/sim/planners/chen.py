"""``chen``: Chen et al.'s sqrt(n) checkpointing and its greedy variant.

See Note [Chen on chains and on general graphs].
"""
from __future__ import annotations

import math
import time
from typing import List, Optional, Sequence, Tuple

from dtr.sim.graph import PlanGraph, chain_shape
from dtr.sim.planners.base import PlanOptions, PlanResult, register_planner
from dtr.sim.planners.recompute import recompute_missing
from dtr.sim.schedule import sequence_profile, sequence_steps

__all__ = ["plan_chen", "checkpoint_sequence", "greedy_checkpoints"]

# Note [Chen on chains and on general graphs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A plan is a set C of checkpoints. The schedule computes the nodes in the
# log's order; a non-checkpoint value computed in that sweep is usable until
# the next checkpoint is computed (its segment ends), a checkpoint until its
# last use. A node whose input is no longer usable recomputes that input,
# recursively, from usable values; recomputed values stay usable (they are
# freed after their last use, like every value: see
# dtr.sim.schedule.sequence_steps). On a forward-backward chain this is
# exactly Chen's scheme: the backward pass recomputes one segment at a time
# from its checkpoint.
#
# - On a chain (dtr.sim.graph.chain_shape): C = every ceil(sqrt(n))-th
#   forward activation (Chen's sqrt(n) segments; the last segment is kept from
#   the forward sweep). If that plan does not fit the budget, the greedy
#   variant below is tried.
# - On a general graph: Chen's greedy variant (the paper's Algorithm 3): walk
#   the nodes in order adding their sizes; when the running sum passes a
#   threshold x, mark the node a checkpoint and restart the sum. x is searched
#   over a geometric grid (Chen's grid search), and the cheapest plan within
#   the budget wins (ties: lower peak). When no plan fits: ``oom``. The grid
#   stops at ``options.time_limit`` (each point costs a sweep of the graph:
#   seconds on graphs of tens of thousands of nodes): the best plan so far,
#   or ``timeout`` when none fit yet.


def checkpoint_sequence(pg: PlanGraph, ckpt: Sequence[bool]) -> List[int]:
    """The compute sequence of a checkpoint set (Note [Chen on chains and on general graphs])."""
    n = pg.n
    deps, pinned = pg.deps, pg.pinned
    usable = bytearray(n)
    segment: List[int] = []  # non-checkpoint values of the current segment's sweep
    seq: List[int] = []
    for v in range(n):
        for d0 in deps[v]:
            if not usable[d0]:
                recompute_missing(deps, usable, d0, seq)
        seq.append(v)
        usable[v] = 1
        if ckpt[v] and not pinned[v]:
            for u in segment:
                usable[u] = 0
            segment.clear()
        elif not pinned[v]:
            segment.append(v)
    return seq


def greedy_checkpoints(pg: PlanGraph, x: float) -> List[bool]:
    """Chen's greedy marking: a checkpoint each time the running size passes x."""
    out, acc = [False] * pg.n, 0
    for v in range(pg.n):
        if pg.pinned[v]:
            continue
        acc += pg.mem[v]
        if acc > x:
            out[v] = True
            acc = 0
    return out


def _measure(pg: PlanGraph, seq: List[int]) -> Tuple[int, float]:
    return sequence_profile(pg, sequence_steps(pg, seq))


@register_planner("chen")
def plan_chen(pg: PlanGraph, budget: int, options: PlanOptions) -> PlanResult:
    """Chen's sqrt(n) segments on chains, its greedy variant elsewhere.

    Returns:
        ``ok`` with the cheapest plan found within the budget, ``oom`` (no
        plan of this family fits; the message gives the lowest peak found),
        or ``timeout`` (the time limit passed before any plan fit).
    """
    ch = chain_shape(pg)
    tried: List[Tuple[float, int, List[int], str]] = []
    if ch is not None:
        n = len(ch.fwd)
        k = max(1, math.ceil(math.sqrt(n)))
        ck = [False] * pg.n
        for i in range(k, n, k):  # a_k, a_2k, ... (a_n is kept from the sweep anyway)
            ck[ch.fwd[i - 1]] = True
        seq = checkpoint_sequence(pg, ck)
        peak, cost = _measure(pg, seq)
        if peak <= budget:
            return PlanResult("chen", "ok", tuple(seq), predicted_cost=cost,
                              message=f"sqrt(n) segments of {k}")
        tried.append((cost, peak, seq, f"sqrt(n) segments of {k}"))
    movable = [pg.mem[v] for v in range(pg.n) if not pg.pinned[v]]
    lo, hi = max(1, min((m for m in movable if m > 0), default=1)), max(1, sum(movable))
    steps = 40
    xs = sorted({lo * (hi / lo) ** (j / (steps - 1)) for j in range(steps)} | {0.0})
    best: Optional[Tuple[float, int, List[int], str]] = None
    deadline = time.perf_counter() + options.time_limit
    for x in xs:
        if time.perf_counter() > deadline:
            if best is None:
                return PlanResult("chen", "timeout", None,
                                  message=f"time limit ({options.time_limit:g} s) after {len(tried)} grid points")
            break
        seq = checkpoint_sequence(pg, greedy_checkpoints(pg, x))
        peak, cost = _measure(pg, seq)
        cand = (cost, peak, seq, f"greedy, threshold {x:.4g} bytes")
        tried.append(cand)
        if peak <= budget and (best is None or (cost, peak) < (best[0], best[1])):
            best = cand
    if best is None:
        low = min(tried, key=lambda c: c[1])
        return PlanResult("chen", "oom", None, message=f"no plan fits; the lowest peak found is {low[1]} bytes")
    return PlanResult("chen", "ok", tuple(best[2]), predicted_cost=best[0], message=best[3])
