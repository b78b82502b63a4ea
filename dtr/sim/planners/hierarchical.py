"""``hierarchical``: a chain of parts, exact options per part, a DP over the chain.

In the spirit of Rockmate and HiRemate (rockmate.txt, hiremate.txt): the
graph is cut into a chain of parts, each part's trade-offs between the
memory it keeps and the recomputation it costs are solved exactly by a small
ILP, and a dynamic program over the chain picks one option per part. See
Note [Hierarchical planning] here, Note [The part options] in
:mod:`dtr.sim.planners.hierarchical_chain` (the chain: split, parts, options,
DP), and Note [Refining the keep set] and Note [Repairing the peak] in
:mod:`dtr.sim.planners.hierarchical_plans` (measured plans).
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Dict, List, Optional, Tuple

from dtr.sim.graph import PlanGraph
from dtr.sim.planners.base import PlanOptions, PlanResult, register_planner
from dtr.sim.planners.checkmate import plan_checkmate
from dtr.sim.planners.hierarchical_chain import CAPS as CAPS
from dtr.sim.planners.hierarchical_chain import Option, Part, Split, chain_dp, part_options, partition, split_graph
from dtr.sim.planners.hierarchical_chain import _enum_options as _enum_options
from dtr.sim.planners.hierarchical_chain import _ilp_options as _ilp_options
from dtr.sim.planners.hierarchical_chain import _part_inputs as _part_inputs
from dtr.sim.planners.hierarchical_chain import build_parts as build_parts
from dtr.sim.planners.hierarchical_plans import _measure, _Plan, _plan_of, execute, refine, repair

__all__ = ["plan_hierarchical", "Split", "Part", "Option", "split_graph", "partition", "part_options",
           "chain_dp", "execute"]

# Note [Hierarchical planning]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A training step's graph has a turning point T: the position of the log's
# order where the memory of the plan without recomputation peaks (the end of
# the forward pass). The nodes up to T are the *forward*, the others the
# *backward*. A forward value read after T (or referenced at the end) is
# *saved*. The planner's schedules are Rockmate's with one level of
# recomputation:
# - the forward runs in the log's order, every node once;
# - a forward value is either *kept* (it stays resident from its computation
#   until its last use) or *dropped* (it is used by the forward only; the
#   backward recomputes it on demand, right before the first node that reads
#   it, recursively from kept, pinned and already recomputed values);
# - the backward runs in the log's order, every node once;
# - a recomputed value stays until its last use (sequence_steps frees every
#   computation after its last use, so the forward's copy of a dropped value
#   goes after its last forward use).
# The plan is the keep set. It is chosen hierarchically: the forward is cut
# into a chain of parts (contiguous in the log's order, of about equal saved
# bytes, at most a given number of nodes: each of PART_SIZES is tried, the
# time limit shared among them); each part gets a set of *options* (keep
# sets of the part, with the bytes they keep over T and the recomputation
# they cost: Note [The part options]); a DP over the chain picks one option
# per part. Memory model of the DP (Rotor's, rockmate.txt 3.4): when the
# backward reaches part i, the parts before it still hold what they keep,
# part i has all its saved values resident (kept or recomputed), and the
# parts after it are done; add what else is live then (gradients: the log's
# plan's live bytes minus its saved bytes, the most over part i's backward
# window). So option o_i is allowed when sum_{j<i} m(o_j) + abar_i + other_i
# <= B', and at T the kept bytes plus what else is live at T must fit.
# Minimize the sum of the options' costs (bytes in slots of B').
#
# The DP's model is an estimate; every plan is measured (sequence_profile of
# its steps, the memory model every planner's schedule is judged by before
# the evaluator) and the DP's budget B' is calibrated: a bisection on
# B' / budget for the cheapest plan whose real peak fits. Small graphs
# (at most SMALL_GRAPH nodes) are also solved whole by the Checkmate ILP,
# the hierarchy's leaf (hiremate.txt: the lowest level is solved exactly),
# with half the time limit; the cheaper valid plan wins.
#
# Time: the chain DPs get 40% of the time limit (each partition an equal
# share of what is left, 60% of it for its part options), the repair and the
# refinement the rest; the best plan found is returned when the time is up.
# Every phase is deterministic (options.seed is unused) unless the time
# limit cuts it short.

#: The most forward nodes of a part, one partition per entry, in the order tried.
PART_SIZES = (16, 4, 32, 8, 2, 64)
#: Partitions also tried with greedy part options (the DP's model is inexact: its
#: exact fronts are not always the best measured plans).
GREEDY_SIZES = (16, 4, 32)
#: Forwards of at most this many nodes also try parts of one node.
SMALL_FORWARD = 256

#: Graphs up to this many nodes are also given to the whole-graph ILP.
SMALL_GRAPH = 80

#: The cheapest chain plans refined (Note [Refining the keep set] in dtr.sim.planners.hierarchical_plans).
REFINED = 8


def _hierarchy(pg: PlanGraph, sp: Split, budget: int, deadline: float, hard: float, part_nodes: int,
               exact: bool = True) -> Tuple[Optional[_Plan], Optional[_Plan], str]:
    """The chain DP's cheapest plan within the budget, calibrating B' (Note [Hierarchical planning]).

    Args:
        pg: the planning graph.
        sp: its split.
        budget: bytes.
        deadline: for this partition (60% of it for the part options); the
            first plan is measured even past it.
        hard: the time limit.
        part_nodes: the most nodes of a part.
        exact: False: greedy part options only.

    Returns:
        (the cheapest plan that fits or None, the plan with the lowest peak, a message).
    """
    now = time.perf_counter()
    parts = build_parts(pg, sp, now + 0.6 * max(0.0, deadline - now), part_nodes, exact)
    at_turn = max(0, sp.live[sp.turn] - sum(pg.mem[v] for v in range(sp.turn + 1) if sp.saved[v]))
    best: Optional[_Plan] = None
    lowest: Optional[_Plan] = None
    tried: Dict[Tuple[int, ...], int] = {}
    all_true = [True] * pg.n

    def attempt(alpha: float) -> Optional[bool]:
        nonlocal best, lowest
        picks = chain_dp(parts, alpha * budget, at_turn)
        if picks is None:
            return None
        key = tuple(picks)
        if key not in tried:
            keep = [False] * pg.n
            for part, j in zip(parts, picks):
                for v in part.options[j].keep:
                    keep[v] = True
            plan = _plan_of(pg, sp, keep, all_true)
            tried[key] = plan.peak
            if lowest is None or (plan.peak, plan.cost) < (lowest.peak, lowest.cost):
                lowest = plan
            if plan.peak <= budget and (best is None or (plan.cost, plan.peak) < (best.cost, best.peak)):
                best = plan
        return tried[key] <= budget

    # f(alpha): None (the DP finds nothing: alpha too small), True (fits), False (over the budget);
    # taken as monotone: find the largest alpha that fits.
    grid = [0.25 * 1.5 ** k for k in range(9)]  # 0.25 .. 6.4
    res = []
    for a in grid:
        now = time.perf_counter()
        if now > hard or (now > deadline and tried):
            break
        r = attempt(a)
        res.append((a, r))
        if r is False:
            break
    over = [a for a, r in res if r is False]
    if over:
        hi = over[0]
        below = [a for a, r in res if a < hi]
        lo = max(below) if below else 0.0
        for _ in range(12):
            if time.perf_counter() > deadline or hi - lo < 2e-3 * hi:
                break
            mid = (lo + hi) / 2
            if attempt(mid) is False:
                hi = mid
            else:
                lo = mid
    msg = f"{len(parts)} parts, {len(tried)} plans measured"
    if best is None:
        msg += f"; lowest peak {lowest.peak}" if lowest is not None else "; the chain DP found nothing"
    return best, lowest, msg


@register_planner("hierarchical")
def plan_hierarchical(pg: PlanGraph, budget: int, options: PlanOptions) -> PlanResult:
    """Rockmate-style planning: a chain of parts, ILP options per part, a DP over the chain.

    See Note [Hierarchical planning].

    Args:
        pg: the planning graph.
        budget: bytes, constants included.
        options: ``time_limit`` bounds the whole search (the best plan found
            so far is returned when it runs out).

    Returns:
        ``optimal`` (no recomputation needed, or the whole-graph ILP proved
        its plan optimal and nothing cheaper was found), ``ok`` (a plan
        within the budget), ``infeasible`` (the constants alone exceed the
        budget), ``timeout`` (the time ran out before any plan) or ``oom``
        (no plan of the planner's space fits).
    """
    t0 = time.perf_counter()
    deadline = t0 + max(0.1, options.time_limit)
    if pg.pinned_bytes > budget:
        return PlanResult("hierarchical", "infeasible", None, message="the constants alone exceed the budget")
    base = list(range(pg.n))
    peak0, cost0 = _measure(pg, base)
    if peak0 <= budget:
        return PlanResult("hierarchical", "optimal", tuple(base), predicted_cost=cost0,
                          message="no recomputation needed")
    cands: List[Tuple[float, int, List[int], str]] = []
    msgs: List[str] = []
    if pg.n <= SMALL_GRAPH:
        r = plan_checkmate(pg, budget, replace(options, time_limit=max(0.1, 0.5 * options.time_limit)))
        if r.sequence is not None:
            peak, cost = _measure(pg, list(r.sequence))
            if peak <= budget:
                cands.append((cost, peak, list(r.sequence), "ilp-" + r.status))
        msgs.append(f"whole-graph ILP: {r.status}")
    sp = split_graph(pg)
    sizes = PART_SIZES + ((1,) if sum(1 for v in range(sp.turn + 1) if not pg.pinned[v]) <= SMALL_FORWARD else ())
    fits: List[Tuple[_Plan, int]] = []
    lows: List[Tuple[_Plan, int]] = []
    if sp.turn >= 0:
        t_dp = time.perf_counter() + 0.4 * max(0.0, deadline - time.perf_counter())
        configs = [(size, True) for size in sizes] + [(size, False) for size in GREEDY_SIZES]
        for k, (part_nodes, exact) in enumerate(configs):
            now = time.perf_counter()
            if now > t_dp:
                break
            best, lowest, msg = _hierarchy(pg, sp, budget, now + (t_dp - now) / (len(configs) - k), deadline,
                                           part_nodes, exact)
            msgs.append(f"parts of <= {part_nodes}{'' if exact else ' (greedy options)'}: {msg}")
            if best is not None:
                fits.append((best, part_nodes))
            if lowest is not None:
                lows.append((lowest, part_nodes))
    # Repair the lowest plans of the partitions, lowest first, until one fits (Note [Repairing the peak]
    # in dtr.sim.planners.hierarchical_plans).
    lows.sort(key=lambda c: (c[0].peak, c[0].cost))
    t_rep = time.perf_counter() + 0.6 * max(0.0, deadline - time.perf_counter())
    for k, (low, part_nodes) in enumerate(lows if not fits else []):
        now = time.perf_counter()
        if now > t_rep:
            break
        share = (t_rep - now) / 2 if k < len(lows) - 1 else t_rep - now
        plan, changes = repair(pg, sp, low, budget, now + share)
        msgs.append(f"repair of the lowest plan of parts of <= {part_nodes}: {changes} changes, peak {plan.peak}")
        if plan.peak <= budget:
            fits.append((plan, part_nodes))
            break
    # Refine the best chain plans, cheapest first (Note [Refining the keep set] in
    # dtr.sim.planners.hierarchical_plans).
    fits.sort(key=lambda c: (c[0].cost, c[0].peak))
    fits = fits[:REFINED]
    for k, (plan, part_nodes) in enumerate(fits):
        now = time.perf_counter()
        plan, added = refine(pg, sp, plan, budget, now + (deadline - now) / (len(fits) - k))
        cands.append((plan.cost, plan.peak, plan.seq, f"chain of parts of <= {part_nodes} nodes, refined "
                                                      f"(+{added} kept)"))
    if not cands:
        status = "timeout" if time.perf_counter() > deadline else "oom"
        return PlanResult("hierarchical", status, None, message="; ".join(msgs))
    cands.sort(key=lambda c: (c[0], c[3] != "ilp-optimal", c[1]))
    cost, peak, seq, how = cands[0]
    status = "optimal" if how == "ilp-optimal" else "ok"
    return PlanResult("hierarchical", status, tuple(seq), predicted_cost=cost,
                      message=f"{how}; " + "; ".join(msgs))
