"""Which arguments an operator writes, including writes its schema does not declare.

Most in-place and ``out=`` ops declare their written arguments in the schema
(``Tensor(a!)``). A few do not: ``native_batch_norm`` updates ``running_mean``
and ``running_var`` in training mode although its schema says nothing. Such
writes are registered here, by decorator, one small function per op.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["has_hidden_writes", "may_write", "overwrites_self", "register_writes", "written_args"]

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
        _generation += 1      # (and the native path's cache of which ops write: csrc/native/fastpath.cpp)
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

