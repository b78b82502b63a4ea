"""``checkmate-lp``'s rounding of the LP relaxation (Note [Rounding the LP]).

The model is in :mod:`dtr.sim.planners.checkmate_model`; the LP solves that
feed the rounding are in :mod:`dtr.sim.planners.checkmate_solve`.
"""
from __future__ import annotations

import random
import time
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from dtr.sim.graph import PlanGraph
from dtr.sim.planners.base import PlanOptions
from dtr.sim.planners.checkmate_model import IlpModel, _Values, _values
from dtr.sim.schedule import COMPUTE, sequence_profile, sequence_steps

__all__ = ["round_forward"]

# Note [Rounding the LP]
# ~~~~~~~~~~~~~~~~~~~~~~
# ``checkmate-lp`` solves the LP relaxation and rounds it in two phases
# (Checkmate's scheme): round S, then take the least R that the rounded S
# needs (``round_forward``: stage by stage, compute each of the stage's
# nodes right after the inputs it lacks, so that a grouped stage does not
# hold all its recomputations at once; a rounded S = 1 for a value that is
# not available is dropped, not recomputed). S is rounded
# with per-node thresholds (keep i into stage s when S*[s,i] > tau_i): 20
# uniform thresholds 0.05..1, ``rounds`` random per-node thresholds, and
# ``rounds`` independent Bernoulli(S*) draws; then a local search over the
# per-node thresholds of the best rounding, on the nodes whose S* is
# fractional somewhere (each tried at -1, 0.1..0.9, 1; up to 3 passes),
# within the deadline. The cheapest rounding whose schedule fits the budget
# is kept. The LP's integrality gap is large on real logs (on resnet32 from
# logs/ at 50% the LP costs 1.007x while every threshold rounding peaks 6 to
# 29% over the budget; the model's memory is exact for a rounded schedule),
# so the ``REPAIRS`` cheapest roundings over the budget are repaired before
# the local search: at the peak's stage, of the kept values that the stage
# does not read before the peak, the REPAIR_LOOKAHEAD with the most bytes
# per unit of their node's cost are each dropped from that stage on
# (recomputed where next needed, with whatever that needs in turn) and the
# rounding redone; the one with the least extra cost per byte of peak saved
# is kept, until the schedule fits or nothing left lowers the peak.
# When none fits, the LP is solved again with its memory rows
# tightened (0.85, then 0.7 of the budget), as Checkmate does, while time
# is left: the model's memory over-approximation then leaves room for the
# rounding's own excess. When the model was grouped and time is left, a
# finer grouping (sized from the LP time just measured, which grows about
# with the square of the columns) is solved and rounded too; the cheapest
# rounding of all the models is kept.

#: Roundings over the budget (the cheapest) that the rounding repairs (Note [Rounding the LP]).
REPAIRS = 4
#: Values the repair tries at each step (the most bytes per unit of cost first).
REPAIR_LOOKAHEAD = 6


def round_forward(pg: PlanGraph, keep: Callable[[int, int], bool], bounds: Optional[Sequence[int]] = None) -> List[int]:
    """Two-phase rounding, feasibility-restoring: the least R for a rounded S, stage by stage.

    ``keep(s, i)`` says whether node i's values, available at the end of
    stage s-1 (resident before, or computed in it), stay resident into stage
    s. Stage s computes its own nodes in order, each right after the nodes
    (recursively) with a value it reads that is not resident, in index order;
    what the stage computed stays usable to its end (each storage is still
    freed at its last use) and is available for ``keep``. A rounded S = 1 for a value that is not
    available is dropped instead of recomputed (the cheapest repair). Wanted
    values missing at the end are recomputed last.

    Args:
        pg: the planning graph.
        keep: the rounded S, per node.
        bounds: stage starts (default: one node per stage).
    """
    b = list(bounds) if bounds is not None else list(range(pg.n + 1))
    vals = _values(pg)
    return _round(pg, vals, b, lambda s, avail: {u for u in avail if keep(s, vals.node[u])})


def _round(pg: PlanGraph, vals: _Values, b: Sequence[int], kept: Callable[[int, Set[int]], Set[int]],
           trace: Optional[List[Tuple[int, Set[int]]]] = None) -> List[int]:
    """:func:`round_forward` over values: ``kept(s, available values of non-constants)`` is the rounded S.

    Args:
        trace: if given, gets per stage (and for the final recomputation)
            the position where it starts and the values resident then.
    """
    pinned = pg.pinned
    reads, v_node, of_node = vals.reads, vals.node, vals.of_node
    resident: Set[int] = set()
    seq: List[int] = []

    def closure(roots) -> List[int]:
        need: Set[int] = set()
        stack = list(roots)
        while stack:
            v = stack.pop()
            if v in need:
                continue
            need.add(v)
            stack.extend(v_node[u] for u in reads[v] if u not in resident and v_node[u] not in need)
        return sorted(need)

    T = len(b) - 1
    consts: Set[int] = set()
    for s in range(T):
        if trace is not None:
            trace.append((len(seq), set(resident)))
        avail = {u for u in resident if u not in consts}
        for t in range(b[s], b[s + 1]):  # each node's missing inputs just before it
            need = closure((t,))
            seq.extend(need)
            for i in need:
                (consts if pinned[i] else avail).update(of_node[i])
                resident.update(of_node[i])
        resident = kept(s + 1, avail) | consts
    if trace is not None:
        trace.append((len(seq), set(resident)))
    missing = {v_node[u] for u, wanted in enumerate(vals.at_end) if wanted and u not in resident}
    seq.extend(closure(missing))
    return seq


def _repair(pg: PlanGraph, vals: _Values, b: Sequence[int], kept: Callable[[int, Set[int]], Set[int]],
            budget: int, deadline: float) -> Optional[Tuple[float, int, List[int]]]:
    """Drop kept values at the peak until a rounding fits (Note [Rounding the LP]).

    Returns:
        (cost, peak, sequence) within the budget, or None (nothing left to
        drop, or the deadline).
    """
    banned: Dict[int, Set[int]] = {}
    reads, v_node, v_mem, pinned = vals.reads, vals.node, vals.mem, pg.pinned
    mem, size, cost_of = pg.mem, pg.graph.storage_size, pg.cost

    def kept2(s: int, avail: Set[int]) -> Set[int]:
        out = kept(s, avail)
        ban = banned.get(s)
        return out - ban if ban else out

    def measure(trace: Optional[List[Tuple[int, Set[int]]]]) -> Tuple[float, int, int, List[int]]:
        seq = _round(pg, vals, b, kept2, trace)
        cur = peak = 0
        cost = 0.0
        at = pos = -1
        for kind, x in sequence_steps(pg, seq):
            if kind == COMPUTE:
                pos += 1
                cur += mem[x]
                cost += cost_of[x]
                if cur > peak:
                    peak, at = cur, pos
            else:
                cur -= size[x]
        return cost, peak, at, seq

    trace: List[Tuple[int, Set[int]]] = []
    cost, peak, at, seq = measure(trace)
    while peak > budget and time.perf_counter() < deadline:
        s = bisect_right([t[0] for t in trace], at) - 1
        used = {u for v in seq[trace[s][0]:at + 1] for u in reads[v]}
        cands = [u for u in trace[s][1] if u not in used and not pinned[v_node[u]] and v_mem[u] > 0]
        if not cands:
            return None
        cands.sort(key=lambda u: v_mem[u] / (cost_of[v_node[u]] + 1e-9), reverse=True)
        best = None  # (extra cost per byte saved, candidate, its result)
        ban = banned.setdefault(s, set())
        for u in cands[:REPAIR_LOOKAHEAD]:
            ban.add(u)
            c2, p2, a2, seq2 = measure(None)
            ban.discard(u)
            if p2 < peak:
                score = (c2 - cost) / (peak - p2)
                if best is None or score < best[0]:
                    best = (score, u, (c2, p2, a2, seq2))
        if best is None:
            return None
        ban.add(best[1])
        trace = []
        cost, peak, at, seq = measure(trace)
    if peak <= budget:
        return cost, peak, seq
    return None


@dataclass
class _Rounding:
    """The best rounding so far (cost, peak, sequence) and what was tried."""

    best: Optional[Tuple[float, int, List[int]]] = None
    best_taus: Optional[List[float]] = None
    tries: int = 0
    lowest: Optional[int] = None
    seen: Set[Tuple[int, ...]] = field(default_factory=set)


def _round_lp(pg: PlanGraph, budget: int, model: IlpModel, x, options: PlanOptions, deadline: float,
              state: _Rounding) -> None:
    """Round an LP solution (Note [Rounding the LP]) until the deadline; updates ``state``."""
    b = model.bounds
    T = len(b) - 1
    vals = model.values if model.values is not None else _values(pg)
    probs: List[Dict[int, float]] = [{} for _ in range(T + 1)]
    fractional: Set[int] = set()
    for (s, i), col in model.s_cols.items():
        p = float(x[col])
        if p > 1e-6:
            probs[s][i] = min(1.0, p)
            if p < 1 - 1e-6:
                fractional.add(i)
    rng = random.Random(options.seed)

    near: List[Tuple[float, int, Any]] = []  # the cheapest roundings over the budget, to repair

    def attempt(kept, taus=None) -> bool:
        seq = _round(pg, vals, b, kept)
        key = tuple(seq)
        if key in state.seen:
            return False
        state.seen.add(key)
        peak, cost = sequence_profile(pg, sequence_steps(pg, seq))
        state.tries += 1
        state.lowest = peak if state.lowest is None else min(state.lowest, peak)
        if peak > budget and (state.best is None or cost < state.best[0]):
            near.append((cost, state.tries, kept))
            near.sort(key=lambda c: c[:2])
            del near[REPAIRS:]
        if peak <= budget and (state.best is None or (cost, peak) < (state.best[0], state.best[1])):
            state.best = (cost, peak, seq)
            if taus is not None:
                state.best_taus = list(taus)
            return True
        return False

    def per_value(taus):
        return lambda s, avail: {u for u, p in probs[s].items() if p > taus[u] and u in avail}

    def draw(s, avail):
        return {u for u, p in probs[s].items() if u in avail and p > rng.random()}

    n = len(vals.node)
    rules: List[Tuple[str, float]] = [("threshold", tau / 20.0) for tau in range(1, 21)]
    for r in range(max(1, options.rounds)):
        rules.append(("node", r))
        rules.append(("draw", r))
    for kind, arg in rules:
        if time.perf_counter() > deadline:
            return
        if kind == "threshold":
            taus = [arg - 1e-9] * n
        elif kind == "node":
            taus = [rng.random() for _ in range(n)]
        else:
            attempt(draw)
            continue
        attempt(per_value(taus), taus)
    for k, (cost, _, kept) in enumerate(list(near)):
        now = time.perf_counter()
        if state.best is not None and cost >= state.best[0]:
            continue
        fixed = _repair(pg, vals, b, kept, budget, now + (deadline - now) / (2 * (len(near) - k)))
        if fixed is not None and (state.best is None or fixed[:2] < state.best[:2]):
            state.best = fixed
    grid = (-1.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0)
    order = sorted(fractional)
    for _ in range(3):
        if state.best_taus is None:
            return
        improved = False
        for i in order:
            for tau in grid:
                if time.perf_counter() > deadline:
                    return
                base = state.best_taus
                if tau == base[i]:
                    continue
                taus = list(base)
                taus[i] = tau
                if attempt(per_value(taus), taus):
                    improved = True
        if not improved:
            return
