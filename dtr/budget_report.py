"""What filled the budget when no eviction could make room: the data of an :class:`~dtr.OutOfBudgetError`.

The core (csrc/core_evict.cpp, Note [What filled the budget]) reports every
resident storage at that moment, each unevictable for a reason; the runtime
names the ops. This module turns that into records a tool can read and a
message a person can act on. It is torch-free, as the simulator's errors are.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, NamedTuple, Optional, Tuple

from dtr.units import format_bytes

__all__ = ["HOLD_REASONS", "HeldStorage", "BudgetReport"]

#: Why a resident storage could not be evicted, by the name of the core's ``Hold`` value (lower case): what the
#: storage is, in a user's terms. tests/runtime/test_budget_errors.py checks there is one for each of the core's
#: reasons.
HOLD_REASONS: Dict[str, str] = {
    "constant": "constants: weights, inputs and tensors from before the block (never evicted)",
    "protected": "pinned to keep a value that a write to a constant (an optimizer step, a dropped input) "
                 "would otherwise change",
    "escaped": "pinned because their bytes were read outside PyTorch (.numpy(), DLPack, data_ptr(), "
               "torch.save, pickle, a collective such as DDP's all-reduce) or computed from bytes that can be "
               "written there (torch.from_numpy and the like)",
    "version_chain": "pinned after many in-place writes (optimizer state, gradients summed in place)",
    "output": "held by the program at the end of the block (they must all be resident then)",
    "pinned": "pinned by dtr",
    "input": "inputs of the op about to run (they must be resident while it runs)",
    "recompute": "read by a recomputation in progress (locked until it ends)",
    "locked": "locked by dtr",
}


class HeldStorage(NamedTuple):
    """One resident storage that could not be evicted.

    Attributes:
        bytes: its size.
        reason: why, a key of :data:`HOLD_REASONS`.
        referenced: whether the program still holds a tensor of it.
        storage: the core's id of it (for tools that read a recorded log).
    """

    bytes: int
    reason: str
    referenced: bool
    storage: int


@dataclass(frozen=True)
class BudgetReport:
    """What was resident when no eviction could make room, and what was being run.

    Attributes:
        budget: the budget in bytes.
        needed: the bytes that had to be resident at once (``resident + request``).
        request: the bytes the failing (re)computation needed.
        evictable: bytes dtr could still have evicted (0: it evicted everything it could).
        held: every resident storage, largest first (all unevictable when ``evictable`` is 0).
        op: the op that was about to run (None: dtr was not running one, or it is unknown).
        doing: what dtr was doing, in words, when it was not running an op (bringing back the tensors the
            program holds at the end of the block, say).
        recomputing: the op dtr was recomputing for it when room ran out (None: the op itself needed the room).
        op_id, remat_op_id: the core's ids of those ops (-1: none).
    """

    budget: int
    needed: int
    request: int
    evictable: int
    held: Tuple[HeldStorage, ...]
    op: Optional[str] = None
    doing: Optional[str] = None
    recomputing: Optional[str] = None
    op_id: int = -1
    remat_op_id: int = -1

    @property
    def resident(self) -> int:
        """Bytes resident when room ran out."""
        return sum(h.bytes for h in self.held) + self.evictable

    @property
    def enough_if_all_evicted(self) -> bool:
        """Whether evicting everything evictable would have made room (False: the budget is too small for what
        could not be evicted, whatever dtr chose)."""
        return self.resident - self.evictable + self.request <= self.budget

    def by_reason(self) -> Dict[str, Tuple[int, int]]:
        """``reason -> (storages, bytes)`` over :attr:`held`, largest total first."""
        totals: Dict[str, Tuple[int, int]] = {}
        for h in self.held:
            n, b = totals.get(h.reason, (0, 0))
            totals[h.reason] = (n + 1, b + h.bytes)
        return dict(sorted(totals.items(), key=lambda kv: -kv[1][1]))

    def named(self, op: Optional[str] = None, recomputing: Optional[str] = None,
              doing: Optional[str] = None) -> "BudgetReport":
        """A copy that names the op being run (or says what dtr was doing) and the op being recomputed (the
        runtime knows them; the core only has ids)."""
        return replace(self, op=op, recomputing=recomputing, doing=doing)

    def describe(self, largest: int = 5) -> str:
        """The report in words: the op, what filled the budget by reason, the largest storages, and whether
        evicting more could have helped.

        Args:
            largest: how many of the largest storages to list one by one.
        """
        doing = (f"while running {self.op}" if self.op is not None else
                 f"while {self.doing}" if self.doing is not None else "")
        if self.recomputing is not None:
            doing += f"{' ' if doing else ''}(recomputing {self.recomputing}{' for it' if doing else ''})"
        lines = [(doing + ", " if doing else "") + f"dtr needed {format_bytes(self.request)} more"]
        if self.enough_if_all_evicted:
            lines.append(f"dtr could still have evicted {format_bytes(self.evictable)}; evicting everything "
                         f"evictable would have been enough")
        else:
            lines.append(f"evicting everything evictable would not have been enough: "
                         f"{format_bytes(self.resident - self.evictable)} resident could not be evicted"
                         + (f" ({format_bytes(self.evictable)} more could)" if self.evictable else ""))
        lines.append("what could not be evicted:")
        for reason, (n, b) in self.by_reason().items():
            held_by_program = sum(h.bytes for h in self.held if h.reason == reason and h.referenced)
            note = f", {format_bytes(held_by_program)} of it held by the program" if held_by_program and \
                reason not in ("constant", "output") else ""
            lines.append(f"  {format_bytes(b)} in {n} storage{'s' if n != 1 else ''}: {HOLD_REASONS[reason]}{note}")
        if self.held:
            shown = ", ".join(f"{format_bytes(h.bytes)} ({h.reason.replace('_', ' ')}"
                              f"{', held by the program' if h.referenced else ''})" for h in self.held[:largest])
            lines.append(f"largest: {shown}")
        return "\n".join(lines)
