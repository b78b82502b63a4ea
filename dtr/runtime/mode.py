"""The dispatch mode that feeds every PyTorch op to the core and carries out its decisions.

The design and its measurements: docs/runtime-design.md; the rules are in the
Note [...] blocks next to the code they explain.
"""
from __future__ import annotations

import logging
import math
import weakref
from itertools import chain
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode_stack

from dtr.core import Core, Hold
from dtr.errors import OutOfBudgetError, ThrashingError
from dtr.runtime.costs import CostModel
from dtr.runtime.effects import has_hidden_writes, may_write, overwrites_self, schema_writes, written_args
from dtr.runtime.failures import name_failure, recomputed_op_name
from dtr.runtime.liveness import Liveness
from dtr.runtime.prediction import PREDICTIONS, Prediction
from dtr.runtime.pytree import count_leaves, tree_flatten
from dtr.runtime.recompute import Recipe, Recomputer, RngStates, Slot, rng_capture, slot_of
from dtr.runtime.recorder import LogRecorder
from dtr.runtime.storage_table import Buf, StorageTable, opaque, subclass_types, wrapper
from dtr.runtime.timing import ProvisionalCosts, Timer, WallTimer, make_timer

__all__ = ["DTRMode"]

log = logging.getLogger("dtr.runtime")
# Tensor.untyped_storage unwrapped: a block wraps the public method (Note [Escaped memory] in escapes.py).
_storage = torch._C.TensorBase.untyped_storage

_MAX_VERSIONS = 8   # see Note [Version chains]
_GC_MIN_OPS = 256
_COMPACT_MIN_OPS = 4096  # see Note [Compaction]
# Note [Constants from earlier blocks]
# A constant enters the core when an op first touches it, so a step counted
# the gradients only from its backward on: its forward could spend their share
# of the budget although they were resident all along (on the GPT benchmark
# the measured peak ran 34 MiB over a 117 MiB budget, all of it gradients and
# later layers' weights). The budget is meant as a device cap, so when a block
# ends, the storages the program still holds are remembered (weakly, per
# device type) and the next block on that device counts those still alive
# from its first op, as constants. What is remembered accumulates over the
# blocks: every storage an earlier block saw the program hold at its end, as
# long as it lives, whether or not the last block touched it and whether or
# not that block failed (Note [A failed block leaves nothing to the next] in
# budget.py): a block failing at its first op, before it had counted them, once
# made the next one count the parameters only when touched. One ``with`` per
# training step thus counts parameters, gradients and optimizer state from the
# start of every step after the first; with one ``with`` around all steps they
# stay in the core anyway. A remembered storage the program drops is dead, so
# it is freed at a poll.
_CARRIED: Dict[str, Dict[int, "Buf"]] = {}  # device type -> storage address -> weakly held buffer
_REMAT = "remat"    # the timer's tag of a recomputation (see Note [Measured costs])
_SEEDED = torch.Tag.nondeterministic_seeded  # a random op: its generator state is saved for recomputation

# Note [Keeping what evicted tensors need]
# The core (Config::keep_needed, its Note [Freeing what an evicted tensor
# needs]) keeps a released storage resident while an evicted, referenced
# storage depends on it. The runtime makes that real: when a referenced
# storage is evicted, the buffers it is computed from become strongly held
# (as constants' are), so the program dropping one of them later does not free
# its memory; the core frees it (resizes it to 0) once nothing evicted needs
# it. A storage that was already gone when it was released is "forgotten"
# (marked evicted) so that it is recomputed rather than read.

# Note [Dropped buffers]
# The core learns that the program dropped a storage only at the next poll;
# until then it still counts a reference. Anything that brings such a storage
# back in between (protect() pinning what still needs a constant's old value,
# a recomputation) fills a buffer of dtr's own. Two things keep that from
# living for ever: before a write to a constant, what protect() would pin is
# checked (only that: a full poll per parameter update would cost O(live) each)
# and released if dropped, so that protect() pins (and recomputes, with its
# whole forward chain) only what the program still holds; and a buffer dtr
# allocates in place of a dropped program storage reports itself dead, so the
# next poll releases it (a pinned one as a dead constant). It is also no longer
# mistaken for the live version of a new storage that reuses its address.
# Without this, the seed gradient (ones_like(loss)) of each backward was
# recomputed and pinned by the optimizer's first parameter update, then held
# by dtr: one more recipe, buffer and live tensor every step (and its forward
# chain recomputed to compute it).

# Note [Compaction]
# Graph GC (collect, every few hundred ops) drops the recipes of ops the core
# will never run again and the buffers of storages it will never need again;
# the core marks them collected (Note [Collection and compaction] in
# csrc/core_compact.cpp). Once more than half of the core's storages were collected
# since the last compaction, the core drops them from its tables and
# renumbers what is left; every core id held here (recipes and their slots,
# buffers, handles, versions, liveness) goes through the maps it returns.
# Each compaction costs time linear in the tables, which are then at most
# about twice what is live: amortized O(1) per op, and the metadata of one
# block over many training steps stays bounded. Tables of fewer than
# _COMPACT_MIN_OPS ops are never compacted: what compaction would free there
# is a few hundred kilobytes at most, and renumbering every recipe in Python
# was the largest single cost of a short block (one ``with`` per training step
# of a 645-op MLP compacted once per step, about 2 µs per op).

# Note [Measured costs]
# With cost_model="time" every op runs between timer.start() and timer.stop()
# (dtr/runtime/timing.py). On CPU the cost is the host time, known at once. On
# CUDA it comes from events resolved a few ops later (Note [Timing on CUDA]):
# the op ends in the core with a provisional cost (Note [Provisional costs]),
# its measurement is deferred under the tag (op, sig, func), and a poll at the
# start of each later op hands resolved times to Core.set_cost. Compaction
# renumbers the tags' ops (a dropped op's time is discarded). Recomputations
# are timed the same way under the tag _REMAT; their times only add up in
# remat_seconds (on CUDA, as they resolve; all are in by the end of the block).
#
# Note [Recording on CUDA]
# A recorded log must carry the cost the core used, so that a replay makes the
# runtime's decisions. While recording on CUDA the timer therefore waits for
# each op's end event (one synchronization per op): the cost is exact when the
# op ends, nothing is provisional and no set_cost happens. Recording is an
# offline activity; buffering log lines until their costs resolve would write
# costs the core never used at decision time.

# Note [Version chains]
# Each in-place write makes a new version computed from the old one, so a
# buffer written every step (optimizer state, accumulated gradients) would keep
# a recomputation chain, and its recipes, as long as the run. After
# _MAX_VERSIONS consecutive in-place versions the storage is pinned: it becomes
# a constant (it is long-lived anyway), and its history can be collected.
# Activations rarely see more than two or three in-place writes (ReLU(inplace),
# a residual +=), so they stay evictable. Later writes to it are writes to a
# constant (no new version); while nothing was computed from it, it is held
# weakly (Note [Constants held weakly] in storage_table.py).


# Note [Handles]
# A handle names one storage as the program sees it, across its in-place
# versions: an in-place write moves the handle to the new version. Liveness is
# kept per handle (``alive``: handle -> current version, in creation order),
# and a recorded log names tensors by handle. Handles are ints counted from 1
# in each block; a log's spelling of them ("t7") is LogRecorder's, made only
# when a log is recorded. Each is made once, by StorageTable.new_handle, and
# only copied after that, so equal handles are one object (the native path's
# poll compares them by identity).


def _layouts(leaves: List[Any]) -> Tuple[Any, ...]:
    """Each leaf's part of an op's signature: (shape, stride, dtype) of a strided tensor, else a hashable value."""
    return tuple([((tuple(x.shape), tuple(x.stride()), x.dtype) if not opaque(x)
                   else (x.layout, x.dtype)) if isinstance(x, torch.Tensor)  # (Note [Other layouts])
                  else _hashable(x) for x in leaves])


class _Call(NamedTuple):
    """An op as it reached the mode: what its recipe and log record are made of (see _commit)."""

    func: Any
    leaves: List[Any]  # the flattened (args, kwargs)
    spec: Any          # their tree_flatten spec
    tpos: List[int]    # the positions of the tracked tensors among the leaves
    ins: List[int]     # their core tensors (current versions), in that order
    rng: Optional[RngStates] = None  # the generator states a random op drew from (Note [Random ops])


# Note [The mode's slots]
# The attributes every op reads or writes are slots, not instance-dict
# entries: the native per-op path (csrc/native/fastpath.cpp) reads them at
# fixed offsets instead of hashing their names about 25 times per op, and
# Python reads them through member descriptors. Anything else (the native
# path's bound methods among them) stays in the instance dict that
# TorchDispatchMode gives every mode.
class DTRMode(TorchDispatchMode):
    """Runs ops through the DTR core. Created and entered by :class:`dtr.budget`."""

    __slots__ = ("device_type", "_opaque_readers", "timer", "recorder", "ops_seen", "liveness", "table",
                 "recomputer", "_ops_at_gc", "_live_after_gc")

    def __init__(self, core: Core, cost_model: CostModel, recorder: Optional[LogRecorder],
                 device: Optional[torch.device] = None, native: bool = False, entry: str = "mode"):
        super().__init__()
        self.core = core  # (it applies the block's thrash limit itself: Note [The thrash limit] in dtr.semantics)
        self.cost_model = cost_model
        self.recorder = recorder
        self.device_type = device.type if device is not None else None
        self.device: Optional[torch.device] = device
        self.table = StorageTable()  # buffers, addresses, handles, liveness (Note [The storage table])
        self.liveness = Liveness(core, self.table, recorder)  # polls for what the program dropped
        self.recomputer = Recomputer(core, self.table)  # the recipes, and running them again
        self.predictions = PREDICTIONS  # shared by every block: see Note [Sizes before allocation] (prediction.py)
        self.remat_seconds = 0.0
        self.ops_seen = 0
        # _opaque_keys of a non-strided tensor -> (its guard, the core tensors computed from it)
        self._opaque_readers: Dict[Any, Tuple[Any, List[int]]] = {}
        self._ops_at_gc = 0
        self._live_after_gc = 0
        self._collected_after_compact = 0   # collected storages the core kept at the last compaction
        self._collected_ops = 0             # ops collected since the last compaction
        # Until the device is known (the block's first op), a wall-clock timer that nothing uses.
        self.timer: Timer = WallTimer()  # see Note [Measured costs]
        self.provisional = ProvisionalCosts()
        core.set_hooks(on_evict=self._on_evict, on_compute=self._on_compute, on_pin=self._on_pin)
        self._compactions = 0
        self.entry = entry  # how ops should reach the mode: "mode" or "key" (see enter_dispatch)
        self.entered: Optional[str] = None  # how they did: "mode" or "key", once entered
        self._fast: Any = None
        if native or entry == "key":  # see Note [The native per-op path] in csrc/native/fastpath.cpp
            from dtr.runtime.native import fast_path
            fp = self._fast = fast_path(self, DTRMode._dispatch)  # (it also takes over the core's hooks)
            # The same steps in C++ (tests/test_native.py compares the two paths' logs line by line).
            if native:
                self.__torch_dispatch__ = fp  # type: ignore[method-assign]
            self._constant = fp.constant  # type: ignore[method-assign]
            self._carried = fp.carried  # type: ignore[method-assign]
        if device is not None:
            self._set_device(device)

    def detach_native(self) -> None:
        """Drop the native per-op path, if any (it holds the mode: a cycle the block's end breaks)."""
        for name in ("__torch_dispatch__", "_constant", "_carried", "_fast"):
            self.__dict__.pop(name, None)

    def enter_dispatch(self) -> None:
        """Start receiving the thread's ops: as a TorchDispatchMode, or through the dispatch key.

        With ``entry="key"`` the ops come through dtr._native's dispatch key
        (Note [The dispatch-key entry] in csrc/native/fastpath.cpp): the
        native steps where they apply, else this class's __torch_dispatch__
        (all of them there without ``native``). Another block holding the
        key (in another thread), or a key dtr cannot take (another extension
        registered it: a warning says so, once), makes this one a mode.
        """
        if self.entry == "key":
            from dtr.runtime.native import key_enter
            if key_enter(self._fast, self.__dict__.get("__torch_dispatch__") is None):
                self.entered = "key"
                return
        self.__enter__()
        self.entered = "mode"

    def exit_dispatch(self, exc_type: Any = None, exc: Any = None, tb: Any = None) -> None:
        """Stop receiving the thread's ops (the end of enter_dispatch)."""
        if self.entered == "key":
            from dtr.runtime.native import native_module
            m = native_module()
            assert m is not None, "entered through the key without dtr._native"
            m.key_exit()
            return
        self.__exit__(exc_type, exc, tb)

    def receives_ops(self) -> bool:
        """Whether the thread's next op comes to this mode (not while dtr's own work runs, nor after the block)."""
        if self.entered == "key":
            from dtr.runtime.native import key_active
            return key_active()
        return self in _get_current_dispatch_mode_stack()

    def off(self) -> Any:
        """A context in which the thread's ops do not come to this mode (nor any other mode)."""
        if self.entered == "key":
            from dtr.runtime.native import key_off
            return key_off()
        return _disable_current_modes()

    # ----------------------------------------------------------------- tracking
    def _trackable(self, x: Any) -> bool:
        if not isinstance(x, torch.Tensor) or x.layout != torch.strided or x.is_nested or x.is_meta or wrapper(x):
            return False
        dev = x.device.type
        if self.device_type is None:
            self._set_device(x.device)
        return dev == self.device_type

    def _set_device(self, device: torch.device) -> None:
        self.device_type = device.type
        self.device = self.recomputer.device = device
        self.timer = make_timer(device, self._on_timed, sync=self.recorder is not None)
        for w in list(_CARRIED.get(device.type, {}).values()):  # see Note [Constants from earlier blocks]
            st = w.get()
            if st is not None:
                self._constant(st)

    def carry_out(self) -> List["Buf"]:
        """Remember the resident storages the program still holds, for the next block on this device; those
        remembered only now (weakly held)."""
        if self.device_type is None:
            return []
        remembered = {k: b for k, b in _CARRIED.get(self.device_type, {}).items() if b.get() is not None}
        added = []
        for b in self._carried():
            st = b.get()
            if st is not None:
                if st._cdata not in remembered:
                    added.append(b)
                remembered[st._cdata] = b
        _CARRIED[self.device_type] = remembered
        return added

    def _carried(self) -> List["Buf"]:
        """Each resident storage the program still holds, once, in a buffer that holds it weakly. O(live tensors)."""
        keep = {}  # storage address -> its buffer
        for t in self.table.alive.values():
            buf = self.table.phys.get(self.core.storage_of(t))
            st = buf.get() if buf is not None and not buf.dropped else None
            if st is not None and st.nbytes() > 0 and st._cdata not in keep:
                keep[st._cdata] = Buf(st, owned=False)
        return list(keep.values())

    def _track(self, x: torch.Tensor) -> int:
        """The core tensor (current version) of x's storage; a constant on first sight."""
        st = _storage(x)
        cdata = st._cdata
        t = self.table.version.get(cdata)
        if t is not None and self.table.phys[self.core.storage_of(t)].dead():
            t = None  # the address of a storage that died since the last poll, reused
        if t is None:
            t = self._constant(st)
        return t

    def _constant(self, st: torch.UntypedStorage) -> int:
        """Register a storage that existed before the block as a constant; its core tensor."""
        t = self.core.constant(st.nbytes())
        h = self.table.add(t, self.core.storage_of(t), st, Buf(st, owned=True, shared=True))
        if self.recorder is not None:
            self.recorder.constant(h, st.nbytes())
        return t

    def poll(self, handles: Optional[Iterable[int]] = None) -> None:
        """Tell the core about tracked storages the program no longer references (see liveness.py).

        Args:
            handles: check only these (the last ops' tensors, cheap enough for
                every op); None checks every tracked storage (O(live tensors)).
        """
        self.liveness.poll(self.ops_seen, handles)

    # ------------------------------------------------------------- core hooks
    # Note [Storages that cannot be resized]
    # A storage made outside the dispatcher over memory PyTorch does not own
    # (torch.from_numpy) and a storage whose memory was handed to NumPy
    # (.numpy()) cannot be resized. Both are constants, never evicted, but
    # one the program drops is freed at the next poll, and resize_(0) raised
    # ("Trying to resize storage that is not resizable") in the middle of the
    # block. dtr drops its own reference instead: the memory goes when the
    # last other owner (the NumPy array) lets it go, no longer PyTorch's to
    # count.
    # Note [Evicting storages in place]
    # dtr frees a storage's bytes with ``UntypedStorage.resize_(0)`` and refills it
    # with ``resize_(n)`` plus a copy of the recomputed value, as FSDP2 does. Every
    # tensor object viewing the storage (the user's, its views, autograd's saved
    # tensors) stays valid and sees the value again once it is refilled; version
    # counters are untouched because the copy goes through a fresh tensor. A
    # wrapper-subclass design would have to wrap every tensor and unwrap it per op;
    # freeing in place costs nothing on the hot path for tensors that are resident.
    def _on_evict(self, s: int) -> None:
        buf = self.table.phys.get(s)
        st = buf.get() if buf is not None else None
        if st is not None:
            if st.resizable():
                st.resize_(0)
            else:  # see Note [Storages that cannot be resized]
                self.table.phys[s] = Buf(torch.UntypedStorage(0, device=st.device), owned=True)
        if self.core.storage_refs(s) > 0:
            self._hold_deps(s)

    def _hold_deps(self, s: int) -> None:
        """Hold the storages evicted ``s`` is computed from strongly (see Note [Keeping what evicted tensors need])."""
        for d in self.core.storage_deps(s):
            self.table.hold(d)

    def _on_pin(self, s: int) -> None:
        # A constant must outlive the program's references once anything may need its value (see Buf).
        core = self.core
        self.table.pinned(s, strongly=bool(core.storage_dependents(s)) or core.storage_size(s) == 0)

    def _on_compute(self, op: int, remat: bool) -> None:
        if remat:
            timer = self.timer
            token = timer.start()
            try:
                self.recomputer.run(op)
            except BaseException:
                timer.cancel(token)
                raise
            m = timer.stop(token)
            if isinstance(m, float):
                self.remat_seconds += m * 1e-9
            else:
                timer.defer(m, _REMAT)

    def _on_timed(self, tag: Any, ns: float) -> None:
        """A deferred measurement resolved (see Note [Measured costs])."""
        if tag is _REMAT:
            self.remat_seconds += ns * 1e-9
            return
        op, sig, func = tag
        self.core.set_cost(op, ns)
        self.provisional.observe(sig, func, ns)

    # ---------------------------------------------------------------- dispatch
    # Note [Tensor subclasses]
    # A tensor subclass that dispatches in Python (a wrapper: TwoTensor, DTensor,
    # float8 and quantized wrappers, jagged nested tensors) has a storage that is
    # no memory of its own; resizing it raises ("invalid python storage"), so
    # tracking it as a constant failed the block when it died. What it holds
    # are plain tensors, and its __torch_dispatch__ runs ops on them. So the
    # mode declines any op with such an argument (NotImplemented: torch then
    # runs the subclass's handler, whose ops on the plain tensors come back
    # here and are tracked, evicted and recomputed as any others), as the
    # dispatch-key entry does by construction (the key sits below the Python
    # key). An op that still meets a wrapper (one a subclass runs on itself with
    # the Python key excluded, through the dispatch key) leaves it alone as a
    # tensor of another layout (Note [Other layouts]; storage_table.opaque).
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return self._dispatch(func, types, args, kwargs)
        except (OutOfBudgetError, ThrashingError) as e:  # the core names ids; the user reads op names
            name_failure(self, e, func)
            raise

    def _dispatch(self, func, types, args=(), kwargs=None):
        """The reference per-op path (``__torch_dispatch__`` without naming budget errors)."""
        if types and subclass_types(types):  # see Note [Tensor subclasses]
            return NotImplemented
        kwargs = kwargs or {}
        leaves, spec = tree_flatten((args, kwargs))
        device_type = self.device_type
        if device_type is None:
            tpos = [i for i, x in enumerate(leaves) if self._trackable(x)]
        else:  # _trackable, inlined for the hot path (once the device is known)
            tpos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.layout == torch.strided
                    and not x.is_nested and not x.is_meta and x.device.type == device_type
                    and (type(x) is torch.Tensor or not wrapper(x))]
        if self._opaque_readers:  # see Note [Other layouts]
            self._before_opaque_writes(func, args, kwargs)
        if not tpos:
            return self._run_untracked_inputs(func, args, kwargs, leaves, spec)
        if func in _REBINDS:
            return self._rebind(func, args, kwargs)
        self.ops_seen += 1
        core = self.core
        if self.timer.pending:  # costs measured on the device since the last op
            self.timer.poll()
        ins = [self._track(leaves[i]) for i in tpos]

        # Written tensors: their leaf positions, split into versions and constants.
        plain_writes, const_writes = [], []
        for pos in self._written_leaves(func, args, kwargs, leaves):
            t = self.table.version[_storage(leaves[pos])._cdata]
            (const_writes if core.pinned(core.storage_of(t)) else plain_writes).append((pos, t))

        layouts = _layouts(leaves)
        sig = (func, layouts)
        pred = self.predictions.of_op(func, leaves, spec, sig)
        if pred.sizes is None:  # no meta kernel: run it first, account for it after
            return self._run_unpredicted(_Call(func, leaves, spec, tpos, ins), args, kwargs)
        sizes = list(pred.sizes)
        need = core.memory + sum(sizes)
        if self.liveness.due(self.ops_seen, need) or (core.budget >= 0 and need > core.budget) \
                or not all(map(core.defined, ins)):  # a recomputation must not read a storage just dropped
            self.poll()
        elif self.liveness.recent:
            self.poll(chain.from_iterable(self.liveness.recent))
        rng = rng_capture(func, leaves, leaves[tpos[0]].device) if _SEEDED in func.tags else None

        # The core brings the inputs back, locks them and makes room; then the op runs.
        protected = 0
        while protected < len(const_writes):
            for _, t in const_writes[protected:]:
                s = core.storage_of(t)
                self.liveness.release_dropped_targets(s)  # see Note [Dropped buffers]
                if not all(map(core.resident, core.protect_targets(s))):
                    self.poll()  # protecting recomputes: it must not read a storage just dropped
                core.protect(s)
            protected = len(const_writes)
            # See Note [Writes that protecting pins]: a version this op writes may be pinned by now.
            newly = [w for w in plain_writes if core.pinned(core.storage_of(w[1]))]
            if newly:
                plain_writes = [w for w in plain_writes if w not in newly]
                const_writes += newly
        if plain_writes:
            inplace_of = [-1] * len(sizes) + [ins.index(t) for _, t in plain_writes]
            all_sizes = sizes + [core.storage_size(core.storage_of(t)) for _, t in plain_writes]
        else:
            inplace_of, all_sizes = [-1] * len(sizes), sizes
        cost = 0.0  # a view computes nothing
        if not self.cost_model.measured and (sizes or plain_writes or const_writes):
            cost = self.cost_model.estimate(func, args, kwargs, pred.metas)
        op = core.begin_call(ins, all_sizes, [-1] * len(all_sizes), inplace_of, cost)
        try:
            out, flat_out, cost, pending = self._execute(func, args, kwargs, cost, sig)
        except BaseException:
            core.abort_call(op)
            raise
        # An op that writes nothing leaves its inputs' layouts as they were: the recipe reuses the signature's.
        self._commit(_Call(func, leaves, spec, tpos, ins, rng), op, flat_out, sizes, pred.owning, cost,
                     plain_writes, const_writes, None if pending is None else (pending, sig),
                     None if plain_writes or const_writes else layouts)
        return out

    def _native_predict(self, func, args, kwargs) -> Tuple[list, Any, Tuple[Any, ...], Prediction]:
        """For the native path, on first sight of a signature: (leaves, spec, layouts, prediction)."""
        leaves, spec = tree_flatten((args, kwargs))
        layouts = _layouts(leaves)
        return leaves, spec, layouts, self.predictions.of_op(func, leaves, spec, (func, layouts))

    # Note [Rebinding a tensor's storage]
    # aten::set_ makes its ``self`` view another storage (or a new empty one):
    # it writes no bytes, although its schema marks ``self`` as written. Taken
    # as a write, it made a new version of self's old storage whose buffer was
    # the source's storage, so the source's bytes were later freed as that
    # version's (a storage's clone, ``copy.deepcopy`` and ``torch.load`` run
    # set_ on fresh tensors: they came back empty, even without a budget). It
    # is a view instead: the source is brought back, as for any read, and the
    # tensor then shares its storage, which dtr already tracks by storage (or
    # meets as a constant if it came from outside the dispatcher). Nothing is
    # recomputable about it, so it has no recipe and no log record.
    def _rebind(self, func, args, kwargs):
        """Run aten::set_ (see Note [Rebinding a tensor's storage]); the source comes back first."""
        src = args[1] if len(args) > 1 else kwargs.get("source")
        st = _storage(src) if isinstance(src, torch.Tensor) else src
        t = self.table.version.get(st._cdata) if isinstance(st, torch.UntypedStorage) else None
        if t is not None and not self.table.phys[self.core.storage_of(t)].dead():
            if not self.core.defined(t):
                self.poll()  # (a recomputation must not read a storage just dropped)
            if self.table.version.get(st._cdata) == t:
                self.core.require(t)
        return func(*args, **kwargs)

    # Note [Writes that protecting pins]
    # An op that writes a constant and other tensors at once (a fused
    # optimizer step: _fused_adamw_ writes the parameters, and its schema says
    # it writes the gradients and the moments too) first protects the
    # constant, which pins what the program holds that was computed from it:
    # the gradients are. Left among the op's plain writes, such a pinned
    # gradient got a new version as if it were an activation, whose
    # recomputation reran the whole fused step on the updated parameters (on
    # a 12-parameter MLP the second moments came back wrong). A write to a
    # storage that protecting pinned is therefore a write to a constant too,
    # protected in turn (which may pin more, until nothing changes).
    def _execute(self, func, args, kwargs, cost: float, sig: Any):
        """Run the op for real; returns (result, flattened result, cost, pending measurement or None).

        The cost is the measured one, or the estimate given (flops), or, while
        the device has not reported the time yet, a provisional one.
        """
        pending = None
        if self.cost_model.measured:
            timer = self.timer
            if timer.samples and sig is not None:
                known = self.provisional.sampled(sig)
                if known is not None:  # Note [Sampled timing on CUDA]
                    out = func(*args, **kwargs)
                    return out, tree_flatten(out)[0], known, None
            token = timer.start()
            try:
                out = func(*args, **kwargs)
            except BaseException:
                timer.cancel(token)
                raise
            m = timer.stop(token)
            if isinstance(m, float):
                cost = m
            else:
                pending = m
                cost = self.provisional.guess(sig, func, m.host_ns)
        else:
            out = func(*args, **kwargs)
        return out, tree_flatten(out)[0], cost, pending

    def _commit(self, call: _Call, op: int, flat_out: List[Any], sizes: List[int], owning: Sequence[int],
                cost: float, plain_writes: Sequence[Tuple[int, int]] = (),
                const_writes: Sequence[Tuple[int, int]] = (), pending: Any = None, layouts: Any = None) -> None:
        """Register the op's outputs and versions, record it, and finish core op ``op``.

        Args:
            call: the op and its tracked inputs.
            flat_out: its flattened result; ``owning`` the positions of the
                outputs that own a new storage, of ``sizes`` bytes.
            cost: what the core is told it cost.
            plain_writes, const_writes: (leaf position, core tensor) of each
                storage it wrote in place: new versions, and constants.
            pending: (measurement, sig) when the op's real cost comes later
                (see Note [Measured costs]); deferred once the op has ended,
                before any compaction could renumber it.
            layouts: (shape, stride, dtype) of each tensor leaf as it is now,
                or None to read them from the leaves.
        """
        func, leaves, spec, tpos, ins, rng = call
        core = self.core
        storage_of, table = core.storage_of, self.table
        outs = core.op_outputs(op)
        new_tensors = outs[:len(sizes)]
        out_slots = []
        for k, pos in enumerate(owning):
            o, t = flat_out[pos], new_tensors[k]
            st = _storage(o)
            if st.nbytes() != sizes[k]:
                _size_warning(func, st.nbytes(), sizes[k])
            table.add(t, storage_of(t), st, Buf(st, owned=False))
            out_slots.append((pos, slot_of(t, o)))
        writes, chains = [], []
        for k, (pos, old) in enumerate(plain_writes):
            new = outs[len(sizes) + k]
            # The old version loses its buffer to the new one (see Note [Versions] in recompute.py).
            chains.append((new, table.write(old, new, storage_of(old), storage_of(new), _storage(leaves[pos]))))
            writes.append((pos, old, new))
        writes += [(pos, t, -1) for pos, t in const_writes]
        if out_slots or plain_writes:  # see Note [Constants held weakly] in storage_table.py
            table.computed_from(ins, storage_of)
        if self.recorder is not None:
            handle = table.handle
            self.recorder.call(func._schema.name.split("::")[-1], [handle[t] for t in ins],
                               [handle[t] for t in new_tensors], sizes, cost,
                               mutated=[handle[old] for _, old in plain_writes] + [handle[t] for _, t in const_writes])
        core.end_call(op, cost)
        if any(isinstance(x, torch.Tensor) and opaque(x) for x in leaves):
            for x in leaves:  # see Note [Other layouts]
                if isinstance(x, torch.Tensor) and opaque(x):
                    for k, guard in _opaque_keys(x):
                        entry = self._opaque_readers.get(k)
                        if entry is None or entry[0].expired():  # (a key of something dead: reused)
                            entry = self._opaque_readers[k] = (guard, [])
                        entry[1].extend(new_tensors)
        if pending is not None:
            self.timer.defer(pending[0], (op, pending[1], func))
        handle = table.handle
        self.liveness.saw([handle[t] for t in ins if t in handle] + [handle[t] for t in new_tensors])
        if out_slots or writes:  # ops that produce nothing are never recomputed
            rleaves = list(leaves)
            if layouts is None:
                for k, i in enumerate(tpos):  # (layouts as they are now: an op such as as_strided_ changes them)
                    rleaves[i] = slot_of(ins[k], leaves[i])
            else:
                for k, i in enumerate(tpos):
                    rleaves[i] = Slot(ins[k], leaves[i].storage_offset(), *layouts[i])
            # (tuples: see Note [Recipes and the cyclic GC] in recompute.py)
            self.recomputer.recipes[op] = Recipe(func, tuple(rleaves), spec, tuple(out_slots), tuple(writes), rng)
        for new, n in chains:  # see Note [Version chains]
            if n >= _MAX_VERSIONS:
                if self.recorder is not None:
                    self.recorder.pin(table.handle[new])
                core.pin(new, Hold.VERSION_CHAIN)
        if self.ops_seen - self._ops_at_gc > max(_GC_MIN_OPS, self._live_after_gc):
            self.collect()

    # Note [Other layouts]
    # dtr evicts and recomputes strided storages only. A tensor of another
    # layout (sparse COO/CSR/CSC/BSR/BSC, jagged, mkldnn) or a nested tensor
    # (of any layout) has no strides (or sizes) and no single storage of
    # plain elements: dtr leaves it alone (_opaque), as a value it neither tracks,
    # counts nor evicts, held as it is by the recipes that read it (the
    # recipes' outputs are tracked and evictable as usual). A recipe reads it
    # when it is recomputed, so an in-place write to it (S.mul_(2), a sparse
    # gradient accumulated) would change what the recipe recomputes: before
    # any op writes such a tensor, the outputs of the ops that read it (kept
    # in _opaque_readers) are treated as a constant about to be written: the
    # program's references to them are pinned, and so is everything the
    # program holds that was computed from them (Core.protect), brought back
    # first while the old value is still there. A view of such a tensor's
    # memory (S.values()) is never taken for a new storage (_view_positions).
    # Ops with such arguments have no meta prediction (their sizes are
    # accounted for after they ran). With a log, a protection is not recorded
    # (a replay may then keep less than the runtime did).
    def _before_opaque_writes(self, func, args, kwargs) -> None:
        """Pin what was computed from the non-strided tensors ``func`` is about to write (Note [Other layouts])."""
        names = None
        for p in written_args(func, args, kwargs):
            if p < len(args):
                x = args[p]
            else:
                names = names or [a.name for a in func._schema.arguments]
                x = kwargs.get(names[p])
            for y in (x if isinstance(x, (list, tuple)) else (x,)):
                if not isinstance(y, torch.Tensor):
                    continue
                for k in ([k for k, _ in _opaque_keys(y)] if opaque(y) else [_storage(y)._cdata]):
                    entry = self._opaque_readers.pop(k, None)
                    if entry is None or entry[0].expired():  # (what it named is gone: y only reuses its key)
                        continue
                    self.poll()  # (pinning may recompute: it must not read a storage just dropped)
                    core = self.core
                    for t in entry[1]:
                        s = core.storage_of(t)
                        if core.collected(s):
                            continue
                        if core.refs(t) > 0:  # the program holds it: keep its value as it is now
                            if self.recorder is not None:
                                self.recorder.pin(self.table.handle[t])
                            core.pin(t, Hold.PROTECTED)
                        core.protect(s)  # and what the program holds that was computed from it

    def _run_untracked_inputs(self, func, args, kwargs, leaves, spec):
        """An op without tracked inputs: a factory (zeros, randn) is tracked by its outputs.

        A factory on the budget's device makes room before it allocates (see
        Note [Factories]); any other op is accounted for after it ran.
        """
        rng = None
        if _SEEDED in func.tags:  # (a factory: the generator of the device it allocates on)
            device = kwargs.get("device")
            rng = rng_capture(func, leaves, torch.device(device) if device is not None else torch.device("cpu"))
        reserved = self._reserve_factory(func, args, kwargs, leaves)
        if reserved is not None:
            op, sizes, predicted, metas = reserved
            try:
                out = func(*args, **kwargs)
            except BaseException:
                self.core.abort_call(op)
                raise
            flat_out = tree_flatten(out)[0]
            owning = [i for i, o in enumerate(flat_out) if self._trackable(o)]
            if owning == predicted and [_storage(flat_out[i]).nbytes() for i in owning] == sizes:
                self.ops_seen += 1
                cost = 1.0 if self.cost_model.measured else self.cost_model.estimate(func, (), {}, metas)
                self._commit(_Call(func, leaves, spec, [], [], rng), op, flat_out, sizes, owning, cost)
                return out
            self.core.abort_call(op)  # the meta run was wrong about it: account for what it made
        else:
            out = func(*args, **kwargs)
            flat_out = tree_flatten(out)[0]
            views = _view_positions(func, out)  # (S.values() of a sparse S: its memory, not a new storage)
            owning = [i for i, o in enumerate(flat_out) if self._trackable(o) and i not in views]
        if not owning:
            return out
        return self._account_after(_Call(func, leaves, spec, [], [], rng), out, flat_out, owning)

    # Note [Factories]
    # A factory (torch.ones, arange, randn, empty, full, and _to_copy onto the
    # device) has no tracked input, so the general path cannot make room for it
    # first. When its ``device`` argument names the budget's device, it runs
    # once on the meta device (cached by op and arguments, as for every op) and
    # the core makes room for its outputs before it allocates; the recorded
    # call is the same as when it was accounted for afterwards, so replays and
    # decisions do not change. Ops without a device argument, or whose meta run
    # fails or disagrees, are still accounted for after they ran.
    def _reserve_factory(self, func, args, kwargs, leaves):
        """(op, sizes, output positions, meta outputs) with room made for a factory's outputs, or None."""
        if self.device_type is None or not _has_device_argument(func):
            return None
        device = kwargs.get("device")
        if (torch.device(device).type if device is not None else "cpu") != self.device_type:
            return None
        sig = (func, "factory", tuple((tuple(x.shape), tuple(x.stride()), x.dtype, x.device)
                                      if isinstance(x, torch.Tensor) else _hashable(x) for x in leaves))
        pred = self.predictions.of_factory(func, args, kwargs, sig)
        if pred.sizes is None or not pred.sizes:
            return None
        sizes = list(pred.sizes)
        if self.core.budget >= 0 and self.core.memory + sum(sizes) > self.core.budget:
            self.poll()  # what the program dropped is room too
        op = self.core.begin_call([], sizes, [-1] * len(sizes), [], 0.0)
        return op, sizes, pred.owning, pred.metas

    def _run_unpredicted(self, call: _Call, args, kwargs):
        """An op whose output sizes could not be predicted: run, then account (may overshoot by its outputs)."""
        func, leaves, _, tpos, ins, _ = call
        if not all(map(self.core.defined, ins)):  # a recomputation must not read a storage just dropped
            self.poll()
        op0 = self.core.begin_call(ins, [], [], [], 0.0)  # brings the inputs back
        if self.recorder is not None:
            self.recorder.call(func._schema.name.split("::")[-1], [self.table.handle[t] for t in ins], [], [], 0.0)
        self.core.end_call(op0, 0.0)
        if _SEEDED in func.tags:
            call = call._replace(rng=rng_capture(func, leaves, leaves[tpos[0]].device))
        out = func(*args, **kwargs)
        flat_out = tree_flatten(out)[0]
        known = {_storage(leaves[i])._cdata for i in tpos}
        views = _view_positions(func, out)
        owning = [i for i, o in enumerate(flat_out) if self._trackable(o)
                  and _storage(o)._cdata not in known and i not in views]
        return self._account_after(call, out, flat_out, owning)

    def _account_after(self, call: _Call, out: Any, flat_out: List[Any], owning: List[int]) -> Any:
        """Account for an op that already ran (its outputs at ``owning`` own new storages); its result."""
        self.ops_seen += 1
        sizes = [_storage(flat_out[i]).nbytes() for i in owning]
        op = self.core.begin_call(call.ins, sizes, [-1] * len(sizes), [], 0.0)
        outs = [o for o in flat_out if isinstance(o, torch.Tensor)]
        cost = 1.0 if self.cost_model.measured else self.cost_model.estimate(call.func, (), {}, outs)
        self._commit(call, op, flat_out, sizes, owning, cost)
        return out

    # Note [Written leaves]
    # The leaves an op writes are those of the arguments its schema (or a
    # hidden-write rule) marks as written, found by position, never by
    # identity: in a.add_(a) or torch.mul(a, b, out=a) the written tensor
    # object is also read through another argument, and matching by identity
    # made two writes of one storage (two new versions of it, the second
    # recorded from an already superseded one; the core then released a
    # tensor twice). One storage is written at most once per op: a second
    # written leaf on an already written storage (two written views of it) is
    # the same write. The core counts the reads: an input read twice holds two
    # locks, so a recomputation copies the old version instead of handing its
    # bytes over (Note [Handing bytes over on recomputation] in the core).
    def _written_leaves(self, func, args, kwargs, leaves) -> List[int]:
        """Leaf positions of the tracked tensors ``func`` writes, one per written storage."""
        positions = written_args(func, args, kwargs)
        if not positions:
            return []
        names = [a.name for a in func._schema.arguments]
        starts, n = {}, 0  # the first leaf of each argument (as tree_flatten orders them)
        for i, v in enumerate(args):
            starts[i] = n
            n += count_leaves(v)
        for k, v in kwargs.items():
            starts[names.index(k)] = n
            n += count_leaves(v)
        out, storages = [], set()
        for p in sorted(positions):
            if p not in starts:  # a written argument left at its default (None)
                continue
            v = args[p] if p < len(args) else kwargs[names[p]]
            for i in range(starts[p], starts[p] + count_leaves(v)):
                x = leaves[i]
                if self._trackable(x):
                    cdata = _storage(x)._cdata
                    if cdata not in storages:
                        storages.add(cdata)
                        out.append(i)
        return out

    def escape(self, x: torch.Tensor, pin: bool = True) -> None:
        """x's memory is about to leave PyTorch's view: bring it back and (with pin) never evict it.

        Called by the wrappers of escapes.py (Note [Escaped memory]); only the
        program's own calls count, not dtr's (made with this mode off the stack).
        """
        if not self._trackable(x) or not self.receives_ops():
            return
        cdata = _storage(x)._cdata
        t = self.table.version.get(cdata)
        if t is None or self.table.phys[self.core.storage_of(t)].dead():
            return  # not dtr's: nothing to bring back
        with self.off():
            if not self.core.defined(t):
                self.poll()
            try:
                if pin:
                    if self.recorder is not None:
                        self.recorder.pin(self.table.handle[t])
                    self.core.pin(t, Hold.ESCAPED)
                else:
                    self.core.require(t)
            except (OutOfBudgetError, ThrashingError) as e:
                name_failure(self, e, "bringing back a tensor whose bytes are read outside PyTorch")
                raise

    def collect(self) -> None:
        """Drop the recipes of ops the core will never run again and the buffers of storages it
        will never need again (graph GC); compact the core's tables when they are mostly garbage."""
        self._ops_at_gc = self.ops_seen
        core = self.core
        if self.recorder is not None:  # it frees storages: a replay must do the same
            self.recorder.collect()
        ops, storages = core.collect()
        self._collected_ops += len(ops)
        self.recomputer.collected(ops)
        for s in storages:
            self.table.collected(s, core.storage_tensors(s))
        self._live_after_gc = len(self.recomputer.recipes)
        for k in [k for k, (guard, _) in self._opaque_readers.items() if guard.expired()]:
            del self._opaque_readers[k]  # (what they named is gone: see _opaque_keys)
        if core.num_ops >= _COMPACT_MIN_OPS and (
                2 * (core.num_collected_storages - self._collected_after_compact) > core.num_storages
                or 2 * self._collected_ops > core.num_ops):
            self.compact()

    def compact(self) -> None:
        """Compact the core's tables and renumber every core id dtr holds (see Note [Compaction])."""
        ops, tensors, storages = self.core.compact()
        self._compactions += 1

        def timed(tag: Any) -> Any:  # a pending measurement's op, renumbered (None: its op was dropped)
            if tag is _REMAT:
                return tag
            new = ops[tag[0]]
            return None if new < 0 else (new,) + tag[1:]

        self.timer.map_tags(timed)

        self.recomputer.renumber(ops, tensors)
        self.table.renumber(tensors, storages)
        self._opaque_readers = {k: (guard, [tensors[t] for t in ts if tensors[t] >= 0])
                                for k, (guard, ts) in self._opaque_readers.items() if not guard.expired()}
        self._collected_after_compact = self.core.num_collected_storages
        self._collected_ops = 0

    def _check(self) -> None:
        """Assert the runtime's invariants: the core's, the storage table's and the recipes'. O(tables).

        Tests call it after every step of a program (tests/test_runtime_fuzz.py).

        Raises:
            AssertionError: one does not hold (a bug in the runtime).
        """
        core = self.core
        core.check()
        self.table._check(core, _MAX_VERSIONS)
        self.recomputer._check()
        self.liveness._check()

    # ------------------------------------------------------------------ closing
    # Note [The end of a block]
    # When a block ends, every tensor the program still holds must have its
    # bytes again: without the mode nothing could recompute it, and a tensor
    # whose storage holds 0 bytes reads freed memory. They come back as one
    # materialization (Core.pin_many: what several of them need is recomputed
    # once). If what the program holds does not fit in the budget (it kept more
    # activations than the budget allows), or bringing it back passes the
    # thrash limit, the failure is still raised (OutOfBudgetError saying what
    # filled the budget, ThrashingError), but only after everything came back
    # with the limits lifted, so that a program that catches it loses nothing.
    # A thrashing bring-back continues with no budget as well as no thrash
    # limit: with nothing to evict, every planned recomputation runs at most
    # once (the core's Note [Planned recomputation]), so it ends; with the
    # budget kept, evictions could make it thrash without end. A block left by
    # an exception (out of budget, thrashing, the program's own) brings back
    # what the program holds the same way before that exception propagates.
    # Only if a recomputation itself fails does a BudgetWarning say that the
    # tensors dtr had evicted stay unusable.
    def finish(self) -> None:
        """Bring back every tensor the program still holds (the output condition); see Note [The end of a block].

        Raises:
            OutOfBudgetError, ThrashingError: they did not fit, or took too much
                recomputation; raised after all of them came back regardless.
        """
        core = self.core
        self.poll()
        budget = core.budget
        # The first failure's figures, not the exception: its traceback holds this frame, a cycle that kept the
        # failed block's tensors alive until the next garbage collection (budget.py's Note [Nothing of a failed
        # block stays alive]).
        failure: Optional[tuple] = None
        while True:  # each failure lifts a limit: at most three rounds
            try:
                core.pin_many(list(self.table.alive.values()), Hold.OUTPUT)
                break
            except (ThrashingError, OutOfBudgetError) as e:
                if core.budget < 0 and core.thrash_limit == math.inf:  # nothing left to lift: never loop
                    raise
                if failure is None:
                    failure = ((OutOfBudgetError, e.needed, e.report) if isinstance(e, OutOfBudgetError)
                               else (ThrashingError, e.remat_compute, e.limit, e.remats, e.count_limit))
                core.set_budget(None)
                if isinstance(e, ThrashingError):
                    core.set_thrash_limit(math.inf)
        self.timer.flush()  # the device's last measurements (one wait, at the end of the block)
        if failure is not None:  # (made by a function: a local naming it here would be a cycle with this frame)
            raise self._end_failure(failure, budget) from None

    def _end_failure(self, failure: tuple, budget: int) -> Exception:
        """The error of a bring-back that failed (finish's first failure's figures), naming what dtr was doing."""
        what = "bringing back the tensors the program holds at the end of the block"
        if failure[0] is OutOfBudgetError:
            _, needed, report = failure
            err = OutOfBudgetError(budget, max(needed, self.core.memory),
                                   f"{what}; they were all brought back beyond the budget and can be used")
            if report is not None:
                err.with_report(report.named(None, recomputed_op_name(self, report.remat_op_id), what))
            return err
        _, rc, limit, remats, count_limit = failure
        return ThrashingError(rc, limit, f"while {what}; they were all brought back regardless and can be used",
                              remats=remats, count_limit=count_limit)


class _ObjectGuard:
    """Whether an object is gone, without keeping it (StorageWeakRef's ``expired()`` for any object)."""

    __slots__ = ("ref",)

    def __init__(self, x: Any):
        self.ref = weakref.ref(x)

    def expired(self) -> bool:
        return self.ref() is None


def _opaque_keys(x: torch.Tensor) -> List[Tuple[Any, Any]]:
    """(key, guard) of a non-strided tensor's memory: the object, and the storages of its strided parts.

    A write through a part (``S.values().mul_(2)``) changes the tensor as much as a write to it (Note
    [Other layouts]). The keys are addresses (the object's id, the parts' storages), which a later
    object or storage may reuse once these are gone: each comes with a guard whose ``expired()``
    says so, and a key whose guard expired names nothing any more.
    """
    layout = x.layout
    parts: Tuple[torch.Tensor, ...] = ()
    try:
        if layout == torch.sparse_coo:
            parts = (x._indices(), x._values())
        elif layout in (torch.sparse_csr, torch.sparse_bsr):
            parts = (x.crow_indices(), x.col_indices(), x.values())
        elif layout in (torch.sparse_csc, torch.sparse_bsc):
            parts = (x.ccol_indices(), x.row_indices(), x.values())
        elif x.is_nested:
            parts = (x.values(),)
    except (RuntimeError, NotImplementedError):
        parts = ()
    return [(("object", id(x)), _ObjectGuard(x))] + [(_storage(p)._cdata, StorageWeakRef(_storage(p)))
                                                     for p in parts if not opaque(p)]


def _view_positions(func: Any, out: Any) -> Tuple[int, ...]:
    """Positions among the flattened outputs of those the schema declares views of an input.

    A view of an input dtr does not track (the values of a sparse tensor, a
    storage from outside the dispatcher) must not be taken for a new storage
    the op allocated: dtr would evict memory that belongs to that input.
    """
    views = schema_writes(func)[1]
    if not views:
        return ()
    outs = out if len(func._schema.returns) > 1 else (out,)
    got: List[int] = []
    n = 0
    for k, o in enumerate(outs):
        m = count_leaves(o)
        if k in views:
            got.extend(range(n, n + m))
        n += m
    return tuple(got)


_REBINDS = frozenset(getattr(torch.ops.aten.set_, o) for o in torch.ops.aten.set_.overloads())
_RESIZES = frozenset(("aten::resize_", "aten::resize_as_", "aten::resize_as_sparse_"))  # (a storage's size changes)


def _size_warning(func: Any, got: int, predicted: int) -> None:
    log.warning("dtr: %s allocated %d bytes where %d were predicted", func, got, predicted)


def _native_op_info(func: Any) -> Tuple[bool, bool, str, Any, bool]:
    """(whether the native path may run ``func``, whether it is random, its name in logs, what to call,
    whether it may run it as an in-place op on its first argument).

    The native path runs ops that write nothing (no declared or hidden write:
    see effects.may_write) and are not aten::set_; and in-place ops whose one
    write, declared by the schema, is their first argument, a single tensor
    that they return (``add_``, ``mul_``, ...), when that is neither random,
    nor a fill (Note [Adopting recomputed bytes] in recompute.py), nor a change of metadata
    (``t_``, ``as_strided_``: tagged inplace_view) or of the storage's size
    (``resize_``), nor under a hidden-write rule. What it calls to run the op is the overload's bound C++ operator
    (``func._op``, what ``OpOverload.__call__`` calls) when ``func`` is a plain
    ``OpOverload``: one Python frame less per op; anything else is called as it is.
    """
    call = func._op if type(func) is torch._ops.OpOverload else func
    seeded = _SEEDED in func.tags
    schema = func._schema
    writes = schema_writes(func)[0] if type(func) is torch._ops.OpOverload else None  # (metadata writes excluded:)
    inplace = (writes == (0,) and func not in _REBINDS and not seeded and not overwrites_self(func)
               and not has_hidden_writes(func) and schema.name not in _RESIZES
               and torch.Tag.inplace_view not in func.tags and len(schema.returns) == 1
               and schema.returns[0].alias_info is not None and schema.returns[0].alias_info.is_write
               and isinstance(schema.arguments[0].type, torch.TensorType))
    return (func not in _REBINDS and not may_write(func), seeded, schema.name.split("::")[-1], call, inplace)
_DEVICE_ARGUMENT: Dict[Any, bool] = {}


def _has_device_argument(func: Any) -> bool:
    """Whether the op's schema takes a ``device`` (factories and device copies), cached per overload."""
    got = _DEVICE_ARGUMENT.get(func)
    if got is None:
        got = _DEVICE_ARGUMENT[func] = any(a.name == "device" for a in func._schema.arguments)
    return got


def _hashable(x: Any) -> Any:
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)
