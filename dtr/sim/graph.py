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

__all__ = ["Graph", "GraphError", "PlanGraph", "PlanGraphError", "graph_from_log", "plan_graph", "chain_shape",
           "ChainShape"]


class GraphError(DtrError):
    """A log whose exact graph cannot be built (it uses something the core does not model consistently)."""


@dataclass(frozen=True)
class Graph:
    """The exact operator graph of a log (ids as in the simulator's core).

    Operators are numbered in the log's order (constants, calls and mutates
    each make one). Tensors are numbered as the operators create their
    outputs; storages as the operators allocate them (a view output shares
    its input's storage; a mutate allocates a fresh copy of each storage it
    writes, simrd's reference layer; an in-place write, a ``call`` with
    ``mutated`` or a ``mutate`` with ``inplace``, makes a new version of each
    written storage after the call's own outputs, except of a constant, which
    is written where it is: see Note [The exact graph follows the core]).

    Attributes:
        name: where the graph comes from (the log's path).
        cost_unit: unit of the costs.
        op_kind: ``constant``, ``call`` or ``mutate`` per operator.
        op_name: the operator's name (``constant`` for constants).
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
        storage_pinned: constants: resident from their operator on, never
            recomputed; freed only if the log drops them (not ``wanted``).
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
    op_overwrites: Tuple[Tuple[int, ...], ...]
    op_instr: Tuple[int, ...]

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


# Note [The exact graph follows the core]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The exact graph must number operators, tensors and storages as the core
# does when it replays the log (the export checks it), so graph_from_log
# walks the log as csrc/replay.cpp drives the core:
# - ``constant``, ``call``: one operator; outputs in order, a fresh storage
#   each unless the output views an input.
# - ``mutate`` (simrd's reference layer, Core::mutate): a fresh copy of each
#   written storage; the written handle moves to the copy.
# - an in-place write (a ``call`` with ``mutated``, a ``mutate`` with
#   ``inplace``; Core::call_inplace): after the call's own outputs, one new
#   version per written input, a fresh storage of the written storage's size,
#   which every handle of the old version moves to. A written storage that is
#   *pinned* at that moment (a constant, or a storage pinned by ``pin`` or by
#   protecting a constant) gets no new version: it is written where it is.
#   So the numbering depends on which storages are pinned, and the builder
#   keeps the core's pinned set: constants, ``pin``, and the storages
#   Core::protect pins, which are the referenced storages computed from the
#   protected one through storages that are neither pinned nor freed for
#   good. A pinned storage is protected before it is written in place
#   (repeatedly, as protecting one written input may pin another), on
#   ``protect``, and, under the log's ``free_dead_constants`` semantics (see
#   Log.semantics), when its last handle is released; it is
#   then freed for good (one of no bytes is never protected, and stays).
#   That needs reference counts (live handles per tensor, moved to the new
#   version on an in-place write) and the storage dependency graph. An
#   in-place write whose own output views a storage it overwrites is refused
#   (GraphError): the core would put that view on the old version, which it
#   evicts, and count it resident without its bytes (the runtime never logs
#   one: it logs no views; a hand-written log can log the view as a separate
#   call after the write).
# - ``copy``, ``copyfrom``, ``release``: handles and references only (a
#   release may drop a pinned storage: see above).
# - ``collect`` frees storages that can never be needed again. It does not
#   renumber anything (the replayer never compacts) and cannot change the
#   pinned set that matters: a collected storage is unreferenced for good and
#   no referenced, unpinned storage is computed from it through unpinned
#   ones (it would have been needed), so protecting never reaches through it.
# Everything else the core does (evictions, rematerializations, keep_needed)
# changes no id. Banishing (replay --banish) pins storages on the fly and is
# not modelled: the export never banishes.


class _Builder:
    """Builds a :class:`Graph` by walking a log as the core replays it."""

    def __init__(self, name: str, free_dead_constants: bool) -> None:
        self.name = name
        self.free_dead_constants = free_dead_constants
        self.op_kind: List[str] = []
        self.op_name: List[str] = []
        self.op_line: List[int] = []
        self.op_instr: List[int] = []
        self.instr = -1  # the instruction being applied
        self.op_cost: List[float] = []
        self.op_inputs: List[Tuple[int, ...]] = []
        self.op_outputs: List[Tuple[int, ...]] = []
        self.op_fresh: List[Tuple[int, ...]] = []
        self.op_alloc: List[int] = []
        self.op_overwrites: List[Tuple[int, ...]] = []
        self.tensor_op: List[int] = []
        self.tensor_storage: List[int] = []
        self.tensor_view: List[bool] = []
        self.tensor_refs: List[int] = []
        self.storage_size: List[int] = []
        self.storage_op: List[int] = []
        self.storage_const: List[bool] = []
        self.storage_tensors: List[List[int]] = []
        self.storage_refs: List[int] = []
        self.storage_dependents: List[List[int]] = []
        self.storage_deps: List[set] = []
        self.pinned: List[bool] = []  # the core's pinned set now
        self.gone: List[bool] = []    # freed for good (a dead constant)
        self.handle: Dict[str, int] = {}

    def add_op(self, kind: str, name: str, line: int, cost: float, inputs: List[int],
               specs: List[Tuple[str, int]], overwrites: Tuple[int, ...] = ()) -> List[int]:
        """Add an operator as Core::new_op does.

        Args:
            kind, name, line, cost: the operator's.
            inputs: input tensors.
            specs: per output, ("fresh", size) or ("view", the input tensor it views).
            overwrites: the storages it writes in place (one per new version).

        Returns:
            The output tensors (each with one reference, its handle's).
        """
        k = len(self.op_cost)
        outs: List[int] = []
        fresh: List[int] = []
        alloc = 0
        for sp, arg in specs:
            t = len(self.tensor_op)
            if sp == "fresh":
                s = len(self.storage_size)
                self.storage_size.append(int(arg))
                self.storage_op.append(k)
                self.storage_const.append(kind == "constant")
                self.storage_tensors.append([])
                self.storage_refs.append(0)
                self.storage_deps.append(set())
                self.storage_dependents.append([])
                self.pinned.append(kind == "constant")
                self.gone.append(False)
                fresh.append(s)
                alloc += int(arg)
            else:
                s = self.tensor_storage[arg]
            self.tensor_op.append(k)
            self.tensor_storage.append(s)
            self.tensor_view.append(sp == "view")
            self.tensor_refs.append(1)  # the output's handle
            self.storage_refs[s] += 1
            self.storage_tensors[s].append(t)
            for u in inputs:  # the core's storage-level edges (Core::new_op)
                su = self.tensor_storage[u]
                if su != s and su not in self.storage_deps[s]:
                    self.storage_deps[s].add(su)
                    self.storage_dependents[su].append(s)
            outs.append(t)
        self.op_kind.append(kind)
        self.op_name.append(name)
        self.op_line.append(line)
        self.op_instr.append(self.instr)
        self.op_cost.append(float(cost))
        self.op_inputs.append(tuple(inputs))
        self.op_outputs.append(tuple(outs))
        self.op_fresh.append(tuple(fresh))
        self.op_alloc.append(alloc)
        self.op_overwrites.append(tuple(overwrites))
        return outs

    def protect(self, s: int) -> None:
        """Core::protect: pin the referenced storages computed from ``s``."""
        if self.storage_size[s] == 0:
            return
        seen = set()
        stack = list(self.storage_dependents[s])
        targets = []
        while stack:
            d = stack.pop()
            if d in seen or self.pinned[d] or self.gone[d]:
                continue
            seen.add(d)
            if self.storage_refs[d] > 0:
                targets.append(d)
            stack.extend(self.storage_dependents[d])
        for d in targets:
            self.pinned[d] = True

    def release(self, t: int) -> None:
        """Core::release of one reference (a handle dies)."""
        self.tensor_refs[t] -= 1
        s = self.tensor_storage[t]
        self.storage_refs[s] -= 1
        if self.storage_refs[s] == 0 and self.pinned[s] and self.free_dead_constants and self.storage_size[s] > 0:
            self.protect(s)
            self.pinned[s] = False
            self.gone[s] = True

    def write_inplace(self, kind: str, r, outputs: List[Tuple[str, int]]) -> None:
        """Core::call_inplace: the call's outputs, then a new version per written unpinned input.

        Args:
            kind: ``call`` or ``mutate``.
            r: the log record (its ``mutated`` are the written inputs).
            outputs: the specs of the call's own outputs (see :meth:`add_op`).

        Raises:
            GraphError: an output views a storage the call overwrites.
        """
        ins = [self.handle[h] for h in r.inputs]
        written = [ins[r.inputs.index(h)] for h in r.mutated]
        done = [False] * len(written)
        again = True
        while again:  # protecting a written constant may pin another written input
            again = False
            for k, t in enumerate(written):
                s = self.tensor_storage[t]
                if self.pinned[s] and not done[k]:
                    self.protect(s)
                    done[k] = True
                    again = True
        specs = list(outputs)
        versions: List[int] = []  # per written input: the index of its new version, or -1
        overwrites: List[int] = []
        for t in written:
            s = self.tensor_storage[t]
            if self.pinned[s]:
                versions.append(-1)
                continue
            versions.append(len(specs))
            specs.append(("fresh", self.storage_size[s]))
            overwrites.append(s)
        for h, a, (sp, t) in zip(r.outputs, r.aliases, outputs):
            if sp == "view" and self.tensor_storage[t] in overwrites:
                raise GraphError(f"{self.name}:{r.line}: output {h!r} views {a!r}, whose storage this call "
                                 f"overwrites in place: not supported (log the view as a separate call after "
                                 f"the write)")
        outs = self.add_op(kind, r.name or kind, r.line, r.cost, ins, specs, tuple(overwrites))
        for h, t in zip(r.outputs, outs):
            self.handle[h] = t
        for old, v in zip(written, versions):
            if v < 0:
                continue
            new = outs[v]
            moved = self.tensor_refs[old]  # the old version's references move to the new one
            self.storage_refs[self.tensor_storage[new]] += moved - self.tensor_refs[new]
            self.tensor_refs[new] = moved
            self.storage_refs[self.tensor_storage[old]] -= moved
            self.tensor_refs[old] = 0
            for h, x in self.handle.items():
                if x == old:
                    self.handle[h] = new

    def record(self, r) -> None:
        """Apply one log instruction."""
        if r.kind == "constant":
            (t,) = self.add_op("constant", "constant", r.line, 0.0, [], [("fresh", r.sizes[0])])
            self.handle[r.outputs[0]] = t
        elif r.kind == "call":
            specs = [("fresh", size) if a is None else ("view", self.handle[a])
                     for size, a in zip(r.sizes, r.aliases)]
            if r.inplace:
                self.write_inplace("call", r, specs)
                return
            ins = [self.handle[h] for h in r.inputs]
            outs = self.add_op("call", r.name or "call", r.line, r.cost, ins, specs)
            for h, t in zip(r.outputs, outs):
                self.handle[h] = t
        elif r.kind == "mutate":
            if r.inplace:
                self.write_inplace("mutate", r, [])
                return
            ins = [self.handle[h] for h in r.inputs]
            old = [self.handle[h] for h in r.mutated]
            specs = [("fresh", self.storage_size[self.tensor_storage[t]]) for t in old]
            outs = self.add_op("mutate", r.name or "mutate", r.line, r.cost, ins, specs)
            for t in old:
                self.release(t)
            for h, t in zip(r.mutated, outs):
                self.handle[h] = t
        elif r.kind == "copy":
            t = self.handle[r.inputs[0]]
            self.tensor_refs[t] += 1
            self.storage_refs[self.tensor_storage[t]] += 1
            self.handle[r.outputs[0]] = t
        elif r.kind == "copyfrom":
            t, old = self.handle[r.inputs[0]], self.handle[r.outputs[0]]
            self.tensor_refs[t] += 1
            self.storage_refs[self.tensor_storage[t]] += 1
            self.release(old)
            self.handle[r.outputs[0]] = t
        elif r.kind == "release":
            self.release(self.handle.pop(r.inputs[0]))
        elif r.kind == "pin":
            self.pinned[self.tensor_storage[self.handle[r.inputs[0]]]] = True
        elif r.kind == "protect":
            self.protect(self.tensor_storage[self.handle[r.inputs[0]]])
        # "collect" changes no id and no pinned storage that matters (see the Note).

    def graph(self, name: str, cost_unit: str) -> Graph:
        """The graph built so far; handles still live are the wanted outputs."""
        wanted = tuple(sorted(set(self.handle.values())))
        return Graph(
            name=name, cost_unit=cost_unit, op_kind=tuple(self.op_kind), op_name=tuple(self.op_name),
            op_line=tuple(self.op_line), op_cost=tuple(self.op_cost), op_inputs=tuple(self.op_inputs),
            op_outputs=tuple(self.op_outputs), op_fresh=tuple(self.op_fresh), op_alloc=tuple(self.op_alloc),
            tensor_op=tuple(self.tensor_op), tensor_storage=tuple(self.tensor_storage),
            tensor_view=tuple(self.tensor_view), storage_size=tuple(self.storage_size),
            storage_op=tuple(self.storage_op), storage_pinned=tuple(self.storage_const),
            storage_tensors=tuple(tuple(x) for x in self.storage_tensors), wanted=wanted,
            op_overwrites=tuple(self.op_overwrites), op_instr=tuple(self.op_instr))


def graph_from_log(log) -> Graph:
    """Extract the exact operator graph of a log.

    The ids are those the core gives when it replays the log under the log's
    own semantics (Note [The exact graph follows the core]).

    Args:
        log: a :class:`dtr.sim.logs.Log`, or a path to one.

    Returns:
        The :class:`Graph`, operators in the log's order.

    Raises:
        LogFormatError: ``log`` is a path to a bad log.
        GraphError: an in-place write's output views a storage it overwrites
            (Note [The exact graph follows the core]).
    """
    from dtr.sim.logs import Log, read_log
    if not isinstance(log, Log):
        log = read_log(os.fspath(log))
    b = _Builder(str(log.path), free_dead_constants=log.semantics.free_dead_constants)
    for b.instr, r in enumerate(log.records()):
        b.record(r)
    return b.graph(str(log.path), log.cost_unit)


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
# do). An operator without outputs (an in-place write of a constant such as
# a step counter's ``add_``, or a view nobody keeps) allocates nothing and is
# folded into the latest node it reads, reading the others' storages as that
# node's inputs; one that reads nothing folds into the node before it. A
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
        if not outs:
            if not in_nodes and not cost:
                raise PlanGraphError(f"{g.name}:{g.op_line[k]}: an operator without inputs or outputs "
                                     f"before any other cannot be planned")
            n = max(in_nodes) if in_nodes else len(cost) - 1
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

