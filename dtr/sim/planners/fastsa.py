"""``fastsa``: simulated annealing over the compute sequence (fastsa.txt section 2).

See Note [FastSA].
"""
from __future__ import annotations

import math
import random
import time
from bisect import bisect_left, insort
from typing import List, Optional, Tuple

from dtr.sim.graph import PlanGraph
from dtr.sim.planners import PlanOptions, PlanResult, register_planner
from dtr.sim.schedule import sequence_profile, sequence_steps

__all__ = ["plan_fastsa", "AddMaxTree", "Annealer"]

# Note [FastSA]
# ~~~~~~~~~~~~~
# The state is a fixed-length vector of time slots (6 per node, initially
# the log's order with nops between), each holding a node or nop. Mutations:
# add a node into a nop slot (valid when each input was produced earlier),
# remove a node (valid when its uses up to its next production are still
# covered by an earlier production; a node keeps at least one production,
# constants are never touched). Each node's value lives, for each of its
# productions, from the production to its last use before the next one (to
# the end for the last production of a node referenced at the end or a
# constant); the memory of every time slot is kept in an add-max segment
# tree (range add, global max), so the peak after a mutation costs
# O(log T) per changed interval. A
# rejected mutation is undone by its inverse. Objective: the paper's eq. 1,
# f = max(budget, peak) * cost, while the peak is within the budget; above
# it the peak counts to the power OVER (4), budget * (peak/budget)^4 * cost,
# so that memory is driven down first. Acceptance
# exp(-(f'/f - 1) / temperature), temperature geometric from TEMP0 (1e-2) to
# TEMP1 (1e-5). Node grouping (section 2.2.2): the first half of the run also
# proposes adding or removing an input-output pair (d, v) together, in the
# next two nop slots; the second half works on single nodes only, at the
# lower temperatures. Warm start (``options.warm_start``, default): the
# initial state is the cheapest plan within the budget of Rotor or Chen
# (spread over max(6 n, 3 len) slots, nops between), else the log's order;
# the best state within the budget is kept, so the result is never worse
# than that start. Values are node-level (a node's storages as one block);
# the schedule then frees each storage at its own last use. Seeded by
# ``options.seed``; stops after ``options.sa_steps`` iterations (default
# 5000 per node, at most 3,000,000) or ``options.time_limit`` seconds.

SLOTS = 6
#: Relative temperatures (the paper starts at 1e-3; 1e-2 explores better on the toy chains from a cold start).
TEMP0, TEMP1 = 1e-2, 1e-5
#: Exponent of the peak in the objective while the peak is above the budget.
OVER = 4.0


class AddMaxTree:
    """Range add / global max over an array of length n (iterative, lazy-free)."""

    def __init__(self, n: int):
        size = 1
        while size < max(1, n):
            size *= 2
        self.size = size
        self.t = [0] * (2 * size)
        self.d = [0] * size

    def add(self, lo: int, hi: int, v: int) -> None:
        """Add v to A[lo:hi+1] (inclusive)."""
        if lo > hi or v == 0:
            return
        t, d, size = self.t, self.d, self.size
        lft, rgt = lo + size, hi + 1 + size
        l0, r0 = lft, rgt - 1
        while lft < rgt:
            if lft & 1:
                t[lft] += v
                if lft < size:
                    d[lft] += v
                lft += 1
            if rgt & 1:
                rgt -= 1
                t[rgt] += v
                if rgt < size:
                    d[rgt] += v
            lft >>= 1
            rgt >>= 1
        for i in (l0, r0):
            i >>= 1
            while i >= 1:
                a, b = t[2 * i], t[2 * i + 1]
                t[i] = (a if a > b else b) + d[i]
                i >>= 1

    @property
    def max(self) -> int:
        return self.t[1]


class Annealer:
    """The annealing state of Note [FastSA]."""

    def __init__(self, pg: PlanGraph, slots: int = SLOTS, init: Optional[List[int]] = None):
        self.pg = pg
        n = pg.n
        order = list(range(n)) if init is None else list(init)
        self.T = T = max(1, n * slots, 3 * len(order))
        self.slot: List[int] = [-1] * T
        self.prod: List[List[int]] = [[] for _ in range(n)]
        self.uses: List[List[int]] = [[] for _ in range(n)]
        self.ivs: List[List[Tuple[int, int]]] = [[] for _ in range(n)]
        self.keep = [pg.referenced_at_end[v] or pg.pinned[v] for v in range(n)]
        self.tree = AddMaxTree(T)
        self.cost = 0.0
        L = max(1, len(order))
        for j, v in enumerate(order):
            t = j * T // L
            self.slot[t] = v
            self.prod[v].append(t)
            for d in pg.deps[v]:
                self.uses[d].append(t)
            self.cost += pg.cost[v]
        for v in range(n):
            self._refresh(v)

    def _intervals(self, v: int) -> List[Tuple[int, int]]:
        prod, uses = self.prod[v], self.uses[v]
        if self.pg.pinned[v]:
            return [(prod[0], self.T - 1)] if prod else []
        out = []
        for i, p in enumerate(prod):
            nxt = prod[i + 1] if i + 1 < len(prod) else self.T
            if nxt == self.T and self.keep[v]:
                out.append((p, self.T - 1))
                continue
            j = bisect_left(uses, nxt) - 1
            r = uses[j] if j >= 0 and uses[j] > p else p
            out.append((p, r))
        return out

    def _refresh(self, v: int) -> None:
        new = self._intervals(v)
        old = self.ivs[v]
        if new == old:
            return
        m = self.pg.mem[v]
        for lo, hi in old:
            self.tree.add(lo, hi, -m)
        for lo, hi in new:
            self.tree.add(lo, hi, m)
        self.ivs[v] = new

    def can_add(self, v: int, t: int) -> bool:
        return self.slot[t] < 0 and all(self.prod[d] and self.prod[d][0] < t for d in self.pg.deps[v])

    def add(self, v: int, t: int) -> None:
        self.slot[t] = v
        insort(self.prod[v], t)
        for d in self.pg.deps[v]:
            insort(self.uses[d], t)
        self.cost += self.pg.cost[v]
        self._refresh(v)
        for d in self.pg.deps[v]:
            if not self.pg.pinned[d]:
                self._refresh(d)

    def can_remove(self, t: int) -> bool:
        v = self.slot[t]
        if v < 0 or self.pg.pinned[v]:
            return False
        prod = self.prod[v]
        i = bisect_left(prod, t)
        if i > 0:
            return True
        if len(prod) == 1:
            return False
        nxt = prod[1]
        uses = self.uses[v]
        j = bisect_left(uses, t)
        return not (j < len(uses) and uses[j] < nxt)

    def remove(self, t: int) -> int:
        v = self.slot[t]
        self.slot[t] = -1
        self.prod[v].remove(t)
        for d in self.pg.deps[v]:
            self.uses[d].remove(t)
        self.cost -= self.pg.cost[v]
        self._refresh(v)
        for d in self.pg.deps[v]:
            if not self.pg.pinned[d]:
                self._refresh(d)
        return v

    @property
    def peak(self) -> int:
        return self.tree.max

    def sequence(self) -> List[int]:
        return [v for v in self.slot if v >= 0]


@register_planner("fastsa")
def plan_fastsa(pg: PlanGraph, budget: int, options: PlanOptions) -> PlanResult:
    """Simulated annealing over the compute sequence (Note [FastSA]).

    Returns:
        ``ok`` with the best sequence within the budget, or ``oom`` (the
        message gives the lowest peak reached).
    """
    rng = random.Random(options.seed)
    t_start = time.perf_counter()
    start_seq, start_name = _initial(pg, budget, options) if options.warm_start else (None, "the log's order")
    st = Annealer(pg, init=start_seq)
    movable = [v for v in range(pg.n) if not pg.pinned[v]]
    pairs = [(d, v) for v in movable for d in pg.deps[v] if not pg.pinned[d]]
    if not movable:
        seq = st.sequence()
        peak, cost = sequence_profile(pg, sequence_steps(pg, seq))
        ok = peak <= budget
        return PlanResult("fastsa", "ok" if ok else "oom", tuple(seq) if ok else None, predicted_cost=cost)
    steps = options.sa_steps or min(5000 * pg.n, 3_000_000)
    deadline = t_start + options.time_limit
    b = max(budget, 1)

    def f() -> float:
        # the paper's eq. (1) within the budget; above it the excess counts
        # OVER-fold, so that the first moves drive the peak under the budget
        p = st.peak
        m = b if p <= b else b * (p / b) ** OVER
        return m * max(st.cost, 1e-12)

    cur = f()
    best: Optional[Tuple[float, List[int]]] = None
    lowest = st.peak
    if st.peak <= budget:
        best = (st.cost, st.sequence())
    temp0, temp1 = TEMP0, TEMP1
    T = st.T
    for it in range(steps):
        if (it & 255) == 0 and time.perf_counter() > deadline:
            break
        temp = temp0 * (temp1 / temp0) ** (it / steps)
        grouped = it < steps // 2 and pairs and rng.random() < 0.3
        undo: List[Tuple[str, int, int]] = []
        r = rng.random()
        if r < 0.5:  # add
            t = rng.randrange(T)
            if grouped:
                d, v = pairs[rng.randrange(len(pairs))]
                t2 = t + 1
                while t2 < T and st.slot[t2] >= 0:
                    t2 += 1
                if t2 >= T or not st.can_add(d, t):
                    continue
                st.add(d, t)
                undo.append(("r", t, d))
                if not st.can_add(v, t2):
                    st.remove(t)
                    continue
                st.add(v, t2)
                undo.append(("r", t2, v))
            else:
                v = movable[rng.randrange(len(movable))]
                if not st.can_add(v, t):
                    continue
                st.add(v, t)
                undo.append(("r", t, v))
        else:  # remove
            t = rng.randrange(T)
            if not st.can_remove(t):
                continue
            v = st.remove(t)
            undo.append(("a", t, v))
            if grouped:
                t0 = t - 1
                while t0 >= 0 and st.slot[t0] < 0:
                    t0 -= 1
                if t0 >= 0 and st.slot[t0] in pg.deps[v] and st.can_remove(t0):
                    w = st.remove(t0)
                    undo.append(("a", t0, w))
        new = f()
        if new <= cur or rng.random() < math.exp(-(new / cur - 1.0) / temp):
            cur = new
            lowest = min(lowest, st.peak)
            if st.peak <= budget and (best is None or st.cost < best[0]):
                best = (st.cost, st.sequence())
        else:
            for kind, t, v in reversed(undo):
                if kind == "r":
                    st.remove(t)
                else:
                    st.add(v, t)
    if best is None:
        return PlanResult("fastsa", "oom", None, message=f"no sequence within the budget; lowest peak {lowest} "
                                                           f"bytes (start: {start_name})")
    seq = best[1]
    peak, cost = sequence_profile(pg, sequence_steps(pg, seq))
    return PlanResult("fastsa", "ok" if peak <= budget else "oom", tuple(seq) if peak <= budget else None,
                      predicted_cost=cost, message=f"{it + 1} iterations from {start_name}")


def _initial(pg: PlanGraph, budget: int, options: PlanOptions) -> Tuple[Optional[List[int]], str]:
    """The start state: the cheapest sequence within the budget from Rotor or Chen, else the log's order."""
    from dtr.sim.planners import get_planner
    best: Optional[Tuple[float, List[int], str]] = None
    for name in ("rotor", "chen"):
        try:
            r = get_planner(name)(pg, budget, options)
        except Exception:  # a failing seed planner only loses the warm start
            continue
        if r.sequence is None:
            continue
        peak, cost = sequence_profile(pg, sequence_steps(pg, list(r.sequence)))
        if peak <= budget and (best is None or cost < best[0]):
            best = (cost, list(r.sequence), f"{name}'s plan")
    if best is None:
        return None, "the log's order"
    return best[1], best[2]
