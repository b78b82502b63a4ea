"""Tensors of other layouts (sparse, nested, wrapper subclasses): the keys dtr knows their memory by, and the
outputs of an op that view an input rather than own new memory (Note [Other layouts] in reference.py)."""
from __future__ import annotations

import weakref
from typing import Any, List, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from dtr.runtime.effects import schema_writes
from dtr.runtime.pytree import count_leaves
from dtr.runtime.storage_table import opaque

__all__ = ["ObjectGuard", "opaque_keys", "view_positions"]

# Tensor.untyped_storage unwrapped: a block wraps the public method (Note [Escaped memory] in escapes.py).
_storage = torch._C.TensorBase.untyped_storage


class ObjectGuard:
    """Whether an object is gone, without keeping it (StorageWeakRef's ``expired()`` for any object)."""

    __slots__ = ("ref",)

    def __init__(self, x: Any):
        self.ref = weakref.ref(x)

    def expired(self) -> bool:
        return self.ref() is None


def opaque_keys(x: torch.Tensor) -> List[Tuple[Any, Any]]:
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
    return [(("object", id(x)), ObjectGuard(x))] + [(_storage(p)._cdata, StorageWeakRef(_storage(p)))
                                                     for p in parts if not opaque(p)]


def view_positions(func: Any, out: Any) -> Tuple[int, ...]:
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


def signature_layouts(leaves: List[Any]) -> Tuple[Any, ...]:
    """Each leaf's part of an op's signature: (shape, stride, dtype) of a strided tensor, else a hashable value."""
    return tuple([((tuple(x.shape), tuple(x.stride()), x.dtype) if not opaque(x) else opaque_layout(x))
                  if isinstance(x, torch.Tensor) else hashable(x) for x in leaves])


def opaque_layout(x: torch.Tensor) -> Tuple[Any, ...]:
    """An opaque tensor's part of a signature (Note [Other layouts]): its layout and dtype, and its shape where
    it has one (ops on two shapes of a sparse, zero or quantized tensor are two signatures)."""
    try:
        return (x.layout, x.dtype, tuple(x.shape))
    except (RuntimeError, ValueError):  # (a nested tensor's ragged shape)
        return (x.layout, x.dtype)


def hashable(x: Any) -> Any:
    """``x`` itself if it can be hashed, else its repr (an op argument in a signature)."""
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)
