"""``hierarchical``'s chain: the forward/backward split, the parts and their options, the DP over them.

See Note [The part options]; the planner and Note [Hierarchical planning]
are in :mod:`dtr.sim.planners.hierarchical`, the measured plans in
:mod:`dtr.sim.planners.hierarchical_plans`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from dtr.sim.graph import PlanGraph
from dtr.sim.schedule import sequence_steps

__all__ = ["Split", "Part", "Option", "split_graph", "partition", "part_options", "build_parts", "chain_dp"]

#: Parts larger than this get greedy options (their ILP would be slow).
ILP_NODES = 64
#: Memory slots of the chain DP (at least; 16 per part up to MAX_SLOTS).
SLOTS = 1024
MAX_SLOTS = 16384
#: Parts with at most this many keep variables (nodes and outside inputs) are enumerated.
ENUM_VARS = 10
#: At most this many parts per partition get the ILP (the others: greedy options).
ILP_PARTS = 60
#: Budget fractions (of a part's keepable bytes) the part ILP is solved for.
CAPS = (0.0, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8)


@dataclass(frozen=True)
class Split:
    """The forward / backward split of a planning graph (Note [Hierarchical planning] in dtr.sim.planners.hierarchical).

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
    """Find the turning point and the saved values (Note [Hierarchical planning] in dtr.sim.planners.hierarchical).

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
