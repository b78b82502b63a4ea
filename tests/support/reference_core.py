"""An independent, pure-Python reference of the DTR simulator core.

This is written from the specification of simrd's eager-eviction runtime (not
from the C++ sources), and is meant to be slow and obvious: the differential
test (tests/core/test_differential.py) drives it and the C++ core ``dtr._C`` with
the same operation sequences and compares every decision and counter.

Ids of tensors, storages and ops are handed out sequentially from 0 in
creation order, like the core's. Eviction and rematerialization decisions are
recorded in :attr:`RefCore.evicted` (storage ids) and :attr:`RefCore.remat_ops`
(op ids).
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

__all__ = ["RefCore", "RefOutOfBudget", "RefThrashing", "HEURISTICS"]

# name -> (cost term, use_size, use_staleness)
HEURISTICS = {
    "dtr": ("full", True, True),
    "eqclass": ("eqclass", True, True),
    "eqclass-split": ("eqclass-split", True, True),  # exact components, by brute force
    "local": ("local", True, True),
    "lru": ("none", False, True),
    "largest": ("none", True, False),
}


class RefOutOfBudget(Exception):
    def __init__(self, needed: int, budget: int):
        super().__init__(f"out of budget: needed {needed}, budget {budget}")
        self.needed, self.budget = needed, budget


class RefThrashing(Exception):
    def __init__(self, remat_compute: float, limit: float):
        super().__init__(f"thrashing: {remat_compute} > {limit}")
        self.remat_compute, self.limit = remat_compute, limit


class _Op:
    __slots__ = ("cost", "inputs", "outputs", "sizes", "total_size")

    def __init__(self, cost: float, inputs: List[int]):
        self.cost, self.inputs = cost, inputs
        self.outputs: List[int] = []
        self.sizes: List[int] = []  # per output; alias outputs count 0
        self.total_size = 0


class _Tensor:
    __slots__ = ("storage", "op", "index", "is_alias", "defined", "refs")

    def __init__(self, storage: int, op: int, index: int, is_alias: bool):
        self.storage, self.op, self.index, self.is_alias = storage, op, index, is_alias
        self.defined = False
        self.refs = 0


class _Node:
    """A union-find node of the eqclass heuristic (value meaningful at roots)."""
    __slots__ = ("parent", "value")

    def __init__(self, value: float):
        self.parent: Optional[_Node] = None
        self.value = value

    def root(self) -> "_Node":
        r = self
        while r.parent is not None:
            r = r.parent
        x = self
        while x is not r:  # path compression
            nxt = x.parent
            x.parent = r
            x = nxt
        return r


class _Storage:
    __slots__ = ("size", "tensors", "ops", "cost", "deps", "dependents", "locks", "refs",
                 "resident", "pinned", "last_access", "node", "computed")

    def __init__(self, size: int):
        self.size = size
        self.tensors: List[int] = []
        self.ops: List[int] = []  # distinct ops of its tensors
        self.cost = 0.0
        self.deps: List[int] = []
        self.dependents: List[int] = []
        self.locks = 0
        self.refs = 0
        self.resident = False
        self.pinned = False
        self.last_access = -math.inf
        self.node: Optional[_Node] = None
        self.computed = False  # has been resident at least once


class RefCore:
    """Reference DTR core. ``budget`` None means unlimited."""

    def __init__(self, heuristic: str, budget: Optional[int] = None, remat_limit: float = math.inf,
                 pending_evicted: bool = True):
        self.pending_evicted = pending_evicted
        self.cost_mode, self.use_size, self.use_staleness = HEURISTICS[heuristic]
        self.budget = budget
        self.remat_limit = remat_limit
        self.tensors: List[_Tensor] = []
        self.storages: List[_Storage] = []
        self.ops: List[_Op] = []
        self.pool: dict = {}  # storage id -> insertion sequence number
        self._seq = 0
        self.clock = 0.0
        self.counters = dict(base_compute=0.0, remat_compute=0.0, evictions=0, eager_evictions=0,
                             remats=0, memory=0, peak_memory=0, heuristic_evals=0,
                             largest_op_bytes=0, constant_bytes=0, banishments=0)
        self.evicted: List[int] = []    # storage ids, in eviction order
        self.remat_ops: List[int] = []  # op ids, in rematerialization order

    # ------------------------------------------------------------------ API
    def constant(self, size: int) -> int:
        (t,) = self.call([], [size], [-1], 0.0)
        s = self.storages[self.tensors[t].storage]
        self._lock(self.tensors[t].storage)
        s.pinned = True
        self.counters["constant_bytes"] += size
        return t

    def call(self, inputs: Sequence[int], sizes: Sequence[int], alias_of: Sequence[int], cost: float) -> List[int]:
        assert len(sizes) == len(alias_of) and len(sizes) >= 1
        op_id = len(self.ops)
        op = _Op(float(cost), list(inputs))
        self.ops.append(op)
        for i, (size, a) in enumerate(zip(sizes, alias_of)):
            t_id = len(self.tensors)
            if a < 0:
                s_id = len(self.storages)
                self.storages.append(_Storage(size))
                op.sizes.append(size)
            else:
                s_id = self.tensors[inputs[a]].storage
                op.sizes.append(0)
            t = _Tensor(s_id, op_id, i, a >= 0)
            self.tensors.append(t)
            op.outputs.append(t_id)
            s = self.storages[s_id]
            s.tensors.append(t_id)
            if op_id not in s.ops:
                s.ops.append(op_id)
                s.cost += op.cost
            for p in inputs:
                d = self.tensors[p].storage
                if d != s_id and d not in s.deps:
                    s.deps.append(d)
                    self.storages[d].dependents.append(s_id)
            t.refs = 1
            s.refs += 1
        op.total_size = sum(op.sizes)
        self._materialize(op.outputs[0], remat=False)
        for u in op.outputs:
            self.storages[self.tensors[u].storage].last_access = self.clock
        return list(op.outputs)

    def mutate(self, inputs: Sequence[int], mutated: Sequence[int], cost: float) -> List[int]:
        sizes = [self.storages[self.tensors[inputs[j]].storage].size for j in mutated]
        outs = self.call(inputs, sizes, [-1] * len(mutated), cost)
        for j in mutated:
            self.release(inputs[j])
        return outs

    def retain(self, t: int) -> None:
        self.tensors[t].refs += 1
        self.storages[self.tensors[t].storage].refs += 1

    def release(self, t: int) -> None:
        tt = self.tensors[t]
        s = self.storages[tt.storage]
        assert tt.refs > 0, "release of a tensor with no references"
        tt.refs -= 1
        s.refs -= 1
        if s.refs == 0 and s.resident and not s.pinned and s.locks == 0:
            self._evict(tt.storage, by_heuristic=False)

    def require(self, t: int) -> None:
        if not self.tensors[t].defined:
            self._materialize(t, remat=True)

    def pin(self, t: int) -> None:
        self.require(t)
        s_id = self.tensors[t].storage
        if not self.storages[s_id].pinned:
            self._lock(s_id)
            self.storages[s_id].pinned = True

    def check(self) -> None:
        """The reference's own invariants (between ops)."""
        resident = [s for s in self.storages if s.resident]
        assert self.counters["memory"] == sum(s.size for s in resident), "memory != resident bytes"
        pool = {i for i, s in enumerate(self.storages) if s.resident and not s.pinned and s.locks == 0}
        assert set(self.pool) == pool, "pool != resident, unlocked, unpinned storages"
        for i, s in enumerate(self.storages):
            assert s.locks == (1 if s.pinned else 0), f"storage {i}: locks held between ops"
            assert s.refs == sum(self.tensors[t].refs for t in s.tensors)
            assert (s.node is not None) == (self.cost_mode.startswith("eqclass") and s.computed and not s.resident)
            if s.resident:
                assert not self.tensors[s.tensors[0]].is_alias and self.tensors[s.tensors[0]].defined
            else:
                assert not any(self.tensors[t].defined for t in s.tensors)

    # ------------------------------------------------------------ internals
    def _pool_add(self, s_id: int) -> None:
        s = self.storages[s_id]
        if s.resident and not s.pinned and s.locks == 0:
            self.pool[s_id] = self._seq
            self._seq += 1

    def _lock(self, s_id: int) -> None:
        s = self.storages[s_id]
        if s.locks == 0:
            self.pool.pop(s_id, None)
        s.locks += 1

    def _unlock(self, s_id: int) -> None:
        s = self.storages[s_id]
        assert s.locks > 0
        s.locks -= 1
        if s.locks == 0:
            self._pool_add(s_id)

    def _materialize(self, t: int, remat: bool) -> None:
        op = self.ops[self.tensors[t].op]
        for p in op.inputs:
            self.storages[self.tensors[p].storage].last_access = self.clock
        for p in op.inputs:
            if self.tensors[p].defined:
                self._lock(self.tensors[p].storage)
        pending = [p for p in op.inputs if not self.tensors[p].defined]
        for p in pending:
            if not self.tensors[p].defined:
                self._materialize(p, remat=True)
            self._lock(self.tensors[p].storage)
        self._make_room(op.total_size)
        self._compute(t, remat)
        for p in op.inputs:
            self._unlock(self.tensors[p].storage)
        if self.counters["remat_compute"] > self.remat_limit:
            raise RefThrashing(self.counters["remat_compute"], self.remat_limit)

    def _compute(self, t: int, remat: bool) -> None:
        c = self.counters
        op_id = self.tensors[t].op
        op = self.ops[op_id]
        if remat:
            self.remat_ops.append(op_id)
        self.clock += op.cost
        if remat:
            c["remat_compute"] += op.cost
            c["remats"] += 1
        else:
            c["base_compute"] += op.cost
        c["memory"] += op.total_size
        c["peak_memory"] = max(c["peak_memory"], c["memory"])
        in_bytes = sum(self.ops[self.tensors[p].op].sizes[self.tensors[p].index] for p in op.inputs)
        c["largest_op_bytes"] = max(c["largest_op_bytes"], op.total_size + in_bytes)
        fresh: List[int] = []
        for u in op.outputs:
            tu = self.tensors[u]
            if tu.defined:
                c["memory"] -= op.sizes[tu.index]  # a duplicate: freed at once
            s = self.storages[tu.storage]
            if not s.resident:
                s.resident = s.computed = True
                fresh.append(tu.storage)
            tu.defined = True
        for s_id in fresh:
            s = self.storages[s_id]
            if s.node is not None:
                s.node.root().value -= s.cost
                s.node = None
            self._pool_add(s_id)

    def _make_room(self, n: int) -> None:
        if self.budget is None:
            return
        while self.counters["memory"] + n > self.budget:
            if not self.pool:
                raise RefOutOfBudget(self.counters["memory"] + n, self.budget)
            self._evict(self._choose(), by_heuristic=True)

    def _evict(self, s_id: int, by_heuristic: bool) -> None:
        s = self.storages[s_id]
        assert s.resident and not s.pinned and s.locks == 0
        s.resident = False
        self.counters["memory"] -= s.size
        self.pool.pop(s_id, None)
        for t in s.tensors:
            self.tensors[t].defined = False
        self.counters["evictions" if by_heuristic else "eager_evictions"] += 1
        self.evicted.append(s_id)
        if self.cost_mode.startswith("eqclass"):  # (eqclass-split only reads whether there is a node)
            s.node = _Node(s.cost)
            for n_id in s.deps + s.dependents:
                n = self.storages[n_id]
                if not n.resident and n.node is not None:
                    a, b = n.node.root(), s.node.root()
                    if a is not b:
                        b.parent = a
                        a.value += b.value

    # ----------------------------------------------------------- heuristics
    def eqclass_cost(self, s_id: int) -> float:
        s = self.storages[s_id]
        roots = []
        for n_id in s.deps + s.dependents:
            n = self.storages[n_id]
            if not n.resident and n.node is not None:
                r = n.node.root()
                if not any(r is q for q in roots):
                    roots.append(r)
        return sum(r.value for r in roots)

    def split_cost(self, s_id: int) -> float:
        """Exact eqclass: the costs of the storages with a node joined to S through storages with a node."""
        seen: set = set()
        stack = [s_id]
        while stack:
            x = self.storages[stack.pop()]
            for y in x.deps + x.dependents:
                if y not in seen and y != s_id and self.storages[y].node is not None:
                    seen.add(y)
                    stack.append(y)
        return sum(self.storages[y].cost for y in sorted(seen))

    def _evicted(self, s_id: int) -> bool:
        s = self.storages[s_id]
        return not s.resident and (s.computed or self.pending_evicted)

    def evicted_neighbourhood(self, s_id: int) -> set:
        """e*(S): evicted storages reachable through evicted deps, union through evicted dependents.

        The outputs of the call in progress (created, never yet computed) are
        not evicted, unless ``pending_evicted`` (simrd's ``not material``).
        """
        result: set = set()
        for attr in ("deps", "dependents"):
            seen: set = set()
            stack = [s_id]
            while stack:
                x = stack.pop()
                for y in getattr(self.storages[x], attr):
                    if y not in seen and self._evicted(y):
                        seen.add(y)
                        stack.append(y)
            result |= seen
        return result

    def full_cost(self, s_id: int) -> float:
        return sum(self.storages[x].cost for x in sorted(self.evicted_neighbourhood(s_id)))

    def score(self, s_id: int) -> float:
        s = self.storages[s_id]
        if self.cost_mode == "none":
            c = 1.0
        elif self.cost_mode == "local":
            c = s.cost
        elif self.cost_mode == "eqclass":
            c = s.cost + self.eqclass_cost(s_id)
        elif self.cost_mode == "eqclass-split":
            c = s.cost + self.split_cost(s_id)
        else:
            c = s.cost + self.full_cost(s_id)
        d = 1.0
        if self.use_size:
            d *= s.size
        if self.use_staleness:
            d *= self.clock - s.last_access
        if d <= 0:
            return math.inf
        return c / d

    def _choose(self) -> int:
        zero = None   # (seq, id) of the earliest-inserted zero score
        best = None   # (score, seq, id)
        for s_id, seq in self.pool.items():
            self.counters["heuristic_evals"] += 1
            sc = self.score(s_id)
            if sc == 0:
                if zero is None or seq < zero[0]:
                    zero = (seq, s_id)
            elif best is None or sc < best[0] or (sc == best[0] and seq > best[1]):
                best = (sc, seq, s_id)
        return zero[1] if zero is not None else best[2]
