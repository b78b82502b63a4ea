"""The runtime's driver of the core for one block: its state, the core's hooks, and the end of the block.

A :class:`Driver` owns what a block knows (the core, the storage table, liveness, the recipes, the prediction
cache) and carries out the core's decisions on real storages (its hooks evict, recompute and pin). Each op's
bookkeeping is its :class:`~dtr.runtime.reference.ReferencePath` (the Python reference) or the native path's
twin of it (csrc/native/, over the same state). How ops reach it is the block's entry (dtr/runtime/entry.py).
The design and its measurements: docs/design.md; the rules are in the Note [...] blocks next to the code they
explain.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import torch

from dtr.core import Core, Hold
from dtr.errors import OutOfBudgetError, ThrashingError
from dtr.runtime import limits
from dtr.runtime.costs import CostModel
from dtr.runtime.escapes import PIN, READ, WRITE
from dtr.runtime.failures import name_failure, recomputed_op_name
from dtr.runtime.liveness import Liveness
from dtr.runtime.lost_values import bring_back_each, fill_lost
from dtr.runtime.prediction import PREDICTIONS
from dtr.runtime.recompute import Recomputer
from dtr.runtime.recorder import LogRecorder
from dtr.runtime.reference import ReferencePath
from dtr.runtime.storage_table import Buf, StorageTable, resize_storage, trackable
from dtr.runtime.timing import ProvisionalCosts, Timer, WallTimer, make_timer

__all__ = ["Driver"]

# Tensor.untyped_storage unwrapped: a block wraps the public method (Note [Escaped memory] in escapes.py).
_storage = torch._C.TensorBase.untyped_storage
_REMAT = "remat"  # the timer's tag of a recomputation (see Note [Measured costs])

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
# limits.COMPACT_MIN_OPS ops are never compacted: what compaction would free there
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

# Note [Handles]
# A handle names one storage as the program sees it, across its in-place
# versions: an in-place write moves the handle to the new version. Liveness is
# kept per handle (``alive``: handle -> current version, in creation order),
# and a recorded log names tensors by handle. Handles are ints counted from 1
# in each block; a log's spelling of them ("t7") is LogRecorder's, made only
# when a log is recorded. Each is made once, by StorageTable.new_handle, and
# only copied after that, so equal handles are one object (the native path's
# poll compares them by identity).


# Note [The driver's slots]
# The attributes every op reads or writes are slots, not instance-dict
# entries: the native per-op path (csrc/native/) reads them at fixed offsets
# instead of hashing their names about 25 times per op, and Python reads them
# through member descriptors. Anything else stays in the instance dict (the
# ReferencePath part has no slots, so a driver has one, and weak references).
class Driver(ReferencePath):
    """Drives the DTR core for one ``dtr.budget`` block. Created by :class:`dtr.budget`; its entry feeds it ops."""

    __slots__ = ("device_type", "_opaque_readers", "timer", "recorder", "ops_seen", "liveness", "table",
                 "recomputer", "_ops_at_gc", "_live_after_gc", "_volatile")

    def __init__(self, core: Core, cost_model: CostModel, recorder: Optional[LogRecorder],
                 device: Optional[torch.device] = None):
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
        # opaque_keys of a non-strided tensor -> (its guard, the core tensors computed from it)
        self._opaque_readers: Dict[Any, Tuple[Any, List[int]]] = {}
        # Core storages whose bytes may change outside the dispatcher (Note [Bytes written outside PyTorch])
        self._volatile: Set[int] = set()
        self._ops_at_gc = 0
        self._live_after_gc = 0
        self._collected_after_compact = 0   # collected storages the core kept at the last compaction
        self._collected_ops = 0             # ops collected since the last compaction
        # Until the device is known (the block's first op), a wall-clock timer that nothing uses.
        self.timer: Timer = WallTimer()  # see Note [Measured costs]
        self.provisional = ProvisionalCosts()
        core.set_hooks(on_evict=self._on_evict, on_compute=self._on_compute, on_pin=self._on_pin)
        self._compactions = 0
        self._fast: Any = None  # the native path's FastPath over this driver, if the block runs it (entry.py)
        self.entry: Any = None  # how the block's ops reach it (entry.py), once entered
        if device is not None:
            self._set_device(device)

    def attach_native(self, fast: Any) -> None:
        """The native per-op path runs over this driver (it took over the core's hooks when it was made)."""
        self._fast = fast

    def detach_native(self) -> None:
        """Drop the native per-op path, if any (it holds the driver: a cycle the block's end breaks)."""
        self._fast = None

    def receives_ops(self) -> bool:
        """Whether the thread's next op comes to this driver (not while dtr's own work runs, nor after the block)."""
        return self.entry is not None and self.entry.receives_ops()

    def off(self) -> Any:
        """A context in which the thread's ops do not come to this driver; see Note [Where dtr's own work runs]."""
        return self.entry.off()

    # ----------------------------------------------------------------- tracking
    def _trackable(self, x: Any) -> bool:
        """storage_table.trackable for this block; the first such tensor sets the block's device."""
        if not trackable(x, self.device_type):
            return False
        if self.device_type is None:
            self._set_device(x.device)
        return True

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
        if self._fast is not None:  # (the native path's twin: FastPath.carried)
            return self._fast.carried()
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
            if not st.resizable():  # memory PyTorch does not own (Note [Bytes written outside PyTorch])
                self._volatile.add(self.core.storage_of(t))
        return t

    def _constant(self, st: torch.UntypedStorage) -> int:
        """Register a storage that existed before the block as a constant; its core tensor."""
        if self._fast is not None:  # (the native path's twin: FastPath.constant)
            return self._fast.constant(st)
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
                resize_storage(st, 0)
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

    def escape(self, x: torch.Tensor, how: str = PIN) -> None:
        """x's memory is about to leave PyTorch's view: bring it back and (PIN, WRITE) never evict it.

        Called by the wrappers of escapes.py (Note [Escaped memory]) with ``how`` (escapes.READ, PIN or WRITE:
        the bytes may be written outside PyTorch, Note [Bytes written outside PyTorch]); only the program's
        own calls count, not dtr's (made with this mode off the stack).
        """
        pin = how != READ
        if not self._trackable(x) or not self.receives_ops():
            return
        cdata = _storage(x)._cdata
        t = self.table.version.get(cdata)
        if t is None or self.table.phys[self.core.storage_of(t)].dead():
            if how == WRITE:  # not dtr's yet: a constant now, whose bytes may change (Note [Bytes written ...])
                with self.off():
                    self._volatile.add(self.core.storage_of(self._track(x)))
            return
        with self.off():
            if not self.core.defined(t):
                self.poll()
            try:
                if pin:
                    if self.recorder is not None:
                        self.recorder.pin(self.table.handle[t])
                    self.core.pin(t, Hold.ESCAPED)
                    s = self.core.storage_of(t)
                    if how == WRITE and s not in self._volatile:  # see Note [Bytes written outside PyTorch]
                        self._volatile.add(s)
                        if self.core.protect_targets(s):
                            if self.recorder is not None:
                                self.recorder.protect(self.table.handle[t])
                            self.core.protect(s)
                else:  # (the log says so, or a replay made fewer evictions: Note [Escaped memory] in escapes.py)
                    if self.recorder is not None:
                        self.recorder.read(self.table.handle[t])
                    self.core.require(t)
            except (OutOfBudgetError, ThrashingError) as e:
                name_failure(self, e, "bringing back a tensor whose bytes are read outside PyTorch")
                raise

    def escape_storage(self, st: torch.UntypedStorage, how: str = PIN) -> None:
        """:meth:`escape` for a storage's own bytes (``UntypedStorage.data_ptr``: Note [Escaped memory])."""
        if self.receives_ops():
            with self.off():
                x = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)  # (a tensor over all of it)
            self.escape(x, how)

    # Note [Bytes written outside PyTorch]
    # Memory handed out writable (a NumPy array, DLPack, a data pointer, a
    # storage's data pointer, shared memory: escapes.WRITE, Note [Escaped
    # memory] in escapes.py; not torch.save, pickle or a storage object's
    # other methods, whose writes are dispatched or wrapped) can be written
    # without any dispatched op, and so can memory PyTorch does not own (a
    # tensor from torch.from_numpy, from_dlpack or frombuffer: its storage
    # cannot be resized). A recomputation reads its inputs as they are when it
    # runs, so a value computed from such memory before a write dtr never saw
    # came back computed from the new bytes (a = x.numpy(); y = x * 2;
    # a[:] = 5: an evicted y came back as 10s). Such storages are *volatile*
    # (Driver._volatile): when a storage escapes, what the program holds that
    # was computed from it is protected as from a constant about to be
    # written (Core.protect: brought back and pinned), and from then on every
    # op that reads a volatile storage has its results pinned (the reference
    # path's _commit; the native path leaves such ops to it). Nothing computed
    # from them is ever recomputed from them. The cost is memory: the results
    # of the ops that read such storages stay resident (a model fed with
    # torch.from_numpy batches keeps its first layer's outputs).
    # Note [Storages the program resizes]
    # FSDP2 frees each unsharded parameter after its forward and backward use
    # (``untyped_storage().resize_(0)``) and allocates it again before the next
    # (``resize_(n)``, then an all-gather writes it): no dispatched op, so the
    # core went on counting the old bytes as there, and an evicted activation
    # computed from the parameter was recomputed from whatever the storage held
    # then: on a 2-process FSDP2 MLP at half its peak the loss was NaN from the
    # second step. Called before the program resizes a storage dtr tracks, this
    # first brings it back if dtr evicted it (in plain PyTorch its bytes would
    # be there), and if the size changes, ends the storage for dtr: its current
    # version is then held by a buffer of dtr's own (a copy of the bytes, if
    # anything computed from it may still need them; none otherwise) marked
    # dropped, so the next poll releases it, a pinned one as a dead constant
    # (protected, or kept while that costs less: Note [Keeping a dead
    # constant] in liveness.py). Its address is forgotten: the next op that
    # reads the program's storage finds a new one (a constant, at its new size).
    # The copy holds what the program just freed, so the budget still counts
    # true bytes.
    def resize(self, st: torch.UntypedStorage, nbytes: int) -> None:
        """The program is about to resize ``st`` to ``nbytes`` itself (see Note [Storages the program resizes])."""
        if self.receives_ops():
            with self.off():
                self.end_storage(st, nbytes)

    def end_storage(self, st: torch.UntypedStorage, nbytes: int) -> None:
        """:meth:`resize`'s work, where dtr's ops already run off the block (an op the driver is handling)."""
        t = self.table.version.get(st._cdata)
        if t is None:
            return
        core = self.core
        s = core.storage_of(t)
        buf = self.table.phys.get(s)
        if buf is None or buf.dead():
            return
        if not core.resident(s):
            try:
                core.require(t)
            except (OutOfBudgetError, ThrashingError) as e:
                name_failure(self, e, "bringing back a storage the program resizes")
                raise
        size = core.storage_size(s)
        if nbytes == size:
            return
        if size and core.storage_dependents(s):
            keep = torch.UntypedStorage(size, device=st.device)
            keep.copy_(st)
        else:
            keep = torch.UntypedStorage(0, device=st.device)
        self.table.phys[s] = Buf(keep, owned=True, dropped=True)
        self.table.forget_address(t)

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
            del self._opaque_readers[k]  # (what they named is gone: see opaque_keys)
        if core.num_ops >= limits.COMPACT_MIN_OPS and (
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
        self._volatile = {storages[s] for s in self._volatile if storages[s] >= 0}
        self._collected_after_compact = self.core.num_collected_storages
        self._collected_ops = 0

    def _check(self) -> None:
        """Assert the runtime's invariants: the core's, the storage table's and the recipes'. O(tables).

        Tests call it after every step of a program (tests/runtime/test_runtime_fuzz.py).

        Raises:
            AssertionError: one does not hold (a bug in the runtime).
        """
        core = self.core
        core.check()
        self.table._check(core, limits.MAX_VERSIONS)
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
    # If a recomputation itself fails (the op raises, or the program is
    # interrupted while it runs), the bring-back is tried once more (a failure
    # may not come again); if that fails too, each tensor is tried on its own,
    # and each storage still without its bytes (its recomputation fails) gets
    # them back filled with 0xFF bytes (NaN for floating dtypes), so that
    # using it gives visibly wrong values, not a crash on an empty storage; a
    # BudgetWarning says how many lost their values and why, and the failure
    # propagates.
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
        tries = 2  # (a recomputation that fails: see the Note)
        while True:  # each failure lifts a limit: at most three rounds (and one more try)
            try:
                core.pin_many(list(self.table.alive.values()), Hold.OUTPUT)
                break
            except (ThrashingError, OutOfBudgetError) as e:
                if core.budget < 0 and core.thrash_limit == math.inf:  # nothing left to lift: never loop
                    fill_lost(core, self.table, f"{type(e).__name__}: {e}".split("\n")[0])
                    raise
                if failure is None:
                    failure = ((OutOfBudgetError, e.needed, e.report) if isinstance(e, OutOfBudgetError)
                               else (ThrashingError, e.remat_compute, e.limit, e.remats, e.count_limit))
                core.set_budget(None)
                if isinstance(e, ThrashingError):
                    core.set_thrash_limit(math.inf)
            except BaseException as e:
                tries -= 1
                if tries == 0:
                    bring_back_each(core, self.table)
                    fill_lost(core, self.table, f"{type(e).__name__}: {e}".split("\n")[0])
                    raise
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
