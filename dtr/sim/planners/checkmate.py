"""``checkmate`` and ``checkmate-lp``: the Checkmate ILP on HiGHS (``scipy.optimize.milp``).

See Note [The Checkmate ILP] (after Jain et al.; rockmate.txt appendix B
gives the multi-output variant).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

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
#   S[t+1,i] <= S[t,i] + R[t,i]; S[n,i] = 1 for nodes referenced at the end;
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
# Note [ILP incumbents and gaps]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# HiGHS alone finds no feasible point of the ILP on ~100-node chains within
# minutes (its root LP bound is already tight there; the primal side fails).
# scipy's milp takes no start solution, so the planner (with
# ``options.warm_start``) first runs Rotor and Chen, keeps the cheapest plan
# within the budget, maps it to the ILP's R/S variables (``ilp_point``: the
# log's order of first computations, one computation per node and stage) and
# checks with the solver that it is feasible in the ILP's memory model (all
# R/S fixed). Its cost C then becomes an objective cutoff row
# sum c R <= C - delta (delta 0.5 for integral costs, else a relative 1e-7):
# HiGHS searches only for strictly cheaper schedules, and its bound pruning
# works from the start. Outcomes:
# - HiGHS finds a solution: ``optimal`` (proven, gap <= 1e-6) or ``ok``
#   (time limit; HiGHS's own relative gap);
# - HiGHS proves the cut-off model infeasible: nothing in the ILP is cheaper
#   than the incumbent, which is therefore an ILP optimum when it is in the
#   ILP's space (``optimal``, gap 0), else ``ok`` (gap 0: as cheap as the ILP);
# - time limit with nothing cheaper: ``timeout`` with the incumbent's schedule
#   and gap = (C - L) / C, where L is HiGHS's dual bound (a lower bound on
#   every ILP schedule: the cut-off model's bound, capped at C) or, when
#   HiGHS has none yet, the base compute (every node once);
# - no incumbent and no solution: ``timeout`` (or ``infeasible``), no schedule.
# Gap is relative to the schedule returned, against a lower bound for the ILP
# (the log's order), not for every possible schedule.
#
# ``checkmate-lp`` solves the LP relaxation and rounds it in two phases
# (Checkmate's scheme): round S, then take the least R that the rounded S
# needs (``round_forward``: stage by stage, compute t and the inputs that are
# not resident; a rounded S = 1 for a value that is not available is dropped,
# not recomputed). S is rounded with per-node thresholds (keep i into stage
# t when S*[t,i] > tau_i): 19 uniform thresholds 0.05..0.95, ``rounds``
# random per-node thresholds, and ``rounds`` independent Bernoulli(S*) draws;
# then a local search over the per-node thresholds of the best rounding
# (each node's tau tried at -1, 0.1..0.9, 1; up to 3 passes, within the time
# limit). The cheapest rounding whose schedule fits the budget is kept.


@dataclass
class IlpModel:
    """The assembled ILP (scipy.optimize inputs) and its variable layout.

    The arrays are numpy arrays and ``A`` a scipy sparse matrix (scipy has no
    type information, and numpy is imported lazily: typed ``Any``).
    """

    n: int
    c: Any
    A: Any
    lo: Any
    hi: Any
    lb: Any
    ub: Any
    integrality: Any
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

    def add(entries, low, high):
        nonlocal row
        for col, v in entries:
            rows.append(row)
            cols.append(col)
            vals.append(v)
        lo.append(low)
        hi.append(high)
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
                fi = free_idx.get((t, i, k - 1))
                if fi is not None:
                    ent.append((fi, m[i]))
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
        if pg.referenced_at_end[i] or pg.pinned[i]:
            lb[S(n, i)] = 1.0
    # Pruning (Note [The Checkmate ILP]): keeping i into stage t is useless once
    # its last user has run (last[i] < t); computing i in stage t is useless once
    # every node that transitively reads it is done (reach[i] < t).
    last = [n if (pg.referenced_at_end[i] or pg.pinned[i]) else max(users[i], default=i) for i in range(n)]
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


def ilp_point(pg: PlanGraph, model: IlpModel, seq: List[int]):
    """The R and S values of a compute sequence in the ILP's variables, or None.

    The sequence must compute the nodes for the first time in the log's order
    (stage t then ends with the first computation of t) and compute a node at
    most once per stage. S[t,i] = 1 when the value of i alive at the start of
    stage t is read later (or is referenced at the end, or a constant). Whether the point is
    feasible in the ILP (its memory model) is checked by the solver
    (:func:`_verify_point`).
    """
    import numpy as np
    n = pg.n
    first = [-1] * n
    for p, v in enumerate(seq):
        if first[v] < 0:
            first[v] = p
    if any(first[i] < 0 for i in range(n)) or any(first[i] >= first[i + 1] for i in range(n - 1)):
        return None
    stage_of = []
    t = 0
    for p in range(len(seq)):
        while first[t] < p:
            t += 1
        stage_of.append(t)
    x = {}
    for p, v in enumerate(seq):
        key = model.r(stage_of[p], v)
        if key in x:
            return None  # twice in one stage
        x[key] = 1.0
    # lifetime of each computation: [p, last read before the next computation]
    # (to the end for the last computation of a node referenced at the end or a constant)
    latest = [-1] * n
    end = list(range(len(seq)))
    for p, v in enumerate(seq):
        for d in pg.deps[v]:
            end[latest[d]] = p
        latest[v] = p
    for v in range(n):
        if pg.referenced_at_end[v] or pg.pinned[v]:
            end[latest[v]] = len(seq)
    start = [first[t - 1] + 1 for t in range(1, n + 1)]  # stage t starts here (t = 1..n)
    start.append(len(seq) + 1)
    for p, v in enumerate(seq):
        t = stage_of[p] + 1
        while t <= n and start[t - 1] <= end[p]:
            x[model.s(t, v)] = 1.0
            t += 1
    vals = np.zeros(model.num_r + model.num_s)
    for k, val in x.items():
        vals[k] = val
    return vals


def _verify_point(model: IlpModel, vals, time_limit: float):
    """Is the R/S point feasible in the ILP? Returns the full solution vector or None."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    k = model.num_r + model.num_s
    lb, ub = model.lb.copy(), model.ub.copy()
    if np.any(vals < lb[:k] - 1e-9) or np.any(vals > ub[:k] + 1e-9):
        return None
    lb[:k] = vals
    ub[:k] = vals
    res = milp(model.c, constraints=LinearConstraint(model.A, model.lo, model.hi), bounds=Bounds(lb, ub),
               integrality=model.integrality, options={"time_limit": max(1.0, time_limit), "disp": False})
    return res.x if res.status == 0 and res.x is not None else None


def heuristic_incumbents(pg: PlanGraph, budget: int, options: PlanOptions) -> List[Tuple[float, str, List[int]]]:
    """Valid sequences within the budget from the fast planners (Rotor, Chen), cheapest first."""
    from dtr.sim.planners import get_planner
    out = []
    for name in ("rotor", "chen"):
        try:
            r = get_planner(name)(pg, budget, options)
        except Exception:  # a heuristic failing must not stop the ILP
            continue
        if r.sequence is None:
            continue
        peak, cost = sequence_profile(pg, sequence_steps(pg, list(r.sequence)))
        if peak <= budget:
            out.append((cost, name, list(r.sequence)))
    out.sort(key=lambda c: c[0])
    return out


@register_planner("checkmate")
def plan_checkmate(pg: PlanGraph, budget: int, options: PlanOptions) -> PlanResult:
    """Solve the Checkmate ILP with HiGHS within ``options.time_limit`` seconds.

    See Note [ILP incumbents and gaps].

    Returns:
        ``optimal`` (proven, gap <= ``gap_tol``), ``ok`` (time limit with an
        incumbent; ``gap`` set), ``timeout`` (HiGHS found nothing better than
        the heuristic incumbent, or nothing at all, within the time limit;
        the heuristic schedule is returned when there is one, ``gap`` against
        HiGHS's lower bound), or ``infeasible``.
    """
    import time

    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_matrix, vstack
    t0 = time.perf_counter()
    if pg.pinned_bytes > budget:
        return PlanResult("checkmate", "infeasible", None, message="the constants alone exceed the budget")
    model = build_ilp(pg, budget)
    inc = None  # (cost, name, seq, in the ILP's space)
    for cost, name, seq in (heuristic_incumbents(pg, budget, options) if options.warm_start else []):
        vals = ilp_point(pg, model, seq)
        left = options.time_limit - (time.perf_counter() - t0)
        ok = vals is not None and left > 1 and _verify_point(model, vals, min(10.0, left / 4)) is not None
        if inc is None or ok:
            inc = (cost, name, seq, ok)
        if ok:
            break
    A, lo, hi = model.A, model.lo, model.hi
    cutoff = None
    if inc is not None:
        integral = all(float(c).is_integer() for c in pg.cost)
        cutoff = inc[0] - 0.5 if integral else inc[0] - 1e-7 * max(1.0, abs(inc[0]))
        A = vstack([A, csr_matrix(model.c.reshape(1, -1))]).tocsr()
        lo = np.append(lo, -np.inf)
        hi = np.append(hi, cutoff)
    left = max(1.0, options.time_limit - (time.perf_counter() - t0))
    res = milp(model.c, constraints=LinearConstraint(A, lo, hi),
               bounds=Bounds(model.lb, model.ub), integrality=model.integrality,
               options={"time_limit": float(left), "mip_rel_gap": float(options.gap_tol), "disp": False})
    size = f"{model.A.shape[1]} variables, {model.A.shape[0]} constraints"
    bound = getattr(res, "mip_dual_bound", None)
    bound = None if bound is None or not math.isfinite(bound) else float(bound)
    if res.x is not None:
        seq = _sequence_from_r(model, res.x)
        gap = getattr(res, "mip_gap", None)
        gap = None if gap is None or not math.isfinite(gap) else float(gap)
        status = "optimal" if res.status == 0 and options.gap_tol <= 1e-6 else "ok"
        if status == "optimal":
            gap = 0.0 if gap is None else gap
        extra = f"; better than {inc[1]}'s {inc[0]:g}" if inc is not None else ""
        return PlanResult("checkmate", status, tuple(seq), gap=gap, predicted_cost=float(res.fun),
                          message=f"{size}{extra}")
    if inc is None:
        if res.status == 2:
            return PlanResult("checkmate", "infeasible", None, message=res.message)
        return PlanResult("checkmate", "timeout", None, message=f"{size}; no schedule found; {res.message}")
    cost, name, seq, in_space = inc
    if res.status == 2:  # nothing in the ILP is cheaper than the incumbent
        if in_space:
            return PlanResult("checkmate", "optimal", tuple(seq), gap=0.0, predicted_cost=cost,
                              message=f"{size}; HiGHS proved no ILP schedule cheaper than {name}'s {cost:g}, "
                                      f"which is in the ILP's space")
        return PlanResult("checkmate", "ok", tuple(seq), gap=0.0, predicted_cost=cost,
                          message=f"{size}; HiGHS proved no ILP schedule cheaper than {name}'s {cost:g} "
                                  f"(outside the ILP's space)")
    # Lower bound: HiGHS's dual bound when it has one, else every node once.
    base = float(sum(pg.cost))
    low, what = (min(bound, cost), "HiGHS's lower bound") if bound is not None and bound >= base else \
        (base, "the base compute (HiGHS had no bound yet)")
    gap = max(0.0, (cost - low) / abs(cost)) if cost else 0.0
    return PlanResult("checkmate", "timeout", tuple(seq), gap=gap, predicted_cost=cost,
                      message=f"{size}; time limit: HiGHS found nothing cheaper than {name}'s schedule ({cost:g}"
                              f"{', in the ILP space' if in_space else ''}); gap against {what} {low:g}")


def round_forward(pg: PlanGraph, keep) -> List[int]:
    """Two-phase rounding, feasibility-restoring: the least R for a rounded S, stage by stage.

    ``keep(t, i)`` says whether node i, available at the end of stage t-1
    (resident before, or computed in it), stays resident into stage t. Stage
    t computes t and, recursively, every input that is not resident (in
    topological order); what it computed is available for ``keep``. A
    rounded S[t,i] = 1 for a value that is not available is dropped instead
    of recomputed (the cheapest repair). Wanted values missing at the end are
    recomputed last.
    """
    n = pg.n
    deps, pinned = pg.deps, pg.pinned
    resident: set = set()
    seq: List[int] = []

    def closure(roots) -> List[int]:
        need: set = set()
        stack = [v for v in roots if v not in resident]
        while stack:
            v = stack.pop()
            if v in need:
                continue
            need.add(v)
            stack.extend(d for d in deps[v] if d not in resident and d not in need)
        return sorted(need)

    for t in range(n):
        need = closure([t])
        seq.extend(need)
        avail = resident.union(need)
        resident = {i for i in avail if pinned[i] or keep(t + 1, i)}
    missing = [i for i in range(n) if pg.referenced_at_end[i] and i not in resident]
    seq.extend(closure(missing))
    return seq


@register_planner("checkmate-lp")
def plan_checkmate_lp(pg: PlanGraph, budget: int, options: PlanOptions) -> PlanResult:
    """The ILP's LP relaxation with Checkmate's randomized two-phase rounding.

    Returns:
        ``ok`` with the cheapest rounding within the budget; ``infeasible``
        when the LP is, ``oom`` when no rounding fits, ``timeout`` when the LP
        ran out of time.
    """
    import time

    from scipy.optimize import linprog
    t_start = time.perf_counter()
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
    probs = {}
    for t in range(1, n + 1):
        for i in range(t):
            p = float(x[model.s(t, i)])
            if p > 1e-9:
                probs[(t, i)] = min(1.0, p)

    def prob(t: int, i: int) -> float:
        return probs.get((t, i), 0.0)

    rng = random.Random(options.seed)
    best: Optional[Tuple[float, int, List[int]]] = None
    tries = 0
    lowest = None
    seen = set()
    rules = [("threshold", tau / 20.0) for tau in range(1, 20)]
    for r in range(max(1, options.rounds)):
        rules.append(("node", r))
        rules.append(("draw", r))
    best_taus: Optional[List[float]] = None

    def attempt(keep, taus=None) -> bool:
        nonlocal best, best_taus, tries, lowest
        seq = round_forward(pg, keep)
        key = tuple(seq)
        if key in seen:
            return False
        seen.add(key)
        peak, cost = sequence_profile(pg, sequence_steps(pg, seq))
        tries += 1
        lowest = peak if lowest is None else min(lowest, peak)
        if peak <= budget and (best is None or (cost, peak) < (best[0], best[1])):
            best = (cost, peak, seq)
            if taus is not None:
                best_taus = list(taus)
            return True
        return False

    def per_node(taus):
        return lambda t, i: prob(t, i) > taus[i]

    for kind, arg in rules:
        if kind == "threshold":  # a per-node threshold vector, all equal
            taus = [arg - 1e-9] * n
        elif kind == "node":  # one uniform per node: consistent across stages
            taus = [rng.random() for _ in range(n)]
        else:  # Checkmate's independent Bernoulli(S*) per stage and node
            attempt(lambda t, i: prob(t, i) > rng.random())
            continue
        attempt(per_node(taus), taus)
    # Local search on the per-node thresholds of the best valid rounding: keep
    # a node more (or less) often when that is cheaper and still fits.
    deadline = time.perf_counter() + max(0.0, options.time_limit - (time.perf_counter() - t_start))
    grid = (-1.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0)
    for _ in range(3):
        if best_taus is None:
            break
        improved = False
        for i in range(n):
            if pg.pinned[i] or time.perf_counter() > deadline:
                continue
            base = best_taus
            for tau in grid:
                if tau == base[i]:
                    continue
                taus = list(base)
                taus[i] = tau
                if attempt(per_node(taus), taus):
                    improved = True
        if not improved:
            break
    if best is None:
        return PlanResult("checkmate-lp", "oom", None,
                          message=f"no rounding of {tries} fits; lowest peak {lowest} bytes; LP bound {res.fun:g}")
    return PlanResult("checkmate-lp", "ok", tuple(best[2]), predicted_cost=best[0],
                      message=f"LP bound {res.fun:g}; best of {tries} roundings")
