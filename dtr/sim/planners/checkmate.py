"""``checkmate`` and ``checkmate-lp``: the Checkmate ILP on HiGHS (``scipy.optimize.milp``).

See Note [The Checkmate ILP] (after Jain et al.; rockmate.txt appendix B
gives the multi-output variant).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import List, Optional, Tuple

from dtr.sim.graph import PlanGraph
from dtr.sim.planners import PlanOptions, PlanResult, register_planner
from dtr.sim.schedule import sequence_profile, sequence_steps

__all__ = ["plan_checkmate", "plan_checkmate_lp", "build_ilp", "IlpModel"]

# Note [The Checkmate ILP]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Nodes 0..n-1 in the log's order; stage t ends with the first computation of
# node t. Binary R[t,i] (i <= t): node i computed during stage t; S[t,i]
# (i < t, plus a final row t = n): i resident when stage t starts;
# FREE[t,i,k]: i freed right after computing k in stage t (k = i or a user of
# i); continuous U[t,k]: memory after computing k in stage t, before frees.
#   R[t,t] = 1; R[t,k] <= R[t,d] + S[t,d] for each input d of k;
#   S[t+1,i] <= S[t,i] + R[t,i]; S[n,i] = 1 for wanted nodes;
#   FREE[t,i,k] = R[t,k] (1 - S[t+1,i]) prod_{users j of i, k < j <= t} (1 - R[t,j]),
#     linearized with the hazard count h = (1 - R[t,k]) + S[t+1,i] + sum R[t,j]:
#     1 - FREE <= h and kappa (1 - FREE) >= h, kappa = 2 + #j;
#   U[t,0] = sum_i m_i S[t,i] + m_0 R[t,0];
#   U[t,k] = U[t,k-1] - sum_{i in in(k-1) + {k-1}} m_i FREE[t,i,k-1] + m_k R[t,k];
#   U[t,k] <= budget; minimize sum c_i R[t,i].
# Constants are resident from their stage on and never freed or recomputed.
# The memory model counts a node's storages as one block and frees it after
# its last use in a stage, so it is at most the schedule's real peak (the
# schedule built from R frees each storage at its own last use). Memory is
# scaled by the budget (U <= 1) for numerics. Variables that cannot matter
# are fixed to 0 (S[t,i] after i's last user, R[t,i] once nothing that reads
# i transitively is left), which HiGHS's presolve then removes. ``optimal`` is reported only
# when HiGHS proves optimality with mip_rel_gap <= 1e-6; on the time limit
# with an incumbent the status is ``ok`` and ``gap`` is HiGHS's relative gap.
#
# ``checkmate-lp`` solves the LP relaxation and rounds it as Checkmate does
# (two-phase rounding): draw S[t,i] ~ Bernoulli(S*_lp[t,i]) (plus the
# deterministic S* >= 0.5 rounding), then derive the least R that the drawn S
# needs (a node is computed in stage t when stage t needs it and it is not
# resident), and keep the cheapest rounding whose schedule fits the budget.


@dataclass
class IlpModel:
    """The assembled ILP (scipy.optimize inputs) and its variable layout."""

    n: int
    c: "object"
    A: "object"
    lo: "object"
    hi: "object"
    lb: "object"
    ub: "object"
    integrality: "object"
    num_r: int
    num_s: int

    def r(self, t: int, i: int) -> int:
        return t * (t + 1) // 2 + i

    def s(self, t: int, i: int) -> int:
        return self.num_r + (t - 1) * t // 2 + i


def build_ilp(pg: PlanGraph, budget: int) -> IlpModel:
    """Assemble the ILP of Note [The Checkmate ILP] (scipy sparse matrices)."""
    import numpy as np
    from scipy.sparse import coo_matrix
    n = pg.n
    users = pg.users()
    scale = float(max(budget, 1))
    m = [x / scale for x in pg.mem]
    num_r = n * (n + 1) // 2
    num_s = n * (n + 1) // 2  # rows t = 1..n, i < t

    def R(t, i):
        return t * (t + 1) // 2 + i

    def S(t, i):
        return num_r + (t - 1) * t // 2 + i

    nv = num_r + num_s
    free_idx = {}
    for t in range(n):
        for k in range(t + 1):
            for i in set(pg.deps[k]) | {k}:
                if not pg.pinned[i]:
                    free_idx[(t, i, k)] = nv
                    nv += 1
    u0 = nv
    nv += num_r

    def U(t, k):
        return u0 + t * (t + 1) // 2 + k

    rows: List[int] = []
    cols: List[int] = []
    vals: List[float] = []
    lo: List[float] = []
    hi: List[float] = []
    row = 0

    def add(entries, l, h):
        nonlocal row
        for col, v in entries:
            rows.append(row)
            cols.append(col)
            vals.append(v)
        lo.append(l)
        hi.append(h)
        row += 1

    inf = np.inf
    for t in range(n):
        for k in range(t + 1):
            for d in pg.deps[k]:
                add([(R(t, k), 1.0), (R(t, d), -1.0)] + ([(S(t, d), -1.0)] if d < t else []), -inf, 0.0)
        for i in range(t + 1):
            ent = [(S(t + 1, i), 1.0), (R(t, i), -1.0)]
            if i < t:
                ent.append((S(t, i), -1.0))
            add(ent, -inf, 0.0)
    for (t, i, k), f in free_idx.items():
        js = [j for j in users[i] if k < j <= t]
        kappa = 2 + len(js)
        haz = [(R(t, k), -1.0), (S(t + 1, i), 1.0)] + [(R(t, j), 1.0) for j in js]
        add([(f, 1.0)] + haz, 0.0, inf)                  # 1 - FREE <= h
        add([(f, float(kappa))] + haz, -inf, kappa - 1.0)  # kappa (1 - FREE) >= h
    for t in range(n):
        ent = [(U(t, 0), 1.0), (R(t, 0), -m[0])] + [(S(t, i), -m[i]) for i in range(t)]
        add(ent, 0.0, 0.0)
        for k in range(1, t + 1):
            ent = [(U(t, k), 1.0), (U(t, k - 1), -1.0), (R(t, k), -m[k])]
            for i in set(pg.deps[k - 1]) | {k - 1}:
                f = free_idx.get((t, i, k - 1))
                if f is not None:
                    ent.append((f, m[i]))
            add(ent, 0.0, 0.0)
    lb = np.zeros(nv)
    ub = np.ones(nv)
    ub[u0:] = 1.0
    for t in range(n):
        lb[R(t, t)] = 1.0
        for i in range(t):
            if pg.pinned[i]:
                ub[R(t, i)] = 0.0
        for i in range(t):
            if pg.pinned[i]:
                lb[S(t, i)] = 1.0
    for i in range(n):
        if pg.wanted[i] or pg.pinned[i]:
            lb[S(n, i)] = 1.0
    # Pruning (Note [The Checkmate ILP]): keeping i into stage t is useless once
    # its last user has run (last[i] < t); computing i in stage t is useless once
    # every node that transitively reads it is done (reach[i] < t).
    last = [n if (pg.wanted[i] or pg.pinned[i]) else max(users[i], default=i) for i in range(n)]
    reach = last[:]
    for i in range(n - 1, -1, -1):
        for j in users[i]:
            reach[i] = max(reach[i], reach[j])
    for t in range(1, n + 1):
        for i in range(t):
            if last[i] < t:
                ub[S(t, i)] = 0.0
            if t < n and reach[i] < t:
                ub[R(t, i)] = 0.0
    c = np.zeros(nv)
    for t in range(n):
        for i in range(t + 1):
            c[R(t, i)] = pg.cost[i]
    integrality = np.ones(nv)
    integrality[u0:] = 0
    A = coo_matrix((vals, (rows, cols)), shape=(row, nv)).tocsr()
    return IlpModel(n=n, c=c, A=A, lo=np.asarray(lo), hi=np.asarray(hi), lb=lb, ub=ub, integrality=integrality,
                    num_r=num_r, num_s=num_s)


def _sequence_from_r(model: IlpModel, x) -> List[int]:
    seq = []
    for t in range(model.n):
        for i in range(t + 1):
            if x[model.r(t, i)] > 0.5:
                seq.append(i)
    return seq


def _ilp_cost(pg: PlanGraph, seq: List[int]) -> float:
    return float(sum(pg.cost[v] for v in seq))


@register_planner("checkmate")
def plan_checkmate(pg: PlanGraph, budget: int, options: PlanOptions) -> PlanResult:
    """Solve the Checkmate ILP with HiGHS within ``options.time_limit`` seconds.

    Returns:
        ``optimal`` (proven, gap <= ``gap_tol``), ``ok`` (time limit with an
        incumbent; ``gap`` set), ``timeout`` (no incumbent), or ``infeasible``.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    if pg.pinned_bytes > budget:
        return PlanResult("checkmate", "infeasible", None, message="the constants alone exceed the budget")
    model = build_ilp(pg, budget)
    res = milp(model.c, constraints=LinearConstraint(model.A, model.lo, model.hi),
               bounds=Bounds(model.lb, model.ub), integrality=model.integrality,
               options={"time_limit": float(options.time_limit), "mip_rel_gap": float(options.gap_tol),
                        "disp": False})
    gap = getattr(res, "mip_gap", None)
    gap = None if gap is None or not math.isfinite(gap) else float(gap)
    if res.x is None:
        if res.status == 2:
            return PlanResult("checkmate", "infeasible", None, gap=gap, message=res.message)
        return PlanResult("checkmate", "timeout", None, gap=gap, message=res.message)
    seq = _sequence_from_r(model, res.x)
    status = "optimal" if res.status == 0 and options.gap_tol <= 1e-6 else "ok"
    if status == "optimal":
        gap = 0.0 if gap is None else gap
    return PlanResult("checkmate", status, tuple(seq), gap=gap, predicted_cost=float(res.fun),
                      message=f"{model.A.shape[1]} variables, {model.A.shape[0]} constraints")


def _round(pg: PlanGraph, S_rows: List[set]) -> List[int]:
    """Two-phase rounding: the least R (as a sequence) that a drawn S needs."""
    n = pg.n
    seq: List[int] = []
    for t in range(n):
        have = set(S_rows[t])
        need = set(S_rows[t + 1]) - have
        need.add(t)
        # close under inputs that are not resident
        stack = list(need)
        while stack:
            v = stack.pop()
            for d in pg.deps[v]:
                if d not in have and d not in need:
                    need.add(d)
                    stack.append(d)
        seq.extend(sorted(need))
    return seq


@register_planner("checkmate-lp")
def plan_checkmate_lp(pg: PlanGraph, budget: int, options: PlanOptions) -> PlanResult:
    """The ILP's LP relaxation with Checkmate's randomized two-phase rounding.

    Returns:
        ``ok`` with the cheapest rounding within the budget; ``infeasible``
        when the LP is, ``oom`` when no rounding fits, ``timeout`` when the LP
        ran out of time.
    """
    from scipy.optimize import linprog
    if pg.pinned_bytes > budget:
        return PlanResult("checkmate-lp", "infeasible", None, message="the constants alone exceed the budget")
    model = build_ilp(pg, budget)
    import numpy as np
    A = model.A
    finite_hi = np.isfinite(model.hi)
    finite_lo = np.isfinite(model.lo)
    eq = finite_hi & finite_lo & (model.lo == model.hi)
    ub_rows = finite_hi & ~eq
    lb_rows = finite_lo & ~eq
    from scipy.sparse import vstack
    A_ub = vstack([A[ub_rows], -A[lb_rows]]).tocsr()
    b_ub = np.concatenate([model.hi[ub_rows], -model.lo[lb_rows]])
    res = linprog(model.c, A_ub=A_ub, b_ub=b_ub, A_eq=A[eq], b_eq=model.hi[eq],
                  bounds=np.stack([model.lb, model.ub], axis=1), method="highs",
                  options={"time_limit": float(options.time_limit), "disp": False})
    if res.status == 2:
        return PlanResult("checkmate-lp", "infeasible", None, message="the LP relaxation is infeasible")
    if res.x is None:
        return PlanResult("checkmate-lp", "timeout", None, message=str(res.message))
    x = res.x
    n = pg.n
    probs = [[min(1.0, max(0.0, x[model.s(t, i)])) for i in range(t)] for t in range(1, n + 1)]
    rng = random.Random(options.seed)
    best: Optional[Tuple[float, int, List[int]]] = None
    tries = 0
    lowest = None
    for r in range(max(1, options.rounds) + 1):
        S_rows: List[set] = [set()]
        for t in range(1, n + 1):
            p = probs[t - 1]
            if r == 0:
                S_rows.append({i for i in range(t) if p[i] >= 0.5 or pg.pinned[i]})
            else:
                S_rows.append({i for i in range(t) if pg.pinned[i] or rng.random() < p[i]})
        for i in range(n):
            if pg.wanted[i] or pg.pinned[i]:
                S_rows[n].add(i)
        seq = _round(pg, S_rows)
        peak, cost = sequence_profile(pg, sequence_steps(pg, seq))
        tries += 1
        lowest = peak if lowest is None else min(lowest, peak)
        if peak <= budget and (best is None or (cost, peak) < (best[0], best[1])):
            best = (cost, peak, seq)
    if best is None:
        return PlanResult("checkmate-lp", "oom", None,
                          message=f"no rounding of {tries} fits; lowest peak {lowest} bytes; LP bound {res.fun:g}")
    return PlanResult("checkmate-lp", "ok", tuple(best[2]), predicted_cost=best[0],
                      message=f"LP bound {res.fun:g}; best of {tries} roundings")
