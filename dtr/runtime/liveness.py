"""Liveness: learning which storages the program dropped, and releasing them in the core.

The runtime holds the program's storages weakly (Note [Liveness]); a poll
finds those that died and tells the core, which frees what it no longer
needs. A dropped constant is protected first, or kept while that is cheaper
(Note [Keeping a dead constant]). The native per-op path polls the same way
over the same state (csrc/native/liveness.cpp's liveness_poll_recent and liveness_poll_full)
and hands every poll that finds a dead constant to :meth:`Liveness.poll`.
"""
from __future__ import annotations

from typing import Any, Iterable, List, Optional

import torch

from dtr.runtime import limits
from dtr.runtime.storage_table import StorageTable

__all__ = ["Liveness"]

_expired = torch.UntypedStorage._expired  # StorageWeakRef.expired() without its two Python frames

# Note [Liveness]
# The runtime holds only *weak* references to the storages the program owns
# (user variables, views and autograd's saved tensors hold the strong ones), so
# a storage the program drops is freed by PyTorch at once, exactly as without
# dtr. The core learns of it at the next poll, and until then counts it as
# resident: its accounting errs on the safe side. Before every op, the
# storages that the last limits.RECENT_OPS ops read or wrote are checked: most die
# right after their last use (a variable rebound, autograd dropping a node's
# saved tensors once the node's backward ops ran). Every limits.POLL_EVERY ops (or,
# under a budget and not recording, every len(alive) / 4 ops when more live:
# amortized O(1) per op), whenever room must be made, and before any
# recomputation, all are checked. When only tracking (no budget, no log), the
# scheduled check waits for an op that could set a new peak: below the peak,
# a late release changes nothing the program or the stats see (the core's
# memory, dead tensors included, can only reach the peak through such an op,
# so what dtr holds stays bounded by it). On the H100's 12-layer GPT this took
# budget(None) from 1.33x to 1.14x plain with flop costs (the host runs ahead
# of the GPU by less than a dead-tensor scan of every live tensor each 16 ops);
# on the 2-core CPU's GPT it made no measurable difference.
# Checking all at every op costs O(live tensors) per op, quadratic over a
# TreeLSTM step; checking all only every 16 ops made recorded logs release
# tensors up to 16 ops late (an 11% higher peak on the LSTM log), which the
# simulator then counted as live. Buffers dtr owns (an old version's value
# brought back for a recomputation) are held strongly.


# Note [Keeping a dead constant]
# When the program drops a constant (a storage from before the block, or one
# pinned since), the storages still referenced that were computed from it must
# not need its value again: protect() pins them, recomputing those evicted.
# Pinned, they cannot be evicted any more, and when the program drops one of
# them in turn, what was computed from it is pinned too. In Hugging Face's
# GPT-2 (transformers 5.17) the causal mask is `where(mask, tensor(0.0), min)`:
# dropping the scalar pinned the mask, and dropping the mask after the last
# layer pinned every attention activation still held for the backward pass,
# which at half the peak no longer fit. Keeping the dead constant instead costs
# its bytes, which the budget already counts, until what needs it dies. So a
# dead constant is kept while its bytes are fewer than those protect() would
# pin, and looked at again at each full poll: once what needs it shrinks below
# its size (or to nothing) it is protected and released as before. The log
# records the protect and release when they happen, so replays agree.


class Liveness:
    """Which storages the program still holds (see the module's docstring); one per block.

    The native per-op path reads ``recent``, ``next_full_poll`` and
    ``on_schedule`` at fixed offsets (Note [The driver's slots] in driver.py).
    """

    __slots__ = ("core", "table", "recorder", "recent", "next_full_poll", "on_schedule")

    def __init__(self, core: Any, table: StorageTable, recorder: Any) -> None:
        self.core = core
        self.table = table
        self.recorder = recorder
        self.recent: List[List[int]] = []  # handles each of the last limits.RECENT_OPS ops read or wrote
        self.next_full_poll = limits.POLL_EVERY
        # Tracking only: a scheduled full poll waits for an op that could set a new peak (Note [Liveness]).
        self.on_schedule = recorder is not None or core.budget >= 0

    def due(self, ops_seen: int, need: int) -> bool:
        """Whether the scheduled full poll is due before an op that brings the core's memory to ``need`` bytes."""
        return ops_seen >= self.next_full_poll and (self.on_schedule or need > self.core.peak_memory)

    def saw(self, handles: List[int]) -> None:
        """An op read or wrote ``handles``: the next ops' partial polls look at them."""
        recent = self.recent
        recent.append(handles)
        if len(recent) > limits.RECENT_OPS:
            del recent[0]

    def _check(self) -> None:
        """Assert that the recent handles are few and were made by the table. O(limits.RECENT_OPS * arity).

        Raises:
            AssertionError: they are not (a bug in the runtime).
        """
        assert len(self.recent) <= limits.RECENT_OPS, f"{len(self.recent)} recent ops kept, at most {limits.RECENT_OPS}"
        last = self.table._next_handle
        assert all(1 <= h <= last for hs in self.recent for h in hs), "a recent op names a handle never made"

    def poll(self, ops_seen: int, handles: Optional[Iterable[int]] = None) -> None:
        """Tell the core about tracked storages the program no longer references.

        Args:
            ops_seen: the block's op count (a full poll schedules the next one from it).
            handles: check only these (the last ops' tensors, cheap enough for
                every op); None checks every tracked storage (O(live tensors)).
        """
        phys, core, alive = self.table.phys, self.core, self.table.alive
        storage_of = core.storage_of
        if handles is None:
            self.schedule(ops_seen)
            # _Buf.dead() inlined for the program's (weakly held) buffers: this runs for every live tensor.
            dead = [h for h, t in alive.items()
                    if (_expired(b.weak) if (b := phys[storage_of(t)]).strong is None else b.dead())]
        else:  # (likewise: this runs for every op)
            dead = [h for h in dict.fromkeys(handles) if (t := alive.get(h)) is not None
                    and (_expired(b.weak) if (b := phys[storage_of(t)]).strong is None else b.dead())]
        if not dead:
            return
        # Activations first, so the core knows they are gone before anything is
        # recomputed; then constants, each protected while all are still there,
        # except those worth keeping for now (Note [Keeping a dead constant]).
        pinned = core.pinned
        constants = [h for h in dead if pinned(storage_of(alive[h]))]
        if handles is not None:  # (a partial poll: see Note [Protecting in a partial poll])
            for h in constants:
                c = storage_of(alive[h])
                if not self.worth_keeping(c):
                    self.release_dropped_targets(c)
                    if not all(map(core.resident, core.protect_targets(c))):
                        self.poll(ops_seen)  # protecting would recompute: first learn of every drop
                        return
        for h in dead:
            if h not in constants and h in alive:  # (release_dropped_targets may have released it)
                self.release(h)
        constants = [h for h in constants if h in alive and not self.worth_keeping(storage_of(alive[h]))]
        for h in constants:
            if self.recorder is not None:
                self.recorder.protect(h)
            core.protect(core.storage_of(self.table.alive[h]))
        for h in constants:
            self.release(h)

    # Note [Protecting in a partial poll]
    # A poll of the last ops' tensors that finds a dropped constant it will not
    # keep protects it, which pins what was computed from it. If that recomputes
    # something, the recomputation must not read a storage the program dropped
    # since the last full poll, so the poll becomes a full one first (O(live
    # tensors)). If everything protect() would pin is resident, nothing is
    # recomputed: the dropped ones among them are released (as before a write to
    # a constant) and the partial poll goes on. Gradients summed in place (the
    # dispatch-key entry: autograd accumulates in place when no Python object
    # holds a gradient) make version chains that are pinned at limits.MAX_VERSIONS,
    # and pinned gradients are dropped (by autograd, or by the program's
    # zero_grad(set_to_none=True)): a full poll for each cost the TreeLSTM about
    # 5% of a step. The native path settles such a poll itself when no dropped
    # target must be released first and nothing must be recomputed
    # (csrc/native/liveness.cpp, settle_constants): it cost 5.7 ms a TreeLSTM
    # step in Python. (Pinned gradients were dropped at each later sum then,
    # summed out of place, until Note [Constants held weakly] in
    # storage_table.py.)

    def schedule(self, ops_seen: int) -> None:
        """Set when the next scheduled full poll is due; called by every full poll.

        Every limits.POLL_EVERY ops or, under a budget (which polls fully anyway
        whenever room must be made), every len(alive) / 4 ops when more
        tensors live: amortized O(1) per op. Without a budget or while
        recording, limits.POLL_EVERY keeps the peak accounting and the log's
        releases prompt.
        """
        lazy = self.recorder is None and self.core.budget >= 0
        every = max(limits.POLL_EVERY, len(self.table.alive) // 4) if lazy else limits.POLL_EVERY
        self.next_full_poll = ops_seen + every

    def worth_keeping(self, s: int) -> bool:
        """Whether dead constant ``s`` costs less kept than protecting what needs it (Note [Keeping a dead constant]).

        O(storages computed from ``s``), run at each full poll while it is kept.
        """
        core = self.core
        size = core.storage_size
        return size(s) < sum(size(d) for d in core.protect_targets(s))

    def release_dropped_targets(self, s: int) -> None:
        """Before protect(s): release what it would pin that the program dropped since the last poll."""
        core, phys, handle, alive = self.core, self.table.phys, self.table.handle, self.table.alive
        for d in core.protect_targets(s):
            buf = phys.get(d)
            if buf is None or not buf.dead():
                continue
            for t in core.storage_tensors(d):
                h = handle.get(t)
                if h is not None and alive.get(h) == t:
                    self.release(h)

    def release(self, h: int) -> None:
        """The program dropped the storage of handle ``h``: release it in the table, the log and the core."""
        t = self.table.drop(h)
        if self.recorder is not None:
            self.recorder.release(h)
        core = self.core
        core.release(t)
        s = core.storage_of(t)
        if core.resident(s) and core.storage_refs(s) == 0:  # kept for an evicted dependent
            buf = self.table.phys.get(s)
            if buf is None or buf.get() is None:  # but its memory is gone: it must be recomputed
                core.forget(s)
