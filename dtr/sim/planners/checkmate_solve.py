"""The Checkmate solves on HiGHS (``scipy.optimize.milp``): incumbents, the LP search, deadlines.

See Note [Time limits that hold]; the incumbents are those of Note [ILP
incumbents and gaps] in :mod:`dtr.sim.planners.checkmate`.
"""
from __future__ import annotations

import math
import time
from typing import Dict, List, Optional, Sequence, Tuple

from dtr.sim.export import dtr_starts
from dtr.sim.graph import PlanGraph, chain_shape
from dtr.sim.planners.base import PlanOptions, get_planner
from dtr.sim.planners.checkmate_model import MIN_STAGES, IlpModel, _columns, _values, build_ilp, choose_group
from dtr.sim.planners.checkmate_rounding import _round_lp, _Rounding
from dtr.sim.planners.chen import checkpoint_sequence, greedy_checkpoints
from dtr.sim.schedule import sequence_profile, sequence_steps

__all__ = ["ilp_point", "heuristic_incumbents"]

# Note [Time limits that hold]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The whole planner call (incumbents, building, solving, rounding) keeps to
# ``options.time_limit``: every phase gets the time left before one
# deadline, the solver's own limit is what is left minus a reserve for
# decoding, and the rounding loops check the deadline between attempts.
# What is returned on the limit is the best schedule found so far within
# the budget: HiGHS's incumbent, else the cheapest rounding of the LP, else
# the heuristic warm start (``timeout`` with a gap, see Note [ILP incumbents
# and gaps] in dtr.sim.planners.checkmate); nothing at all only when none of
# them exists. The model sizes assume a solver speed (COLS_PER_ROOT_SECOND,
# dtr.sim.planners.checkmate_model) that a loaded machine may not
# have: when the first LP of ``checkmate-lp`` runs out of its share
# (LP_TIME of the time left), a model twice as coarse (about 1/4 of the
# solve time) gets the rest.

#: Share of the time left that the first LP of a model may take (the rest: rounding, or a coarser model).
LP_TIME = 0.6


def _sequence_from_r(model: IlpModel, x) -> List[int]:
    """The compute sequence of an (integral) solution: R columns are stage-major, nodes ascending."""
    return [int(v) for v in model.r_node[x[:model.num_r] > 0.5]]


def ilp_point(pg: PlanGraph, model: IlpModel, seq: List[int]):
    """The R and S values of a compute sequence in the ILP's variables, or None.

    The sequence must compute the nodes for the first time in the log's order
    (stage s then ends with the first computation of its last node e_s - 1),
    end there, compute a node at most once per stage, and use only variables
    the model has. S[s,i] = 1 when the value of i alive at the start of stage
    s is read later (or is referenced at the end). Whether the point is
    feasible in the ILP (its memory model) is checked by the solver
    (:func:`_verify_point`).
    """
    import numpy as np
    n = pg.n
    b = model.bounds
    T = len(b) - 1
    first = [-1] * n
    for p, v in enumerate(seq):
        if first[v] < 0:
            first[v] = p
    if any(first[i] < 0 for i in range(n)) or any(first[i] >= first[i + 1] for i in range(n - 1)):
        return None
    if first[n - 1] != len(seq) - 1:
        return None
    ends = [first[b[s + 1] - 1] for s in range(T)]  # stage s ends at this position
    stage_of = []
    s = 0
    for p in range(len(seq)):
        while ends[s] < p:
            s += 1
        stage_of.append(s)
    vals = np.zeros(model.num_r + model.num_s)
    for p, v in enumerate(seq):
        col = model.r(stage_of[p], v)
        if col < 0 or vals[col] > 0:
            return None  # outside the model, or twice in one stage
        vals[col] = 1.0
    values = model.values if model.values is not None else _values(pg)
    v_node = values.node
    latest = [-1] * n
    end: Dict[Tuple[int, int], int] = {}  # (position, value) -> its last read before the node's next computation
    for p, v in enumerate(seq):
        for u in values.reads[v]:
            end[(latest[v_node[u]], u)] = p
        latest[v] = p
        for u in values.of_node[v]:
            end[(p, u)] = p
    for u, wanted in enumerate(values.at_end):
        if wanted:
            end[(latest[v_node[u]], u)] = len(seq)
    start = [ends[s - 1] + 1 for s in range(1, T + 1)] + [len(seq) + 1]  # stage s (1..T) starts here
    for (p, u), e in end.items():
        if pg.pinned[v_node[u]]:
            continue
        s = stage_of[p] + 1
        while s <= T and start[s - 1] <= e:
            col = model.s(s, u)
            if col < 0:
                return None
            vals[col] = 1.0
            s += 1
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
               integrality=model.integrality, options={"time_limit": max(0.5, time_limit), "disp": False})
    return res.x if res.status == 0 and res.x is not None else None


def heuristic_incumbents(pg: PlanGraph, budget: int, options: PlanOptions,
                         deadline: Optional[float] = None) -> List[Tuple[float, str, List[int]]]:
    """Valid sequences within the budget from the fast planners (Rotor, Chen) and DTR's runs, cheapest first.

    Chen's greedy thresholds are tried one by one (its own grid, through its
    public helpers) so that ``deadline`` (a ``time.perf_counter()`` value)
    holds on graphs where the whole grid takes long.
    """
    found = dtr_starts(pg, budget, deadline)  # first: milliseconds on most logs (Note [DTR runs as starts])

    def consider(seq: Sequence[int], name: str) -> None:
        peak, cost = sequence_profile(pg, sequence_steps(pg, list(seq)))
        if peak <= budget:
            found.append((cost, name, list(seq)))

    if chain_shape(pg) is not None:
        for name in ("rotor", "chen"):
            try:
                r = get_planner(name)(pg, budget, options)
            except Exception:  # a heuristic failing must not stop the ILP
                continue
            if r.sequence is not None:
                consider(r.sequence, name)
    else:
        movable = [pg.mem[v] for v in range(pg.n) if not pg.pinned[v]]
        lo, hi = max(1, min((m for m in movable if m > 0), default=1)), max(1, sum(movable))
        steps = 40
        for x in sorted({lo * (hi / lo) ** (j / (steps - 1)) for j in range(steps)} | {0.0}):
            if deadline is not None and time.perf_counter() > deadline:
                break
            consider(checkpoint_sequence(pg, greedy_checkpoints(pg, x)), "chen")
    found.sort(key=lambda c: c[0])
    return found[:2]


def _solve_lp(model: IlpModel, time_limit: float, mem_factor: float = 1.0):
    """The LP relaxation (HiGHS), U's bound scaled by ``mem_factor``; scipy's result."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    ub = model.ub
    if mem_factor != 1.0:
        ub = ub.copy()
        ub[model.u0:] = mem_factor
    return milp(model.c, constraints=LinearConstraint(model.A, model.lo, model.hi), bounds=Bounds(model.lb, ub),
                integrality=None, options={"time_limit": float(max(0.2, time_limit)), "disp": False})


def _lp_rounding(pg: PlanGraph, budget: int, model: IlpModel, options: PlanOptions, deadline: float,
                 state: Optional[_Rounding] = None) -> Tuple[_Rounding, str, Optional[float], float]:
    """Solve the LP and round it, tightening the memory rows when nothing fits; until ``deadline``.

    Args:
        state: the roundings so far (a coarser model's), kept and improved on.

    Returns:
        The rounding state, the LP's outcome (``ok``, ``infeasible``,
        ``timeout``), the LP bound (None without one) and the first LP's seconds.
    """
    state = state if state is not None else _Rounding()
    outcome, bound = "timeout", None
    first_lp = 0.0
    for factor in (1.0, 0.85, 0.7):
        left = deadline - time.perf_counter()
        if left <= 0.2:
            break
        t_lp = time.perf_counter()
        res = _solve_lp(model, left * (LP_TIME if factor == 1.0 else 0.8), factor)
        lp_seconds = time.perf_counter() - t_lp
        first_lp = first_lp or lp_seconds
        if res.status == 2:
            if factor == 1.0:
                outcome = "infeasible"
            break
        if res.x is None or res.status != 0:
            break
        if factor == 1.0:
            outcome, bound = "ok", float(res.fun)
        _round_lp(pg, budget, model, res.x, options, deadline, state)
        if state.best is not None or deadline - time.perf_counter() < 1.5 * lp_seconds:
            break
    return state, outcome, bound, first_lp


def _finer_group(pg: PlanGraph, group: int, window: int, cap: int) -> Optional[int]:
    """The finest of group/2, group/4, ... whose R and S columns stay under ``cap`` (None: not even group/2)."""
    vals = _values(pg)
    best = None
    g = group // 2
    while g >= 1 and _columns(pg, vals, g, window, limit=cap) is not None:
        best = g
        g //= 2
    return best


def _lp_search(pg: PlanGraph, budget: int, options: PlanOptions,
               deadline: float) -> Tuple[_Rounding, Optional[IlpModel], str, Optional[float], str]:
    """The LP rounding of ``checkmate-lp`` until ``deadline``: coarse first, finer with the time left.

    See Note [Rounding the LP] (in :mod:`dtr.sim.planners.checkmate_rounding`) and Note [Time limits
    that hold].

    Returns:
        The roundings, the last model solved (None: no model fits the time;
        the last string then says why), the LP's outcome on it, its bound,
        and the coarser groupings solved before it.
    """
    group, window, fits = choose_group(pg, 0.5 * (deadline - time.perf_counter()))
    if not fits:
        return (_Rounding(), None, "timeout", None,
                f"the model over {math.ceil(pg.n / group)} stages is too large for this time limit (no model built)")
    model = build_ilp(pg, budget, group, window)
    state, outcome, bound, lp_seconds = _lp_rounding(pg, budget, model, options, deadline)
    coarsest = max(1, math.ceil(pg.n / MIN_STAGES))
    if outcome == "timeout" and model.group < coarsest:
        # the machine is slower than COLS_PER_ROOT_SECOND assumes: a model 2x coarser solves in about 1/4
        model = build_ilp(pg, budget, min(coarsest, 2 * model.group), window)
        state, outcome, bound, lp_seconds = _lp_rounding(pg, budget, model, options, deadline, state)
    coarser = ""
    # Note [Rounding the LP] (dtr.sim.planners.checkmate_rounding): time left after a coarse model goes to a finer one
    while outcome in ("ok", "infeasible") and not model.exact and lp_seconds > 0:
        left = deadline - time.perf_counter()
        if left < 3 * lp_seconds:
            break
        cap = int((model.num_r + model.num_s) * math.sqrt(0.5 * left / max(lp_seconds, 0.05)))
        finer = _finer_group(pg, model.group, window, cap)
        if finer is None:
            break
        m2 = build_ilp(pg, budget, finer, window)
        state, out2, bound2, lp2 = _lp_rounding(pg, budget, m2, options, deadline, state)
        if out2 == "timeout":
            break
        coarser += f"{model.group}, "
        model, outcome, bound, lp_seconds = m2, out2, bound2, lp2
    return state, model, outcome, bound, coarser


def _deadline(options: PlanOptions) -> Tuple[float, float]:
    """Start and deadline of a planner call (a small reserve for returning)."""
    t0 = time.perf_counter()
    tl = max(0.0, float(options.time_limit))
    return t0, t0 + tl - min(1.0, 0.05 * tl)
