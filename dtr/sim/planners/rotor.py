"""``rotor``: dynamic programming for heterogeneous forward-backward chains (optimal in its own space).

After Beaumont et al.'s Rotor (rockmate.txt section 3.4 and appendix C),
specialized to the chains of :func:`dtr.sim.graph.chain_shape` (one kind of
forward computation: what the backward reads is the forward output itself).
See Note [The Rotor recurrence].
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

from dtr.sim.graph import ChainShape, PlanGraph, chain_shape
from dtr.sim.planners.base import PlanOptions, PlanResult, register_planner

__all__ = ["plan_rotor", "rotor_chain"]

# Note [The Rotor recurrence]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Chain: a_i = F_i(a_{i-1}) (i = 1..n, a_0 = nothing), g_k = B_k(a_k, g_{k+1})
# (k = n..0, g_{n+1} = nothing). P(s, t, m): the least cost to produce g_s
# starting with a_s and g_{t+1} resident, within memory m (which counts them),
# ending with only g_s resident of the three. For s = t: run B_s, feasible when
# a_s + g_{s+1} + g_s <= m. For s < t: choose the next activation i kept
# (s < i <= t): run F_{s+1}..F_i, each intermediate freed after its use (peak
# a_s + g_{t+1} + a_{j-1} + a_j at step j), then P(i, t, m - a_s) (a_s stays
# aside), then P(s, i - 1, m) (a_s and g_i resident). i = s + 1 is Rotor's
# "computed once" case (eq. 1), i > s + 1 its "computed more than once" case
# (eq. 2). Memory is counted in slots: exact bytes when the budget is at most
# ``rotor_slots`` times the smallest nonzero size and all sizes divide evenly,
# else budget / rotor_slots bytes per slot with sizes rounded up (a plan is
# then still within the budget, optimal up to that rounding). Constants are
# computed first and their bytes taken off the budget.
#
# Note [What Rotor's optimum covers]
# P keeps a_s aside while it solves P(i, t, m - a_s): a checkpoint, once
# kept, stays until its segment's backward. A schedule outside that space can
# cost less: on x -> a0 -> a1 -> a2 (sizes 3, 19, 14) at a budget of 39,
# freeing a0 after it rebuilt a1 and rebuilding a0 from x before B1 costs 19,
# Rotor's best 20 (a helper's counterexample, tests/planners). So Rotor's
# plans are reported ``ok``, "optimal among Rotor's schedules", never
# ``optimal``, which means proven over all schedules in the log's order.
#
# Cost: O(n^3 M) for M slots (vectorized over the choice i and the memory m).
# When the chain is homogeneous (equal forward costs, backward costs and sizes)
# P depends only on t - s and on whether s = 0 and t = n: O(n^2 M), which
# plans a 1000-layer chain in well under a second.


def rotor_chain(a: List[int], g: List[int], f: List[float], b: List[float], m_avail: int
                ) -> Tuple[float, Optional[List[Tuple[str, int]]]]:
    """Solve the chain DP in slot units.

    Args:
        a: a[0..n] activation sizes (a[0] = 0).
        g: g[0..n+1] gradient sizes (g[n+1] = 0).
        f: f[1..n] forward costs (f[0] unused).
        b: b[0..n] backward costs.
        m_avail: memory in slots.

    Returns:
        (cost, sequence of ("F", i) / ("B", k)), or (inf, None) when infeasible.
    """
    import numpy as np
    n = len(a) - 1
    M = max(0, int(m_avail))
    inf = math.inf
    mgrid = np.arange(M + 1)
    homog = (n >= 2 and len(set(a[1:])) == 1 and len(set(g[:n + 1])) == 1 and len(set(f[1:])) == 1
             and len(set(b)) == 1)
    fcum = np.concatenate([[0.0], np.cumsum(np.asarray(f[1:], dtype=float))])  # fcum[i] = f_1 + .. + f_i

    def shift(arr: "np.ndarray", k: int) -> "np.ndarray":
        """arr[..., m - k] (inf where m < k)."""
        if k == 0:
            return arr
        out = np.full_like(arr, inf)
        if k <= M:
            out[..., k:] = arr[..., :M + 1 - k]
        return out

    def fwd_peaks(s: int, t: int) -> "np.ndarray":
        """Forward-sweep peaks for i = s+1..t (excluding a_s + g_{t+1})."""
        steps = [(a[j - 1] if j - 1 > s else 0) + a[j] for j in range(s + 1, t + 1)]
        return np.maximum.accumulate(np.asarray(steps, dtype=np.int64))

    def base(s: int) -> "np.ndarray":
        need = a[s] + g[s + 1] + g[s]
        return np.where(mgrid >= need, float(b[s]), inf)

    if homog:
        # tables[(L, R)][l] over m; arg likewise (choice offset k = i - s).
        tab = {(L, R): np.full((n + 1, M + 1), inf) for L in (0, 1) for R in (0, 1)}
        arg = {(L, R): np.zeros((n + 1, M + 1), dtype=np.int32) for L in (0, 1) for R in (0, 1)}
        for L in (0, 1):
            for R in (0, 1):
                s = 0 if L else 1
                need = a[s] + (0 if R else g[1]) + g[0]
                tab[(L, R)][0] = np.where(mgrid >= need, float(b[0]), inf)
        for ell in range(1, n + 1):
            for L in (0, 1):
                for R in (0, 1):
                    if (L and R and ell != n) or (not L and not R and ell > n - 2) or (L + R == 1 and ell > n - 1):
                        continue
                    s = 0 if L else 1
                    as_ = a[s]
                    gt = 0 if R else g[1]
                    right = shift(tab[(0, R)][ell - 1::-1], as_)  # P(i, t): length ell - k, k = 1..ell
                    left = tab[(L, 0)][0:ell]                     # P(s, i-1): length k - 1
                    ks = np.arange(1, ell + 1)
                    peaks = as_ + gt + np.where(ks == 1, a[1], 2 * a[1])
                    cand = fcum[1] * ks[:, None] + right + left
                    cand = np.where(mgrid[None, :] >= peaks[:, None], cand, inf)
                    best = np.argmin(cand, axis=0)
                    tab[(L, R)][ell] = cand[best, mgrid]
                    arg[(L, R)][ell] = best + 1

        def lookup(s: int, t: int, m: int) -> Tuple[float, int]:
            key = (int(s == 0), int(t == n))
            return tab[key][t - s][m], int(arg[key][t - s][m])
    else:
        P = np.full((n + 1, n + 1, M + 1), inf)
        A = np.zeros((n + 1, n + 1, M + 1), dtype=np.int32)
        for s in range(n + 1):
            P[s, s] = base(s)
        for ell in range(1, n + 1):
            for s in range(0, n + 1 - ell):
                t = s + ell
                right = shift(P[s + 1:t + 1, t], a[s])   # P(i, t, m - a_s), i = s+1..t
                left = P[s, s:t]                          # P(s, i-1, m)
                peaks = a[s] + g[t + 1] + fwd_peaks(s, t)
                fc = fcum[s + 1:t + 1] - fcum[s]
                cand = fc[:, None] + right + left
                cand = np.where(mgrid[None, :] >= peaks[:, None], cand, inf)
                best = np.argmin(cand, axis=0)
                P[s, t] = cand[best, mgrid]
                A[s, t] = best + 1

        def lookup(s: int, t: int, m: int) -> Tuple[float, int]:
            return P[s, t, m], int(A[s, t, m])

    total, _ = lookup(0, n, M)
    if not math.isfinite(total):
        return inf, None
    seq: List[Tuple[str, int]] = []
    stack: List[tuple] = [(0, n, M)]  # (s, t, m): solve P(s, t, m); ("F", j): run F_j
    while stack:
        item = stack.pop()
        if item[0] == "F":
            seq.append(("F", item[1]))
            continue
        s, t, m = item
        if s == t:
            seq.append(("B", s))
            continue
        _, k = lookup(s, t, m)
        i = s + k
        # executed in this order: F_{s+1..i}, P(i, t, m - a_s), P(s, i - 1, m)
        stack.append((s, i - 1, m))
        stack.append((i, t, m - a[s]))
        for j in range(i, s, -1):
            stack.append(("F", j))
    return float(total), seq


def _slots(sizes: List[int], avail: int, slots: int) -> Tuple[int, List[int], bool]:
    """(budget in slots, sizes in slots, exact): exact units (the sizes' gcd) when few enough."""
    nz = [x for x in sizes if x > 0]
    if not nz:
        return 0, [0] * len(sizes), True
    unit = math.gcd(*nz)
    if avail // unit <= slots:
        return avail // unit, [x // unit for x in sizes], True
    q = avail / slots
    return slots, [math.ceil(x / q - 1e-9) if x > 0 else 0 for x in sizes], False


def _sequence(ch: ChainShape, steps: List[Tuple[str, int]]) -> List[int]:
    out = list(ch.consts)
    for kind, i in steps:
        out.append(ch.fwd[i - 1] if kind == "F" else ch.bwd[i])
    return out


@register_planner("rotor")
def plan_rotor(pg: PlanGraph, budget: int, options: PlanOptions) -> PlanResult:
    """Rotor's dynamic program on a forward-backward chain (n/a on other graphs).

    Args:
        pg: the planning graph.
        budget: bytes, constants included.
        options: ``rotor_slots`` sets the memory discretization.

    Returns:
        ``ok`` with the sequence (optimal among Rotor's schedules, up to the
        memory rounding when sizes are discretized), ``infeasible``, or ``n/a``.
    """
    ch = chain_shape(pg)
    if ch is None:
        return PlanResult("rotor", "n/a", None, message="not a forward-backward chain")
    n = len(ch.fwd)
    a = [0] + [pg.mem[v] for v in ch.fwd]
    g = [pg.mem[v] for v in ch.bwd] + [0]
    f = [0.0] + [pg.cost[v] for v in ch.fwd]
    b = [pg.cost[v] for v in ch.bwd]
    avail = budget - pg.pinned_bytes
    if avail < 0:
        return PlanResult("rotor", "infeasible", None, message="the constants alone exceed the budget")
    slots = options.rotor_slots
    homog = n >= 2 and len(set(a[1:])) == 1 and len(set(g)) <= 2 and len(set(f[1:])) == 1
    if not homog:  # the O(n^2 M) table must fit in memory
        slots = max(16, min(slots, int(3e7 / (n + 1) ** 2)))
    m_slots, sizes, exact = _slots(a + g, avail, slots)
    a_s, g_s = sizes[:n + 1], sizes[n + 1:]
    cost, steps = rotor_chain(a_s, g_s, f, b, m_slots)
    if steps is None:
        return PlanResult("rotor", "infeasible", None, message="no chain schedule fits the budget")
    const_cost = sum(pg.cost[v] for v in ch.consts)
    # ("ok", not "optimal": see Note [What Rotor's optimum covers])
    return PlanResult("rotor", "ok", tuple(_sequence(ch, steps)), predicted_cost=cost + const_cost,
                      message="optimal among Rotor's schedules" if exact
                      else f"memory discretized in {m_slots} slots")
