"""Output sizes before an op allocates: one meta run per op signature, cached for the process.

See Note [Sizes before allocation]. The native per-op path keeps its own
index of these predictions by layout (csrc/native/prediction.cpp), filled from
this cache on a signature's first sight.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from dtr.runtime import limits
from dtr.runtime.effects import RESIZES
from dtr.runtime.pytree import tree_flatten, tree_unflatten
from dtr.runtime.storage_table import opaque

__all__ = ["PREDICTIONS", "Prediction", "PredictionCache", "size_warning"]

log = logging.getLogger("dtr.runtime")

# Tensor.untyped_storage unwrapped: a block wraps the public method (Note [Escaped memory] in escapes.py).
_storage = torch._C.TensorBase.untyped_storage


class Prediction(NamedTuple):
    """What an op will allocate, from its meta run."""

    sizes: Optional[List[int]]   # bytes of each output that owns a new storage (None: unknown)
    owning: Optional[List[int]]  # their positions among the flattened outputs
    metas: List[torch.Tensor]    # the meta outputs (shapes for cost estimates)
    #: (leaf position, bytes after the op) of each tensor argument whose storage the meta run grew: an out=
    #: argument smaller than the result (Note [Outputs an op grows] in reference.py)
    grown: Tuple[Tuple[int, int], ...] = ()


# Note [Sizes before allocation]
# The core makes room *before* an op allocates, so output sizes are needed in
# advance: the op runs once on meta tensors and the result is cached by op and
# input shapes/strides/dtypes, so a training loop pays for it once: the cache is
# process-wide, shared by every block (with one block per training step, a
# cache per block reran every op on meta tensors each step: 15-25% of a small
# CNN's step). An op without a meta kernel, or whose output sizes depend on
# its data, is cached as unknown (``sizes`` None): it is accounted for after
# it ran. Past limits.MAX_PREDICTIONS entries the cache starts over. The meta
# run's warnings are silenced: PyTorch's own (an out= tensor resized) came
# twice, once from dtr's frame. A warning PyTorch gives only once per process
# (TORCH_WARN_ONCE) that the meta kernel gives too is then not seen at all.
def _in_place(func: Any) -> bool:
    """Whether every return of ``func`` is its ``self``, written in place (``Tensor(a!)``): it allocates nothing.

    An out= overload (kwarg-only written arguments) is not, nor a resize: they may grow a storage.
    """
    schema = func._schema
    args, rets = schema.arguments, schema.returns
    if schema.name in RESIZES or not args or not rets or any(
            a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in args):
        return False
    first = args[0].alias_info
    return first is not None and first.is_write and all(
        r.alias_info is not None and r.alias_info.before_set == first.before_set for r in rets)


_QUANTIZED = frozenset([torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4])


class PredictionCache:
    """Predictions by op signature, bounded (see Note [Sizes before allocation])."""

    __slots__ = ("_entries", "limit")

    def __init__(self, limit: int = limits.MAX_PREDICTIONS) -> None:
        self._entries: Dict[Any, Prediction] = {}
        self.limit = limit

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def _put(self, sig: Any, pred: Prediction) -> Prediction:
        if len(self._entries) >= self.limit:
            self._entries.clear()
        self._entries[sig] = pred
        return pred

    def of_op(self, func: Any, leaves: List[Any], spec: Any, sig: Any) -> Prediction:
        """The prediction for ``func`` on flattened arguments ``leaves`` (signature ``sig``): O(1) once cached.

        Its outputs own a new storage unless they are an input or view one.
        """
        pred = self._entries.get(sig)
        if pred is not None:
            return pred
        if func._schema.name in _SIZED_BY_STORAGE:  # see Note [Outputs sized by an input's storage]
            return self._put(sig, Prediction(None, None, []))
        if any(isinstance(x, torch.Tensor) and opaque(x) or isinstance(x, torch.dtype) and x in _QUANTIZED
               for x in leaves):
            # An argument of another layout has no meta twin here (a sparse tensor's strides read (0, 0)),
            # and the meta device has no quantized tensors (quantize_per_tensor's meta output is a float
            # tensor): sizes known only after running, where the actual outputs say what is tracked (Note
            # [Other layouts] in reference.py).
            return self._put(sig, Prediction(None, None, []))
        try:
            meta = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
                    if isinstance(x, torch.Tensor) else x for x in leaves]
            margs, mkwargs = tree_unflatten(meta, spec)
            before = [(i, _storage(x).nbytes()) for i, x in enumerate(meta) if isinstance(x, torch.Tensor)]
            with warnings.catch_warnings():  # (the op's own warnings are the real run's to give)
                warnings.simplefilter("ignore")
                mout = tree_flatten(func(*margs, **mkwargs))[0]
            grown = tuple((i, _storage(meta[i]).nbytes()) for i, n in before if _storage(meta[i]).nbytes() > n)
            metas = {id(x) for x in meta if isinstance(x, torch.Tensor)}
            in_storages = {_storage(x)._cdata for x in meta if isinstance(x, torch.Tensor)}
            owning, sizes = [], []
            for i, o in enumerate(mout):
                if isinstance(o, torch.Tensor) and id(o) not in metas and \
                        _storage(o)._cdata not in in_storages:
                    owning.append(i)
                    sizes.append(_storage(o).nbytes())
            pred = Prediction(sizes, owning, [o for o in mout if isinstance(o, torch.Tensor)], grown)
        except Exception:  # data-dependent or without a meta kernel: sizes known only after running
            # (an in-place op allocates nothing: Note [Writes without a prediction] in unpredicted.py)
            pred = Prediction([], [], []) if _in_place(func) else Prediction(None, None, [])
        return self._put(sig, pred)

    def of_factory(self, func: Any, args: Any, kwargs: Dict[str, Any], sig: Any) -> Prediction:
        """The prediction for factory ``func`` (signature ``sig``), run on the meta device instead of its own."""
        pred = self._entries.get(sig)
        if pred is not None:
            return pred
        try:
            with warnings.catch_warnings():  # (the op's own warnings are the real run's to give)
                warnings.simplefilter("ignore")
                mout = tree_flatten(func(*args, **dict(kwargs, device=torch.device("meta"))))[0]
            owning = [i for i, o in enumerate(mout) if isinstance(o, torch.Tensor) and o.is_meta and not opaque(o)]
            pred = Prediction([_storage(mout[i]).nbytes() for i in owning], owning, [mout[i] for i in owning])
        except Exception:  # no meta kernel, or an argument the meta device refuses (pin_memory)
            pred = Prediction(None, None, [])
        return self._put(sig, pred)


# Note [Outputs sized by an input's storage]
# The meta run gives each tensor argument a storage of its own, as large as
# its view. An op whose output is as large as an argument's whole storage
# (forward-mode AD's _new_zeros_with_same_feature_meta: a view's tangent is a
# view of zeros the size of the view's base) was predicted at the view's size
# (256 bytes for a 2048-byte base): the core counted the prediction, and an
# evicted tangent came back into a buffer of the predicted size (the end of
# the block failed: "size does not match"). Such an op is accounted for after
# it ran, at its real size, as an op without a meta kernel is.
_SIZED_BY_STORAGE = frozenset({"aten::_new_zeros_with_same_feature_meta"})

PREDICTIONS = PredictionCache()  # shared by every block: see Note [Sizes before allocation]


# Note [Sizes that differ from the prediction]
# An op's meta kernel can disagree with its real one: BatchNorm in eval mode
# returns empty saved statistics where its meta kernel gives one float per
# channel. The core counts the predicted bytes for the op's outputs (the
# budget then holds with less room when the prediction was larger; when it
# was smaller, memory can pass the budget by the difference). That is said
# once per op and pair of sizes: a loop that runs the op every step logged it
# at every call.
_SIZE_WARNINGS: set = set()
_MAX_SIZE_WARNINGS = 1024


def size_warning(func: Any, got: int, predicted: int) -> None:
    """Log, once per op and sizes, that ``func`` allocated ``got`` bytes where ``predicted`` were counted
    (Note [Sizes that differ from the prediction])."""
    key = (str(func), got, predicted)
    if key in _SIZE_WARNINGS or len(_SIZE_WARNINGS) >= _MAX_SIZE_WARNINGS:
        return
    _SIZE_WARNINGS.add(key)
    what = ("the budget holds, with less room" if got < predicted
            else "memory can pass the budget by the difference")
    log.warning("dtr: %s allocated %d bytes where %d were predicted and counted (%s); said once", func, got,
                predicted, what)
