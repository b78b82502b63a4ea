"""Which arguments an operator writes, including writes its schema does not declare.

Most in-place and ``out=`` ops declare their written arguments in the schema
(``Tensor(a!)``). A few do not: ``native_batch_norm`` updates ``running_mean``
and ``running_var`` in training mode although its schema says nothing. Such
writes are registered here, by decorator, one small function per op.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["COLLECTIVE_NAMESPACES", "REBINDS", "RESIZES", "SEEDED", "grown_storage", "has_device_argument",
           "has_hidden_writes", "is_collective", "may_write",
           "native_op_info", "overwrites_self", "register_writes", "schema_writes", "writes_first_argument_in_place",
           "writes_out_arguments", "written_args"]

_generation = 0  # how many times rules were registered
# op overload packet name -> f(args, kwargs) -> positions of written tensor args
_HIDDEN_WRITES: Dict[str, Callable[[Sequence, dict], List[int]]] = {}
# op overload -> (written positions its schema declares, its _HIDDEN_WRITES rule or None)
_rules_cache: Dict[torch._ops.OpOverload, Tuple[Tuple[int, ...], Optional[Callable[[Sequence, dict], List[int]]]]] = {}


def register_writes(*names: str):
    """Decorator: ``f(args, kwargs) -> list of written argument positions`` for these ops."""

    def wrap(fn):
        for n in names:
            _HIDDEN_WRITES[n] = fn
        _rules_cache.clear()  # an overload looked up before must see the new rule
        global _generation
        _generation += 1      # (and the native path's cache of which ops write: csrc/native/prediction.cpp)
        return fn

    return wrap


@register_writes("aten::native_batch_norm", "aten::cudnn_batch_norm", "aten::miopen_batch_norm")
def _batch_norm_running_stats(args: Sequence, kwargs: dict) -> List[int]:
    # (input, weight, bias, running_mean, running_var, training, momentum, eps)
    training = args[5] if len(args) > 5 else kwargs.get("training", False)
    return [i for i in (3, 4) if training and len(args) > i and isinstance(args[i], torch.Tensor)]


_schema_cache: Dict[torch._ops.OpOverload, Tuple[Tuple[int, ...], Tuple[int, ...]]] = {}


def schema_writes(func: torch._ops.OpOverload) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(positions of arguments the schema marks as written, returns that alias an input).

    Cached per overload.
    """
    got = _schema_cache.get(func)
    if got is None:
        s = func._schema
        writes = tuple(i for i, a in enumerate(s.arguments) if a.alias_info is not None and a.alias_info.is_write)
        views = tuple(i for i, r in enumerate(s.returns) if r.alias_info is not None)
        got = _schema_cache[func] = (writes, views)
    return got


_out_cache: Dict[torch._ops.OpOverload, bool] = {}


def writes_out_arguments(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` writes a keyword-only argument (an ``out=`` overload), whose storage its kernel may grow
    (Note [Outputs an op grows] in reference.py). Cached per overload."""
    got = _out_cache.get(func)
    if got is None:
        arguments = func._schema.arguments
        got = _out_cache[func] = any(arguments[i].kwarg_only for i in schema_writes(func)[0])
    return got


def written_args(func: torch._ops.OpOverload, args: Sequence, kwargs: dict) -> List[int]:
    """Positions (in the schema's argument order) of the tensor arguments ``func`` writes."""
    # Called for every dispatched op: the schema's writes and the hidden rule are looked up once per overload.
    rules = _rules_cache.get(func)
    if rules is None:
        rules = _rules_cache[func] = (schema_writes(func)[0], _HIDDEN_WRITES.get(func._schema.name))
    declared, hidden = rules
    writes = list(declared)
    if hidden is not None:
        writes += [i for i in hidden(args, kwargs) if i not in writes]
    return writes


def has_hidden_writes(func: torch._ops.OpOverload) -> bool:
    """Whether a hidden-write rule (register_writes) covers ``func``: its schema does not say all it writes."""
    return func._schema.name in _HIDDEN_WRITES


def may_write(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` writes any argument for some arguments: its schema says so, or a hidden-write rule exists."""
    return bool(schema_writes(func)[0]) or func._schema.name in _HIDDEN_WRITES


# Ops that write every element of ``self`` without reading it (fills and
# in-place samplers): recomputing one needs no copy of the old value when its
# ``self`` covers its whole storage (see Note [Adopting recomputed bytes] in recompute.py).
_OVERWRITE_SELF = frozenset(f"aten::{n}" for n in (
    "bernoulli_", "uniform_", "normal_", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_",
    "fill_", "zero_", "copy_"))


def overwrites_self(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` writes every element of its first argument without reading it."""
    return func._schema.name in _OVERWRITE_SELF



#: ``aten::set_``: it rebinds a tensor's storage, writing no bytes (Note [Rebinding a tensor's storage] in
#: reference.py).
REBINDS = frozenset(getattr(torch.ops.aten.set_, o) for o in torch.ops.aten.set_.overloads())
#: Ops that change a storage's size.
RESIZES = frozenset(("aten::resize_", "aten::resize_as_", "aten::resize_as_sparse_"))
#: A random op: its generator state is saved for recomputation (Note [Random ops] in recompute.py).
SEEDED = torch.Tag.nondeterministic_seeded


#: Namespaces of collective communication ops (Note [Collectives] in dtr/runtime/reference.py).
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})


def is_collective(func: Any) -> bool:
    """Whether ``func`` is a collective (``c10d::allreduce_``, ``_c10d_functional::all_reduce``, ...)."""
    return getattr(func, "namespace", None) in COLLECTIVE_NAMESPACES


def writes_first_argument_in_place(func: Any) -> bool:
    """Whether ``func`` is a collective that writes the tensors of its first argument where they are, although
    its schema says nothing (``c10d::allreduce_``, ``broadcast_``, ``recv_``, the outputs of ``allgather_``,
    ``reduce_scatter_``, ``alltoall_``...: the in-place ones, named with a trailing underscore)."""
    return getattr(func, "namespace", None) == "c10d" and func._schema.name.endswith("_")


def native_op_info(func: Any) -> Tuple[bool, bool, str, Any, bool]:
    """How the native per-op path may take ``func``: (whether it may run it, whether it is random, its name in
    logs, what to call, whether it may run it as an in-place op on its first argument).

    The native path runs ops that write nothing (no declared or hidden write:
    see effects.may_write) and are neither aten::set_ nor collectives (Note [Collectives]
    in reference.py); and in-place ops whose one
    write, declared by the schema, is their first argument, a single tensor
    that they return (``add_``, ``mul_``, ...), when that is neither random,
    nor a fill (Note [Adopting recomputed bytes] in recompute.py), nor a change of metadata
    (``t_``, ``as_strided_``: tagged inplace_view) or of the storage's size
    (``resize_``), nor under a hidden-write rule. What it calls to run the op is the overload's bound C++ operator
    (``func._op``, what ``OpOverload.__call__`` calls) when ``func`` is a plain
    ``OpOverload``: one Python frame less per op; anything else is called as it is.
    """
    call = func._op if type(func) is torch._ops.OpOverload else func
    seeded = SEEDED in func.tags
    schema = func._schema
    writes = schema_writes(func)[0] if type(func) is torch._ops.OpOverload else None  # (metadata writes excluded:)
    inplace = (writes == (0,) and func not in REBINDS and not seeded and not overwrites_self(func)
               and not has_hidden_writes(func) and schema.name not in RESIZES
               and torch.Tag.inplace_view not in func.tags and len(schema.returns) == 1
               and schema.returns[0].alias_info is not None and schema.returns[0].alias_info.is_write
               and isinstance(schema.arguments[0].type, torch.TensorType))
    takes = func not in REBINDS and not may_write(func) and not is_collective(func)
    return (takes, seeded, schema.name.split("::")[-1], call, inplace)


_DEVICE_ARGUMENT: Dict[Any, bool] = {}


def has_device_argument(func: Any) -> bool:
    """Whether the op's schema takes a ``device`` (factories and device copies), cached per overload."""
    got = _DEVICE_ARGUMENT.get(func)
    if got is None:
        got = _DEVICE_ARGUMENT[func] = any(a.name == "device" for a in func._schema.arguments)
    return got


# Note [Tensors the program resizes]
# Tensor.resize_ (and resize_as_) to more elements than its storage holds
# grows the storage: the same bytes plus new ones, a size the core's
# storage no longer has. Taken as an in-place write, the new version kept
# the old size in the core, and recomputing it copied 128 KiB into a
# 64 KiB buffer (it raised, and left the block's tensors without bytes).
# So such a resize ends the storage for dtr first, as a resize of the
# storage itself does (Note [Storages the program resizes] in driver.py),
# and runs outside the core: the next op that reads it finds a new
# constant at its new size. A resize within the storage's bytes changes
# only the tensor's shape, and is an in-place write as before.
def grown_storage(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[Tuple[torch.Tensor, int]]:
    """For aten::resize_ or resize_as_ (RESIZES): (the tensor, the bytes its storage will have) if the resize
    grows its storage, else None (Note [Tensors the program resizes])."""
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args), **kwargs)
    x, shape = bound.get("self"), bound.get("size")
    if shape is None:
        template = bound.get("the_template")
        shape = template.shape if isinstance(template, torch.Tensor) else None
    if not isinstance(x, torch.Tensor) or shape is None:
        return None
    numel = 1
    for d in shape:
        numel *= int(d)
    needed = (int(x.storage_offset()) + numel) * x.element_size() if numel else 0
    return (x, needed) if needed > x.untyped_storage().nbytes() else None
