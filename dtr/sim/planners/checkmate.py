"""``checkmate`` and ``checkmate-lp``: the Checkmate ILP on HiGHS (``scipy.optimize.milp``).

See Note [The Checkmate ILP] (after Jain et al.; rockmate.txt appendix B
gives the multi-output variant) and Note [A sparse model that scales] in
:mod:`dtr.sim.planners.checkmate_model` (the model), Note [Time limits that
hold] in :mod:`dtr.sim.planners.checkmate_solve` (the solves), Note
[Rounding the LP] in :mod:`dtr.sim.planners.checkmate_rounding`, and Note
[ILP incumbents and gaps] here. This module holds the registered planners and
re-exports the names of its parts that other modules use.
"""
from __future__ import annotations

import math
import time

from dtr.sim.graph import PlanGraph
from dtr.sim.planners.base import PlanOptions, PlanResult, register_planner
from dtr.sim.planners.checkmate_model import IlpModel, build_ilp, choose_group, stage_bounds
from dtr.sim.planners.checkmate_model import default_window as default_window
from dtr.sim.planners.checkmate_rounding import round_forward
from dtr.sim.planners.checkmate_solve import _deadline, _lp_search, _sequence_from_r, heuristic_incumbents, ilp_point
from dtr.sim.planners.checkmate_solve import _solve_lp as _solve_lp
from dtr.sim.planners.checkmate_solve import _verify_point as _verify_point

__all__ = ["plan_checkmate", "plan_checkmate_lp", "build_ilp", "IlpModel", "stage_bounds", "choose_group",
           "round_forward"]

# Note [ILP incumbents and gaps]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# HiGHS alone rarely finds a feasible point of the ILP on graphs of
# hundreds of nodes within minutes. scipy's milp takes no start solution,
# so the planner (with ``options.warm_start``) first collects incumbents:
# DTR's simulated runs (Note [DTR runs as starts] in dtr.sim.export),
# Rotor's and Chen's plans within the budget (Chen's grid within
# HEURISTIC_SHARE of the time limit), and ``checkmate-lp``'s best rounding
# (its whole search, within LP_SHARE of the time left); the ILP's own
# model is then sized for ILP_SHARE of the time left (a coarser model than
# the LP's: branch and bound needs many LP solves). The cheapest one's
# cost C becomes an objective cutoff row sum c R <= C - delta (delta 0.5
# for integral costs, else a relative 1e-7): HiGHS searches only for
# strictly cheaper schedules, and its bound pruning works from the start.
# Whether the incumbent is in the ILP's space is checked (``ilp_point``
# maps it to R/S, ``_verify_point`` fixes them and asks the solver for the
# rest) only on small models. Outcomes:
# - HiGHS finds a solution: ``optimal`` (proven, gap <= 1e-6, one node per
#   stage) or ``ok`` (time limit; HiGHS's own relative gap);
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

#: Models up to this many nonzeros get their incumbent checked against the ILP (_verify_point).
VERIFY_NNZ = 400_000
#: Share of the time limit the ILP spends on its LP-rounding incumbent (``checkmate-lp``'s search).
LP_SHARE = 0.5
#: Share of the time limit the ILP's heuristic incumbents (Chen's grid) may take.
HEURISTIC_SHARE = 0.2
#: The ILP's model is sized for this share of the time limit (as an LP; the MILP needs more).
ILP_SHARE = 0.25


@register_planner("checkmate")
def plan_checkmate(pg: PlanGraph, budget: int, options: PlanOptions) -> PlanResult:
    """Solve the Checkmate ILP with HiGHS within ``options.time_limit`` seconds.

    See Note [ILP incumbents and gaps] and Note [Time limits that hold] (in
    :mod:`dtr.sim.planners.checkmate_solve`).

    Returns:
        ``optimal`` (proven, gap <= ``gap_tol``, one node per stage), ``ok``
        (a schedule from HiGHS or an incumbent HiGHS proved unbeatable; ``gap``
        set when known), ``timeout`` (HiGHS found nothing better than the
        incumbent, or nothing at all, within the time limit; the incumbent's
        schedule is returned when there is one, ``gap`` against HiGHS's lower
        bound), or ``infeasible``.
    """
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_matrix, vstack
    t0, deadline = _deadline(options)
    if pg.pinned_bytes > budget:
        return PlanResult("checkmate", "infeasible", None, message="the constants alone exceed the budget")
    incs = heuristic_incumbents(pg, budget, options, t0 + HEURISTIC_SHARE * (deadline - t0)) \
        if options.warm_start else []
    if options.warm_start:
        left = deadline - time.perf_counter()
        state, _, _, _, _ = _lp_search(pg, budget, options, time.perf_counter() + LP_SHARE * left)
        if state.best is not None:
            incs.append((state.best[0], "LP rounding", state.best[2]))
            incs.sort(key=lambda c: c[0])
    group, window, fits = choose_group(pg, ILP_SHARE * (deadline - time.perf_counter()), keep_for_recompute=True)
    if not fits:
        why = (f"the model over {math.ceil(pg.n / group)} stages is too large for the time left "
               f"(no model built)")
        if incs:
            cost, name, seq = incs[0]
            base_gap = max(0.0, 1 - sum(pg.cost) / cost) if cost else 0.0
            return PlanResult("checkmate", "timeout", tuple(seq), gap=base_gap, predicted_cost=cost,
                              message=f"{why}; {name}'s schedule; gap against the base compute")
        return PlanResult("checkmate", "timeout", None, message=why)
    model = build_ilp(pg, budget, group, window, keep_for_recompute=True)
    exact = model.exact
    size = model.size()
    inc = None  # (cost, name, seq, in the ILP's space)
    for cost, name, seq in incs:
        ok = False
        left = deadline - time.perf_counter()
        if model.A.nnz <= VERIFY_NNZ and left > 1:
            vals = ilp_point(pg, model, seq)
            ok = vals is not None and _verify_point(model, vals, min(5.0, left / 4)) is not None
        if inc is None or ok:
            inc = (cost, name, seq, ok)
        if ok:
            break
    A, lo, hi = model.A, model.lo, model.hi
    if inc is not None:
        integral = all(float(c).is_integer() for c in pg.cost)
        cutoff = inc[0] - 0.5 if integral else inc[0] - 1e-7 * max(1.0, abs(inc[0]))
        A = vstack([A, csr_matrix(model.c.reshape(1, -1))]).tocsr()
        lo = np.append(lo, -np.inf)
        hi = np.append(hi, cutoff)
    left = deadline - time.perf_counter()
    res = None
    if left > 0.2:
        res = milp(model.c, constraints=LinearConstraint(A, lo, hi), bounds=Bounds(model.lb, model.ub),
                   integrality=model.integrality,
                   options={"time_limit": float(0.9 * left), "mip_rel_gap": float(options.gap_tol), "disp": False})
    bound = getattr(res, "mip_dual_bound", None) if res is not None else None
    bound = None if bound is None or not math.isfinite(bound) else float(bound)
    grouping = "" if exact else f"; optimal only over stages of {model.group} nodes and the window"
    if res is not None and res.x is not None:
        seq = _sequence_from_r(model, res.x)
        gap = getattr(res, "mip_gap", None)
        gap = None if gap is None or not math.isfinite(gap) else float(gap)
        proven = res.status == 0 and options.gap_tol <= 1e-6
        status = "optimal" if proven and exact else "ok"
        if proven:
            gap = 0.0 if gap is None else gap
        extra = f"; better than {inc[1]}'s {inc[0]:g}" if inc is not None else ""
        return PlanResult("checkmate", status, tuple(seq), gap=gap, predicted_cost=float(res.fun),
                          message=f"{size}{extra}{grouping if proven else ''}")
    if inc is None:
        if res is not None and res.status == 2:
            if exact:
                return PlanResult("checkmate", "infeasible", None, message=f"{size}; {res.message}")
            return PlanResult("checkmate", "timeout", None,
                              message=f"{size}; infeasible at the grouping this time limit allows (a longer one "
                                      f"gives finer stages)")
        why = res.message if res is not None else "no time left for the solver"
        return PlanResult("checkmate", "timeout", None, message=f"{size}; no schedule found; {why}")
    cost, name, seq, in_space = inc
    if res is not None and res.status == 2:  # nothing in the ILP is cheaper than the incumbent
        if in_space and exact:
            return PlanResult("checkmate", "optimal", tuple(seq), gap=0.0, predicted_cost=cost,
                              message=f"{size}; HiGHS proved no ILP schedule cheaper than {name}'s {cost:g}, "
                                      f"which is in the ILP's space")
        return PlanResult("checkmate", "ok", tuple(seq), gap=0.0, predicted_cost=cost,
                          message=f"{size}; HiGHS proved no ILP schedule cheaper than {name}'s {cost:g} "
                                  f"({'in' if in_space else 'outside'} the ILP's space){grouping}")
    # Lower bound: HiGHS's dual bound when it has one, else every node once.
    base = float(sum(pg.cost))
    low, what = (min(bound, cost), "HiGHS's lower bound") if bound is not None and bound >= base else \
        (base, "the base compute (HiGHS had no bound yet)")
    gap = max(0.0, (cost - low) / abs(cost)) if cost else 0.0
    return PlanResult("checkmate", "timeout", tuple(seq), gap=gap, predicted_cost=cost,
                      message=f"{size}; time limit: HiGHS found nothing cheaper than {name}'s schedule ({cost:g}"
                              f"{', in the ILP space' if in_space else ''}); gap against {what} {low:g}")


@register_planner("checkmate-lp")
def plan_checkmate_lp(pg: PlanGraph, budget: int, options: PlanOptions) -> PlanResult:
    """The ILP's LP relaxation with Checkmate's randomized two-phase rounding.

    See Note [Rounding the LP] (in :mod:`dtr.sim.planners.checkmate_rounding`) and Note [Time limits
    that hold] (in :mod:`dtr.sim.planners.checkmate_solve`).

    Returns:
        ``ok`` with the cheapest rounding within the budget; ``infeasible``
        when the LP is, ``oom`` when no rounding fits, ``timeout`` when the LP
        ran out of time.
    """
    t0, deadline = _deadline(options)
    if pg.pinned_bytes > budget:
        return PlanResult("checkmate-lp", "infeasible", None, message="the constants alone exceed the budget")
    state, model, outcome, bound, coarser = _lp_search(pg, budget, options, deadline)
    if model is None:
        return PlanResult("checkmate-lp", "timeout", None, message=coarser)
    size = model.size() + (f" (after stages of {coarser.rstrip(', ')})" if coarser else "")
    lp = "" if bound is None else f"; LP bound {bound:g}"
    if state.best is not None:
        return PlanResult("checkmate-lp", "ok", tuple(state.best[2]), predicted_cost=state.best[0],
                          message=f"{size}{lp}; best of {state.tries} roundings")
    if outcome == "infeasible":
        if model.exact:
            return PlanResult("checkmate-lp", "infeasible", None, message=f"{size}; the LP relaxation is infeasible")
        return PlanResult("checkmate-lp", "timeout", None,
                          message=f"{size}; the LP is infeasible at the grouping this time limit allows (a longer "
                                  f"one gives finer stages)")
    if outcome == "timeout":
        return PlanResult("checkmate-lp", "timeout", None, message=f"{size}; the LP did not finish in time")
    return PlanResult("checkmate-lp", "oom", None,
                      message=f"{size}; no rounding of {state.tries} fits; lowest peak {state.lowest} bytes{lp}")
