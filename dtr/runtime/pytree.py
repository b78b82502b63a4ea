"""A small flattener for ATen-level op arguments: nested lists and tuples of tensors and scalars, and kwargs.

See Note [Flattening]. The specs it makes hold tuples only (Note [Recipes and
the cyclic GC] in recompute.py).
"""
from __future__ import annotations

from typing import Any, Tuple

__all__ = ["count_leaves", "tree_flatten", "tree_unflatten"]


# Note [Flattening]
# Every dispatched op's arguments are flattened to find its tensors. At the
# ATen level arguments are tensors, scalars and (nested) lists or tuples of
# them, so a small recursive flattener does, at a fraction of the cost of the
# general pytree machinery on this hot path.


def _flat(x: Any, leaves: list) -> Any:
    if isinstance(x, (list, tuple)):  # (tuples: see Note [Recipes and the cyclic GC] in recompute.py)
        return (list if isinstance(x, list) else tuple, tuple([_flat(v, leaves) for v in x]))
    leaves.append(x)
    return None


def count_leaves(x: Any) -> int:
    """How many leaves _flat makes of x."""
    if isinstance(x, (list, tuple)):
        return sum(count_leaves(v) for v in x)
    return 1


def _unflat(spec: Any, it) -> Any:
    if spec is None:
        return next(it)
    kind, items = spec
    return kind(_unflat(s, it) for s in items)


def tree_flatten(tree: Any) -> Tuple[list, Any]:
    """Leaves of nested lists/tuples/dicts of values (dict keys kept in order), and a spec."""
    leaves: list = []
    spec: tuple
    if isinstance(tree, tuple) and len(tree) == 2 and isinstance(tree[1], dict):  # (args, kwargs)
        args, kwargs = tree
        spec = ("ak", _flat(args, leaves), tuple([(k, _flat(v, leaves)) for k, v in kwargs.items()]))
    else:
        spec = ("t", _flat(tree, leaves))
    return leaves, spec


def tree_unflatten(leaves: list, spec: Any) -> Any:
    """The tree ``tree_flatten`` made ``spec`` of, with ``leaves`` in place of its leaves."""
    it = iter(leaves)
    if spec[0] == "ak":
        args = _unflat(spec[1], it)
        return args, {k: _unflat(s, it) for k, s in spec[2]}
    return _unflat(spec[1], it)
