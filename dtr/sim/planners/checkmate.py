"""``checkmate`` and ``checkmate-lp``: the Checkmate ILP on HiGHS (``scipy.optimize.milp``).

See Note [The Checkmate ILP] (after Jain et al.; rockmate.txt appendix B
gives the multi-output variant), Note [A sparse model that scales] and
Note [Time limits that hold].
"""
from __future__ import annotations

import math
import random
import time
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from dtr.sim.export import dtr_starts
from dtr.sim.graph import PlanGraph
from dtr.sim.planners import PlanOptions, PlanResult, register_planner
from dtr.sim.schedule import COMPUTE, in_place_frees, sequence_profile, sequence_steps

__all__ = ["plan_checkmate", "plan_checkmate_lp", "build_ilp", "IlpModel", "stage_bounds", "choose_group",
           "round_forward"]

# Note [The Checkmate ILP]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Nodes 0..n-1 in the log's order, cut into stages: stage s introduces the
# nodes b_s..e_s-1 (e_s = b_{s+1}; one node per stage is Checkmate's own
# model, Note [A sparse model that scales] groups them) and ends with the
# first computation of e_s - 1. Residency is tracked per value (Note
# [Values, not nodes]): a node's storages grouped by their readers. Binary
# R[s,i]: node i computed during stage s (in index order within the stage;
# R[s,i] = 1 for the stage's own nodes); S[s,v] (plus a final row s = T):
# value v resident when stage s starts; FREE[s,v,k]: v freed right after
# computing k in stage s (k = v's node or a reader of v); continuous
# U[s,k]: memory after computing k in stage s, before its frees.
#   R[s,k] <= R[s,d] + S[s,v] for each value v of node d that k reads;
#   S[s+1,v] <= S[s,v] + R[s,node(v)]; S[T,v] = 1 for values referenced at the end;
#   FREE[s,v,k] = R[s,k] (1 - S[s+1,v]) prod_{readers j of v, k < j < e_s} (1 - R[s,j]),
#     as its upper bounds only: FREE <= R[s,k], FREE <= 1 - S[s+1,v],
#     FREE <= 1 - R[s,j] (a free only lowers memory, so nothing gains by a
#     smaller FREE and the lower bound of the product is not needed; the
#     per-factor bounds are tighter in the LP than Checkmate's aggregated
#     hazard count);
#   U[s,first k] = C_s + sum_v m_v S[s,v] + m_k R[s,k];
#   U[s,k] = U[s,k'] - sum_v m_v FREE[s,v,k'] + m_k R[s,k] (k' the previous k;
#     the bytes an in-place write takes over are freed at k itself, as
#     dtr.sim.schedule's Note [Planned frees] does);
#   U[s,k] <= budget; minimize sum c_i R[s,i].
# Constants are resident from their stage on, never freed or recomputed: no
# variables, their bytes are the constant C_s (a constant the log drops is
# still counted: the schedule frees it, so the model is conservative there).
# Memory is scaled by the budget (U <= 1) for numerics. ``optimal`` is
# reported only when HiGHS proves optimality with mip_rel_gap <= 1e-6 on
# the one-node-per-stage model without a window; on the time limit with an
# incumbent the status is ``ok`` and ``gap`` is HiGHS's relative gap.
#
# Note [Values, not nodes]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A planning node may own several storages with different readers (a
# batch norm's output, read by the next layer, and its saved statistics,
# read by the backward pass); the schedule frees each storage after its own
# last use. A model that keeps a node's bytes as one block until its last
# reader counted, on resnet32 at the peak of the plain order, 0.87 of the
# peak where the schedule holds 0.49, and needed recomputation even at 100%
# of the peak. The S and FREE variables are therefore per value: the
# storages of one node that have the same readers (rockmate.txt appendix B
# makes the same split of multi-output operators). R stays per node
# (computing a node makes all its values). With this, the model's memory
# for a rounded schedule is the evaluator's peak, to the byte, on the
# published logs.
#
# Note [A sparse model that scales]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Checkmate's model has Theta(n^2) variables (n R and S per stage, and a
# FREE per stage and edge): 448,320 variables, 509,354 rows and 1.85
# million nonzeros on resnet32 (493 nodes), hundreds of millions on the
# LSTM logs. Four things keep it small:
# - variables that cannot matter are never created (rather than created at
#   0 and left to presolve): R[s,i] only for i an ancestor of the stage's
#   own nodes (a restriction of Checkmate's space: a value computed in a
#   stage is one that stage reads; rounding builds the same kind of
#   schedule), never for a constant; S[s,v] only while v has a reader at or
#   after b_s (or is referenced at the end) and was available in stage s-1;
#   FREE[s,v,k] only when no node of the stage itself (R fixed at 1) reads v
#   after k and v is not kept to the end; a FREE with no hazard at all is
#   the constant 1 and moves into the memory row's right-hand side (on
#   resnet32 with one node per stage: 164,387 variables, 681,610 nonzeros);
# - rows are assembled into flat index lists and one CSR matrix, without
#   per-entry tuples or dictionaries of the full triangle;
# - a recomputation window: on large graphs a stage may recompute only the
#   ancestors within ``default_window`` hops (2 sqrt(n) + 2, at least 16) of
#   its own nodes; farther ones must be kept (S). A restriction, said in
#   the model's size message ("windowed");
# - stages are grouped (``choose_group``): g consecutive nodes per stage
#   divide the stage count, hence the model, by about g. A grouped schedule
#   is also a schedule of the one-node-per-stage model (its recomputations
#   all fall in the stage of its first node), so grouping is a restriction
#   too: a proven optimum of a grouped or windowed model is reported ``ok``
#   (optimal over the grouping, said in the message), never ``optimal``. g
#   is the smallest power of two that keeps the R and S columns under a cap
#   that grows with the time given to the solver (COLS_PER_ROOT_SECOND *
#   sqrt(seconds): HiGHS's simplex time grew about with the square of the
#   model on these graphs), so a short time limit gets a coarse model that
#   HiGHS can solve and a long one a fine model; at least MIN_STAGES stages,
#   and when even that is over the cap no model is built.
#
# Note [Time limits that hold]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The whole planner call (incumbents, building, solving, rounding) keeps to
# ``options.time_limit``: every phase gets the time left before one
# deadline, the solver's own limit is what is left minus a reserve for
# decoding, and the rounding loops check the deadline between attempts.
# What is returned on the limit is the best schedule found so far within
# the budget: HiGHS's incumbent, else the cheapest rounding of the LP, else
# the heuristic warm start (``timeout`` with a gap, see Note [ILP incumbents
# and gaps]); nothing at all only when none of them exists. The model sizes
# assume a solver speed (COLS_PER_ROOT_SECOND) that a loaded machine may not
# have: when the first LP of ``checkmate-lp`` runs out of its share
# (LP_TIME of the time left), a model twice as coarse (about 1/4 of the
# solve time) gets the rest.
#
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
#
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

#: R and S columns per square root of a second of solving (Note [A sparse model that scales]).
COLS_PER_ROOT_SECOND = 1800
#: The coarsest grouping keeps this many stages (a model that cannot fit the time limit then times out).
MIN_STAGES = 8
#: Models up to this many nonzeros get their incumbent checked against the ILP (_verify_point).
VERIFY_NNZ = 400_000
#: Share of the time left that the first LP of a model may take (the rest: rounding, or a coarser model).
LP_TIME = 0.6
#: Roundings over the budget (the cheapest) that the rounding repairs (Note [Rounding the LP]).
REPAIRS = 4
#: Values the repair tries at each step (the most bytes per unit of cost first).
REPAIR_LOOKAHEAD = 6
#: Share of the time limit the ILP spends on its LP-rounding incumbent (``checkmate-lp``'s search).
LP_SHARE = 0.5
#: Share of the time limit the ILP's heuristic incumbents (Chen's grid) may take.
HEURISTIC_SHARE = 0.2
#: The ILP's model is sized for this share of the time limit (as an LP; the MILP needs more).
ILP_SHARE = 0.25


@dataclass
class IlpModel:
    """The assembled ILP (scipy.optimize inputs) and its variable layout.

    The arrays are numpy arrays and ``A`` a scipy sparse matrix (scipy has no
    type information, and numpy is imported lazily: typed ``Any``). Columns:
    R (``num_r``, by stage then node), S (``num_s``), FREE, then U (one per
    R column, same order).

    Attributes:
        n: nodes.
        bounds: stage starts b_0 = 0 < ... < b_T = n.
        r_cols: (stage, node) -> column of R (absent: fixed at 0).
        s_cols: (stage, value) -> column of S (stage 1..T; absent: 0, or 1 for a constant).
        r_node: node of each R column (numpy array).
        u0: first U column.
        build_seconds: time spent building.
        window_cut: whether the recomputation window left an ancestor out.
        values: the S variables' values (Note [Values, not nodes]).
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
    bounds: Tuple[int, ...] = ()
    r_cols: Dict[Tuple[int, int], int] = field(default_factory=dict)
    s_cols: Dict[Tuple[int, int], int] = field(default_factory=dict)
    r_node: Any = None
    u0: int = 0
    build_seconds: float = 0.0
    window_cut: bool = False
    values: Optional[_Values] = None

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    @property
    def exact(self) -> bool:
        """One node per stage and no ancestor left out: a proven optimum is an optimum of the ILP."""
        return self.group == 1 and not self.window_cut

    @property
    def group(self) -> int:
        """Nodes per stage (the last stage may have fewer)."""
        return self.bounds[1] - self.bounds[0] if len(self.bounds) > 1 else 1

    def r(self, s: int, i: int) -> int:
        """Column of R[s,i], -1 when the variable is not in the model."""
        return self.r_cols.get((s, i), -1)

    def s(self, s: int, i: int) -> int:
        """Column of S[s,i], -1 when the variable is not in the model."""
        return self.s_cols.get((s, i), -1)

    def size(self) -> str:
        """Variables, constraints, nonzeros and stages, for messages."""
        return (f"{self.A.shape[1]} variables, {self.A.shape[0]} constraints, {self.A.nnz} nonzeros, "
                f"{self.num_stages} stages of {self.group}{', windowed' if self.window_cut else ''}, "
                f"built in {self.build_seconds:.1f}s")


def stage_bounds(n: int, group: int) -> Tuple[int, ...]:
    """Stage starts for ``group`` consecutive nodes per stage: (0, g, 2g, ..., n)."""
    g = max(1, int(group))
    return tuple(range(0, n, g)) + (n,)


def choose_group(pg: PlanGraph, seconds: float) -> Tuple[int, int, bool]:
    """The finest stage grouping and recomputation window whose model fits ``seconds`` of solving.

    Tries Checkmate's own model (one node per stage, no window), then the
    :func:`default_window` with g = 1, 2, 4, ... nodes per stage, and returns
    the first whose R and S columns are under ``COLS_PER_ROOT_SECOND *
    sqrt(seconds)``, but never fewer than ``MIN_STAGES`` stages (Note [A
    sparse model that scales]).

    Returns:
        (group, window, fits): ``fits`` is False when even the coarsest
        grouping is over the cap (the planners then build nothing).
    """
    n = pg.n
    cap = int(COLS_PER_ROOT_SECOND * math.sqrt(max(seconds, 0.5))) + 1
    vals = _values(pg)
    if _columns(pg, vals, 1, n, limit=cap) is not None:
        return 1, n, True
    win = default_window(pg)
    g, coarsest = 1, max(1, math.ceil(n / MIN_STAGES))
    while g < coarsest and _columns(pg, vals, g, win, limit=cap) is None:
        g *= 2
    g = min(g, coarsest)
    return g, win, g < coarsest or _columns(pg, vals, g, win, limit=cap) is not None


def default_window(pg: PlanGraph) -> int:
    """Hops from a stage's nodes within which R may recompute an ancestor (Note [A sparse model that scales])."""
    return max(16, 2 * math.isqrt(max(pg.n, 1)) + 2)


def _ancestors(pg: PlanGraph, lo: int, hi: int, window: int, mark: List[int], stamp: int) -> Tuple[List[int], bool]:
    """Non-constant ancestors below ``lo`` of the nodes lo..hi-1 within ``window`` hops, ascending.

    Returns:
        The ancestors, and whether the window left some out.
    """
    deps, pinned = pg.deps, pg.pinned
    frontier = list(range(lo, hi))
    for v in frontier:
        mark[v] = stamp
    out = []
    hops = 0
    cut = False
    while frontier:
        nxt = []
        for v in frontier:
            for d in deps[v]:
                if mark[d] != stamp and not pinned[d]:
                    mark[d] = stamp
                    if d < lo:
                        if hops >= window:
                            cut = True
                            continue
                        out.append(d)
                    nxt.append(d)
        frontier = nxt
        hops += 1
    out.sort()
    return out, cut


@dataclass
class _Values:
    """The model's values: a node's storages grouped by the nodes that read them.

    Attributes:
        node: the node producing each value.
        mem: its bytes.
        storages: its exact storages.
        users: the nodes reading it, ascending.
        at_end: whether it is referenced at the end.
        last: its last user (n when referenced at the end).
        of_node: per node, its values.
        reads: per node, the values it reads (of other nodes).
    """

    node: List[int]
    mem: List[int]
    storages: List[Tuple[int, ...]]
    users: List[List[int]]
    at_end: List[bool]
    last: List[int]
    of_node: List[List[int]]
    reads: List[List[int]]


def _values(pg: PlanGraph) -> _Values:
    """Group each node's storages by their readers (Note [Values, not nodes])."""
    n = pg.n
    readers: Dict[int, Set[int]] = {}
    for k in range(n):
        for x in pg.reads[k]:
            readers.setdefault(x, set()).add(k)
    size = pg.graph.storage_size
    at_end_st = pg.storages_referenced_at_end
    vals = _Values([], [], [], [], [], [], [[] for _ in range(n)], [[] for _ in range(n)])
    value_of: Dict[int, int] = {}
    for i in range(n):
        groups: Dict[frozenset, List[int]] = {}
        for x in pg.storages[i]:
            groups.setdefault(frozenset(readers.get(x, ())), []).append(x)
        if not groups:
            groups[frozenset()] = []
        for who, xs in groups.items():
            v = len(vals.node)
            vals.node.append(i)
            vals.mem.append(sum(size[x] for x in xs))
            vals.storages.append(tuple(xs))
            vals.users.append(sorted(who))
            end = any(x in at_end_st for x in xs)
            vals.at_end.append(end)
            vals.last.append(n if end else max(who, default=i))
            vals.of_node[i].append(v)
            for x in xs:
                value_of[x] = v
    for k in range(n):
        vals.reads[k] = sorted({value_of[x] for x in pg.reads[k]})
    return vals


@dataclass
class _Columns:
    """The R and S columns of a model (see :func:`build_ilp`); S columns are over values."""

    bounds: Tuple[int, ...]
    r_stage: List[int]
    r_node: List[int]
    stage_r: List[Tuple[int, int]]
    s_stage: List[int]
    s_value: List[int]
    cut: bool


def _columns(pg: PlanGraph, vals: _Values, group: int, window: Optional[int],
             limit: Optional[int] = None) -> Optional[_Columns]:
    """R columns (ancestors within the window, then the stage's own nodes) and S columns, by stage.

    Returns None as soon as there are more than ``limit`` columns.
    """
    n = pg.n
    b = stage_bounds(n, group)
    T = len(b) - 1
    win = n if window is None else window
    pinned = pg.pinned
    r_stage: List[int] = []
    r_node: List[int] = []
    stage_r: List[Tuple[int, int]] = []
    mark = [-1] * n
    cut = False
    for s in range(T):
        start = len(r_node)
        anc, cut_s = _ancestors(pg, b[s], b[s + 1], win, mark, s)
        cut = cut or cut_s
        nodes = anc + list(range(b[s], b[s + 1]))
        r_node += nodes
        r_stage += [s] * len(nodes)
        stage_r.append((start, len(r_node)))
        if limit is not None and len(r_node) > limit:
            return None
    s_stage: List[int] = []
    s_value: List[int] = []
    prev: List[int] = []  # S values of the previous stage
    last, of_node = vals.last, vals.of_node
    for s in range(1, T + 1):
        cand = set(prev)
        lo_r, hi_r = stage_r[s - 1]
        for i in r_node[lo_r:hi_r]:
            if not pinned[i]:
                cand.update(of_node[i])
        cur = sorted(v for v in cand if last[v] >= b[s])
        s_value += cur
        s_stage += [s] * len(cur)
        prev = cur
        if limit is not None and len(r_node) + len(s_value) > limit:
            return None
    return _Columns(b, r_stage, r_node, stage_r, s_stage, s_value, cut)


def build_ilp(pg: PlanGraph, budget: int, group: int = 1, window: Optional[int] = None) -> IlpModel:
    """Assemble the ILP of Note [The Checkmate ILP] (sparse, pruned; scipy CSR).

    Args:
        pg: the planning graph.
        budget: bytes (constants included).
        group: nodes per stage (1: Checkmate's own model).
        window: hops within which a stage may recompute an ancestor
            (None: no limit; :func:`choose_group` picks one for large graphs).

    Returns:
        The :class:`IlpModel`.
    """
    import numpy as np
    from scipy.sparse import csr_matrix
    t_build = time.perf_counter()
    n = pg.n
    vals = _values(pg)
    cols_ = _columns(pg, vals, group, window)
    assert cols_ is not None
    b = cols_.bounds
    T = len(b) - 1
    pinned = pg.pinned
    scale = float(max(budget, 1))
    m = [x / scale for x in pg.mem]
    vm = [x / scale for x in vals.mem]
    v_node, v_users, v_at_end = vals.node, vals.users, vals.at_end
    r_stage, r_node, stage_r = cols_.r_stage, cols_.r_node, cols_.stage_r
    s_stage, s_value = cols_.s_stage, cols_.s_value
    num_r, num_s = len(r_node), len(s_value)
    r_cols: Dict[Tuple[int, int], int] = {(s, i): c for c, (s, i) in enumerate(zip(r_stage, r_node))}
    s_cols: Dict[Tuple[int, int], int] = {(s, v): num_r + c for c, (s, v) in enumerate(zip(s_stage, s_value))}

    rows: List[int] = []
    cols: List[int] = []
    coef: List[float] = []
    lo: List[float] = []
    hi: List[float] = []
    inf = math.inf
    nrow = 0
    # (a) inputs resident or computed before: R[s,k] - R[s,d] - S[s,v] <= 0 for each value v of d that k reads
    for col in range(num_r):
        s, k = r_stage[col], r_node[col]
        bs = b[s]
        for v in vals.reads[k]:
            d = v_node[v]
            if pinned[d] or d >= bs:
                continue
            rows.append(nrow)
            cols.append(col)
            coef.append(1.0)
            rd = r_cols.get((s, d))
            if rd is not None:
                rows.append(nrow)
                cols.append(rd)
                coef.append(-1.0)
            sd = s_cols.get((s, v))
            if sd is not None:
                rows.append(nrow)
                cols.append(sd)
                coef.append(-1.0)
            lo.append(-inf)
            hi.append(0.0)
            nrow += 1
    # (b) kept only if available: S[s,v] - R[s-1,node(v)] - S[s-1,v] <= 0
    for j in range(num_s):
        s, v = s_stage[j], s_value[j]
        rows.append(nrow)
        cols.append(num_r + j)
        coef.append(1.0)
        for other in (r_cols.get((s - 1, v_node[v])), s_cols.get((s - 1, v))):
            if other is not None:
                rows.append(nrow)
                cols.append(other)
                coef.append(-1.0)
        lo.append(-inf)
        hi.append(0.0)
        nrow += 1
    # (c) FREE[s,v,k] <= each factor of the product; unconditional frees become constants.
    nv = num_r + num_s
    # per R column: (FREE col, bytes freed after it, bytes handed over to it in place)
    free_of: List[List[Tuple[int, float, float]]] = [[] for _ in range(num_r)]
    freed_after = [0.0] * num_r
    freed_before = [0.0] * num_r
    in_place = in_place_frees(pg)
    size = pg.graph.storage_size
    for col in range(num_r):
        s, k = r_stage[col], r_node[col]
        bs, es = b[s], b[s + 1]
        own = k >= bs  # R fixed at 1
        for v in (*vals.reads[k], *vals.of_node[k]):
            if pinned[v_node[v]]:
                continue
            us = v_users[v]
            p = bisect_left(us, max(k + 1, bs))
            if p < len(us) and us[p] < es:
                continue  # a node of the stage reads v later
            if s + 1 == T and v_at_end[v]:
                continue  # kept to the end
            keep_col = s_cols.get((s + 1, v))
            hazards = [r_cols[(s, j)] for j in us[bisect_left(us, k + 1):] if j < bs and (s, j) in r_cols]
            early = sum(size[x] for x in vals.storages[v] if x in in_place[k]) / scale if in_place[k] else 0.0
            if own and keep_col is None and not hazards:
                freed_after[col] += vm[v] - early
                freed_before[col] += early
                continue
            f = nv
            nv += 1
            free_of[col].append((f, vm[v] - early, early))
            if not own:
                rows += [nrow, nrow]
                cols += [f, col]
                coef += [1.0, -1.0]
                lo.append(-inf)
                hi.append(0.0)
                nrow += 1
            for h in ([keep_col] if keep_col is not None else []) + hazards:
                rows += [nrow, nrow]
                cols += [f, h]
                coef += [1.0, 1.0]
                lo.append(-inf)
                hi.append(1.0)
                nrow += 1
    # (d) memory: U[s,k] per R column, chained in index order within the stage.
    u0 = nv
    nv += num_r
    const = [0.0] * (T + 1)  # bytes of the constants computed before stage s
    acc = 0.0
    for s in range(T):
        const[s] = acc
        acc += sum(m[i] for i in range(b[s], b[s + 1]) if pinned[i])
    s_by_stage: List[List[int]] = [[] for _ in range(T + 1)]
    for j in range(num_s):
        s_by_stage[s_stage[j]].append(j)
    for s in range(T):
        lo_r, hi_r = stage_r[s]
        for col in range(lo_r, hi_r):
            k = r_node[col]
            rows += [nrow, nrow]
            cols += [u0 + col, col]
            coef += [1.0, -m[k]]
            for f, _, early in free_of[col]:
                if early:
                    rows.append(nrow)
                    cols.append(f)
                    coef.append(early)
            if col == lo_r:
                for j in s_by_stage[s]:
                    rows.append(nrow)
                    cols.append(num_r + j)
                    coef.append(-vm[s_value[j]])
                rhs = const[s] - freed_before[col]
            else:
                rows.append(nrow)
                cols.append(u0 + col - 1)
                coef.append(-1.0)
                for f, late, _ in free_of[col - 1]:
                    if late:
                        rows.append(nrow)
                        cols.append(f)
                        coef.append(late)
                rhs = -freed_after[col - 1] - freed_before[col]
            lo.append(rhs)
            hi.append(rhs)
            nrow += 1
    lb = np.zeros(nv)
    ub = np.ones(nv)
    rn = np.asarray(r_node, dtype=np.int64)
    rs = np.asarray(r_stage, dtype=np.int64)
    bounds_arr = np.asarray(b, dtype=np.int64)
    lb[:num_r] = (rn >= bounds_arr[rs]).astype(float)  # the stage's own nodes
    final = [num_r + j for j in range(num_s) if s_stage[j] == T and v_at_end[s_value[j]]]
    lb[final] = 1.0
    lb[u0:] = -inf  # U is bounded above only (memory counted twice at worst)
    c = np.zeros(nv)
    c[:num_r] = np.asarray(pg.cost, dtype=float)[rn] if num_r else 0.0
    integrality = np.ones(nv)
    integrality[u0:] = 0
    ij = (np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64))
    A = csr_matrix((np.asarray(coef, dtype=float), ij), shape=(nrow, nv))
    return IlpModel(n=n, c=c, A=A, lo=np.asarray(lo, dtype=float), hi=np.asarray(hi, dtype=float), lb=lb, ub=ub,
                    integrality=integrality, num_r=num_r, num_s=num_s, bounds=b, r_cols=r_cols, s_cols=s_cols,
                    r_node=rn, u0=u0, build_seconds=time.perf_counter() - t_build, window_cut=cols_.cut,
                    values=vals)


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
    from dtr.sim.graph import chain_shape
    from dtr.sim.planners import get_planner
    from dtr.sim.planners.chen import checkpoint_sequence, greedy_checkpoints
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

    See Note [Rounding the LP] and Note [Time limits that hold].

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
    # Note [Rounding the LP]: time left after a coarse model goes to a finer one
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


@register_planner("checkmate")
def plan_checkmate(pg: PlanGraph, budget: int, options: PlanOptions) -> PlanResult:
    """Solve the Checkmate ILP with HiGHS within ``options.time_limit`` seconds.

    See Note [ILP incumbents and gaps] and Note [Time limits that hold].

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
    group, window, fits = choose_group(pg, ILP_SHARE * (deadline - time.perf_counter()))
    if not fits:
        why = (f"the model over {math.ceil(pg.n / group)} stages is too large for the time left "
               f"(no model built)")
        if incs:
            cost, name, seq = incs[0]
            base_gap = max(0.0, 1 - sum(pg.cost) / cost) if cost else 0.0
            return PlanResult("checkmate", "timeout", tuple(seq), gap=base_gap, predicted_cost=cost,
                              message=f"{why}; {name}'s schedule; gap against the base compute")
        return PlanResult("checkmate", "timeout", None, message=why)
    model = build_ilp(pg, budget, group, window)
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

    See Note [Rounding the LP] and Note [Time limits that hold].

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
