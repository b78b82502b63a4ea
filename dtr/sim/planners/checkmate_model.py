"""The Checkmate ILP's model: its variables, its rows, and the stage grouping that keeps it small.

See Note [The Checkmate ILP], Note [Values, not nodes] and Note [A sparse
model that scales]. The solves are in :mod:`dtr.sim.planners.checkmate_solve`,
the LP rounding in :mod:`dtr.sim.planners.checkmate_rounding`, the planners
in :mod:`dtr.sim.planners.checkmate`.
"""
from __future__ import annotations

import math
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from dtr.sim.graph import PlanGraph
from dtr.sim.schedule import in_place_frees

__all__ = ["IlpModel", "build_ilp", "stage_bounds", "choose_group", "default_window"]

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
#   after b_s (or is referenced at the end) and was available in stage s-1,
#   and, in the exact ILP (keep_for_recompute), also while stage s may
#   compute a reader of v again (an R column of the stage): keeping v can
#   save recomputing its node for that reader's recomputation, and without
#   those S a proven "optimal" lost to an order-keeping schedule (36 against
#   Chen's 33 on a helper's 13-line log). The LP rounding (checkmate-lp)
#   leaves them out: its model stays small enough for its time share in
#   ``auto``, and it claims no optimum;
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

#: R and S columns per square root of a second of solving (Note [A sparse model that scales]).
COLS_PER_ROOT_SECOND = 1800
#: The coarsest grouping keeps this many stages (a model that cannot fit the time limit then times out).
MIN_STAGES = 8


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


def choose_group(pg: PlanGraph, seconds: float, keep_for_recompute: bool = False) -> Tuple[int, int, bool]:
    """The finest stage grouping and recomputation window whose model fits ``seconds`` of solving.

    Tries Checkmate's own model (one node per stage, no window), then the
    :func:`default_window` with g = 1, 2, 4, ... nodes per stage, and returns
    the first whose R and S columns are under ``COLS_PER_ROOT_SECOND *
    sqrt(seconds)``, but never fewer than ``MIN_STAGES`` stages (Note [A
    sparse model that scales]).

    Args:
        keep_for_recompute: count the S columns of :func:`build_ilp`'s ``keep_for_recompute``.

    Returns:
        (group, window, fits): ``fits`` is False when even the coarsest
        grouping is over the cap (the planners then build nothing).
    """
    n = pg.n
    keep = keep_for_recompute
    cap = int(COLS_PER_ROOT_SECOND * math.sqrt(max(seconds, 0.5))) + 1
    vals = _values(pg)
    if _columns(pg, vals, 1, n, limit=cap, keep=keep) is not None:
        return 1, n, True
    win = default_window(pg)
    g, coarsest = 1, max(1, math.ceil(n / MIN_STAGES))
    while g < coarsest and _columns(pg, vals, g, win, limit=cap, keep=keep) is None:
        g *= 2
    g = min(g, coarsest)
    return g, win, g < coarsest or _columns(pg, vals, g, win, limit=cap, keep=keep) is not None


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
             limit: Optional[int] = None, keep: bool = False) -> Optional[_Columns]:
    """R columns (ancestors within the window, then the stage's own nodes) and S columns, by stage.

    ``keep``: S columns also for a value a stage may recompute a reader of (build_ilp's ``keep_for_recompute``).
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
    last, of_node, users = vals.last, vals.of_node, vals.users
    for s in range(1, T + 1):
        cand = set(prev)
        lo_r, hi_r = stage_r[s - 1]
        for i in r_node[lo_r:hi_r]:
            if not pinned[i]:
                cand.update(of_node[i])
        here = set(r_node[stage_r[s][0]:stage_r[s][1]]) if keep and s < T else set()
        cur = sorted(v for v in cand if last[v] >= b[s] or (here and any(u in here for u in users[v])))
        s_value += cur
        s_stage += [s] * len(cur)
        prev = cur
        if limit is not None and len(r_node) + len(s_value) > limit:
            return None
    return _Columns(b, r_stage, r_node, stage_r, s_stage, s_value, cut)


def build_ilp(pg: PlanGraph, budget: int, group: int = 1, window: Optional[int] = None,
              keep_for_recompute: bool = False) -> IlpModel:
    """Assemble the ILP of Note [The Checkmate ILP] (sparse, pruned; scipy CSR).

    Args:
        pg: the planning graph.
        budget: bytes (constants included).
        group: nodes per stage (1: Checkmate's own model).
        window: hops within which a stage may recompute an ancestor
            (None: no limit; :func:`choose_group` picks one for large graphs).
        keep_for_recompute: S variables also for a value past its last
            reader in the log's order that a stage may recompute a reader of
            (Note [The Checkmate ILP]): the exact ILP's, so that its
            ``optimal`` covers every order-keeping schedule; the LP rounding
            leaves them out (a smaller model, solved within its time share).

    Returns:
        The :class:`IlpModel`.
    """
    import numpy as np
    from scipy.sparse import csr_matrix
    t_build = time.perf_counter()
    n = pg.n
    vals = _values(pg)
    cols_ = _columns(pg, vals, group, window, keep=keep_for_recompute)
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
