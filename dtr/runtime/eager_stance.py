"""The "force_eager" compiler stance that dtr.budget blocks hold while any of them runs, in any thread."""
from __future__ import annotations

import threading
from typing import Any, List

import torch

__all__ = ["EagerStance"]

# Note [Compiled code in a block]
# dtr sees an op only when it is dispatched, and a compiled kernel reads its
# inputs by raw pointer: letting compiled code run unseen would read the
# storages dtr evicted as freed memory (docs/design.md, "torch.compile runs eagerly").
# A block therefore runs torch.compile'd functions eagerly, through dtr. Dynamo
# already skips frames under a dispatch mode that does not ignore compiled
# code, but a function compiled with fullgraph=True then raised ("found no
# compiled frames"), although it ran outside the block. The block sets
# PyTorch's public "force_eager" compiler stance instead
# (torch.compiler.set_stance): every torch.compile directive is ignored, with
# no error, and the stance the program had comes back at the block's end.
# Compiled code cached before the block is kept and used again after it.
# The stance is process-wide and blocks are per thread: the first top-level
# block to begin sets it and the last to end restores the program's. Before,
# each block restored the stance it found, so two threads' blocks that ended
# in the order they began left "force_eager" set for good (nothing compiled
# after them).
_STANCE_LOCK = threading.Lock()
_stance: List[Any] = []  # [set_stance's context, the number of top-level blocks running] while any runs


class EagerStance:
    """One top-level block's hold on the "force_eager" stance (Note [Compiled code in a block])."""

    def __init__(self) -> None:
        with _STANCE_LOCK:
            if not _stance:
                _stance.extend([torch.compiler.set_stance("force_eager"), 0])
            _stance[1] += 1
        self._held = True

    def __exit__(self, *exc: Any) -> None:
        with _STANCE_LOCK:
            if not self._held:
                return
            self._held = False
            _stance[1] -= 1
            if _stance[1] == 0:
                context = _stance[0]
                _stance.clear()
                context.__exit__(None, None, None)
