"""The operator graph of a log, for static schedules and planners.

Two forms:

- :class:`Graph`, the *exact* graph: one operator per constant, call and
  mutate of the log, in the log's order, over tensors and storages exactly as
  the simulator's core builds them (same ids), so that a schedule of the
  simulator's decisions evaluates to the simulator's own figures.
- :class:`PlanGraph`, the *planning* graph the static planners work on: one
  node per storage-owning operator, views folded into the node that owns the
  storage they view (see Note [Collapsing views for planners]).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from dtr.errors import DtrError

__all__ = ["Graph", "PlanGraph", "PlanGraphError", "graph_from_log", "plan_graph", "chain_shape", "ChainShape"]


@dataclass(frozen=True)
class Graph:
    """The exact operator graph of a log (ids as in the simulator's core).

    Operators are numbered in the log's order (constants, calls and mutates
    each make one). Tensors are numbered as the operators create their
    outputs; storages as the operators allocate them (a view output shares
    its input's storage; a mutate allocates a fresh copy of each storage it
    writes, simrd's reference layer).

    Attributes:
        name: where the graph comes from (the log's path).
        cost_unit: unit of the costs.
        op_kind: ``constant``, ``call`` or ``mutate`` per operator.
        op_name: the operator's name (``constant`` for constants).
        op_line: the log line that created it.
        op_cost: its cost.
        op_inputs: input tensor ids.
        op_outputs: output tensor ids.
        op_fresh: storage ids it allocates (its non-view outputs).
        op_alloc: bytes it allocates when it runs (sum of its fresh storages).
        tensor_op: the operator that produces each tensor.
        tensor_storage: the storage each tensor lives in.
        tensor_view: whether the tensor is a view of an input (0 bytes).
        storage_size: bytes per storage.
        storage_op: the operator that allocates each storage.
        storage_pinned: constants: resident from their operator on, never freed.
        storage_tensors: the tensors living in each storage.
        wanted: tensors still referenced at the end of the log (must be
            resident when the schedule ends).
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
    storage_pinned: Tuple[bool, ...]
    storage_tensors: Tuple[Tuple[int, ...], ...]
    wanted: Tuple[int, ...]

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
    """Extract the exact operator graph of a log.

    Args:
        log: a :class:`dtr.sim.logs.Log`, or a path to one.

    Returns:
        The :class:`Graph`, operators in the log's order.

    Raises:
        LogFormatError: ``log`` is a path to a bad log.
    """
    from dtr.sim.logs import Log, read_log
    if not isinstance(log, Log):
        log = read_log(os.fspath(log))
    op_kind: List[str] = []
    op_name: List[str] = []
    op_line: List[int] = []
    op_cost: List[float] = []
    op_inputs: List[Tuple[int, ...]] = []
    op_outputs: List[Tuple[int, ...]] = []
    op_fresh: List[Tuple[int, ...]] = []
    op_alloc: List[int] = []
    tensor_op: List[int] = []
    tensor_storage: List[int] = []
    tensor_view: List[bool] = []
    storage_size: List[int] = []
    storage_op: List[int] = []
    storage_pinned: List[bool] = []
    storage_tensors: List[List[int]] = []
    handle: Dict[str, int] = {}  # live handle -> tensor

    def add_op(kind, name, line, cost, inputs, specs) -> List[int]:
        """specs: per output, ("fresh", size) or ("view", input tensor)."""
        k = len(op_cost)
        outs, fresh, alloc = [], [], 0
        for sp, arg in specs:
            t = len(tensor_op)
            if sp == "fresh":
                s = len(storage_size)
                storage_size.append(int(arg))
                storage_op.append(k)
                storage_pinned.append(kind == "constant")
                storage_tensors.append([])
                fresh.append(s)
                alloc += int(arg)
            else:
                s = tensor_storage[arg]
            tensor_op.append(k)
            tensor_storage.append(s)
            tensor_view.append(sp == "view")
            storage_tensors[s].append(t)
            outs.append(t)
        op_kind.append(kind)
        op_name.append(name)
        op_line.append(line)
        op_cost.append(float(cost))
        op_inputs.append(tuple(inputs))
        op_outputs.append(tuple(outs))
        op_fresh.append(tuple(fresh))
        op_alloc.append(alloc)
        return outs

    for r in log.records():
        if r.kind == "constant":
            (t,) = add_op("constant", "constant", r.line, 0.0, (), [("fresh", r.sizes[0])])
            handle[r.outputs[0]] = t
        elif r.kind == "call":
            ins = [handle[h] for h in r.inputs]
            specs = [("fresh", size) if a is None else ("view", handle[a]) for size, a in zip(r.sizes, r.aliases)]
            outs = add_op("call", r.name or "call", r.line, r.cost, ins, specs)
            for h, t in zip(r.outputs, outs):
                handle[h] = t
        elif r.kind == "mutate":
            ins = [handle[h] for h in r.inputs]
            specs = [("fresh", storage_size[tensor_storage[handle[h]]]) for h in r.mutated]
            outs = add_op("mutate", r.name or "mutate", r.line, r.cost, ins, specs)
            for h, t in zip(r.mutated, outs):
                handle[h] = t
        elif r.kind in ("copy", "copyfrom"):
            handle[r.outputs[0]] = handle[r.inputs[0]]
        elif r.kind == "release":
            handle.pop(r.inputs[0], None)
    wanted = tuple(sorted(set(handle.values())))
    return Graph(
        name=str(log.path), cost_unit=log.cost_unit, op_kind=tuple(op_kind), op_name=tuple(op_name),
        op_line=tuple(op_line), op_cost=tuple(op_cost), op_inputs=tuple(op_inputs), op_outputs=tuple(op_outputs),
        op_fresh=tuple(op_fresh), op_alloc=tuple(op_alloc), tensor_op=tuple(tensor_op),
        tensor_storage=tuple(tensor_storage), tensor_view=tuple(tensor_view), storage_size=tuple(storage_size),
        storage_op=tuple(storage_op), storage_pinned=tuple(storage_pinned),
        storage_tensors=tuple(tuple(x) for x in storage_tensors), wanted=wanted)


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
# ``n/a``; the published logs have neither (tests/test_stress's random logs
# do). A mutate is an ordinary node (it allocates a fresh copy). Every node is computed at least once, in the
# log's order for its first computation (the planners' order).


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
        wanted: nodes holding a wanted output (resident at the end).
        ops: per node, the exact operators it runs, in order.
        storages: per node, the exact storages it owns.
        reads: per node, the storages (of other nodes) it reads.
        storage_node: the node owning each exact storage.
        wanted_storages: the storages holding a wanted output.
    """

    graph: Graph
    cost: Tuple[float, ...]
    mem: Tuple[int, ...]
    deps: Tuple[Tuple[int, ...], ...]
    pinned: Tuple[bool, ...]
    wanted: Tuple[bool, ...]
    ops: Tuple[Tuple[int, ...], ...]
    storages: Tuple[Tuple[int, ...], ...]
    reads: Tuple[Tuple[int, ...], ...]
    storage_node: Tuple[int, ...]
    wanted_storages: frozenset

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
    wanted = [False] * len(cost)
    wanted_storages = frozenset(g.tensor_storage[t] for t in g.wanted)
    for s in wanted_storages:
        wanted[node_of_storage[s]] = True
    return PlanGraph(graph=g, cost=tuple(cost), mem=tuple(mem), deps=tuple(tuple(sorted(d)) for d in deps),
                     pinned=tuple(pinned), wanted=tuple(wanted), ops=tuple(tuple(o) for o in ops),
                     storages=tuple(storages), reads=tuple(tuple(sorted(r)) for r in reads),
                     storage_node=tuple(node_of_storage[s] for s in range(g.num_storages)),
                     wanted_storages=wanted_storages)


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
    most F_k and B_{k+1}, and only B_0 (with constants) is wanted. The toy
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
        if pg.wanted[i] and i != bwd[0]:
            return None
    return ChainShape(consts=consts, fwd=tuple(fwd), bwd=bwd)

