"""``hierarchical``: a chain of parts, exact options per part, a DP over the chain.

In the spirit of Rockmate and HiRemate (rockmate.txt, hiremate.txt): the
graph is cut into a chain of parts, each part's trade-offs between the
memory it keeps and the recomputation it costs are solved exactly by a small
ILP, and a dynamic program over the chain picks one option per part. See
Note [Hierarchical planning] and Note [The part options].
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from dtr.sim.graph import PlanGraph
from dtr.sim.planners import PlanOptions, PlanResult, register_planner
from dtr.sim.planners.recompute import recompute_missing
from dtr.sim.schedule import sequence_profile, sequence_steps

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
#: Parts larger than this get greedy options (their ILP would be slow).
ILP_NODES = 64
#: Memory slots of the chain DP (at least; 16 per part up to MAX_SLOTS).
SLOTS = 1024
MAX_SLOTS = 16384
#: Graphs up to this many nodes are also given to the whole-graph ILP.
SMALL_GRAPH = 80
#: Parts with at most this many keep variables (nodes and outside inputs) are enumerated.
ENUM_VARS = 10
#: At most this many parts per partition get the ILP (the others: greedy options).
ILP_PARTS = 60
#: Budget fractions (of a part's keepable bytes) the part ILP is solved for.
CAPS = (0.0, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8)


@dataclass(frozen=True)
class Split:
    """The forward / backward split of a planning graph (Note [Hierarchical planning]).

    Attributes:
        turn: T, the last forward node (-1: no forward).
        saved: per node, a forward non-pinned value read after T or referenced at the end.
        last_use: per node, the last node that reads it (itself if none).
        live: per node position, bytes live right after computing it in the log's plan.
        saved_live: per position after T, the bytes of saved values still to be read.
    """

    turn: int
    saved: Tuple[bool, ...]
    last_use: Tuple[int, ...]
    live: Tuple[int, ...]
    saved_live: Tuple[int, ...]


@dataclass(frozen=True)
class Option:
    """One trade-off of a part.

    Attributes:
        mem: bytes it keeps over T (its kept nodes and the outside inputs it needs kept).
        cost: the recomputation it costs.
        keep: the nodes it keeps.
    """

    mem: int
    cost: float
    keep: Tuple[int, ...]


@dataclass(frozen=True)
class Part:
    """A contiguous run of forward nodes.

    Attributes:
        nodes: its non-pinned forward nodes, ascending.
        abar: bytes of its saved values (all resident while the backward reads them).
        other: bytes live besides saved values over its backward window.
        options: its trade-offs (keep-all first).
    """

    nodes: Tuple[int, ...]
    abar: int
    other: int
    options: Tuple[Option, ...]


def split_graph(pg: PlanGraph) -> Split:
    """Find the turning point and the saved values (Note [Hierarchical planning]).

    Args:
        pg: the planning graph.

    Returns:
        The :class:`Split` (turn -1 for an empty graph).
    """
    n = pg.n
    steps = sequence_steps(pg, range(n))
    live = [0] * n
    mem = 0
    p = -1
    size = pg.graph.storage_size
    for kind, x in steps:
        if kind == "compute":
            p = x
            mem += pg.mem[x]
            live[p] = mem
        else:
            mem -= size[x]
    peak = max(live, default=0)
    turn = max((i for i in range(n) if live[i] == peak), default=-1)
    last_use = list(range(n))
    for v in range(n):
        for d in pg.deps[v]:
            if v > last_use[d]:
                last_use[d] = v
    saved = [False] * n
    for v in range(turn + 1):
        if not pg.pinned[v] and (last_use[v] > turn or pg.referenced_at_end[v]):
            saved[v] = True
    diff = [0] * (n + 1)
    for v in range(turn + 1):
        if saved[v]:
            end = n - 1 if pg.referenced_at_end[v] else last_use[v]
            diff[turn + 1] += pg.mem[v]
            diff[end + 1] -= pg.mem[v]
    saved_live = [0] * n
    acc = 0
    for i in range(n):
        acc += diff[i]
        saved_live[i] = acc
    return Split(turn=turn, saved=tuple(saved), last_use=tuple(last_use), live=tuple(live),
                 saved_live=tuple(saved_live))


def partition(pg: PlanGraph, sp: Split, part_nodes: int = 16) -> List[Tuple[int, ...]]:
    """Cut the forward's non-pinned nodes into contiguous parts of about equal saved bytes.

    A part closes when it reaches ``part_nodes`` nodes or its share of the
    saved bytes (the total over the number of parts ``part_nodes`` implies).

    Args:
        pg: the planning graph.
        sp: its split.
        part_nodes: the most nodes of a part.

    Returns:
        The parts' nodes, in the forward's order.
    """
    fwd = [v for v in range(sp.turn + 1) if not pg.pinned[v]]
    if not fwd:
        return []
    total = sum(pg.mem[v] for v in fwd if sp.saved[v])
    k = max(1, math.ceil(len(fwd) / part_nodes))
    share = total / k if total else math.inf
    parts: List[Tuple[int, ...]] = []
    cur: List[int] = []
    acc = 0
    for v in fwd:
        cur.append(v)
        if sp.saved[v]:
            acc += pg.mem[v]
        if len(cur) >= part_nodes or acc >= share:
            parts.append(tuple(cur))
            cur, acc = [], 0
    if cur:
        parts.append(tuple(cur))
    return parts


# Note [The part options]
# ~~~~~~~~~~~~~~~~~~~~~~~
# For a part P, binaries k_v (keep v over T) and r_v (the backward
# recomputes v) for v in P, and k_e for each outside forward input e that a
# node of P reads (not pinned). Constraints: a saved value is kept or
# recomputed (k_v + r_v >= 1); recomputing u needs each input: r_u <= k_d +
# r_d for an input d in P, r_u <= k_e for an outside input e (a part's
# recomputation starts from kept values: Rotor's checkpoint a_{i-1}); a
# value referenced at the end is kept. Minimize sum c_v r_v (plus a tiny
# weight on the kept bytes) subject to sum m_v k_v <= cap, for caps at the
# CAPS fractions of the part's keepable bytes, plus the keep-all option
# (cost 0). Outside inputs are counted in the part that needs them (also in
# their own part if it keeps them: conservative). Parts larger than the ILP
# allows, or when the time is short, get the greedy options instead: drop
# saved values by increasing cost per byte, closing each drop over the
# inputs in P that are not kept.


def _part_inputs(pg: PlanGraph, nodes: Sequence[int]) -> List[int]:
    inside = set(nodes)
    ext = {d for v in nodes for d in pg.deps[v] if d not in inside and not pg.pinned[d]}
    return sorted(ext)


def _ilp_options(pg: PlanGraph, sp: Split, nodes: Sequence[int], deadline: float) -> Optional[List[Option]]:
    """The part's options from its ILP (Note [The part options]); None when out of time."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix
    ext = _part_inputs(pg, nodes)
    nn = len(nodes)
    kidx = {v: i for i, v in enumerate(nodes)}
    kext = {e: 2 * nn + j for j, e in enumerate(ext)}
    nv = 2 * nn + len(ext)

    def K(v: int) -> int:
        return kidx[v] if v in kidx else kext[v]

    def R(v: int) -> int:
        return nn + kidx[v]

    rows: List[int] = []
    cols: List[int] = []
    vals: List[float] = []
    lo: List[float] = []
    row = 0
    for v in nodes:
        if sp.saved[v]:
            rows += [row, row]
            cols += [K(v), R(v)]
            vals += [1.0, 1.0]
            lo.append(1.0)
            row += 1
        for d in pg.deps[v]:
            if pg.pinned[d]:
                continue
            ent = [(K(d), 1.0), (R(v), -1.0)] + ([(R(d), 1.0)] if d in kidx else [])
            for c_, x in ent:
                rows.append(row)
                cols.append(c_)
                vals.append(x)
            lo.append(0.0)
            row += 1
    mem = np.zeros(nv)
    for v in nodes:
        mem[K(v)] = pg.mem[v]
    for e in ext:
        mem[K(e)] = pg.mem[e]
    scale = float(max(1.0, mem.sum()))
    c = np.zeros(nv)
    for v in nodes:
        c[R(v)] = pg.cost[v]
    cscale = float(max(1e-12, c.sum()))
    obj = c / cscale + 1e-6 * mem / scale
    lb = np.zeros(nv)
    ub = np.ones(nv)
    for v in nodes:
        if pg.referenced_at_end[v]:
            lb[K(v)] = 1.0
    A_dep = coo_matrix((vals, (rows, cols)), shape=(row, nv)).tocsr() if row else None
    keepable = float(sum(pg.mem[v] for v in nodes if sp.saved[v]) + sum(pg.mem[e] for e in ext))
    out: List[Option] = []
    seen = set()
    for frac in CAPS:
        left = deadline - time.perf_counter()
        if left <= 0.05:
            return None
        cons = [LinearConstraint(mem.reshape(1, -1) / scale, -np.inf, frac * keepable / scale + 1e-12)]
        if A_dep is not None:
            cons.append(LinearConstraint(A_dep, np.asarray(lo), np.inf))
        res = milp(obj, constraints=cons, bounds=Bounds(lb, ub), integrality=np.ones(nv),
                   options={"time_limit": float(min(left, 2.0)), "disp": False})
        if res.x is None:
            continue
        keep = tuple(sorted({v for v in nodes if res.x[K(v)] > 0.5} | {e for e in ext if res.x[K(e)] > 0.5}))
        if keep in seen:
            continue
        seen.add(keep)
        cost = float(sum(pg.cost[v] for v in nodes if res.x[R(v)] > 0.5))
        out.append(Option(mem=int(sum(pg.mem[v] for v in keep)), cost=cost, keep=keep))
    return out


def _enum_options(pg: PlanGraph, sp: Split, nodes: Sequence[int]) -> List[Option]:
    """Every keep set of a small part (its nodes and outside inputs), exactly (Note [The part options])."""
    inside = set(nodes)
    ext = _part_inputs(pg, nodes)
    forced = frozenset(v for v in nodes if pg.referenced_at_end[v])
    free = [v for v in list(nodes) + ext if v not in forced]
    saved = [v for v in nodes if sp.saved[v]]
    out: List[Option] = []
    for mask in range(1 << len(free)):
        keep = set(forced)
        keep.update(v for j, v in enumerate(free) if mask >> j & 1)
        rec = _recomputed(pg, [v for v in saved if v not in keep], keep, inside, keep_outside=False)
        if rec is not None:
            out.append(Option(mem=int(sum(pg.mem[v] for v in keep)), cost=float(sum(pg.cost[v] for v in rec)),
                              keep=tuple(sorted(keep))))
    return out


def _recomputed(pg: PlanGraph, roots, keep: set, inside: set, keep_outside: bool) -> Optional[set]:
    """What recomputing ``roots`` inside a part recomputes: the closure over unkept, unpinned inputs.

    An input outside the part is added to ``keep`` when ``keep_outside``; otherwise
    the option is impossible (None).
    """
    rec: set = set()
    stack = list(roots)
    while stack:
        v = stack.pop()
        if v in rec:
            continue
        rec.add(v)
        for d in pg.deps[v]:
            if pg.pinned[d] or d in keep:
                continue
            if d in inside:
                stack.append(d)
            elif keep_outside:
                keep.add(d)
            else:
                return None
    return rec


def _greedy_options(pg: PlanGraph, sp: Split, nodes: Sequence[int], steps: int = 8) -> List[Option]:
    """Greedy options: drop saved values by increasing cost per byte (Note [The part options])."""
    inside = set(nodes)
    saved = [v for v in nodes if sp.saved[v] and not pg.referenced_at_end[v]]
    forced = [v for v in nodes if pg.referenced_at_end[v]]
    saved.sort(key=lambda v: pg.cost[v] / max(1, pg.mem[v]))
    out: List[Option] = []
    for j in range(1, steps + 1):
        drop = set(saved[:math.ceil(len(saved) * j / steps)])
        keep = set(v for v in saved if v not in drop) | set(forced)
        rec = _recomputed(pg, drop, keep, inside, keep_outside=True)
        assert rec is not None
        out.append(Option(mem=int(sum(pg.mem[v] for v in keep)), cost=float(sum(pg.cost[v] for v in rec)),
                          keep=tuple(sorted(keep))))
    return out


def part_options(pg: PlanGraph, sp: Split, nodes: Sequence[int], deadline: float, use_ilp: bool = True,
                 exact: bool = True) -> List[Option]:
    """A part's Pareto front of options, by increasing memory (Note [The part options]).

    Args:
        pg: the planning graph.
        sp: its split.
        nodes: the part's nodes.
        deadline: for the part's ILP (greedy options past it).
        use_ilp: False: greedy options for a part too large to enumerate.
        exact: False: greedy options only.

    Returns:
        The options, increasing memory and decreasing cost; the last one
        costs nothing (keeping every saved value always does).
    """
    keep_all = tuple(v for v in nodes if sp.saved[v])
    opts = [Option(mem=int(sum(pg.mem[v] for v in keep_all)), cost=0.0, keep=keep_all)]
    if not exact:
        more: Optional[List[Option]] = None
    elif len(nodes) + len(_part_inputs(pg, nodes)) <= ENUM_VARS:
        more = _enum_options(pg, sp, nodes)
    else:
        more = _ilp_options(pg, sp, nodes, deadline) if use_ilp and time.perf_counter() < deadline else None
    opts += more if more is not None else _greedy_options(pg, sp, nodes)
    # the Pareto front: drop an option another beats on both memory and cost
    opts.sort(key=lambda o: (o.mem, o.cost))
    front: List[Option] = []
    for o in opts:
        if not front or o.cost < front[-1].cost - 1e-12:
            front.append(o)
    return front


def _window_max(other, lo: int, hi: int) -> int:
    """The most of ``other`` (a numpy array) over positions lo..hi (0 when empty)."""
    return int(other[lo:hi + 1].max()) if lo <= hi else 0


def build_parts(pg: PlanGraph, sp: Split, deadline: float, part_nodes: int = 16, exact: bool = True
                ) -> List[Part]:
    """Partition the forward and compute every part's options and memory figures.

    Args:
        pg: the planning graph.
        sp: its split.
        deadline: past it, parts get greedy options instead of the ILP's.
        part_nodes: the most nodes of a part.
        exact: False: greedy options only.

    Returns:
        The chain of :class:`Part`, in the forward's order.
    """
    import numpy as np
    n = pg.n
    other = np.maximum(0, np.asarray(sp.live, dtype=np.int64) - np.asarray(sp.saved_live, dtype=np.int64))
    other[:sp.turn + 1] = 0
    users = pg.users()
    parts: List[Part] = []
    groups = partition(pg, sp, part_nodes)
    for k, nodes in enumerate(groups):
        uses = [u for v in nodes if sp.saved[v] for u in users[v] if u > sp.turn]
        lo, hi = (min(uses), max(uses)) if uses else (n, n - 1)
        abar = sum(pg.mem[v] for v in nodes if sp.saved[v])
        opts = part_options(pg, sp, nodes, deadline, use_ilp=len(nodes) <= ILP_NODES and k < ILP_PARTS,
                            exact=exact)
        parts.append(Part(nodes=tuple(nodes), abar=abar, other=_window_max(other, lo, hi), options=tuple(opts)))
    return parts


def chain_dp(parts: Sequence[Part], budget: float, at_turn: int, slots: Optional[int] = None
             ) -> Optional[List[int]]:
    """Pick one option per part: least total cost under the chain's memory model.

    Kept bytes are counted in slots of B' / slots, rounded to the nearest
    slot (rounding every part up would add up to a slot per part: with
    hundreds of parts, nothing would fit); a part's own need is rounded up.

    Args:
        parts: the chain, forward order.
        budget: B', the DP's budget in bytes.
        at_turn: bytes live at T besides the saved values.
        slots: memory discretization (default: SLOTS, or 16 per part up to
            MAX_SLOTS).

    Returns:
        The option index per part, or None when nothing fits.
    """
    import numpy as np
    if budget <= 0:
        return None
    if slots is None:
        slots = max(SLOTS, min(MAX_SLOTS, 16 * len(parts)))
    unit = budget / slots
    inf = math.inf
    dp = np.full(slots + 1, inf)
    dp[0] = 0.0
    choice: List["np.ndarray"] = []
    for part in parts:
        need = math.ceil((part.abar + part.other) / unit - 1e-9)
        if need > slots:
            return None
        cur = dp.copy()
        cur[slots - need + 1:] = inf
        new = np.full(slots + 1, inf)
        arg = np.full(slots + 1, -1, dtype=np.int32)
        for j, o in enumerate(part.options):
            m = int(round(o.mem / unit))
            if m > slots:
                continue
            cand = np.full(slots + 1, inf)
            cand[m:] = cur[:slots + 1 - m] + o.cost
            better = cand < new
            new[better] = cand[better]
            arg[better] = j
        dp = new
        choice.append(arg)
    last = slots - math.ceil(at_turn / unit - 1e-9)
    if last < 0 or not np.isfinite(dp[:last + 1]).any():
        return None
    s = int(np.argmin(dp[:last + 1]))
    picks = [0] * len(parts)
    for i in range(len(parts) - 1, -1, -1):
        j = int(choice[i][s])
        picks[i] = j
        s -= int(round(parts[i].options[j].mem / unit))
    return picks


def execute(pg: PlanGraph, sp: Split, keep: Sequence[bool], keep2: Optional[Sequence[bool]] = None) -> List[int]:
    """The compute sequence of a keep set (Note [Hierarchical planning]).

    The forward in the log's order; then the backward in the log's order,
    each dropped input recomputed first (recursively); then whatever is
    referenced at the end and not available.

    Args:
        pg: the planning graph.
        sp: its split.
        keep: per node, kept over T.
        keep2: per node, whether a recomputed copy (or a backward value)
            stays until its last use (default); False: it serves the
            backward node it was recomputed for (a backward value: the next
            backward node that reads it), and is recomputed again for the
            next one (Note [Repairing the peak]).
    """
    n, deps, pinned = pg.n, pg.deps, pg.pinned
    seq = list(range(sp.turn + 1))
    avail = bytearray(n)
    for v in range(sp.turn + 1):
        avail[v] = 1 if (pinned[v] or keep[v]) else 0
    fresh: List[int] = []

    for v in range(sp.turn + 1, n):
        for d in deps[v]:
            if not avail[d]:
                recompute_missing(deps, avail, d, seq, fresh)
        seq.append(v)
        avail[v] = 1
        if keep2 is not None:
            for d in deps[v]:
                if d > sp.turn and not keep2[d] and not pg.referenced_at_end[d]:
                    avail[d] = 0
        if fresh:
            if keep2 is not None:
                for x in fresh:
                    if not keep2[x]:
                        avail[x] = 0
            fresh.clear()
    for v in range(n):
        if pg.referenced_at_end[v] and not avail[v]:
            recompute_missing(deps, avail, v, seq, fresh)
    return seq


def _measure(pg: PlanGraph, seq: List[int]) -> Tuple[int, float]:
    return sequence_profile(pg, sequence_steps(pg, seq))


@dataclass
class _Plan:
    """A keep set with its measured sequence."""

    cost: float
    peak: int
    seq: List[int]
    keep: List[bool]
    keep2: List[bool]


def _plan_of(pg: PlanGraph, sp: Split, keep: List[bool], keep2: List[bool]) -> _Plan:
    seq = execute(pg, sp, keep, keep2)
    peak, cost = _measure(pg, seq)
    return _Plan(cost, peak, seq, keep, keep2)


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


# Note [Refining the keep set]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The chain DP's memory model is coarse (a part's whole saved bytes
# resident during its backward, outside inputs counted twice, one scalar
# calibration for all parts), so its plan usually leaves room under the
# budget. The refinement takes the values the plan recomputes, most
# expensive per byte first, and keeps them (over T, or a recomputed copy
# until its last use) while the plan still fits (measured, not modelled) and
# costs less: first the longest prefix of that order that fits (a
# bisection: few measurements on big graphs), then one by one; two passes
# at most, within the time limit. The cheapest REFINED chain plans (over
# the part sizes tried) are refined, each with an equal share of the time
# left.

def refine(pg: PlanGraph, sp: Split, plan: _Plan, budget: int, deadline: float) -> Tuple[_Plan, int]:
    """Keep more values while the plan still fits, one by one, measured (Note [Refining the keep set]).

    Returns:
        (the refined plan, how many values it keeps in addition).
    """
    count = [0] * pg.n
    for v in plan.seq:
        count[v] += 1
    cands = [(v, 1) for v in range(sp.turn + 1) if count[v] > 1 and not plan.keep[v]]
    cands += [(v, 2) for v in range(sp.turn + 1) if count[v] > 1 and not plan.keep2[v]]
    cands.sort(key=lambda c: (-(pg.cost[c[0]] / max(1, pg.mem[c[0]])), c))
    added = 0

    def with_prefix(k: int) -> _Plan:
        keep, keep2 = list(plan.keep), list(plan.keep2)
        for v, level in cands[:k]:
            (keep if level == 1 else keep2)[v] = True
        return _plan_of(pg, sp, keep, keep2)

    # the longest prefix of the candidates that still fits, by bisection (few measurements on big graphs)
    lo, hi = 0, len(cands)
    while lo < hi and time.perf_counter() < deadline:
        mid = (lo + hi + 1) // 2
        p2 = with_prefix(mid)
        if p2.peak <= budget:
            lo = mid
            if p2.cost < plan.cost - 1e-12:
                plan, added = p2, added + mid
                cands = cands[mid:]
                lo, hi = 0, len(cands)
        else:
            hi = mid - 1
    for _ in range(2):
        improved = False
        for v, level in cands:
            if (plan.keep if level == 1 else plan.keep2)[v]:
                continue
            if time.perf_counter() > deadline:
                return plan, added
            keep, keep2 = list(plan.keep), list(plan.keep2)
            (keep if level == 1 else keep2)[v] = True
            p2 = _plan_of(pg, sp, keep, keep2)
            if p2.peak <= budget and p2.cost < plan.cost - 1e-12:
                plan = p2
                added += 1
                improved = True
        if not improved:
            break
    return plan, added


# Note [Repairing the peak]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# One level of recomputation cannot go below a part's saved bytes plus the
# boundaries kept over T; a tight budget needs more (Rotor's recursion,
# rockmate.txt 3.4). When no chain plan fits, the repair starts from the one
# with the lowest peak and lowers its peak step by step, measured: among the
# forward values resident at the peak, it either drops a kept one (the
# backward recomputes it) or, for a copy the backward recomputed, lets it
# serve only the backward node it was recomputed for (keep2 false: the next
# reader recomputes it again, a second level of recomputation, as DTR
# does), or lets a backward value go after its next reader (recomputed,
# recursively, when another needs it). The lowest plans of the partitions
# are repaired in turn, lowest first, until one fits, each with half of the
# repair's time left (the last with all of it). The REPAIR_TRIES candidates cheapest
# per byte are measured at each step; the one that adds the least cost per
# byte of peak it removes is taken. It stops when the plan
# fits, when no candidate lowers the peak, or at the time limit; a plan that
# fits is then refined (Note [Refining the keep set]).

#: The cheapest chain plans refined (Note [Refining the keep set]).
REFINED = 8
#: Candidates tried per repair step.
REPAIR_TRIES = 24


def _peak_residents(pg: PlanGraph, seq: List[int]) -> List[Tuple[int, int]]:
    """(node, position in seq of the computation) of each storage resident at the peak."""
    steps = sequence_steps(pg, seq)
    size = pg.graph.storage_size
    mem = peak = 0
    at = -1
    for i, (kind, x) in enumerate(steps):
        if kind == "compute":
            mem += pg.mem[x]
            if mem > peak:
                peak, at = mem, i
        else:
            mem -= size[x]
    alive: Dict[int, int] = {}
    pos = -1
    for kind, x in steps[:at + 1]:
        if kind == "compute":
            pos += 1
            for s in pg.storages[x]:
                alive[s] = pos
        else:
            alive.pop(x, None)
    return [(pg.storage_node[s], p) for s, p in alive.items()]


def repair(pg: PlanGraph, sp: Split, plan: _Plan, budget: int, deadline: float) -> Tuple[_Plan, int]:
    """Lower a plan's peak until it fits, one measured change at a time (Note [Repairing the peak]).

    Returns:
        (the lowest plan reached, changes made).
    """
    changes = 0
    while plan.peak > budget and time.perf_counter() < deadline:
        cands = set()
        for v, p in _peak_residents(pg, plan.seq):
            if pg.pinned[v] or pg.referenced_at_end[v]:
                continue
            if v > sp.turn:
                if plan.keep2[v]:
                    cands.add((v, 2))
            elif p <= sp.turn and plan.keep[v]:
                cands.add((v, 1))
            elif p > sp.turn and plan.keep2[v]:
                cands.add((v, 2))
        order = sorted(cands, key=lambda c: (pg.cost[c[0]] / max(1, pg.mem[c[0]]), c))
        nxt: Optional[_Plan] = None
        rate = math.inf
        for v, level in order[:REPAIR_TRIES]:
            if time.perf_counter() > deadline:
                break
            keep, keep2 = list(plan.keep), list(plan.keep2)
            (keep if level == 1 else keep2)[v] = False
            p2 = _plan_of(pg, sp, keep, keep2)
            if p2.peak < plan.peak:
                r = max(0.0, p2.cost - plan.cost) / (plan.peak - p2.peak)
                if r < rate:
                    nxt, rate = p2, r
                if r == 0.0:
                    break
        if nxt is None:
            break
        plan = nxt
        changes += 1
    return plan, changes


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
        from dataclasses import replace

        from dtr.sim.planners.checkmate import plan_checkmate
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
    # Repair the lowest plans of the partitions, lowest first, until one fits (Note [Repairing the peak]).
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
    # Refine the best chain plans, cheapest first (Note [Refining the keep set]).
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
