"""What a block that failed leaves behind: dtr's frames in its exception, and its storages for the next block.

See Note [Nothing of a failed block stays alive] and Note [A failed block leaves nothing to the next].
"""
from __future__ import annotations

import gc
import os
from typing import Any, Dict, Iterable, List, Optional

import torch

__all__ = ["clear_own_frames", "remember_left", "settle_left"]

# Note [Nothing of a failed block stays alive]
# A block left by an exception (OutOfBudgetError, ThrashingError or the
# program's own) must not keep anything of the failed step alive beyond what
# the program itself holds: a training loop that catches a budget error and
# retries with a smaller batch would otherwise grow without bound (100 caught
# errors grew RSS from 330 MiB to 2.1 GiB, and the leftovers, counted as
# constants, made later blocks fail). Two things held it: reference cycles
# between an exception and the frame that kept it (finish() kept the first
# failure while it brought everything back), which only a full garbage
# collection breaks (and the block had frozen the collector's older objects),
# and the exception's traceback, which holds dtr's own frames and their
# locals (the driver, its core and recipes, the op's arguments) for as long as
# the program keeps the exception. So no dtr code keeps an exception in a
# local that outlives its handler, and when a block ends by an exception the
# locals of dtr's own finished frames in its traceback (and in those of its
# context and cause) are cleared, with torch's wrappers around
# __torch_dispatch__ (they hold the entry and its driver): the program's frames are left as
# they are.
#
# Note [A failed block leaves nothing to the next]
# A block's outcome depends only on its program and its budget, never on the
# blocks before it. A failed one leaves two things behind. The storages the
# program still holds are remembered for the next block as any block's are
# (Note [Constants from earlier blocks] in driver.py); a failed block once
# remembered none, so the next one counted the program's parameters only from
# their first use, and made other decisions than after a block that ended
# normally. And the failed step's own tensors are still alive when its
# exception has been caught and dropped, until the cyclic garbage collector
# runs (frames, autograd graphs and checkpointing regions hold each other):
# the next block would count them as constants. So the first block after a
# failed one, if any storage the failed block left is still alive, collects
# the garbage (gc.collect(), once: a tenth of a second in a large process,
# paid only then) before it counts what earlier blocks left.
_OWN_CODE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the dtr package
_TORCH_CODE = os.path.dirname(os.path.abspath(torch.__file__))
_AFTER_FAILURE: Dict[str, Any] = {}  # "left": what the last failed block left (see the Note above)


def clear_own_frames(exc: BaseException) -> None:
    """Clear the locals of dtr's finished frames in ``exc``'s tracebacks (and its context's and cause's).

    dtr's frames are those of its own code, and the frames of torch's code
    right before one of them: the wrappers around ``__torch_dispatch__``
    (they hold the entry among their arguments).
    """
    seen: set = set()
    stack: List[Optional[BaseException]] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        frames, tb = [], e.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        clear = [f.f_code.co_filename.startswith(_OWN_CODE) for f in frames]
        for i in range(len(frames) - 2, -1, -1):  # torch's frames that lead into one of dtr's
            clear[i] = clear[i] or (clear[i + 1] and frames[i].f_code.co_filename.startswith(_TORCH_CODE))
        for frame, c in zip(frames, clear):
            if c:
                try:
                    frame.clear()
                except RuntimeError:  # still running (the frame that handles it)
                    pass
        stack += [e.__context__, e.__cause__]


def remember_left(left: Iterable[Any]) -> None:
    """Remember what a failed block left (weak references to its storages: ``Driver.carry_out``)."""
    _AFTER_FAILURE["left"] = left


def settle_left() -> None:
    """Before a block: collect the garbage once if what the last failed block left is still alive (Note [A
    failed block leaves nothing to the next])."""
    left = _AFTER_FAILURE.pop("left", ())
    if any(b.get() is not None for b in left):
        gc.collect()
