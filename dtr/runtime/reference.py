"""The reference per-op path: each op's bookkeeping in Python, step by step (the native path's twin).

:class:`ReferencePath` is a part of :class:`dtr.runtime.driver.Driver` (a mixin: the driver's state, its
hooks and the end of a block are in driver.py). An op reaches :meth:`ReferencePath._dispatch` through the
block's entry (dtr/runtime/entry.py), or from the native path (csrc/native/) for what that does not take.
The rules are in the Note [...] blocks next to the code they explain.
"""
from __future__ import annotations

from collections import Counter
from itertools import chain
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from dtr.core import Core, Hold
from dtr.runtime import limits
from dtr.runtime.costs import CostModel
from dtr.runtime.effects import (
    REBINDS,
    RESIZES,
    SEEDED,
    grown_storage,
    is_collective,
    writes_first_argument_in_place,
    writes_out_arguments,
    written_args,
)
from dtr.runtime.layouts import opaque_keys, signature_layouts
from dtr.runtime.liveness import Liveness
from dtr.runtime.prediction import Prediction, PredictionCache, size_warning
from dtr.runtime.pytree import count_leaves, tree_flatten, tree_unflatten
from dtr.runtime.recompute import Recipe, Recomputer, Slot, bits_of, old_values, rng_capture, slot_of
from dtr.runtime.recorder import LogRecorder
from dtr.runtime.storage_table import (
    Buf,
    StorageTable,
    as_plain,
    names_subclasses,
    opaque,
    resize_storage,
    subclass_types,
    trackable,
)
from dtr.runtime.timing import ProvisionalCosts, Timer
from dtr.runtime.unpredicted import AccountedAfter, Call

__all__ = ["ReferencePath"]

# Tensor.untyped_storage unwrapped: a block wraps the public method (Note [Escaped memory] in escapes.py).
_storage = torch._C.TensorBase.untyped_storage
_is_grad_enabled = torch.is_grad_enabled
_get_default_dtype = torch.get_default_dtype


# Note [Version chains]
# Each in-place write makes a new version computed from the old one, so a
# buffer written every step (optimizer state, accumulated gradients) would keep
# a recomputation chain, and its recipes, as long as the run. After
# limits.MAX_VERSIONS consecutive in-place versions the storage is pinned: it becomes
# a constant (it is long-lived anyway), and its history can be collected.
# Activations rarely see more than two or three in-place writes (ReLU(inplace),
# a residual +=), so they stay evictable. Later writes to it are writes to a
# constant (no new version); while nothing was computed from it, it is held
# weakly (Note [Constants held weakly] in storage_table.py).


_FAKE_MODE = torch._C._TorchDispatchModeKey.FAKE


class ReferencePath(AccountedAfter):
    """The reference per-op path of a :class:`~dtr.runtime.driver.Driver` (its state is the driver's)."""

    # The driver's state and methods the steps use (dtr/runtime/driver.py defines them).
    core: Core
    cost_model: CostModel
    recorder: Optional[LogRecorder]
    table: StorageTable
    liveness: Liveness
    recomputer: Recomputer
    predictions: PredictionCache
    provisional: ProvisionalCosts
    timer: Timer
    device_type: Optional[str]
    ops_seen: int
    _ops_at_gc: int
    _live_after_gc: int
    _opaque_readers: Dict[Any, Tuple[Any, List[int]]]
    _volatile: Set[int]

    if TYPE_CHECKING:
        def _trackable(self, x: Any) -> bool: ...
        def _track(self, x: torch.Tensor) -> int: ...
        def poll(self, handles: Optional[Iterable[int]] = None) -> None: ...
        def collect(self) -> None: ...
        def end_storage(self, st: torch.UntypedStorage, nbytes: int) -> None: ...

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
    # A subclass without a handler of its own is not declined (Note
    # [Subclasses without a handler] in storage_table.py).
    # Fake tensors are the exception: while torch's FakeTensorMode is active,
    # a FakeTensor declines its ops too, leaving them to that mode, which
    # torch keeps below every mode of the program's. Declined twice, an op on
    # fake tensors failed in a block (``a @ a``: unsupported operand types).
    # Such an op touches no memory: the mode passes it on, down to the fake
    # mode, as a mode that does not care for an op does.
    def _dispatch(self, func, types, args=(), kwargs=None):
        """The reference per-op path (``__torch_dispatch__`` without naming budget errors)."""
        if types and subclass_types(types):  # see Note [Tensor subclasses]
            if torch._C._get_dispatch_mode(_FAKE_MODE) is not None:
                return func(*args, **(kwargs or {}))
            return NotImplemented
        kwargs = kwargs or {}
        leaves, spec = tree_flatten((args, kwargs))
        if types and names_subclasses(types):  # see Note [Subclasses without a handler]
            leaves = as_plain(leaves)
            args, kwargs = tree_unflatten(leaves, spec)
        device_type = self.device_type
        if device_type is None:
            tpos = [i for i, x in enumerate(leaves) if self._trackable(x)]
        else:  # (once the device is known, the rule itself: no device to set)
            tpos = [i for i, x in enumerate(leaves) if trackable(x, device_type)]
        if self._opaque_readers:  # see Note [Other layouts]
            self._before_opaque_writes(func, args, kwargs)
        if not tpos:
            return self._run_untracked_inputs(func, args, kwargs, leaves, spec)
        if func in REBINDS:
            return self._rebind(func, args, kwargs)
        if func._schema.name in RESIZES and self._grows_storage(func, args, kwargs):
            return func(*args, **kwargs)  # see Note [Tensors the program resizes] in effects.py
        if writes_out_arguments(func):
            self._grow_outputs(func, leaves, spec)  # see Note [Outputs an op grows]
        self.ops_seen += 1
        core = self.core
        if self.timer.pending:  # costs measured on the device since the last op
            self.timer.poll()
        ins = [self._track(leaves[i]) for i in tpos]
        collective = is_collective(func)
        if collective:  # see Note [Collectives]
            self._pin_for_collective(ins)
            if writes_first_argument_in_place(func):
                for s in self._storages_of(args[0]):
                    self._protect_written(s)
            if not self._written_leaves(func, args, kwargs, leaves):
                out = func(*args, **kwargs)
                for o in tree_flatten(out)[0]:
                    if self._trackable(o):
                        self._track(o)  # the backend's memory: a constant from now on
                return out

        # Written tensors: their leaf positions, split into versions and constants.
        plain_writes, const_writes = [], []
        for pos in self._written_leaves(func, args, kwargs, leaves):
            t = self.table.version[_storage(leaves[pos])._cdata]
            (const_writes if core.pinned(core.storage_of(t)) else plain_writes).append((pos, t))

        layouts = signature_layouts(leaves)
        sig = (func, layouts, _get_default_dtype())  # (see Note [What a recomputation restores] in recompute.py)
        pred = self.predictions.of_op(func, leaves, spec, sig)
        if pred.sizes is None:  # no meta kernel: run it first, account for it after
            out = self._run_unpredicted(Call(func, leaves, spec, tpos, ins), args, kwargs,
                                        const_writes + plain_writes)
            if collective:
                self._pin_for_collective(self._versions_of(out))
            return out
        sizes = list(pred.sizes)
        need = core.memory + sum(sizes)
        if self.liveness.due(self.ops_seen, need) or (core.budget >= 0 and need > core.budget) \
                or not all(map(core.defined, ins)):  # a recomputation must not read a storage just dropped
            self.poll()
        elif self.liveness.recent:
            self.poll(chain.from_iterable(self.liveness.recent))
        rng = rng_capture(func, leaves, leaves[tpos[0]].device) if SEEDED in func.tags else None

        # The core brings the inputs back, locks them and makes room; then the op runs.
        protected = 0
        while True:
            for _, t in const_writes[protected:]:
                self._protect_written(core.storage_of(t))
            protected = len(const_writes)
            # See Note [Writes that protecting pins]: a version this op writes may be pinned by now, by
            # protecting a written constant or by the poll above (a dropped constant it was computed from).
            newly = [w for w in plain_writes if core.pinned(core.storage_of(w[1]))]
            if not newly:
                break
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
        olds = old_values(leaves, const_writes) if const_writes and sizes else None
        try:
            out, flat_out, cost, pending = self._execute(func, args, kwargs, cost, sig)
        except BaseException:
            core.abort_call(op)
            raise
        # An op that writes nothing leaves its inputs' layouts as they were: the recipe reuses the signature's.
        self._commit(Call(func, leaves, spec, tpos, ins, rng), op, flat_out, sizes, pred.owning, cost,
                     plain_writes, const_writes, None if pending is None else (pending, sig),
                     None if plain_writes or const_writes else layouts, olds)
        if collective:
            self._pin_for_collective(self._versions_of(flat_out))
        return out

    # Note [Collectives]
    # A collective (c10d::allreduce_, broadcast_, allgather_, ...; the
    # functional _c10d_functional::all_reduce) hands its tensors' memory to a
    # communication backend, which reads and writes it on a thread of its own
    # after the op returned, until the program waits for the work; and running
    # it again needs every other rank to run it again too. So before it runs,
    # its tensor arguments are brought back and pinned (as escaped memory is:
    # Note [Escaped memory] in escapes.py), which makes its writes land in those
    # pinned storages, and its tensor outputs are pinned after it: nothing it
    # touches is ever evicted, and it is never recomputed. A collective that
    # writes no argument (the functional ones, wait_tensor, the wrapping into
    # an AsyncCollectiveTensor, a wrapper subclass with no storage of its own)
    # is not an op of the core at all: its outputs are the backend's memory,
    # constants from then on, like tensors from before the block. Before this, DDP's
    # gradient buckets, which DDP allocates again inside the second step's block
    # (it rebuilds them after the first iteration), were evicted while gloo was
    # still writing them: the heap was corrupted, and the process crashed.
    # Recomputing an evicted bucket would have run an all-reduce on one rank
    # alone, which waits for the others forever. The in-place collectives
    # (allreduce_, broadcast_, recv_, the outputs of allgather_...) write their
    # first argument, which their schemas do not say: what still needs the old
    # bytes is protected first, as before a write to a constant. Before, a
    # value computed from a tensor before dist.all_reduce(tensor) and evicted
    # came back computed from the reduced bytes.
    def _pin_for_collective(self, ts: Iterable[int]) -> None:
        """Bring back and pin versions ``ts`` for a collective (Note [Collectives])."""
        core = self.core
        ts = list(ts)
        if not all(map(core.defined, ts)):
            self.poll()  # (bringing back must not read a storage just dropped)
        for t in ts:
            if not core.pinned(core.storage_of(t)):
                if self.recorder is not None:
                    self.recorder.pin(self.table.handle[t])
                core.pin(t, Hold.ESCAPED)

    def _storages_of(self, x: Any) -> List[int]:
        """The core storages of the tracked tensors in ``x`` (a tensor, or lists of them)."""
        core = self.core
        return sorted({core.storage_of(t) for t in self._versions_of(tree_flatten(x)[0])})

    def _versions_of(self, out: Any) -> List[int]:
        """The versions of the tracked tensors in ``out`` (an op's output, or its flattened leaves)."""
        flat = out if isinstance(out, list) else tree_flatten(out)[0]
        version = self.table.version
        return [version[_storage(x)._cdata] for x in flat
                if isinstance(x, torch.Tensor) and self._trackable(x) and _storage(x)._cdata in version]

    def _native_predict(self, func, args, kwargs) -> Tuple[list, Any, Tuple[Any, ...], Prediction]:
        """For the native path, on first sight of a signature: (leaves, spec, layouts, prediction)."""
        leaves, spec = tree_flatten((args, kwargs))
        layouts = signature_layouts(leaves)
        sig = (func, layouts, _get_default_dtype())
        return leaves, spec, layouts, self.predictions.of_op(func, leaves, spec, sig)

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

    def _grows_storage(self, func, args, kwargs) -> bool:
        """Before aten::resize_ or resize_as_: whether it grows its tensor's storage, which has then ended
        for dtr (Note [Tensors the program resizes] in effects.py)."""
        grown = grown_storage(func, args, kwargs)
        if grown is None or not self._trackable(grown[0]):
            return False
        self.end_storage(_storage(grown[0]), grown[1])
        return True

    # Note [Outputs an op grows]
    # An out= op whose out tensor is smaller than its result (``torch.tanh(x,
    # out=torch.empty(0))``) grows that tensor's storage inside its kernel, with
    # no op dispatched. Taken as an in-place write of the storage at its old
    # size, its new version kept the old size in the core: dtr counted 0 bytes
    # for 16 KiB, and recomputing the write handed the new bytes over into a
    # buffer of the old size, which failed at the end of the block and left
    # the program's tensors 0xFF-filled. So before such an op, each written
    # storage that the op's meta run grew (Prediction.grown) and that is
    # smaller than that is grown first, as a program resizing the storage
    # itself would be (Note [Storages the program resizes] in driver.py): dtr
    # ends the storage, grows it outside the core, and the op then reads and
    # writes a constant of its new size. The kernel finds the bytes it needs
    # and resizes only the tensor (with PyTorch's own warning where it warns).
    # The size compared is the storage's true one: dtr's, for a storage it
    # tracks (an evicted storage reads 0 bytes, and "growing" it to a view's
    # result shrank it). An out= tensor that shares its storage with another
    # argument is left to the kernel: the meta run gives each argument a
    # storage of its own, so it predicts a result where the real op may refuse
    # the overlap (``torch.add(x, b, out=x)`` with a broadcast shape raises).
    def _grow_outputs(self, func, leaves, spec) -> None:
        """Before an out= op: grow the written storages it would grow (Note [Outputs an op grows])."""
        sig = (func, signature_layouts(leaves), _get_default_dtype())
        grown = self.predictions.of_op(func, leaves, spec, sig).grown
        if not grown:
            return
        addresses = Counter(_storage(x)._cdata for x in leaves if isinstance(x, torch.Tensor))
        for pos, nbytes in grown:
            x = leaves[pos]
            st = _storage(x)
            if addresses[st._cdata] > 1 or not self._trackable(x):
                continue
            needed = x.storage_offset() * x.element_size() + nbytes
            t = self.table.version.get(st._cdata)
            s = None if t is None else self.core.storage_of(t)
            buf = None if s is None else self.table.phys.get(s)
            have = st.nbytes() if s is None or buf is None or buf.dead() else self.core.storage_size(s)
            if needed > have:
                self.end_storage(st, needed)
                resize_storage(st, needed)

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
    # protected in turn (which may pin more, until nothing changes). The poll
    # before the op pins too: a constant the program just dropped is protected
    # there, which pins what was computed from it. ``x = w @ W; del w;
    # x.mul_(0.5)`` under a budget that evicts gave a wrong ``x``: the poll
    # pinned ``x`` after its write was counted as a new version, which took
    # the pinned version's buffer and left the core counting it resident with
    # no bytes (found by the random programs' "unsharded" products).
    def _protect_written(self, s: int) -> None:
        """Before an op writes constant storage ``s``: pin what still needs its value (Note [Writes that
        protecting pins]); the native path calls it where the poll pinned the storage its op writes."""
        core = self.core
        self.liveness.release_dropped_targets(s)  # see Note [Dropped buffers]
        if not all(map(core.resident, core.protect_targets(s))):
            self.poll()  # protecting recomputes: it must not read a storage just dropped
        core.protect(s)

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

    def _commit(self, call: Call, op: int, flat_out: List[Any], sizes: List[int], owning: Sequence[int],
                cost: float, plain_writes: Sequence[Tuple[int, int]] = (),
                const_writes: Sequence[Tuple[int, int]] = (), pending: Any = None, layouts: Any = None,
                olds: Optional[Dict[int, torch.Tensor]] = None) -> None:
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
            olds: leaf position -> the value a written constant had before the op (Note [Writes to constants
                that allocate] in recompute.py), which the recipe reads in its place.
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
                size_warning(func, st.nbytes(), sizes[k])
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
        if self._volatile:
            self._pin_if_volatile(ins, list(chain(new_tensors, (new for _, _, new in writes if new >= 0))))
        if any(isinstance(x, torch.Tensor) and opaque(x) for x in leaves):
            for x in leaves:  # see Note [Other layouts]
                if isinstance(x, torch.Tensor) and opaque(x):
                    for k, guard in opaque_keys(x):
                        entry = self._opaque_readers.get(k)
                        if entry is None or entry[0].expired():  # (a key of something dead: reused)
                            readers: List[int] = []
                            entry = self._opaque_readers[k] = (guard, readers)
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
                    x, (size, stride, dtype) = leaves[i], layouts[i]
                    rleaves[i] = Slot(ins[k], x.storage_offset(), size, stride, dtype, bits_of(x))
            if olds:
                for pos, x in olds.items():
                    rleaves[pos] = x
            # (tuples: see Note [Recipes and the cyclic GC] in recompute.py)
            self.recomputer.recipes[op] = Recipe(func, tuple(rleaves), spec, tuple(out_slots), tuple(writes), rng,
                                                     _is_grad_enabled(), _get_default_dtype())
        for new, n in chains:  # see Note [Version chains]
            if n >= limits.MAX_VERSIONS:
                if self.recorder is not None:
                    self.recorder.pin(table.handle[new])
                core.pin(new, Hold.VERSION_CHAIN)
        if self.ops_seen - self._ops_at_gc > max(limits.GC_MIN_OPS, self._live_after_gc):
            self.collect()

    def _pin_if_volatile(self, ins: Sequence[int], results: Sequence[int]) -> None:
        """Pin an op's results if it read a volatile storage (Note [Bytes written outside PyTorch] in driver.py);
        the native path's commit calls it too, while any storage is volatile."""
        core = self.core
        if any(core.storage_of(t) in self._volatile for t in ins):
            for t in results:
                if not core.pinned(core.storage_of(t)):
                    if self.recorder is not None:
                        self.recorder.pin(self.table.handle[t])
                    core.pin(t, Hold.ESCAPED)

    # Note [Other layouts]
    # dtr evicts and recomputes strided storages only. A tensor of another
    # layout (sparse COO/CSR/CSC/BSR/BSC, jagged, mkldnn) or a nested tensor
    # (of any layout) has no strides (or sizes) and no single storage of
    # plain elements. A zero tensor (torch._efficientzerotensor, which
    # forward-mode AD makes for tangents it knows are zero) has a storage
    # with no memory, which cannot be resized or read (resize_(0) raised
    # "invalid python storage" at the first eviction). A quantized tensor's
    # quantizer (its scale and zero point) is not in its storage (rebuilding
    # one from its storage for a recomputation failed inside torch). dtr
    # leaves all of these alone (_opaque), as a value it neither tracks,
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
                for k in ([k for k, _ in opaque_keys(y)] if opaque(y) else [_storage(y)._cdata]):
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

