"""The operator graph of a log, for static schedules and planners.

Two forms:

- :class:`Graph`, the *exact* graph: one operator per constant, call and
  mutate of the log, in the log's order, over tensors and storages: the
  simulator's core's own tables (same ids), so that a schedule of the
  simulator's decisions evaluates to the simulator's own figures.
- :class:`PlanGraph`, the *planning* graph the static planners work on: one
  node per storage-owning operator, views folded into the node that owns the
  storage they view (see Note [Collapsing views for planners]).
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from dtr.errors import DtrError

__all__ = ["Graph", "GraphError", "PlanGraph", "PlanGraphError", "graph_from_log", "plan_graph", "chain_shape",
           "ChainShape"]


class GraphError(DtrError):
    """A log whose exact graph a schedule cannot describe (see :func:`graph_from_log`)."""


@dataclass(frozen=True)
class Graph:
    """The exact operator graph of a log: the simulator's core's own tables.

    Operators, tensors and storages are the core's, with the core's ids, as
    it builds them when it replays the log without a budget (Note [The exact
    graph is the core's] in csrc/replay.cpp): operators in the log's order
    (constants, calls and mutates each make one), tensors as the operators
    create their outputs, storages as they allocate them (a view output
    shares its input's storage; a mutate allocates a fresh copy of each
    storage it writes, simrd's reference layer; an in-place write, a ``call``
    with ``mutated`` or a ``mutate`` with ``inplace``, makes a new version of
    each written storage after the call's own outputs, except of a storage
    pinned at that moment, which is written where it is).

    Attributes:
        name: where the graph comes from (the log's path).
        cost_unit: unit of the costs.
        op_kind: ``constant``, ``call`` or ``mutate`` per operator.
        op_name: the operator's name (its kind when the log gives none).
        op_line: the log line that created it.
        op_instr: the index of that instruction in ``Log.records()``.
        op_cost: its cost.
        op_inputs: input tensor ids.
        op_outputs: output tensor ids.
        op_fresh: storage ids it allocates (its non-view outputs).
        op_alloc: bytes it allocates when it runs (sum of its fresh storages).
        op_overwrites: per operator, the storages it writes in place (the old
            versions of its new-version outputs; empty for most operators).
            See Note [In-place writes in a schedule] in :mod:`dtr.sim.schedule`.
        tensor_op: the operator that produces each tensor.
        tensor_storage: the storage each tensor lives in.
        tensor_view: whether the tensor is a view of an input (0 bytes).
        storage_size: bytes per storage.
        storage_op: the operator that allocates each storage.
        storage_constant: whether a ``constant`` instruction allocates the
            storage (a weight, an input): resident from its operator on,
            never recomputed, freed only if the log drops it (none of its
            tensors in ``referenced_at_end``). Storages the core pins on the
            way (``pin``, ``protect``) are not constants: a schedule may free
            and recompute them.
        storage_tensors: the tensors living in each storage.
        referenced_at_end: the tensors some handle still refers to when the
            log ends (simrd's output condition: each must be defined when a
            schedule ends), ascending.
        log: the :class:`dtr.sim.logs.Log` it was read from (None for a graph
            built otherwise): what replays DTR's runs over it
            (:func:`dtr.sim.export.dtr_starts`).
    """

    name: str
    cost_unit: str
    op_kind: Tuple[str, ...]
    op_name: Tuple[str, ...]
    op_line: Tuple[int, ...]
    op_cost: Tuple[float, ...]
    op_inputs: Tuple[Tuple[int, ...], ...]
    op_outputs: Tuple[Tuple[int, ...], ...]
    op_fresh: Tuple[Tuple[int, ...], ...]
    op_alloc: Tuple[int, ...]
    tensor_op: Tuple[int, ...]
    tensor_storage: Tuple[int, ...]
    tensor_view: Tuple[bool, ...]
    storage_size: Tuple[int, ...]
    storage_op: Tuple[int, ...]
    storage_constant: Tuple[bool, ...]
    storage_tensors: Tuple[Tuple[int, ...], ...]
    referenced_at_end: Tuple[int, ...]
    op_overwrites: Tuple[Tuple[int, ...], ...]
    op_instr: Tuple[int, ...]
    log: Any = field(default=None, repr=False, compare=False)

    @property
    def num_ops(self) -> int:
        return len(self.op_cost)

    @property
    def num_storages(self) -> int:
        return len(self.storage_size)

    @property
    def base_compute(self) -> float:
        """Every operator computed once (the log's own compute)."""
        return float(sum(self.op_cost))


def graph_from_log(log) -> Graph:
    """Read the exact operator graph of a log off the simulator's core.

    The log is replayed without a budget under its own semantics
    (:attr:`dtr.sim.logs.Log.semantics`) and the graph is the core's tables
    (:func:`dtr.core.replay_graph`; Note [The exact graph is the core's] in
    csrc/replay.cpp), so its ids are the core's by construction.

    Args:
        log: a :class:`dtr.sim.logs.Log`, or a path to one.

    Returns:
        The :class:`Graph`, operators in the log's order.

    Raises:
        LogFormatError: ``log`` is a path to a bad log.
        GraphError: an in-place write has an output that views a storage it
            overwrites (see :func:`_refuse_views_of_overwritten`).
    """
    from dtr.core import replay_graph
    from dtr.sim.logs import KINDS, Log, read_log
    if not isinstance(log, Log):
        log = read_log(os.fspath(log))
    t = replay_graph(log.program, log.semantics)
    names = log.program.names
    kinds = tuple(KINDS[k] for k in t["op_kind"])
    g = Graph(
        name=str(log.path), cost_unit=log.cost_unit, op_kind=kinds,
        op_name=tuple(k if k == "constant" else (names[n] if n >= 0 else "") or k
                      for n, k in zip(t["op_name"], kinds)),
        op_line=t["op_line"], op_cost=t["op_cost"], op_inputs=t["op_inputs"], op_outputs=t["op_outputs"],
        op_fresh=t["op_fresh"], op_alloc=t["op_alloc"], tensor_op=t["tensor_op"],
        tensor_storage=t["tensor_storage"], tensor_view=t["tensor_view"], storage_size=t["storage_size"],
        storage_op=t["storage_op"],
        storage_constant=tuple(kinds[k] == "constant" for k in t["storage_op"]),
        storage_tensors=t["storage_tensors"], referenced_at_end=t["referenced_at_end"],
        op_overwrites=t["op_overwrites"], op_instr=t["op_instr"], log=log)
    _refuse_views_of_overwritten(g, log)
    return g


# Note [A view of what an in-place write overwrites]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An in-place write whose own output views a storage it overwrites has no
# meaning as a schedule: the core puts that view on the old version, which
# the write evicts, and counts it resident without its bytes. The runtime
# never logs one (it logs no views); a hand-written log can log the view as a
# separate call after the write. The graph refuses it rather than describe
# it wrongly.

def _refuse_views_of_overwritten(g: Graph, log) -> None:
    """Refuse an in-place write with an output viewing a storage it overwrites.

    See Note [A view of what an in-place write overwrites].

    Args:
        g: the graph just read off the core.
        log: the :class:`dtr.sim.logs.Log` it comes from (for the message).

    Raises:
        GraphError: names the log line, the output and the input it views.
    """
    for k, written in enumerate(g.op_overwrites):
        if not written:
            continue
        for i, t in enumerate(g.op_outputs[k]):
            if g.tensor_view[t] and g.tensor_storage[t] in written:
                r = next(itertools.islice(log.records(), g.op_instr[k], None))
                raise GraphError(f"{g.name}:{g.op_line[k]}: output {r.outputs[i]!r} views {r.aliases[i]!r}, whose "
                                 f"storage this call overwrites in place: not supported (log the view as a "
                                 f"separate call after the write)")


# Note [Collapsing views for planners]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The planners (Chen, Rotor, Checkmate, FastSA) reason about a DAG of nodes,
# each with a cost, a memory size, and dependencies; a node is resident or
# not as a whole. A view's validity, however, is tied to its base storage:
# evicting the base invalidates every view of it. So a view operator whose
# inputs all live in one storage is folded into the node that owns that
# storage: the node's cost is the sum, its memory the storage's, and
# computing the node runs the base operator and then its views (in log
# order); its consumers depend on the owning node. A node's storages are
# freed one by one after their own last use (a planner's memory model may
# count the node's bytes as one block: conservative). A view of a constant folds
# into the constant's node (pinned, computed once). An operator that mixes
# fresh and view outputs, or a view of several storages, cannot be folded:
# the planning graph is then refused (PlanGraphError) and the planners report
# ``n/a``; the published logs have neither (tests/core/test_stress.py's random logs
# do). An operator without outputs (an in-place write of a constant such as
# a step counter's ``add_`` or a gradient accumulated in place, or a view
# nobody keeps) allocates nothing and is folded into the node before it in
# the log (the latest node made so far), reading the other nodes' storages as
# that node's inputs: a schedule then runs it at its turn. Folded into the
# latest node it read instead, the accumulation of a gradient declared at the
# block's start (every step after the first: Note [Constants from earlier
# blocks] in dtr/runtime/driver.py) ran with the node that made its input,
# before its turn, and schedules freed that input before the program's write
# read it: following a plan of the CPU GPT recomputed 1.11 s instead of its
# schedule's 0.81 s (now 0.83 s against 0.82 s). A
# mutate, and an in-place write's new versions, are ordinary nodes (fresh
# storages; the planners keep the old version until its last use, which is
# valid and only costs memory: Note [In-place writes in a schedule] in
# dtr.sim.schedule). Every node is computed at least once, in the log's
# order for its first computation (the planners' order).


class PlanGraphError(DtrError):
    """The log's graph cannot be turned into a planning graph."""


@dataclass(frozen=True)
class PlanGraph:
    """The planners' DAG: nodes in a topological order (the log's).

    Attributes:
        graph: the exact graph it was built from.
        cost: per node, the cost of computing it (its operators' sum).
        mem: per node, the bytes it allocates (its storages).
        deps: per node, the nodes it reads (sorted, all earlier).
        pinned: constants: never freed once computed.
        referenced_at_end: nodes holding a tensor of
            :attr:`Graph.referenced_at_end` (resident at the end).
        ops: per node, the exact operators it runs, in order.
        storages: per node, the exact storages it owns.
        reads: per node, the storages (of other nodes) it reads.
        storage_node: the node owning each exact storage.
        storages_referenced_at_end: the storages holding such a tensor.
    """

    graph: Graph
    cost: Tuple[float, ...]
    mem: Tuple[int, ...]
    deps: Tuple[Tuple[int, ...], ...]
    pinned: Tuple[bool, ...]
    referenced_at_end: Tuple[bool, ...]
    ops: Tuple[Tuple[int, ...], ...]
    storages: Tuple[Tuple[int, ...], ...]
    reads: Tuple[Tuple[int, ...], ...]
    storage_node: Tuple[int, ...]
    storages_referenced_at_end: frozenset

    @property
    def n(self) -> int:
        return len(self.cost)

    def users(self) -> List[List[int]]:
        """Per node, the nodes that read it (ascending)."""
        us: List[List[int]] = [[] for _ in range(self.n)]
        for i, ds in enumerate(self.deps):
            for d in ds:
                us[d].append(i)
        return us

    @property
    def pinned_bytes(self) -> int:
        return sum(m for m, p in zip(self.mem, self.pinned) if p)


def plan_graph(g: Graph) -> PlanGraph:
    """Build the planning graph (Note [Collapsing views for planners]).

    Raises:
        PlanGraphError: an operator mixes view and fresh outputs, or views several storages.
    """
    node_of_storage: Dict[int, int] = {}
    cost: List[float] = []
    mem: List[int] = []
    deps: List[set] = []
    reads: List[set] = []
    pinned: List[bool] = []
    ops: List[List[int]] = []
    storages: List[Tuple[int, ...]] = []
    for k in range(g.num_ops):
        outs = g.op_outputs[k]
        views = [g.tensor_view[t] for t in outs]
        in_nodes = {node_of_storage[g.tensor_storage[t]] for t in g.op_inputs[k]}
        if not outs:
            if not in_nodes and not cost:
                raise PlanGraphError(f"{g.name}:{g.op_line[k]}: an operator without inputs or outputs "
                                     f"before any other cannot be planned")
            n = len(cost) - 1  # (at its place in the log's order: Note [Collapsing views for planners])
            ops[n].append(k)
            cost[n] += g.op_cost[k]
            others = in_nodes - {n}
            deps[n].update(others)
            reads[n].update(s for s in (g.tensor_storage[t] for t in g.op_inputs[k]) if node_of_storage[s] != n)
            continue
        if all(views):
            if len(in_nodes) != 1:
                raise PlanGraphError(f"{g.name}:{g.op_line[k]}: a view of several storages cannot be planned")
            (n,) = in_nodes
            ops[n].append(k)
            cost[n] += g.op_cost[k]
            reads[n].update(s for s in (g.tensor_storage[t] for t in g.op_inputs[k]) if node_of_storage[s] != n)
            continue
        if any(views):
            raise PlanGraphError(f"{g.name}:{g.op_line[k]}: an operator with both view and fresh outputs "
                                 f"cannot be planned")
        n = len(cost)
        for s in g.op_fresh[k]:
            node_of_storage[s] = n
        cost.append(g.op_cost[k])
        mem.append(g.op_alloc[k])
        deps.append(in_nodes)
        reads.append({g.tensor_storage[t] for t in g.op_inputs[k]})
        pinned.append(g.op_kind[k] == "constant")
        ops.append([k])
        storages.append(g.op_fresh[k])
    at_end = [False] * len(cost)
    storages_at_end = frozenset(g.tensor_storage[t] for t in g.referenced_at_end)
    for s in storages_at_end:
        at_end[node_of_storage[s]] = True
    return PlanGraph(graph=g, cost=tuple(cost), mem=tuple(mem), deps=tuple(tuple(sorted(d)) for d in deps),
                     pinned=tuple(pinned), referenced_at_end=tuple(at_end), ops=tuple(tuple(o) for o in ops),
                     storages=tuple(storages), reads=tuple(tuple(sorted(r)) for r in reads),
                     storage_node=tuple(node_of_storage[s] for s in range(g.num_storages)),
                     storages_referenced_at_end=storages_at_end)


@dataclass(frozen=True)
class ChainShape:
    """A forward-backward chain found in a planning graph (see :func:`chain_shape`).

    Attributes:
        consts: the pinned nodes (any position).
        fwd: forward nodes F_1..F_n (a_i = F_i(a_{i-1})).
        bwd: backward nodes B_0..B_n (g_k = B_k(a_k, g_{k+1})), indexed by k.
    """

    consts: Tuple[int, ...]
    fwd: Tuple[int, ...]
    bwd: Tuple[int, ...]


def chain_shape(pg: PlanGraph) -> Optional[ChainShape]:
    """Recognize a forward-backward chain (the shape Rotor and Chen's sqrt(n) plan).

    The non-constant nodes, in order, must be F_1..F_n then B_n..B_0, where
    F_i reads at most F_{i-1} (plus constants), B_n reads F_n, B_k reads at
    most F_k and B_{k+1}, and only B_0 (with constants) is referenced at the end. The toy
    chain of :mod:`dtr.sim.chain` has this shape.

    Returns:
        The :class:`ChainShape`, or None when the graph is not such a chain.
    """
    consts = tuple(i for i in range(pg.n) if pg.pinned[i])
    cset = set(consts)
    rest = [i for i in range(pg.n) if not pg.pinned[i]]
    if len(rest) < 3 or len(rest) % 2 == 0:
        return None
    n = (len(rest) - 1) // 2
    fwd, bwd_rev = rest[:n], rest[n:]
    bwd = tuple(reversed(bwd_rev))  # bwd[k] = B_k
    for i, f in enumerate(fwd):
        d = set(pg.deps[f]) - cset
        if d - ({fwd[i - 1]} if i > 0 else set()):
            return None
    for k in range(n + 1):
        d = set(pg.deps[bwd[k]]) - cset
        allowed = ({fwd[k - 1]} if k >= 1 else set()) | ({bwd[k + 1]} if k < n else set())
        if d - allowed:
            return None
    for i in rest:
        if pg.referenced_at_end[i] and i != bwd[0]:
            return None
    return ChainShape(consts=consts, fwd=tuple(fwd), bwd=bwd)

