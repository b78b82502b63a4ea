"""The Python facade over the C++ core ``dtr._C``: the only module that imports it.

Both drivers go through here: the simulator (:mod:`dtr.sim`) replays parsed
logs, and the runtime (:mod:`dtr.runtime`) drives a :class:`Core` op by op.
Errors from the core arrive as dtr's own exceptions.
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import Callable, List, Literal, Optional, Sequence, Tuple

from dtr import _C
from dtr.budget_report import BudgetReport, HeldStorage
from dtr.errors import BudgetError, OutOfBudgetError, ThrashingError
from dtr.heuristics import Heuristic, get_heuristic
from dtr.semantics import SIMRD, Semantics, check_thrash_limit

__all__ = ["Core", "Program", "FollowPlan", "make_config", "parse_program", "replay_program", "replay_graph",
           "RawLogError", "InstrKind", "TraceEvent", "ReplayStatus", "Hold"]

Program = _C.Program
#: A plan the core can follow: ``FollowPlan(fingerprints, starts, steps)`` (Note [Following a plan] in
#: csrc/core_follow.cpp; :mod:`dtr.sim.step_plan` makes them).
FollowPlan = _C.FollowPlan
RawLogError = _C.LogError

#: An instruction's kind, the int ``kind`` of ``Program.records()`` (an ``IntEnum``;
#: a :class:`dtr.sim.logs.Record`'s kind is its name in lower case).
InstrKind = _C.InstrKind
#: The kind of an entry ``(kind, id)`` of a replay's trace (an ``IntEnum``).
TraceEvent = _C.TraceEvent
#: How a replay ended: a str enum, equal to the ``status`` string of its result.
ReplayStatus = _C.ReplayStatus
#: Why a resident storage could not be evicted (an ``IntEnum``; its first six values are pin reasons,
#: for :meth:`Core.pin`). A :class:`~dtr.budget_report.HeldStorage`'s reason is its name in lower case.
Hold = _C.Hold

_MAX_INT64 = 2**63 - 1
_MAX_INT32 = 2**31 - 1


def make_config(heuristic: Heuristic | str = "eqclass", budget: Optional[int] = None, *,
                semantics: Semantics = SIMRD, banish: bool = False, seed: int = 0, sample: int = 0,
                thrash_limit: float = math.inf, remat_limit: float = math.inf) -> "_C.Config":
    """Build the core's configuration.

    Args:
        heuristic: a :class:`Heuristic` or a registered name.
        budget: bytes, or None for no limit.
        banish: banish storages on their last release (simrd 4.5) instead of
            evicting them eagerly.
        seed: seed of the ``random`` heuristic and of sampling.
        sample: score only this many random pool members per eviction (0: all).
        thrash_limit: stop once recomputation passes what this thrash limit
            allows (Note [The thrash limit] in dtr.semantics) over the core's own
            first computations so far: a number >= 1, or infinity for none.
        remat_limit: stop once recomputation compute passes this, whatever the
            thrash limit (a fixed cap: tests compare the core with a reference).
        semantics: the rules that differ between the runtime and simrd
            (:class:`dtr.semantics.Semantics`; simrd's by default). A heuristic
            whose ``split`` is set splits eqclass components whatever
            ``semantics.eqclass_split`` says.

    Raises:
        ValueError: unknown heuristic name, or a seed or sample out of range.
        TypeError: ``semantics`` is not a :class:`Semantics`.
        BudgetError: a budget past 2^63 - 1 bytes.
    """
    h = get_heuristic(heuristic) if isinstance(heuristic, str) else heuristic
    if budget is not None and int(budget) > _MAX_INT64:
        raise BudgetError(f"budget {budget} bytes is more than the core can hold ({_MAX_INT64} bytes)")
    for name, value, top in (("seed", seed, 2**64 - 1), ("sample", sample, _MAX_INT32)):  # uint64_t and int
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value <= top:
            raise ValueError(f"{name} must be a whole number from 0 to {top} (got {value!r})")
    cfg = _C.Config()
    cfg.budget = -1 if budget is None else int(budget)
    cfg.cost = h.cost
    cfg.use_size = h.use_size
    cfg.use_staleness = h.use_staleness
    cfg.random = h.random
    cfg.banish = banish
    cfg.seed = int(seed)
    cfg.sample = int(sample)
    cfg.thrash_limit = check_thrash_limit(thrash_limit)
    cfg.remat_limit = remat_limit
    if not isinstance(semantics, Semantics):
        raise TypeError(f"semantics must be a dtr.semantics.Semantics, not {semantics!r}")
    cfg.semantics = _C.Semantics(**semantics.replace(eqclass_split=semantics.eqclass_split or h.split).to_meta())
    return cfg


class _Translated:
    """``with _TRANSLATED:`` turns the core's exceptions into dtr's public ones.

    A plain class rather than ``@contextmanager``: the runtime enters it twice
    per dispatched op, and a generator-based manager costs several times more.
    """

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ, e, tb) -> Literal[False]:  # it never swallows an exception
        if typ is None:
            return False
        if issubclass(typ, _C.OutOfMemory):
            needed, budget, _, request, op, remat_op, evictable, held = e.args
            report = BudgetReport(budget, needed, request, evictable,
                                  tuple(HeldStorage(size, _HOLD_NAMES[why], referenced, s)
                                        for s, size, why, referenced in held), op_id=op, remat_op_id=remat_op)
            raise OutOfBudgetError(budget, needed, report=report) from None
        if issubclass(typ, _C.Thrashing):
            rc, limit, _, remats, count_limit = e.args
            raise ThrashingError(rc, limit, remats=remats, count_limit=count_limit) from None
        return False


_HOLD_NAMES = {int(h): h.name.lower() for h in _C.Hold}


_TRANSLATED = _Translated()


def _core_property(name: str, doc: str) -> property:
    """A read-only property of :class:`Core` that reads ``name`` of the wrapped ``_C.Core``."""
    # attrgetter rather than a lambda: no Python frame per read (the runtime reads some for every op).
    return property(operator.attrgetter("_core." + name), doc=doc)


class Core:
    """One DTR core instance: the graph of storages, tensors and ops, and the heuristic.

    All ids are ints handed out by the core. Every method that may compute
    (``constant``, ``call``, ``mutate``, ``require``, ``pin``) may evict, and
    raises :class:`OutOfBudgetError` or :class:`ThrashingError`.

    The queries (``storage_of``, ``resident``, ...) and the methods that never
    compute (``lock``, ``unlock``, ``forget``) are the
    wrapped ``_C.Core``'s own bound methods, set on each instance (the runtime
    calls some for every op: no Python frame in between). Nothing else is
    forwarded: another name raises AttributeError.

    Args:
        heuristic: a :class:`Heuristic` or registered name.
        budget: bytes, or None for no limit.
        **options: see :func:`make_config`.
    """

    # The wrapped core and, documented here, the names bound from it in __init__ (in _BOUND).
    # t: a tensor id, s: a storage id, op: an op id. Collected ids (see collect) must not be asked about.
    __slots__ = {
        "_core": "The wrapped dtr._C.Core.",
        # tensors
        "storage_of": "storage_of(t): the storage tensor t views.",
        "op_of": "op_of(t): the op that computes tensor t.",
        "tensor_index": "tensor_index(t): t's position among its op's outputs.",
        "is_alias": "is_alias(t): whether t views an input's storage (a view: it adds no bytes).",
        "defined": "defined(t): whether t's value is there (its storage is resident and t computed).",
        "refs": "refs(t): the driver's references to t.",
        # storages
        "resident": "resident(s): whether storage s holds its bytes.",
        "pinned": "pinned(s): whether s is a constant (never evicted).",
        "banished": "banished(s): whether s is never resident again (a recomputation frees it at once).",
        "handed": "handed(s): whether s's bytes go to the in-place write being recomputed now.",
        "collected": "collected(s): whether collect() found that s can never be needed again.",
        "locks": "locks(s): the locks on s (an op in progress reads it; pinned: one lock for good).",
        "storage_refs": "storage_refs(s): the references to s's tensors.",
        "storage_size": "storage_size(s): s's bytes.",
        "storage_cost": "storage_cost(s): the cost of the ops that compute s's tensors.",
        "storage_root": "storage_root(s): the tensor whose op allocates s.",
        "storage_tensors": "storage_tensors(s): the tensors that view s.",
        "storage_deps": "storage_deps(s): the storages that s's tensors are computed from.",
        "storage_dependents": "storage_dependents(s): the storages computed from s's tensors.",
        "neighbourhood_cost": "neighbourhood_cost(s): the evicted-neighbourhood term of s's score "
                              "under the heuristic's cost mode (0 for local and none).",
        # ops
        "op_inputs": "op_inputs(op): op's input tensors (-1: dropped by compact, for a collected op).",
        "op_outputs": "op_outputs(op): op's output tensors.",
        "op_sizes": "op_sizes(op): the bytes op allocates per output (0 for a view).",
        "op_cost": "op_cost(op): op's cost.",
        "op_collected": "op_collected(op): whether op can never run again (collect()).",
        # never compute
        "lock": "lock(s): keep resident storage s from eviction until unlock(s).",
        "unlock": "unlock(s): give back one lock on s.",
        "forget": "forget(s): the driver lost the memory of s (unreferenced, unlocked): mark it evicted.",
        "set_remat_limit": "set_remat_limit(limit): raise ThrashingError once recomputation compute passes limit.",
    }
    storage_of: Callable[[int], int]
    op_of: Callable[[int], int]
    tensor_index: Callable[[int], int]
    is_alias: Callable[[int], bool]
    defined: Callable[[int], bool]
    refs: Callable[[int], int]
    resident: Callable[[int], bool]
    pinned: Callable[[int], bool]
    banished: Callable[[int], bool]
    handed: Callable[[int], bool]
    collected: Callable[[int], bool]
    locks: Callable[[int], int]
    storage_refs: Callable[[int], int]
    storage_size: Callable[[int], int]
    storage_cost: Callable[[int], float]
    storage_root: Callable[[int], int]
    storage_tensors: Callable[[int], List[int]]
    storage_deps: Callable[[int], List[int]]
    storage_dependents: Callable[[int], List[int]]
    neighbourhood_cost: Callable[[int], float]
    op_inputs: Callable[[int], List[int]]
    op_outputs: Callable[[int], List[int]]
    op_sizes: Callable[[int], List[int]]
    op_cost: Callable[[int], float]
    op_collected: Callable[[int], bool]
    lock: Callable[[int], None]
    unlock: Callable[[int], None]
    forget: Callable[[int], None]
    set_remat_limit: Callable[[float], None]

    def __init__(self, heuristic: Heuristic | str = "eqclass", budget: Optional[int] = None, **options):
        core = self._core = _C.Core(make_config(heuristic, budget, **options))
        for name in _BOUND:
            setattr(self, name, getattr(core, name))

    def constant(self, size: int) -> int:
        """Add a pinned, never-evicted tensor of ``size`` bytes; returns its id."""
        with _TRANSLATED:
            return self._core.constant(size)

    def call(self, inputs: Sequence[int], sizes: Sequence[int], alias_of: Sequence[int], cost: float) -> List[int]:
        """Compute ``outputs = op(inputs)``; ``alias_of[i]`` is the input index output i views, or -1."""
        with _TRANSLATED:
            return self._core.call(list(inputs), list(sizes), list(alias_of), float(cost))

    def mutate(self, inputs: Sequence[int], mutated: Sequence[int], cost: float) -> List[int]:
        """In-place op on ``inputs[j]`` for j in ``mutated``; returns the new tensors."""
        with _TRANSLATED:
            return self._core.mutate(list(inputs), list(mutated), float(cost))

    def mutate_inplace(self, inputs: Sequence[int], mutated: Sequence[int], cost: float) -> List[int]:
        """True in-place op on ``inputs[j]`` for j in ``mutated``: new versions take over the buffers.

        Returns the new versions (-1 for a constant, which keeps its tensor).
        """
        with _TRANSLATED:
            return self._core.mutate_inplace(list(inputs), list(mutated), float(cost))

    def require(self, t: int) -> None:
        """Rematerialize tensor ``t`` if it is evicted."""
        with _TRANSLATED:
            self._core.require(t)

    def pin(self, t: int, why: int = _C.Hold.PINNED) -> None:
        """Rematerialize ``t`` if needed and never evict its storage again.

        Args:
            why: a :data:`Hold` pin reason (what an out-of-budget report says of it).
        """
        with _TRANSLATED:
            self._core.pin(t, int(why))

    def pin_many(self, ts: Sequence[int], why: int = _C.Hold.PINNED) -> None:
        """:meth:`pin` each of ``ts`` in order, as one materialization: what several of them need is
        recomputed once (Note [Planned recomputation] in csrc/core_materialize.cpp); up to the first that fails."""
        with _TRANSLATED:
            self._core.pin_many(list(ts), int(why))

    def pin_reason(self, s: int) -> "_C.Hold":
        """Why pinned storage ``s`` is pinned (a :data:`Hold` pin reason)."""
        return _C.Hold(self._core.pin_reason(s))

    def set_thrash_limit(self, limit: float) -> None:
        """Stop once recomputation passes what thrash limit ``limit`` allows over the core's own first
        computations so far (``math.inf``: never).

        Raises:
            ValueError: not a number >= 1 or infinity.
        """
        self._core.set_thrash_limit(check_thrash_limit(limit))

    @property
    def thrash_limit(self) -> float:
        """The thrash limit (``math.inf``: none)."""
        return self._core.thrash_limit

    def restart_peak(self) -> int:
        """Start the peak again from the memory now; returns the peak until now (a nested block's own peak)."""
        return self._core.restart_peak()

    def fit_budget(self) -> None:
        """Evict until the memory is within the budget (after :meth:`set_budget` lowered it).

        Raises:
            OutOfBudgetError: what cannot be evicted is more than the budget.
        """
        with _TRANSLATED:
            self._core.fit_budget()

    def raise_peak(self, peak: int) -> None:
        """Raise the peak to at least ``peak`` (a nested block gives back the outer peak)."""
        self._core.raise_peak(int(peak))

    def begin_call(self, inputs: Sequence[int], sizes: Sequence[int], alias_of: Sequence[int],
                   inplace_of: Sequence[int], cost: float) -> int:
        """Two-phase call, part one: create the op, bring its inputs back, lock them, make room.

        ``inplace_of[i] >= 0`` marks output i as a new version of that input
        (written in place). Returns the op id; follow with :meth:`end_call` or
        :meth:`abort_call`.
        """
        with _TRANSLATED:
            return self._core.begin_call(list(inputs), list(sizes), list(alias_of), list(inplace_of), float(cost))

    def end_call(self, op: int, cost: float) -> None:
        """Two-phase call, part two: the op ran at ``cost``; account for it, unlock its inputs."""
        with _TRANSLATED:
            self._core.end_call(op, float(cost))

    def set_cost(self, op: int, cost: float) -> None:
        """The finished ``op`` (its :meth:`end_call` returned) really cost ``cost``.

        For a driver that learns op times after the fact (CUDA events resolve
        later): the op's cost, its storages' costs and the evicted-neighbourhood
        terms that include them follow, and ``base_compute`` is corrected. The
        clock (staleness) and ``remat_compute`` keep what they were advanced by.

        Raises:
            ValueError: an unknown or unfinished op, or a cost that is not finite and >= 0.
        """
        self._core.set_cost(op, float(cost))

    def abort_call(self, op: int) -> None:
        """The op of :meth:`begin_call` failed: unlock its inputs, forget its outputs."""
        self._core.abort_call(op)

    def protect(self, storage: int) -> None:
        """Before a constant is written in place: pin what still needs its old value."""
        with _TRANSLATED:
            self._core.protect(storage)

    def protect_targets(self, storage: int) -> List[int]:
        """The storages :meth:`protect` would pin or complete now (referenced, computed from ``storage``).

        Completing a storage brings back its referenced tensors that are
        undefined (views of a constant that came back through its root).
        """
        return self._core.protect_targets(storage)

    def call_inplace(self, inputs: Sequence[int], sizes: Sequence[int], alias_of: Sequence[int],
                     mutated: Sequence[int], cost: float) -> List[int]:
        """An op with outputs that also writes ``inputs[j]`` in place (j in ``mutated``)."""
        with _TRANSLATED:
            return self._core.call_inplace(list(inputs), list(sizes), list(alias_of), list(mutated), float(cost))

    def collect(self) -> Tuple[List[int], List[int]]:
        """Garbage-collect the graph: ``(ops, storages)`` collected by this call.

        A collected storage can never be needed again (it is freed if it was
        resident); a collected op never runs again (its recipe can go). Each id
        is returned once. Collected tensors must not be used again.
        """
        ops, storages = self._core.collect()
        return ops, storages

    def compact(self) -> Tuple[List[int], List[int], List[int]]:
        """Drop what :meth:`collect` made unreachable and renumber the rest (in order).

        Returns the old -> new id maps ``(ops, tensors, storages)``, -1 for a
        dropped id; every id a driver holds must go through them. Later
        decisions are unchanged. Only between calls.
        """
        ops, tensors, storages = self._core.compact()
        return ops, tensors, storages

    def retain(self, t: int) -> None:
        """One more reference to ``t``."""
        self._core.retain(t)

    def release(self, t: int) -> None:
        """One reference to ``t`` fewer; a storage with none left is freed.

        Freeing a dead constant (``free_dead_constants``) first protects what
        still needs it, which may compute.
        """
        with _TRANSLATED:
            self._core.release(t)

    def set_budget(self, budget: Optional[int]) -> None:
        """Change the budget (bytes; None: no limit). Nothing is evicted now: the next call makes room."""
        self._core.budget = -1 if budget is None else int(budget)

    def check(self) -> None:
        """Check every invariant of the core; raises RuntimeError naming the first violated."""
        self._core.check()

    @property
    def counters(self) -> dict:
        """Counters: compute, evictions, remats, memory, peak, storage accesses."""
        return self._core.counters()

    # Read through each time (their values change); attrgetter: no Python frame per read.
    clock = _core_property("clock", "The core's clock: the sum of the costs computed so far (staleness).")
    budget = _core_property("budget", "The budget in bytes (-1: none).")
    memory = _core_property("memory", "Bytes resident now, as the core accounts them.")
    peak_memory = _core_property("peak_memory", "The most bytes resident at once so far.")
    base_compute = _core_property("base_compute", "Compute of first computations so far (cost units).")
    remat_compute = _core_property("remat_compute", "Compute of recomputations so far (cost units).")
    num_tensors = _core_property("num_tensors", "Tensors in the core's tables (ids 0 .. num_tensors - 1).")
    num_storages = _core_property("num_storages", "Storages in the core's tables.")
    num_ops = _core_property("num_ops", "Ops in the core's tables.")
    num_collected_storages = _core_property("num_collected_storages",
                                            "Storages in the tables that collect() collected (compact() drops them).")
    start_memory = _core_property("start_memory", "Bytes resident at the first op of a fingerprinted run (-1: not "
                                  "reached; Note [A step that starts with more] in csrc/core_follow.cpp).")
    pool_size = _core_property("pool_size", "Storages the heuristic may evict now (resident, unlocked, not pinned).")

    def set_plan(self, plan: "_C.FollowPlan") -> None:
        """Follow ``plan`` from the first op on (Note [Following a plan] in csrc/core_follow.cpp).

        Raises:
            RuntimeError: an op was created already.
        """
        self._core.set_plan(plan)

    def record_fingerprints(self, on: bool = True) -> None:
        """Keep each op's fingerprint from the first op on (:meth:`fingerprints`)."""
        self._core.record_fingerprints(on)

    def fingerprints(self) -> List[int]:
        """The fingerprints of the ops so far, while :meth:`record_fingerprints` is on."""
        return self._core.fingerprints()

    @property
    def plan_state(self) -> Tuple[int, int, int]:
        """``(followed, diverged_at, length)``: the ops that matched the plan, the ordinal of the first that did
        not (-1: none so far), and the plan's length (0: no plan)."""
        c = self._core
        return c.plan_followed, c.plan_diverged_at, c.plan_length

    def set_hooks(self, on_evict: Optional[Callable[[int], None]] = None,
                  on_compute: Optional[Callable[[int, bool], None]] = None,
                  on_pin: Optional[Callable[[int], None]] = None) -> None:
        """Callbacks for a driver that owns real memory (None: no callback).

        Args:
            on_evict: ``f(storage)`` after any storage is evicted or freed.
            on_compute: ``f(op, remat)`` before any op is computed (first time or again).
            on_pin: ``f(storage)`` when a storage becomes a constant.
        """
        self._core.on_pin = on_pin
        self._core.on_evict = None if on_evict is None else (lambda s, by_heuristic: on_evict(s))
        self._core.on_compute = on_compute


# The wrapped core's methods that Core sets on each instance (documented in its __slots__).
_BOUND = tuple(name for name in Core.__slots__ if name != "_core")


def parse_program(data: bytes) -> "_C.Program":
    """Parse a whole (decompressed) log; raises ``RawLogError(line, message)``."""
    return _C.parse_log(data)


def replay_program(program: "_C.Program", heuristic: Heuristic | str = "eqclass", budget: Optional[int] = None,
                   *, thrash_limit: float = math.inf, check: bool = False, trace: bool = False,
                   plan: Optional["_C.FollowPlan"] = None, fingerprints: bool = False, **options) -> dict:
    """Replay a parsed program on a fresh core and return its raw result dict.

    ``status`` is a :data:`ReplayStatus` value (a plain string). With ``trace``,
    the dict also has ``trace`` (a list of ``(kind, id)``, kind an int of
    :data:`TraceEvent`: ``COMPUTED`` core op computed (an op without outputs
    too, once), ``RECOMPUTED``, ``EVICTED`` storage evicted by the heuristic,
    ``FREED`` storage freed otherwise: at its last release, collected, or a
    banished output of the op just recomputed, freed at once), ``op_instr``
    (core op -> instruction index), ``storage_op`` and ``storage_index`` (core
    storage -> allocating op and output position). With ``plan``, the core
    follows it (Note [Following a plan] in csrc/core_follow.cpp) and the dict
    has ``plan_followed`` and ``plan_diverged_at``; with ``fingerprints``, a
    list of each op's fingerprint.

    Raises:
        ValueError: a thrash limit that is not a number >= 1 (or infinity),
            and see :func:`make_config`.
    """
    # The core stops once recomputation passes what the limit allows over the log's compute and ops (Note [The
    # thrash limit] in dtr.semantics; the replay counts against the whole log); the replay then reports "thrash".
    config = make_config(heuristic, budget, thrash_limit=thrash_limit, **options)
    return _C.replay(program, config, check, trace, plan, fingerprints)


def replay_graph(program: "_C.Program", semantics: Semantics = SIMRD) -> dict:
    """The core's own tables of ``program``, replayed without a budget under ``semantics``.

    The planners' exact graph (:func:`dtr.sim.graph.graph_from_log`) is read
    from them, so its ids are the core's by construction (Note [The exact
    graph is the core's] in csrc/replay.cpp). Without a budget the heuristic
    never chooses: any one gives the same tables.

    Returns:
        A dict of tuples: per op (``op_kind``, ``op_line``, ``op_name``,
        ``op_instr``, ``op_cost``, ``op_inputs``, ``op_outputs``, ``op_fresh``,
        ``op_alloc``, ``op_overwrites``), per tensor (``tensor_op``,
        ``tensor_storage``, ``tensor_view``), per storage (``storage_size``,
        ``storage_op``, ``storage_tensors``), and ``referenced_at_end``.
    """
    return _C.replay_graph(program, make_config("eqclass", None, semantics=semantics))
