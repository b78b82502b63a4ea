"""``fastsa``: simulated annealing over a slot vector of computations (fastsa.txt).

See Note [FastSA]. The annealing loop is C++ (``dtr._C.fastsa_anneal``,
csrc/fastsa.cpp); this module groups the nodes, builds the start state,
decomposes the groups between the two stages and checks the result.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

from dtr.sim.export import dtr_starts
from dtr.sim.graph import PlanGraph, chain_shape
from dtr.sim.planners.base import PlanOptions, PlanResult, get_planner, register_planner
from dtr.sim.schedule import out_of_order, sequence_profile, sequence_steps

__all__ = ["plan_fastsa", "Grouping", "group_nodes", "Problem", "node_problem", "group_problem", "Stage", "anneal",
           "FIXED", "PINNED", "KEEP"]

# Note [FastSA]
# ~~~~~~~~~~~~~
# The paper's algorithm (fastsa.txt sections 2.1-2.2, appendices B.1, C.1, D.4):
# - Nodes and values (2.1): a unit (a node, or a group) reads values and
#   produces values; the values are the exact storages (a backward node's
#   gradients are separate values: only the one kept to the end lives to the
#   end). A value lives, for each production of its unit, from the production to
#   its last read before the next production; the last production of a storage
#   referenced at the end lives to the end; a production nobody reads lives for
#   its own slot. Memory per slot is the sum over live values plus the running
#   unit's intermediates (B.1); the peak M is kept in an add-max segment tree, so
#   a mutation costs O(log T) per changed interval. This model equals
#   sequence_profile on single nodes (tests/planners/test_fastsa.py) and is conservative
#   on groups (a group's inputs count through its whole slot).
# - Representation (2.2): a fixed-length vector of T slots, each a unit or nop,
#   the start sequence spread evenly with nops between (D.4: slot i*T/(k+1)).
#   Mutations: add a random unit at a random nop slot (valid when each value it
#   reads was produced before), remove the unit at a random slot (valid when an
#   earlier production, or none of its reads before the next, covers it; every
#   unit keeps one production), rotate (move one computation to a nop slot: a
#   remove and an add, valid when both are). A rejected mutation is undone by
#   its inverse. Constants are fixed (2.3: nodes that must not move).
# - Objective (eq. 1): f = max(budget, M) * C; acceptance exp(-(f' - f) / h).
# - Node grouping (C.1, Algorithm 1): in the log's order, a node whose reads
#   take no more bytes than its own storages is fused into every node that
#   reads it (the group reads the union minus what it produces inside; its
#   values are its last node's); the fused node leaves the sequence, so each
#   reader recomputes it. A group's intermediate memory is its peak of internal
#   values while it runs (B.1). Not fused: constants, nodes referenced at the
#   end, nodes nobody reads (they would vanish: every operator must run once),
#   nodes read by a constant.
# - Two stages (2.2.2, D.4): first SA on the grouped units, h from 1e-3 f0 down
#   to 1e-4 of that over N1 iterations (20M), stopping as soon as the peak is
#   within the budget; then the groups are decomposed (each unit instance
#   becomes its nodes in order, spread over a fresh slot vector) and a second SA
#   on single nodes (N2 iterations, 2M) removes the redundant recomputations.
# Where this departs from the paper, and why:
# - The second stage starts at 1e-3 of its own start objective, not at the
#   first stage's final temperature: grouping alone often meets the budget
#   (the first stage then stops at once) at several times the base cost, and
#   the paper's cold second stage is then a greedy descent. Measured at 50%
#   (3M iterations): resnet32 (logs/) 1.084x against 1.118x, densenet-bc 1.013x
#   against 1.042x.
# - Time left after the second stage goes to more rounds (at most REFINE), each
#   from the best state so far, REFINE_COOL times cooler; a round that finds
#   nothing cheaper ends them. A round from a state above the budget (grouping
#   can swallow a whole chain into one unit, leaving the first stage nothing to
#   move) first anneals hot on single nodes with the first stage's schedule.
# - T is 8 slots per unit (a power of two, at least 4096) rather than 2^20; the
#   mutation mix is 40% add, 40% remove, 20% rotate (the paper gives none).
# - The time limit holds: the first stage gets at most STAGE1_SHARE of it; with
#   a warm start (``options.warm_start``: the cheapest of Chen's plan, Rotor's
#   where its estimated time fits, lookahead's and DTR's simulated runs, the
#   planners with a quarter of the time left each: Note [DTR runs as starts]
#   in dtr.sim.export) the cold start gets COLD_SHARE of the time and
#   the warm plan's second-stage refinement the rest; the cheaper result wins.
# - With ``options.in_order`` (a plan for a runtime step: Note [Schedules a
#   step can follow] in dtr.sim.schedule) every run rejects a mutation that
#   moves a first computation past another's, warm starts out of order are
#   dropped, and no node is grouped: the warm start gets all the time, and only
#   without one is there a cold start, the graph's order itself (on the GPT
#   step at 50% it never reached the budget).
# - The model counts what sequence_steps frees early as live (an old version
#   handed to its in-place write, a constant the log drops: Note [Planned
#   frees] in dtr.sim.schedule), so on a runtime's log a warm start within the
#   budget can be above it in the model (a small TreeLSTM step: 11% above). The warm
#   start's refinement runs at the budget plus that excess, and the warm start
#   itself stays a candidate; the check on sequence_profile decides.
# - A budget below the memory every schedule needs is refused by run_planner
#   before this planner runs (``infeasible``: Note [A memory lower bound]).
# The result is checked on sequence_profile. Seeded by ``options.seed``: the
# same seed and iteration counts give the same plan (a time limit that cuts a
# run short can change it).

#: Unit flags of the annealing problem (csrc/fastsa.h).
FIXED, PINNED, KEEP = 1, 2, 4
#: Slots per unit (the start sequence is spread over them), and the bounds on T.
SLOTS, T_MIN, T_MAX = 8, 4096, 1 << 22
#: The paper's iteration counts (D.4): first stage, second stage.
N1, N2 = 20_000_000, 2_000_000
#: The paper's temperatures: start at TEMP0 * f0, each stage ends at TEMP_DROP * its start.
TEMP0, TEMP_DROP = 1e-3, 1e-4
#: Share of the time limit the first stage may take.
STAGE1_SHARE = 0.6
#: Share of the time left for the cold start when there is a warm start.
COLD_SHARE = 0.6
#: Rotor's time per chain length squared and memory slot, measured (a 400-node chain, 256 slots: 1.2 s).
ROTOR_SECONDS = 3e-8
#: Leave this many seconds of the time limit for the final check, plus this many per node (measured on
#: treelstm, 45k nodes, on a loaded 2-core machine: up to 5 s after the last annealing run).
MARGIN, MARGIN_PER_NODE = 0.05, 1.5e-4


@dataclass(frozen=True)
class Grouping:
    """The node grouping of fastsa.txt Algorithm 1.

    Attributes:
        units: the nodes that stay in the sequence (roots of their group), in
            the log's order.
        members: per unit, the nodes it runs, in the log's (topological) order
            (the unit itself last).
        reads: per unit, the storages of other units it reads.
        extra: per unit, the bytes its intermediates take on top of its own
            value while it runs (B.1).
        fused: per node, whether it was fused into its readers.
    """

    units: Tuple[int, ...]
    members: Tuple[Tuple[int, ...], ...]
    reads: Tuple[Tuple[int, ...], ...]
    extra: Tuple[int, ...]
    fused: Tuple[bool, ...]


def group_nodes(pg: PlanGraph) -> Grouping:
    """Fuse every node whose inputs are no larger than its output into its readers (Algorithm 1).

    Args:
        pg: the planning graph.

    Returns:
        The :class:`Grouping` (see Note [FastSA] for which nodes are never fused).
    """
    n = pg.n
    users = pg.users()
    size = pg.graph.storage_size
    members: List[set] = [{v} for v in range(n)]
    reads: List[set] = [set(pg.reads[v]) for v in range(n)]
    fused = [False] * n
    for v in range(n):
        if pg.pinned[v] or pg.referenced_at_end[v] or not users[v] or any(pg.pinned[u] for u in users[v]):
            continue
        if sum(size[s] for s in reads[v]) > pg.mem[v]:
            continue
        fused[v] = True
        own = set(pg.storages[v])
        for u in users[v]:
            members[u] |= members[v]
            reads[u] -= own
            reads[u] |= reads[v]
    units = tuple(v for v in range(n) if not fused[v])
    out_members = tuple(tuple(sorted(members[v])) for v in units)
    return Grouping(units=units, members=out_members, reads=tuple(tuple(sorted(reads[v])) for v in units),
                    extra=tuple(_intermediate(pg, ms) for ms in out_members), fused=tuple(fused))


def _intermediate(pg: PlanGraph, ms: Sequence[int]) -> int:
    """Bytes of a group's internal values at its peak, beyond its own value (its last member's)."""
    if len(ms) == 1:
        return 0
    inside = set(ms)
    last_use = {m: i for i, m in enumerate(ms)}
    for i, m in enumerate(ms):
        for d in pg.deps[m]:
            if d in inside:
                last_use[d] = i
    live = peak = 0
    free_at: List[List[int]] = [[] for _ in ms]
    for m in ms[:-1]:
        free_at[last_use[m]].append(m)
    for i, m in enumerate(ms):
        live += pg.mem[m]
        peak = max(peak, live)
        for d in free_at[i]:
            live -= pg.mem[d]
    return max(0, peak - pg.mem[ms[-1]])


@dataclass(frozen=True)
class Stage:
    """What one annealing run returned (dtr._C.fastsa_anneal's dictionary, typed).

    Attributes:
        slots: the best state (-1: nop).
        iterations: mutation attempts.
        accepted: accepted mutations.
        peak: the best state's peak in the model.
        cost: its cost.
        feasible: its peak is within the budget.
        objective0: the start objective.
        temp_end: the absolute temperature reached.
    """

    slots: Tuple[int, ...]
    iterations: int
    accepted: int
    peak: int
    cost: float
    feasible: bool
    objective0: float
    temp_end: float


@dataclass(frozen=True)
class Problem:
    """An annealing problem (csrc/fastsa.h): units that read and produce values.

    Attributes:
        reads: per unit, the values it reads.
        outs: per unit, the values it produces (each value has one producer).
        extra: per unit, bytes it needs on top while it runs.
        cost: per unit, the cost of one computation.
        unit_flags: per unit, FIXED or 0.
        size: per value, bytes.
        value_flags: per value, PINNED / KEEP bits.
    """

    reads: Sequence[Sequence[int]]
    outs: Sequence[Sequence[int]]
    extra: Sequence[int]
    cost: Sequence[float]
    unit_flags: Sequence[int]
    size: Sequence[int]
    value_flags: Sequence[int]


def node_problem(pg: PlanGraph) -> Problem:
    """The problem over single nodes: values are the exact storages."""
    g = pg.graph
    # a constant the log keeps lives to the end (KEEP: its one production is its last); one the log drops
    # is freed after its last read, as sequence_steps frees it (Note [Planned frees])
    vflags = [KEEP if s in pg.storages_referenced_at_end else 0 for s in range(g.num_storages)]
    return Problem(reads=pg.reads, outs=pg.storages, extra=[0] * pg.n, cost=pg.cost,
                   unit_flags=[FIXED if p else 0 for p in pg.pinned], size=g.storage_size, value_flags=vflags)


def group_problem(pg: PlanGraph, gr: Grouping) -> Problem:
    """The problem over grouped units: a unit produces its last node's storages and reads what its nodes read."""
    base = node_problem(pg)
    return Problem(reads=gr.reads, outs=[pg.storages[v] for v in gr.units], extra=gr.extra,
                   cost=[sum(pg.cost[m] for m in ms) for ms in gr.members],
                   unit_flags=[FIXED if pg.pinned[v] else 0 for v in gr.units], size=base.size,
                   value_flags=base.value_flags)


def _csr(rows: Sequence[Sequence[int]]) -> Tuple[List[int], List[int]]:
    ptr = [0]
    idx: List[int] = []
    for r in rows:
        idx.extend(r)
        ptr.append(len(idx))
    return ptr, idx


def anneal(problem: Problem, slots: Sequence[int], budget: int, iterations: int, temps: Tuple[float, float],
           temp_scale: float, seed: int, time_limit: float, stop_when_feasible: bool,
           soft_peak: bool = False, keep_order: bool = False) -> Stage:
    """One annealing run (see Note [FastSA]); the loop is ``dtr._C.fastsa_anneal``.

    Args:
        problem: the units and values.
        slots: the start state (unit per slot, -1 for nop); a valid sequence.
        budget: bytes.
        iterations: at most this many mutation attempts.
        temps: start and end temperature, times ``temp_scale``.
        temp_scale: <= 0: the start objective.
        seed: the random seed.
        time_limit: seconds (<= 0: none).
        stop_when_feasible: stop once the peak is within the budget.
        soft_peak: the objective's peak is the log-sum-exp over the slots
            (appendix C.2; feasibility still counts the true peak).
        keep_order: units' first computations stay in unit order (the start
            must have them so; Note [Schedules a step can follow] in dtr.sim.schedule).

    Returns:
        The :class:`Stage`.

    Raises:
        ValueError: inconsistent arrays, a start state that reads before it produces, or one out of order
            under ``keep_order``.
    """
    from dtr import _C
    in_ptr, in_idx = _csr(problem.reads)
    out_ptr, out_idx = _csr(problem.outs)
    r = _C.fastsa_anneal(in_ptr, in_idx, out_ptr, out_idx, list(problem.extra), list(problem.cost),
                         list(problem.unit_flags), list(problem.size), list(problem.value_flags), list(slots),
                         int(budget), int(iterations), temps[0], temps[1], temp_scale, seed & (2**64 - 1),
                         time_limit, stop_when_feasible, soft_peak, keep_order)
    return Stage(slots=tuple(r["slots"]), iterations=r["iterations"], accepted=r["accepted"], peak=r["peak"],
                 cost=r["cost"], feasible=r["feasible"], objective0=r["objective0"], temp_end=r["temp_end"])


def _spread(seq: Sequence[int], n_units: int) -> List[int]:
    """The slot vector of D.4: ``seq`` at slots i*T/(k+1), nops elsewhere."""
    k = len(seq)
    T = T_MIN
    while T < SLOTS * max(k, n_units) and T < T_MAX:
        T *= 2
    T = max(T, 2 * k + 2)
    slots = [-1] * T
    for i, v in enumerate(seq):
        slots[(i + 1) * T // (k + 1)] = v
    return slots


@register_planner("fastsa")
def plan_fastsa(pg: PlanGraph, budget: int, options: PlanOptions) -> PlanResult:
    """FastSA (Note [FastSA]): grouped annealing until the budget is met, then annealing on single nodes.

    Args:
        pg: the planning graph.
        budget: bytes.
        options: ``time_limit`` (holds), ``seed``, ``sa_steps`` (the first
            stage's iterations; the second gets a tenth; 0: the paper's 20M
            and 2M), ``warm_start``, ``start``, ``in_order`` (no grouping, and
            every run keeps first computations in the graph's order).

    Returns:
        ``ok`` with the cheapest sequence found within the budget, else
        ``oom`` (the message gives the lowest peak reached).
    """
    t0 = time.perf_counter()
    deadline = t0 + max(0.0, options.time_limit - MARGIN - MARGIN_PER_NODE * pg.n)
    n1 = options.sa_steps or N1
    n2 = max(options.sa_steps // 10, 1000) if options.sa_steps else N2
    warm_seq, warm_name = _warm_start(pg, budget, options, deadline) if options.warm_start else (None, "")
    # with a warm start the cold start gets COLD_SHARE of the time left, the warm start's refinement the rest;
    # in order, a warm start gets all of it (Note [FastSA])
    now = time.perf_counter()
    order = options.in_order
    cold_deadline = deadline if warm_seq is None else now + COLD_SHARE * (deadline - now)
    nodes = node_problem(pg)
    cands: List[Tuple[str, Stage]] = []
    if order and warm_seq is None:
        cold = _refine(nodes, range(pg.n), budget, n2, options.seed + 1, cold_deadline, n1, keep_order=True)
        cands.append((f"cold start (in order, {cold.iterations} iterations)", cold))
    elif not order:
        gr = group_nodes(pg)
        units = gr.units
        stage1 = anneal(group_problem(pg, gr), _spread(range(len(units)), len(units)), budget, n1,
                        (TEMP0, TEMP0 * TEMP_DROP), 0.0, options.seed,
                        max(1e-3, STAGE1_SHARE * (cold_deadline - time.perf_counter())), True)
        seq1 = [m for u in stage1.slots if u >= 0 for m in gr.members[u]]
        cold = _refine(nodes, seq1, budget, n2, options.seed + 1, cold_deadline, n1)
        cands.append((f"cold start ({len(units)} units after grouping, {stage1.iterations} + {cold.iterations} "
                      f"iterations)", cold))
    if warm_seq is not None:
        # the model's budget grows by its excess on the start, which stays a candidate (Note [FastSA])
        as_is = anneal(nodes, _spread(warm_seq, pg.n), budget, 0, (1.0, 1.0), 1.0, 0, 0.0, False)
        slack = max(0, as_is.peak - sequence_profile(pg, sequence_steps(pg, warm_seq))[0])
        warm = _refine(nodes, warm_seq, budget + slack, n2, options.seed + 2, deadline, n1, keep_order=order)
        cands += [(f"{warm_name} ({warm.iterations} iterations)", warm), (warm_name, as_is)]
    best: Optional[Tuple[float, List[int], str]] = None
    lowest = min(s.peak for _, s in cands)
    for name, st in cands:
        seq = [v for v in st.slots if v >= 0]
        peak, cost = sequence_profile(pg, sequence_steps(pg, seq))
        lowest = min(lowest, peak)
        if peak <= budget and (best is None or cost < best[0]):
            best = (cost, seq, name)
    if best is None:
        return PlanResult("fastsa", "oom", None, message=f"no sequence within the budget; lowest peak {lowest} "
                                                           f"bytes")
    return PlanResult("fastsa", "ok", tuple(best[1]), predicted_cost=best[0], message=f"from {best[2]}")


def _refine(problem: Problem, seq: Sequence[int], budget: int, iterations: int, seed: int, deadline: float,
            hot_iterations: int, keep_order: bool = False) -> Stage:
    """The second stage (Note [FastSA]) on single nodes from ``seq``, then more rounds until the deadline.

    A round from a state above the budget first anneals hot (the first stage's temperatures, on single
    nodes, until the budget is met); every round then anneals at the second stage's temperatures.
    """
    n = len(problem.cost)
    best: Optional[Stage] = None
    its = 0
    state = list(seq)
    for rnd in range(REFINE + 1):
        left = deadline - time.perf_counter()
        if rnd and left < 0.05 + MARGIN_PER_NODE * n:  # not worth a round's set-up
            break
        slots = _spread(state, n)
        if best is not None and not best.feasible:
            hot = anneal(problem, slots, budget, hot_iterations, (TEMP0, TEMP0 * TEMP_DROP), 0.0,
                         seed + 7919 * rnd + 1, max(1e-3, 0.5 * left), True, keep_order=keep_order)
            its += hot.iterations
            slots = _spread([v for v in hot.slots if v >= 0], n)
        temps = (TEMP0, TEMP0 * TEMP_DROP) if rnd == 0 else (TEMP0 * REFINE_COOL, TEMP0 * TEMP_DROP * REFINE_COOL)
        st = anneal(problem, slots, budget, iterations, temps, 0.0, seed + 7919 * rnd,
                    max(1e-3, deadline - time.perf_counter()), False, keep_order=keep_order)
        its += st.iterations
        improved = best is None or (st.feasible, -st.cost, -st.peak) > (best.feasible, -best.cost, -best.peak)
        if improved:
            best = st
        elif best is not None and best.feasible and st.cost >= best.cost:
            break  # a feasible round that found nothing cheaper: converged
        assert best is not None
        state = [v for v in best.slots if v >= 0]
    assert best is not None
    return Stage(slots=best.slots, iterations=its, accepted=best.accepted, peak=best.peak, cost=best.cost,
                 feasible=best.feasible, objective0=best.objective0, temp_end=best.temp_end)


#: At most this many extra second-stage rounds, each REFINE_COOL times cooler than the first (Note [FastSA]).
REFINE, REFINE_COOL = 8, 0.1


def _warm_start(pg: PlanGraph, budget: int, options: PlanOptions, deadline: float) -> Tuple[Optional[List[int]], str]:
    """The cheapest sequence within the budget from Chen, Rotor, lookahead, ``options.start`` or DTR's runs.

    None if none fits.

    Rotor runs only where its estimated time (ROTOR_SECONDS per chain length squared and memory slot)
    is under a quarter of the time left, so that the warm start keeps the time limit.
    """
    best: Optional[Tuple[float, List[int], str]] = None
    for name in ("chen", "rotor", "lookahead"):
        if name == "rotor":
            shape = chain_shape(pg)
            est = ROTOR_SECONDS * (len(shape.fwd) if shape else 0) ** 2 * options.rotor_slots
            if shape is None or est > 0.25 * (deadline - time.perf_counter()):
                continue
        try:
            left = max(0.0, deadline - time.perf_counter())
            r = get_planner(name)(pg, budget, replace(options, time_limit=0.25 * left))
        except Exception:  # a failing seed planner only loses the warm start
            continue
        if r.sequence is None or options.in_order and out_of_order(r.sequence) is not None:
            continue
        peak, cost = sequence_profile(pg, sequence_steps(pg, list(r.sequence)))
        if peak <= budget and (best is None or cost < best[0]):
            best = (cost, list(r.sequence), f"{name}'s plan")
    if options.start is not None and not (options.in_order and out_of_order(options.start) is not None):
        peak, cost = sequence_profile(pg, sequence_steps(pg, list(options.start)))
        if peak <= budget and (best is None or cost < best[0]):
            best = (cost, list(options.start), "the given start")
    # DTR's runs (Note [DTR runs as starts] in dtr.sim.export), in at most half the time left
    starts = [s for s in dtr_starts(pg, budget, time.perf_counter() + 0.5 * (deadline - time.perf_counter()))
              if not options.in_order or out_of_order(s[2]) is None]
    if starts and (best is None or starts[0][0] < best[0]):
        best = (starts[0][0], starts[0][2], starts[0][1])
    if best is None:
        return None, ""
    base = sum(pg.cost)
    return best[1], f"{best[2]} at {best[0] / base:.4f}x" if base > 0 else best[2]
