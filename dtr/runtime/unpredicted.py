"""Ops dtr accounts for after they ran: factories (made room for first where their sizes can be predicted) and
ops whose output sizes the meta device cannot predict.

A part of the reference per-op path (:class:`dtr.runtime.reference.ReferencePath` derives from
:class:`AccountedAfter`); its state is the driver's (dtr/runtime/driver.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from dtr.core import Core, Hold
from dtr.runtime.costs import CostModel
from dtr.runtime.effects import SEEDED, has_device_argument
from dtr.runtime.escapes import in_raw_call
from dtr.runtime.layouts import hashable, view_positions
from dtr.runtime.prediction import PredictionCache
from dtr.runtime.pytree import tree_flatten
from dtr.runtime.recompute import RngStates, old_values, rng_capture
from dtr.runtime.recorder import LogRecorder
from dtr.runtime.storage_table import StorageTable

__all__ = ["AccountedAfter", "Call"]

# Tensor.untyped_storage unwrapped: a block wraps the public method (Note [Escaped memory] in escapes.py).
_storage = torch._C.TensorBase.untyped_storage


#: Factories whose bytes are whatever the allocator gave (Note [Tensors a raw function allocates]).
_UNINITIALISED = frozenset({"aten::empty", "aten::empty_strided", "aten::empty_permuted"})


class Call(NamedTuple):
    """An op as it reached the mode: what its recipe and log record are made of (see _commit)."""

    func: Any
    leaves: List[Any]  # the flattened (args, kwargs)
    spec: Any          # their tree_flatten spec
    tpos: List[int]    # the positions of the tracked tensors among the leaves
    ins: List[int]     # their core tensors (current versions), in that order
    rng: Optional[RngStates] = None  # the generator states a random op drew from (Note [Random ops])


class AccountedAfter:
    """The reference path's steps for ops accounted for after they ran (the driver's state)."""

    core: Core
    cost_model: CostModel
    recorder: Optional[LogRecorder]
    table: StorageTable
    predictions: PredictionCache
    device_type: Optional[str]
    ops_seen: int

    if TYPE_CHECKING:
        def _trackable(self, x: Any) -> bool: ...
        def poll(self, handles: Optional[Any] = None) -> None: ...
        def _protect_written(self, s: int) -> None: ...
        def _commit(self, call: Call, op: int, flat_out: List[Any], sizes: List[int], owning: Sequence[int],
                    cost: float, plain_writes: Sequence[Tuple[int, int]] = (),
                    const_writes: Sequence[Tuple[int, int]] = (), pending: Any = None, layouts: Any = None,
                    olds: Optional[Dict[int, torch.Tensor]] = None) -> None: ...

    def _run_untracked_inputs(self, func, args, kwargs, leaves, spec):
        """An op without tracked inputs: a factory (zeros, randn) is tracked by its outputs.

        A factory on the budget's device makes room before it allocates (see
        Note [Factories]); any other op is accounted for after it ran.
        """
        rng = None
        if SEEDED in func.tags:  # (a factory: the generator of the device it allocates on)
            device = torch.device(kwargs["device"]) if kwargs.get("device") is not None else torch.device("cpu")
            # (only a factory whose outputs the block may track is recomputed; on the meta device, which has
            # no generator, torch.randn(..., device="meta") failed in a block)
            if device.type != "meta" and self.device_type in (None, device.type):
                rng = rng_capture(func, leaves, device)
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
                self._commit(Call(func, leaves, spec, [], [], rng), op, flat_out, sizes, owning, cost)
                self._pin_raw_allocations(func, flat_out, owning)
                return out
            self.core.abort_call(op)  # the meta run was wrong about it: account for what it made
        else:
            out = func(*args, **kwargs)
            flat_out = tree_flatten(out)[0]
            views = view_positions(func, out)  # (S.values() of a sparse S: its memory, not a new storage)
            owning = [i for i, o in enumerate(flat_out) if self._trackable(o) and i not in views]
        if not owning:
            return out
        self._account_after(Call(func, leaves, spec, [], [], rng), out, flat_out, owning)
        self._pin_raw_allocations(func, flat_out, owning)
        return out

    # Note [Tensors a raw function allocates]
    # pad_packed_sequence's C++ allocates its lengths tensor (aten::empty: a
    # factory dtr tracks), takes its data pointer, and writes the lengths
    # through it between dispatched ops (the copies into its padded output),
    # any of which may make room by evicting: the lengths tensor was evicted
    # in the middle of the call, its bytes freed, and the writes landed in
    # freed heap (glibc aborted, or a packed LSTM read garbage lengths).
    # ctc_loss's mean divides by its target lengths made with at::tensor (an
    # aten::empty filled through its pointer): evicted, that tensor came back
    # as what aten::empty gave, and the gradients were wrong. So while a
    # function of Note [Ops that touch bytes through raw pointers]
    # (escapes.py) runs, the tensors its uninitialised factories make are
    # pinned as they are made, as its integer arguments and outputs are.
    def _pin_raw_allocations(self, func: Any, flat_out: List[Any], owning: Sequence[int]) -> None:
        """Pin what an uninitialised factory makes while a raw function runs (Note [Tensors a raw function
        allocates])."""
        if not in_raw_call() or func._schema.name not in _UNINITIALISED:
            return
        for i in owning:
            t = self.table.version[_storage(flat_out[i])._cdata]
            if self.recorder is not None:
                self.recorder.pin(self.table.handle[t])
            self.core.pin(t, Hold.ESCAPED)

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
        if self.device_type is None or not has_device_argument(func):
            return None
        device = kwargs.get("device")
        if (torch.device(device).type if device is not None else "cpu") != self.device_type:
            return None
        sig = (func, "factory", tuple((tuple(x.shape), tuple(x.stride()), x.dtype, x.device)
                                      if isinstance(x, torch.Tensor) else hashable(x) for x in leaves))
        pred = self.predictions.of_factory(func, args, kwargs, sig)
        if pred.sizes is None or not pred.sizes:
            return None
        sizes = list(pred.sizes)
        if self.core.budget >= 0 and self.core.memory + sum(sizes) > self.core.budget:
            self.poll()  # what the program dropped is room too
        op = self.core.begin_call([], sizes, [-1] * len(sizes), [], 0.0)
        return op, sizes, pred.owning, pred.metas

    # Note [Writes without a prediction]
    # An op whose output sizes the meta device cannot predict runs first and
    # is accounted for after (_account_after), so the core cannot hand a
    # written storage's bytes to a new version before it runs. An in-place op
    # allocates nothing, so PredictionCache predicts one from its schema (its
    # returns alias written arguments) when its meta kernel fails (in-place
    # samplers given a generator=: "generator is not supported in refs"), and
    # it takes the usual path. Any other op that writes a tracked storage
    # (a custom op without a fake kernel) writes pinned storages: the versions
    # it writes are pinned first, then protected as constants about to be
    # written (what was computed from them is pinned too), and the recipe
    # runs its write on a copy. Before, such a write was not recorded at all:
    # an evicted exponential_(generator=g) came back as the empty tensor it
    # was written into.
    def _run_unpredicted(self, call: Call, args, kwargs, writes: List[Tuple[int, int]]):
        """An op whose output sizes could not be predicted: run, then account (may overshoot by its outputs).

        ``writes``: (leaf position, core tensor) of the tracked storages it writes (Note [Writes without a
        prediction]).
        """
        func, leaves, _, tpos, ins, _ = call
        core = self.core
        if not all(map(core.defined, ins)):  # a recomputation must not read a storage just dropped
            self.poll()
        for _, t in writes:
            if not core.pinned(core.storage_of(t)):
                if self.recorder is not None:
                    self.recorder.pin(self.table.handle[t])
                core.pin(t)
            self._protect_written(core.storage_of(t))
        op0 = self.core.begin_call(ins, [], [], [], 0.0)  # brings the inputs back
        olds = old_values(leaves, writes) if writes else None
        if self.recorder is not None:
            self.recorder.call(func._schema.name.split("::")[-1], [self.table.handle[t] for t in ins], [], [], 0.0)
        self.core.end_call(op0, 0.0)
        if SEEDED in func.tags:
            call = call._replace(rng=rng_capture(func, leaves, leaves[tpos[0]].device))
        out = func(*args, **kwargs)
        flat_out = tree_flatten(out)[0]
        known = {_storage(leaves[i])._cdata for i in tpos}
        views = view_positions(func, out)
        owning = [i for i, o in enumerate(flat_out) if self._trackable(o)
                  and _storage(o)._cdata not in known and i not in views]
        return self._account_after(call, out, flat_out, owning, writes, olds)

    def _account_after(self, call: Call, out: Any, flat_out: List[Any], owning: List[int],
                       const_writes: Sequence[Tuple[int, int]] = (),
                       olds: Optional[Dict[int, torch.Tensor]] = None) -> Any:
        """Account for an op that already ran (its outputs at ``owning`` own new storages, it wrote the pinned
        ``const_writes``); its result."""
        self.ops_seen += 1
        sizes = [_storage(flat_out[i]).nbytes() for i in owning]
        op = self.core.begin_call(call.ins, sizes, [-1] * len(sizes), [], 0.0)
        outs = [o for o in flat_out if isinstance(o, torch.Tensor)]
        cost = 1.0 if self.cost_model.measured else self.cost_model.estimate(call.func, (), {}, outs)
        self._commit(call, op, flat_out, sizes, owning, cost, const_writes=const_writes, olds=olds or None)
        return out
