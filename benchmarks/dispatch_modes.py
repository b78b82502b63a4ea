"""The Python dispatch modes the benchmarks compare dtr against: a do-nothing mode, and one that counts ops."""
from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Nop", "OpNames"]


class Nop(TorchDispatchMode):
    """Runs every op unchanged: the floor any dispatch-mode tool pays."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class OpNames(TorchDispatchMode):
    """Counts the ops it sees by ``name.overload`` (``names``); ``sum(names.values())`` is how many."""

    def __init__(self):
        super().__init__()
        self.names: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[f"{func._schema.name.split('::')[-1]}.{func._overloadname}"] += 1
        return func(*args, **(kwargs or {}))
