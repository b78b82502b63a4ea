"""The dispatch mode that feeds every PyTorch op to the core and carries out its decisions.

The design and its measurements: docs/runtime-design.md; the rules are in the
Note [...] blocks next to the code they explain.
"""
from __future__ import annotations

import logging
import math
import sys
import weakref
from itertools import chain
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode_stack

from dtr.core import Core
from dtr.errors import OutOfBudgetError, ThrashingError
from dtr.runtime.costs import CostModel
from dtr.runtime.effects import has_hidden_writes, may_write, overwrites_self, schema_writes, written_args
from dtr.runtime.recorder import LogRecorder
from dtr.runtime.timing import ProvisionalCosts, Timer, WallTimer, make_timer
from dtr.semantics import remat_allowance

__all__ = ["DTRMode", "Slot"]

log = logging.getLogger("dtr.runtime")
_use_count = torch._C._storage_Use_Count
_expired = torch.UntypedStorage._expired  # StorageWeakRef.expired() without its two Python frames
_free_weak_ref = torch.UntypedStorage._free_weak_ref
_refcount = sys.getrefcount
# Tensor.untyped_storage unwrapped: a block wraps the public method (Note [Escaped memory] in escapes.py).
_storage = torch._C.TensorBase.untyped_storage

# Note [Liveness]
# The runtime holds only *weak* references to the storages the program owns
# (user variables, views and autograd's saved tensors hold the strong ones), so
# a storage the program drops is freed by PyTorch at once, exactly as without
# dtr. The core learns of it at the next poll, and until then counts it as
# resident: its accounting errs on the safe side. Before every op, the
# storages that the last _RECENT_OPS ops read or wrote are checked: most die
# right after their last use (a variable rebound, autograd dropping a node's
# saved tensors once the node's backward ops ran). Every _POLL_EVERY ops (or,
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
_POLL_EVERY = 16
_RECENT_OPS = 4     # see Note [Liveness]
_MAX_VERSIONS = 8   # see Note [Version chains]
_GC_MIN_OPS = 256
_COMPACT_MIN_OPS = 4096  # see Note [Compaction]
_MAX_PREDICTIONS = 1 << 16
# Note [Sizes before allocation]
# The core makes room *before* an op allocates, so output sizes are needed in
# advance: the op runs once on meta tensors and the result is cached by op and
# input shapes/strides/dtypes, so a training loop pays for it once: the cache is
# process-wide, shared by every block (with one block per training step, a
# cache per block reran every op on meta tensors each step: 15-25% of a small
# CNN's step).
_PREDICTIONS: Dict[Any, "_Prediction"] = {}  # (op, argument shapes...) -> output sizes, process-wide
_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")  # see Note [Adopting recomputed bytes]
# Note [Constants from earlier blocks]
# A constant enters the core when an op first touches it, so a step counted
# the gradients only from its backward on: its forward could spend their share
# of the budget although they were resident all along (on the GPT benchmark
# the measured peak ran 34 MiB over a 117 MiB budget, all of it gradients and
# later layers' weights). The budget is meant as a device cap, so when a block
# ends, the storages the program still holds are remembered (weakly, per
# device type) and the next block on that device counts those still alive
# from its first op, as constants (only after a block that ended normally: a
# failed one leaves the program's state to its traceback, not to the next
# block). One ``with`` per training step thus counts
# parameters, gradients and optimizer state from the start of every step after
# the first; with one ``with`` around all steps they stay in the core anyway.
# A remembered storage the program drops is dead, so it is freed at a poll.
_CARRIED: Dict[str, List["_Buf"]] = {}  # weakly held buffers; see Note [Constants from earlier blocks]
_REMAT = "remat"    # the timer's tag of a recomputation (see Note [Measured costs])
_SEEDED = torch.Tag.nondeterministic_seeded  # a random op: its generator state is saved for recomputation

# Note [Keeping what evicted tensors need]
# The core (Config::keep_needed, its Note [Freeing what an evicted tensor
# needs]) keeps a released storage resident while an evicted, referenced
# storage depends on it. The runtime makes that real: when a referenced
# storage is evicted, the buffers it is computed from become strongly held
# (as constants' are), so the program dropping one of them later does not free
# its memory; the core frees it (resizes it to 0) once nothing evicted needs
# it. A storage that was already gone when it was released is "forgotten"
# (marked evicted) so that it is recomputed rather than read.

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

# Note [Dropped buffers]
# The core learns that the program dropped a storage only at the next poll;
# until then it still counts a reference. Anything that brings such a storage
# back in between (protect() pinning what still needs a constant's old value,
# a recomputation) fills a buffer of dtr's own. Two things keep that from
# living for ever: before a write to a constant, what protect() would pin is
# checked (only that: a full poll per parameter update would cost O(live) each)
# and released if dropped, so that protect() pins (and recomputes, with its
# whole forward chain) only what the program still holds; and a buffer dtr
# allocates in place of a dropped program storage reports itself dead, so the
# next poll releases it (a pinned one as a dead constant). It is also no longer
# mistaken for the live version of a new storage that reuses its address.
# Without this, the seed gradient (ones_like(loss)) of each backward was
# recomputed and pinned by the optimizer's first parameter update, then held
# by dtr: one more recipe, buffer and live tensor every step (and its forward
# chain recomputed to compute it).

# Note [Compaction]
# Graph GC (collect, every few hundred ops) drops the recipes of ops the core
# will never run again and the buffers of storages it will never need again;
# the core marks them collected (Note [Collection and compaction] in
# csrc/core_compact.cpp). Once more than half of the core's storages were collected
# since the last compaction, the core drops them from its tables and
# renumbers what is left; every core id held here (recipes and their slots,
# buffers, handles, versions, liveness) goes through the maps it returns.
# Each compaction costs time linear in the tables, which are then at most
# about twice what is live: amortized O(1) per op, and the metadata of one
# block over many training steps stays bounded. Tables of fewer than
# _COMPACT_MIN_OPS ops are never compacted: what compaction would free there
# is a few hundred kilobytes at most, and renumbering every recipe in Python
# was the largest single cost of a short block (one ``with`` per training step
# of a 645-op MLP compacted once per step, about 2 µs per op).

# Note [Measured costs]
# With cost_model="time" every op runs between timer.start() and timer.stop()
# (dtr/runtime/timing.py). On CPU the cost is the host time, known at once. On
# CUDA it comes from events resolved a few ops later (Note [Timing on CUDA]):
# the op ends in the core with a provisional cost (Note [Provisional costs]),
# its measurement is deferred under the tag (op, sig, func), and a poll at the
# start of each later op hands resolved times to Core.set_cost. Compaction
# renumbers the tags' ops (a dropped op's time is discarded). Recomputations
# are timed the same way under the tag _REMAT; their times only add up in
# remat_seconds (on CUDA, as they resolve; all are in by the end of the block).
#
# Note [Recording on CUDA]
# A recorded log must carry the cost the core used, so that a replay makes the
# runtime's decisions. While recording on CUDA the timer therefore waits for
# each op's end event (one synchronization per op): the cost is exact when the
# op ends, nothing is provisional and no set_cost happens. Recording is an
# offline activity; buffering log lines until their costs resolve would write
# costs the core never used at decision time.

# Note [Version chains]
# Each in-place write makes a new version computed from the old one, so a
# buffer written every step (optimizer state, accumulated gradients) would keep
# a recomputation chain, and its recipes, as long as the run. After
# _MAX_VERSIONS consecutive in-place versions the storage is pinned: it becomes
# a constant (it is long-lived anyway), and its history can be collected.
# Activations rarely see more than two or three in-place writes (ReLU(inplace),
# a residual +=), so they stay evictable.


class _Buf:
    """The buffer of one storage version: the program's or dtr's own.

    The program's activations are held weakly (freed when the program drops
    them). Constants are held strongly, so that when the program drops one,
    whatever still needs its value can be protected before it goes; they are
    dead once dtr's is the only reference (``shared`` set). A buffer dtr
    allocates to bring back a version whose program storage is gone
    (``dropped`` set) is dead from the start: see Note [Dropped buffers].
    """

    __slots__ = ("weak", "strong", "shared", "dropped")

    def __init__(self, storage: torch.UntypedStorage, owned: bool, shared: bool = False, dropped: bool = False):
        self.strong = storage if owned else None
        # A raw weak pointer (what StorageWeakRef wraps, without its Python frames): freed in __del__.
        self.weak = None if owned else storage._weak_ref()
        self.shared = shared
        self.dropped = dropped

    def __del__(self) -> None:
        if self.weak is not None and _free_weak_ref is not None:
            _free_weak_ref(self.weak)

    def get(self) -> Optional[torch.UntypedStorage]:
        if self.strong is not None:
            return self.strong
        if _expired(self.weak):
            return None
        return torch.UntypedStorage._new_with_weak_ptr(self.weak)

    def dead(self) -> bool:
        if self.strong is not None:
            # Dead once no tensor but dtr's and no Python reference but this one hold it: the program may
            # hold the storage object itself (a storage's clone, a torch.load), which counts no tensor.
            return self.dropped or (self.shared and _use_count(self.strong._cdata) <= 1
                                    and _refcount(self.strong) <= 2)
        return bool(_expired(self.weak))

    def live(self) -> torch.UntypedStorage:
        """The storage, which dtr holds or the program still does: for buffers dtr is about to read or write."""
        st = self.get()
        if st is None:
            raise RuntimeError("dtr internal error: the buffer of a storage dtr needs is gone; please report this")
        return st


# Note [Handles]
# A handle names one storage as the program sees it, across its in-place
# versions: an in-place write moves the handle to the new version. Liveness is
# kept per handle (``alive``: handle -> current version, in creation order),
# and a recorded log names tensors by handle. Handles are ints counted from 1
# in each block; a log's spelling of them ("t7") is LogRecorder's, made only
# when a log is recorded. Each is made once, by _new_handle, and only copied
# after that, so equal handles are one object (the native path's poll
# compares them by identity).


# Note [Versions]
# The core sees one tensor per *version* of a physical storage. A view is not
# a new core tensor (it shares the storage, so it comes back with it). An
# in-place op creates a new version that takes over the buffer; the old version
# loses its bytes but stays recomputable into a fresh buffer if something
# evicted still needs the old value. Recorded ops refer to their inputs by
# version (a Slot), never by the tensor object, so a recomputation always reads
# the value the op originally read.
class Slot(NamedTuple):
    """A tensor argument or output of a recorded op: a view of one storage version."""

    tensor: int            # core tensor (storage version)
    offset: int
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    dtype: torch.dtype


class Recipe(NamedTuple):
    """What it takes to run a recorded op again (see Note [Recipes and the cyclic GC])."""

    func: Any
    leaves: Tuple[Any, ...]  # flattened (args, kwargs), tensors replaced by Slots
    spec: Any
    outputs: Tuple[Tuple[int, Slot], ...]     # (flat output position, slot) of outputs that own a storage
    writes: Tuple[Tuple[int, int, int], ...]  # (leaf position, old version, new version or -1 for a constant)
    rng: Optional[Tuple[Tuple[torch.Generator, torch.Tensor], ...]]  # (generator, state before the op)


# Note [Recipes and the cyclic GC]
# Recipes are the runtime's long-lived objects, one per op, and every container
# object that outlives a few ops makes Python's cyclic GC run more often and
# traverse more (no recipe is ever part of a cycle). So a recipe and its flatten
# spec hold tuples, never lists: the GC stops tracking a plain tuple of atoms
# (a spec, an op's empty writes are the shared ``()``), while it always
# tracks a list. On a chain of 9000 small ops (h = tanh(h @ w) * 0.5, 64x64,
# under budget(None)) the GC's share of the runtime's overhead went from about
# 6.6 to 3.2 us per op.


# Note [Flattening]
# Every dispatched op's arguments are flattened to find its tensors. At the
# ATen level arguments are tensors, scalars and (nested) lists or tuples of
# them, so a small recursive flattener does, at a fraction of the cost of the
# general pytree machinery on this hot path.

def _flat(x: Any, leaves: list) -> Any:
    if isinstance(x, (list, tuple)):  # (tuples: see Note [Recipes and the cyclic GC])
        return (list if isinstance(x, list) else tuple, tuple([_flat(v, leaves) for v in x]))
    leaves.append(x)
    return None


def _count_leaves(x: Any) -> int:
    """How many leaves _flat makes of x."""
    if isinstance(x, (list, tuple)):
        return sum(_count_leaves(v) for v in x)
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
    it = iter(leaves)
    if spec[0] == "ak":
        args = _unflat(spec[1], it)
        return args, {k: _unflat(s, it) for k, s in spec[2]}
    return _unflat(spec[1], it)


def _layouts(leaves: List[Any]) -> Tuple[Any, ...]:
    """Each leaf's part of an op's signature: (shape, stride, dtype) of a strided tensor, else a hashable value."""
    return tuple([((tuple(x.shape), tuple(x.stride()), x.dtype) if not _opaque(x)
                   else (x.layout, x.dtype)) if isinstance(x, torch.Tensor)  # (Note [Other layouts])
                  else _hashable(x) for x in leaves])


def _numel(size: Tuple[int, ...]) -> int:
    n = 1
    for d in size:
        n *= d
    return n


def _contiguous(size: Tuple[int, ...], stride: Tuple[int, ...]) -> bool:
    """``Tensor.is_contiguous()`` from a shape and strides (dimensions of size 1 may have any stride)."""
    expected = 1
    for d, st in zip(reversed(size), reversed(stride)):
        if d == 0:
            return True
        if d != 1 and st != expected:
            return False
        expected *= d
    return True


def _slot(t: int, x: torch.Tensor) -> Slot:
    # (storage_offset() is typed int | SymInt; it is never symbolic here: dtr sees concrete tensors)
    return Slot(t, x.storage_offset(), tuple(x.shape), tuple(x.stride()), x.dtype)  # type: ignore[arg-type]


class _Prediction(NamedTuple):
    sizes: Optional[List[int]]   # bytes of each output that owns a new storage (None: unknown)
    owning: Optional[List[int]]  # their positions among the flattened outputs
    metas: List[torch.Tensor]    # the meta outputs (shapes for cost estimates)


# Note [The mode's slots]
# The attributes every op reads or writes are slots, not instance-dict
# entries: the native per-op path (csrc/native/fastpath.cpp) reads them at
# fixed offsets instead of hashing their names about 25 times per op, and
# Python reads them through member descriptors. Anything else (the native
# path's bound methods among them) stays in the instance dict that
# TorchDispatchMode gives every mode.
class DTRMode(TorchDispatchMode):
    """Runs ops through the DTR core. Created and entered by :class:`dtr.budget`."""

    __slots__ = ("device_type", "_opaque_readers", "timer", "recorder", "ops_seen", "_next_full_poll",
                 "_poll_on_schedule", "_recent_ops", "version", "cdata_of", "phys", "recipes", "handle", "alive",
                 "_next_handle", "_ops_at_gc", "_live_after_gc", "thrash_limit")

    def __init__(self, core: Core, cost_model: CostModel, recorder: Optional[LogRecorder],
                 thrash_limit: float, device: Optional[torch.device] = None, native: bool = False,
                 entry: str = "mode"):
        super().__init__()
        self.core = core
        self.cost_model = cost_model
        self.recorder = recorder
        self._recent_ops: List[List[int]] = []  # handles each of the last _RECENT_OPS ops read or wrote
        self._next_full_poll = _POLL_EVERY
        # Tracking only: a scheduled full poll waits for an op that could set a new peak (Note [Liveness]).
        self._poll_on_schedule = recorder is not None or core.budget >= 0
        self.thrash_limit = thrash_limit
        self.device_type = device.type if device is not None else None
        self.device: Optional[torch.device] = device
        self.version: Dict[int, int] = {}          # storage cdata -> core tensor (current version)
        self.cdata_of: Dict[int, int] = {}         # core tensor -> storage cdata (program-owned versions)
        self.phys: Dict[int, _Buf] = {}            # core storage -> its buffer
        self.recipes: Dict[int, Recipe] = {}       # core op -> recipe
        self.handle: Dict[int, int] = {}           # core tensor -> handle (Note [Handles])
        self.alive: Dict[int, int] = {}            # handle -> core tensor, in creation order
        self.predictions = _PREDICTIONS  # shared by every block: see Note [Sizes before allocation]
        self.remat_seconds = 0.0
        self.ops_seen = 0
        self.versions: Dict[int, int] = {}          # core tensor -> in-place versions behind it
        # _opaque_keys of a non-strided tensor -> (its guard, the core tensors computed from it)
        self._opaque_readers: Dict[Any, Tuple[Any, List[int]]] = {}
        self._ops_at_gc = 0
        self._live_after_gc = 0
        self._collected_after_compact = 0   # collected storages the core kept at the last compaction
        self._collected_ops = 0             # ops collected since the last compaction
        self._next_handle = 0
        # Until the device is known (the block's first op), a wall-clock timer that nothing uses.
        self.timer: Timer = WallTimer()  # see Note [Measured costs]
        self.provisional = ProvisionalCosts()
        core.set_hooks(on_evict=self._on_evict, on_compute=self._on_compute, on_pin=self._on_pin)
        self._compactions = 0
        self.entry = entry  # how ops should reach the mode: "mode" or "key" (see enter_dispatch)
        self.entered: Optional[str] = None  # how they did: "mode" or "key", once entered
        self._fast: Any = None
        if native or entry == "key":  # see Note [The native per-op path] in csrc/native/fastpath.cpp
            from dtr.runtime.native import fast_path
            fp = self._fast = fast_path(self, DTRMode.__torch_dispatch__)  # (it also takes over the core's hooks)
            # The same steps in C++ (tests/test_native.py compares the two paths' logs line by line).
            if native:
                self.__torch_dispatch__ = fp  # type: ignore[method-assign]
            self._constant = fp.constant  # type: ignore[method-assign]
            self._carried = fp.carried  # type: ignore[method-assign]
        if device is not None:
            self._set_device(device)

    def detach_native(self) -> None:
        """Drop the native per-op path, if any (it holds the mode: a cycle the block's end breaks)."""
        for name in ("__torch_dispatch__", "_constant", "_carried", "_fast"):
            self.__dict__.pop(name, None)

    def enter_dispatch(self) -> None:
        """Start receiving the thread's ops: as a TorchDispatchMode, or through the dispatch key.

        With ``entry="key"`` the ops come through dtr._native's dispatch key
        (Note [The dispatch-key entry] in csrc/native/fastpath.cpp): the
        native steps where they apply, else this class's __torch_dispatch__
        (all of them there without ``native``). Another block holding the
        key (in another thread), or a key dtr cannot take (another extension
        registered it: a warning says so, once), makes this one a mode.
        """
        if self.entry == "key":
            from dtr.runtime.native import key_enter
            if key_enter(self._fast, self.__dict__.get("__torch_dispatch__") is None):
                self.entered = "key"
                return
        self.__enter__()
        self.entered = "mode"

    def exit_dispatch(self, exc_type: Any = None, exc: Any = None, tb: Any = None) -> None:
        """Stop receiving the thread's ops (the end of enter_dispatch)."""
        if self.entered == "key":
            from dtr.runtime.native import native_module
            m = native_module()
            assert m is not None, "entered through the key without dtr._native"
            m.key_exit()
            return
        self.__exit__(exc_type, exc, tb)

    def receives_ops(self) -> bool:
        """Whether the thread's next op comes to this mode (not while dtr's own work runs, nor after the block)."""
        if self.entered == "key":
            from dtr.runtime.native import key_active
            return key_active()
        return self in _get_current_dispatch_mode_stack()

    def off(self) -> Any:
        """A context in which the thread's ops do not come to this mode (nor any other mode)."""
        if self.entered == "key":
            from dtr.runtime.native import key_off
            return key_off()
        return _disable_current_modes()

    # ----------------------------------------------------------------- tracking
    def _trackable(self, x: Any) -> bool:
        if not isinstance(x, torch.Tensor) or x.layout != torch.strided or x.is_nested or x.is_meta:
            return False
        dev = x.device.type
        if self.device_type is None:
            self._set_device(x.device)
        return dev == self.device_type

    def _set_device(self, device: torch.device) -> None:
        self.device_type = device.type
        self.device = device
        self.timer = make_timer(device, self._on_timed, sync=self.recorder is not None)
        for w in _CARRIED.pop(device.type, ()):  # see Note [Constants from earlier blocks]
            st = w.get()
            if st is not None:
                self._constant(st)

    def carry_out(self) -> None:
        """Remember the resident storages the program still holds, for the next block on this device."""
        if self.device_type is None:
            return
        _CARRIED[self.device_type] = self._carried()

    def _carried(self) -> List["_Buf"]:
        """Each resident storage the program still holds, once, in a buffer that holds it weakly. O(live tensors)."""
        keep = {}  # storage address -> its buffer
        for t in self.alive.values():
            buf = self.phys.get(self.core.storage_of(t))
            st = buf.get() if buf is not None and not buf.dropped else None
            if st is not None and st.nbytes() > 0 and st._cdata not in keep:
                keep[st._cdata] = _Buf(st, owned=False)
        return list(keep.values())

    def _new_handle(self) -> int:
        """A new program tensor's handle (see Note [Handles])."""
        self._next_handle += 1
        return self._next_handle

    def _track(self, x: torch.Tensor) -> int:
        """The core tensor (current version) of x's storage; a constant on first sight."""
        st = _storage(x)
        cdata = st._cdata
        t = self.version.get(cdata)
        if t is not None and self.phys[self.core.storage_of(t)].dead():
            t = None  # the address of a storage that died since the last poll, reused
        if t is None:
            t = self._constant(st)
        return t

    def _constant(self, st: torch.UntypedStorage) -> int:
        """Register a storage that existed before the block as a constant; its core tensor."""
        cdata = st._cdata
        t = self.core.constant(st.nbytes())
        self.version[cdata] = t
        self.cdata_of[t] = cdata
        self.phys[self.core.storage_of(t)] = _Buf(st, owned=True, shared=True)
        h = self.handle[t] = self._new_handle()
        self.alive[h] = t
        if self.recorder is not None:
            self.recorder.constant(h, st.nbytes())
        return t

    def poll(self, handles: Optional[Iterable[int]] = None) -> None:
        """Tell the core about tracked storages the program no longer references.

        Args:
            handles: check only these (the last ops' tensors, cheap enough for
                every op); None checks every tracked storage (O(live tensors)).
        """
        phys, core, alive = self.phys, self.core, self.alive
        storage_of = core.storage_of
        if handles is None:
            self._schedule_full_poll()
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
                if not self._worth_keeping(c):
                    self._release_dropped_targets(c)
                    if not all(map(core.resident, core.protect_targets(c))):
                        self.poll()  # protecting would recompute: first learn of every drop
                        return
        for h in dead:
            if h not in constants and h in alive:  # (_release_dropped_targets may have released it)
                self._release(h)
        constants = [h for h in constants if h in alive and not self._worth_keeping(storage_of(alive[h]))]
        for h in constants:
            if self.recorder is not None:
                self.recorder.protect(h)
            core.protect(core.storage_of(self.alive[h]))
        for h in constants:
            self._release(h)

    # Note [Protecting in a partial poll]
    # A poll of the last ops' tensors that finds a dropped constant it will not
    # keep protects it, which pins what was computed from it. If that recomputes
    # something, the recomputation must not read a storage the program dropped
    # since the last full poll, so the poll becomes a full one first (O(live
    # tensors)). If everything protect() would pin is resident, nothing is
    # recomputed: the dropped ones among them are released (as before a write to
    # a constant) and the partial poll goes on. Gradients summed in place (the
    # dispatch-key entry: autograd accumulates in place when no Python object
    # holds a gradient) make version chains that are pinned at _MAX_VERSIONS and
    # then dropped at each later sum: a full poll for each cost the TreeLSTM
    # about 5% of a step.

    def _schedule_full_poll(self) -> None:
        """Set when the next scheduled full poll is due; called by every full poll.

        Every _POLL_EVERY ops or, under a budget (which polls fully anyway
        whenever room must be made), every len(alive) / 4 ops when more
        tensors live: amortized O(1) per op. Without a budget or while
        recording, _POLL_EVERY keeps the peak accounting and the log's
        releases prompt.
        """
        lazy = self.recorder is None and self.core.budget >= 0
        every = max(_POLL_EVERY, len(self.alive) // 4) if lazy else _POLL_EVERY
        self._next_full_poll = self.ops_seen + every

    def _worth_keeping(self, s: int) -> bool:
        """Whether dead constant ``s`` costs less kept than protecting what needs it (Note [Keeping a dead constant]).

        O(storages computed from ``s``), run at each full poll while it is kept.
        """
        core = self.core
        size = core.storage_size
        return size(s) < sum(size(d) for d in core.protect_targets(s))

    def _release_dropped_targets(self, s: int) -> None:
        """Before protect(s): release what it would pin that the program dropped since the last poll."""
        core, phys, handle, alive = self.core, self.phys, self.handle, self.alive
        for d in core.protect_targets(s):
            buf = phys.get(d)
            if buf is None or not buf.dead():
                continue
            for t in core.storage_tensors(d):
                h = handle.get(t)
                if h is not None and alive.get(h) == t:
                    self._release(h)

    def _release(self, h: int) -> None:
        t = self.alive.pop(h)
        cdata = self.cdata_of.pop(t, None)
        if cdata is not None and self.version.get(cdata) == t:
            del self.version[cdata]
        if self.recorder is not None:
            self.recorder.release(h)
        core = self.core
        core.release(t)
        s = core.storage_of(t)
        if core.resident(s) and core.storage_refs(s) == 0:  # kept for an evicted dependent
            buf = self.phys.get(s)
            if buf is None or buf.get() is None:  # but its memory is gone: it must be recomputed
                core.forget(s)

    # ------------------------------------------------------------- core hooks
    # Note [Storages that cannot be resized]
    # A storage made outside the dispatcher over memory PyTorch does not own
    # (torch.from_numpy) and a storage whose memory was handed to NumPy
    # (.numpy()) cannot be resized. Both are constants, never evicted, but
    # one the program drops is freed at the next poll, and resize_(0) raised
    # ("Trying to resize storage that is not resizable") in the middle of the
    # block. dtr drops its own reference instead: the memory goes when the
    # last other owner (the NumPy array) lets it go, no longer PyTorch's to
    # count.
    # Note [Evicting storages in place]
    # dtr frees a storage's bytes with ``UntypedStorage.resize_(0)`` and refills it
    # with ``resize_(n)`` plus a copy of the recomputed value, as FSDP2 does. Every
    # tensor object viewing the storage (the user's, its views, autograd's saved
    # tensors) stays valid and sees the value again once it is refilled; version
    # counters are untouched because the copy goes through a fresh tensor. A
    # wrapper-subclass design would have to wrap every tensor and unwrap it per op;
    # freeing in place costs nothing on the hot path for tensors that are resident.
    def _on_evict(self, s: int) -> None:
        buf = self.phys.get(s)
        st = buf.get() if buf is not None else None
        if st is not None:
            if st.resizable():
                st.resize_(0)
            else:  # see Note [Storages that cannot be resized]
                self.phys[s] = _Buf(torch.UntypedStorage(0, device=st.device), owned=True)
        if self.core.storage_refs(s) > 0:
            self._hold_deps(s)

    def _hold_deps(self, s: int) -> None:
        """Hold the storages evicted ``s`` is computed from strongly (see Note [Keeping what evicted tensors need])."""
        phys = self.phys
        for d in self.core.storage_deps(s):
            buf = phys.get(d)
            if buf is not None and buf.weak is not None:
                st = buf.get()
                if st is not None:
                    phys[d] = _Buf(st, owned=True, shared=True)

    def _on_pin(self, s: int) -> None:
        # A constant must outlive the program's references (see _Buf): hold it.
        buf = self.phys.get(s)
        if buf is not None and buf.weak is not None:
            st = buf.get()
            if st is not None:
                self.phys[s] = _Buf(st, owned=True, shared=True)

    def _on_compute(self, op: int, remat: bool) -> None:
        if remat:
            timer = self.timer
            token = timer.start()
            try:
                self._recompute(op)
            except BaseException:
                timer.cancel(token)
                raise
            m = timer.stop(token)
            if isinstance(m, float):
                self.remat_seconds += m * 1e-9
            else:
                timer.defer(m, _REMAT)

    def _on_timed(self, tag: Any, ns: float) -> None:
        """A deferred measurement resolved (see Note [Measured costs])."""
        if tag is _REMAT:
            self.remat_seconds += ns * 1e-9
            return
        op, sig, func = tag
        self.core.set_cost(op, ns)
        self.provisional.observe(sig, func, ns)

    def _view(self, slot: Slot) -> torch.Tensor:
        st = self.phys[self.core.storage_of(slot.tensor)].live()
        return torch.empty(0, dtype=slot.dtype, device=st.device).set_(st, slot.offset, slot.size, slot.stride)

    def _refill(self, t: int) -> torch.UntypedStorage:
        """The storage of version t, with its bytes allocated (dtr's own buffer if the program dropped it)."""
        s = self.core.storage_of(t)
        n = self.core.storage_size(s)
        buf = self.phys.get(s)
        st = buf.get() if buf is not None else None
        # None: the program dropped it (see Note [Dropped buffers]), or the version is a banished one
        # (collected: its buffer went with it) that an op recomputed for its other outputs writes anyway;
        # the core frees it again as soon as the op ran.
        if st is None:
            st = torch.UntypedStorage(n, device=self.device)
            self.phys[s] = _Buf(st, owned=True, dropped=True)
        elif st.nbytes() != n:
            st.resize_(n)
        return st

    def _recompute(self, op: int) -> None:
        r = self.recipes[op]
        leaves = [self._view(x) if isinstance(x, Slot) else x for x in r.leaves]
        moved = []  # storages holding bytes handed over to this op
        for pos, old, new in r.writes:
            if new < 0:  # a constant's side effect: run it on a copy and drop it
                leaves[pos] = leaves[pos].clone()
            elif self.core.handed(self.core.storage_of(old)):  # the old bytes become the new version's
                leaves[pos] = self._hand_over(old, new, r.leaves[pos], self._overwrites_all(r, pos, new))
                moved.append(_storage(leaves[pos]))
            else:        # the new version starts as a copy of the old one (unless the op overwrites it all)
                st = self._refill(new)
                if not self._overwrites_all(r, pos, new):
                    st.copy_(self.phys[self.core.storage_of(old)].live())
                leaves[pos] = self._view(r.leaves[pos]._replace(tensor=new))
        args, kwargs = tree_unflatten(leaves, r.spec)
        if r.rng is not None:  # replay the random op with the generator state it first saw
            saved = _rng_state(r.rng)
            _set_rng_state(r.rng)
        try:
            out = r.func(*args, **kwargs)
        except BaseException:
            for st in moved:  # the new version stays evicted; the core evicts the old one too
                st.resize_(0)
            raise
        finally:
            if r.rng is not None:
                _set_rng_state(saved)
        flat = tree_flatten(out)[0]
        # A resident twin is dropped, and so is a banished sibling (the core frees it at once; it may be
        # collected, its buffer gone): keeping its bytes would be memory the core does not count.
        core = self.core
        back = []
        for pos, slot in r.outputs:
            s = core.storage_of(slot.tensor)
            if not core.resident(s) and not core.banished(s):
                back.append((slot, flat[pos]))
        # Adopt only fresh buffers, each once: never an input's (an op that aliased one this time).
        srcs = {_storage(o)._cdata for _, o in back}
        adopt = _SWAP and len(srcs) == len(back) and not any(
            isinstance(x, torch.Tensor) and not _opaque(x) and _storage(x)._cdata in srcs for x in leaves)
        for slot, o in back:
            if not (adopt and self._adopt(slot, o)):
                self._refill(slot.tensor)
                self._view(slot).copy_(o)

    def _overwrites_all(self, r: Recipe, pos: int, new: int) -> bool:
        """Whether the recipe's write at leaf ``pos`` replaces every byte of ``new``'s storage."""
        x = r.leaves[pos]
        n = self.core.storage_size(self.core.storage_of(new))
        return pos == 0 and overwrites_self(r.func) and x.offset == 0 and \
            _contiguous(x.size, x.stride) and _numel(x.size) * x.dtype.itemsize == n

    def _hand_over(self, old: int, new: int, slot: Slot, overwrites_all: bool) -> torch.Tensor:
        """Move the old version's bytes into the new version's storage; the view the op writes.

        See the core's Note [Handing bytes over on recomputation]: nothing reads
        the old version after this op, and the core evicts it once the op ran
        (freeing nothing). O(1) with ``_swap_data_ptr_``; otherwise one copy,
        after which the old buffer is freed at once, so that memory matches the
        core's count before the op allocates.
        """
        core = self.core
        src = self.phys[core.storage_of(old)].live()
        s = core.storage_of(new)
        n = core.storage_size(s)
        buf = self.phys.get(s)
        dst = buf.get() if buf is not None else None
        if dst is None:  # the program dropped it (see Note [Dropped buffers])
            dst = torch.UntypedStorage(0, device=self.device)
            self.phys[s] = _Buf(dst, owned=True, dropped=True)
        if _SWAP and dst.nbytes() == 0 and src.nbytes() == n:
            dst._swap_data_ptr_(src)  # type: ignore[attr-defined]  # (torch >= 2.12: see _SWAP)
        else:
            if dst.nbytes() != n:
                dst.resize_(n)
            if not overwrites_all:
                dst.copy_(src)
            src.resize_(0)
        return self._view(slot._replace(tensor=new))

    # Note [Adopting recomputed bytes]
    # A recomputation runs the op as it first ran, so each output it brings back
    # has the layout the evicted version had. Rather than refill the version's
    # storage (resize_(n): fresh pages) and copy the new output into it (one more
    # pass over the bytes), the runtime swaps the new output's buffer into the
    # evicted storage (``UntypedStorage._swap_data_ptr_``: an evicted storage holds
    # 0 bytes, so the swap is allowed) and drops the now empty output. On the GPT
    # benchmark at 15% the copies and refills were 0.64 s of 1.42 s spent
    # recomputing. A layout mismatch, two outputs sharing one buffer, or a torch
    # without the method (2.11 has none) falls back to refill-and-copy, which holds
    # the op's outputs twice for a moment: the real peak can pass the budget by
    # them. Likewise a recomputed in-place op starts its new version as a copy of
    # the old one only if it reads it: a fill or in-place sampler (dropout's
    # bernoulli_) that covers its whole storage gets a fresh buffer
    # (effects.overwrites_self).
    def _adopt(self, slot: Slot, o: torch.Tensor) -> bool:
        """Move the recomputed output's bytes into the version's storage; False if its layout differs.

        See Note [Adopting recomputed bytes]. O(1): no copy, no allocation.
        """
        src = _storage(o)
        s = self.core.storage_of(slot.tensor)
        if src.nbytes() != self.core.storage_size(s) or o.storage_offset() != slot.offset \
                or tuple(o.shape) != slot.size \
                or tuple(o.stride()) != slot.stride or o.dtype != slot.dtype:
            return False
        st = self.phys[s].get()
        if st is None:  # the program dropped it (see Note [Dropped buffers])
            self.phys[s] = _Buf(src, owned=True, dropped=True)
        elif st.nbytes() == 0:
            st._swap_data_ptr_(src)  # type: ignore[attr-defined]  # (torch >= 2.12: see _SWAP)
        else:
            return False
        return True

    # ---------------------------------------------------------------- dispatch
    def _predict(self, func, leaves, spec, sig) -> _Prediction:
        pred = self.predictions.get(sig)
        if pred is not None:
            return pred
        try:
            meta = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
                    if isinstance(x, torch.Tensor) else x for x in leaves]
            margs, mkwargs = tree_unflatten(meta, spec)
            mout = tree_flatten(func(*margs, **mkwargs))[0]
            metas = {id(x) for x in meta if isinstance(x, torch.Tensor)}
            in_storages = {_storage(x)._cdata for x in meta if isinstance(x, torch.Tensor)}
            owning, sizes = [], []
            for i, o in enumerate(mout):
                if isinstance(o, torch.Tensor) and id(o) not in metas and \
                        _storage(o)._cdata not in in_storages:
                    owning.append(i)
                    sizes.append(_storage(o).nbytes())
            pred = _Prediction(sizes, owning, [o for o in mout if isinstance(o, torch.Tensor)])
        except Exception:  # data-dependent or without a meta kernel: sizes known only after running
            pred = _Prediction(None, None, [])
        if len(self.predictions) >= _MAX_PREDICTIONS:  # a bound for programs with ever-new shapes
            self.predictions.clear()
        self.predictions[sig] = pred
        return pred

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, spec = tree_flatten((args, kwargs))
        device_type = self.device_type
        if device_type is None:
            tpos = [i for i, x in enumerate(leaves) if self._trackable(x)]
        else:  # _trackable, inlined for the hot path (once the device is known)
            tpos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.layout == torch.strided
                    and not x.is_nested
                    and not x.is_meta and x.device.type == device_type]
        if self._opaque_readers:  # see Note [Other layouts]
            self._before_opaque_writes(func, args, kwargs)
        if not tpos:
            return self._run_untracked_inputs(func, args, kwargs, leaves, spec)
        if func in _REBINDS:
            return self._rebind(func, args, kwargs)
        self.ops_seen += 1
        core = self.core
        if self.timer.pending:  # costs measured on the device since the last op
            self.timer.poll()
        ins = [self._track(leaves[i]) for i in tpos]

        # Written tensors: their leaf positions, split into versions and constants.
        plain_writes, const_writes = [], []
        for pos in self._written_leaves(func, args, kwargs, leaves):
            t = self.version[_storage(leaves[pos])._cdata]
            (const_writes if core.pinned(core.storage_of(t)) else plain_writes).append((pos, t))

        layouts = _layouts(leaves)
        sig = (func, layouts)
        pred = self._predict(func, leaves, spec, sig)
        if pred.sizes is None:  # no meta kernel: run it first, account for it after
            return self._run_unpredicted(func, args, kwargs, leaves, spec, ins, tpos)
        sizes = list(pred.sizes)
        need = core.memory + sum(sizes)
        if (self.ops_seen >= self._next_full_poll and (self._poll_on_schedule or need > core.peak_memory)) \
                or (core.budget >= 0 and need > core.budget) \
                or not all(map(core.defined, ins)):  # a recomputation must not read a storage just dropped
            self.poll()
        elif self._recent_ops:
            self.poll(chain.from_iterable(self._recent_ops))
        rng = _rng_capture(func, leaves, leaves[tpos[0]].device) if _SEEDED in func.tags else None

        # The core brings the inputs back, locks them and makes room; then the op runs.
        protected = 0
        while protected < len(const_writes):
            for _, t in const_writes[protected:]:
                s = core.storage_of(t)
                self._release_dropped_targets(s)  # see Note [Dropped buffers]
                if not all(map(core.resident, core.protect_targets(s))):
                    self.poll()  # protecting recomputes: it must not read a storage just dropped
                core.protect(s)
            protected = len(const_writes)
            # See Note [Writes that protecting pins]: a version this op writes may be pinned by now.
            newly = [w for w in plain_writes if core.pinned(core.storage_of(w[1]))]
            if newly:
                plain_writes = [w for w in plain_writes if w not in newly]
                const_writes += newly
        if plain_writes:
            inplace_of = [-1] * len(sizes) + [ins.index(t) for _, t in plain_writes]
            all_sizes = sizes + [core.storage_size(core.storage_of(t)) for _, t in plain_writes]
        else:
            inplace_of, all_sizes = [-1] * len(sizes), sizes
        cost = 0.0  # a view computes nothing
        if not self.cost_model.measured and (sizes or plain_writes or const_writes):
            cost = self.cost_model.estimate(func, args, kwargs, pred.metas)
        if self.thrash_limit != math.inf:  # let the core stop a runaway chain of recomputations as it happens
            core.set_remat_limit(remat_allowance(self.thrash_limit, core.base_compute))
        op = core.begin_call(ins, all_sizes, [-1] * len(all_sizes), inplace_of, cost)
        try:
            out, flat_out, cost, pending = self._execute(func, args, kwargs, cost, sig)
        except BaseException:
            core.abort_call(op)
            raise
        # An op that writes nothing leaves its inputs' layouts as they were: the recipe reuses the signature's.
        self._commit(op, func, leaves, spec, ins, tpos, sizes, pred.owning, flat_out, plain_writes, const_writes,
                     rng, cost, None if pending is None else (pending, sig),
                     None if plain_writes or const_writes else layouts)
        return out

    def _native_predict(self, func, args, kwargs) -> Tuple[list, Any, Tuple[Any, ...], _Prediction]:
        """For the native path, on first sight of a signature: (leaves, spec, layouts, prediction)."""
        leaves, spec = tree_flatten((args, kwargs))
        layouts = _layouts(leaves)
        return leaves, spec, layouts, self._predict(func, leaves, spec, (func, layouts))

    # Note [Rebinding a tensor's storage]
    # aten::set_ makes its ``self`` view another storage (or a new empty one):
    # it writes no bytes, although its schema marks ``self`` as written. Taken
    # as a write, it made a new version of self's old storage whose buffer was
    # the source's storage, so the source's bytes were later freed as that
    # version's (a storage's clone, ``copy.deepcopy`` and ``torch.load`` run
    # set_ on fresh tensors: they came back empty, even without a budget). It
    # is a view instead: the source is brought back, as for any read, and the
    # tensor then shares its storage, which dtr already tracks by storage (or
    # meets as a constant if it came from outside the dispatcher). Nothing is
    # recomputable about it, so it has no recipe and no log record.
    def _rebind(self, func, args, kwargs):
        """Run aten::set_ (see Note [Rebinding a tensor's storage]); the source comes back first."""
        src = args[1] if len(args) > 1 else kwargs.get("source")
        st = _storage(src) if isinstance(src, torch.Tensor) else src
        t = self.version.get(st._cdata) if isinstance(st, torch.UntypedStorage) else None
        if t is not None and not self.phys[self.core.storage_of(t)].dead():
            if not self.core.defined(t):
                self.poll()  # (a recomputation must not read a storage just dropped)
            if self.version.get(st._cdata) == t:
                self.core.require(t)
        return func(*args, **kwargs)

    # Note [Writes that protecting pins]
    # An op that writes a constant and other tensors at once (a fused
    # optimizer step: _fused_adamw_ writes the parameters, and its schema says
    # it writes the gradients and the moments too) first protects the
    # constant, which pins what the program holds that was computed from it:
    # the gradients are. Left among the op's plain writes, such a pinned
    # gradient got a new version as if it were an activation, whose
    # recomputation reran the whole fused step on the updated parameters (on
    # a 12-parameter MLP the second moments came back wrong). A write to a
    # storage that protecting pinned is therefore a write to a constant too,
    # protected in turn (which may pin more, until nothing changes).
    def _execute(self, func, args, kwargs, cost: float, sig: Any):
        """Run the op for real; returns (result, flattened result, cost, pending measurement or None).

        The cost is the measured one, or the estimate given (flops), or, while
        the device has not reported the time yet, a provisional one.
        """
        pending = None
        if self.cost_model.measured:
            timer = self.timer
            if timer.samples and sig is not None:
                known = self.provisional.sampled(sig)
                if known is not None:  # Note [Sampled timing on CUDA]
                    out = func(*args, **kwargs)
                    return out, tree_flatten(out)[0], known, None
            token = timer.start()
            try:
                out = func(*args, **kwargs)
            except BaseException:
                timer.cancel(token)
                raise
            m = timer.stop(token)
            if isinstance(m, float):
                cost = m
            else:
                pending = m
                cost = self.provisional.guess(sig, func, m.host_ns)
        else:
            out = func(*args, **kwargs)
        return out, tree_flatten(out)[0], cost, pending

    def _commit(self, op, func, leaves, spec, ins, tpos, sizes, owning, flat_out, plain_writes, const_writes,
                rng, cost, pending=None, layouts=None) -> None:
        """Register the op's outputs and versions, record it, and finish it in the core.

        ``pending``: (measurement, sig) when the op's real cost comes later
        (see Note [Measured costs]); deferred once the op has ended, before
        any compaction could renumber it. ``layouts``: (shape, stride, dtype)
        of each tensor leaf as it is now, or None to read them from the leaves.
        """
        core = self.core
        storage_of, version, key_of, phys, handle, alive = \
            core.storage_of, self.version, self.cdata_of, self.phys, self.handle, self.alive
        outs = core.op_outputs(op)
        new_tensors = outs[:len(sizes)]
        out_slots = []
        for k, pos in enumerate(owning):
            o, t = flat_out[pos], new_tensors[k]
            st = _storage(o)
            cdata = st._cdata
            if st.nbytes() != sizes[k]:
                _size_warning(func, st.nbytes(), sizes[k])
            version[cdata] = t
            key_of[t] = cdata
            phys[storage_of(t)] = _Buf(st, owned=False)
            h = handle[t] = self._new_handle()
            alive[h] = t
            out_slots.append((pos, _slot(t, o)))
        writes = []
        for k, (pos, old) in enumerate(plain_writes):
            new = outs[len(sizes) + k]
            st = _storage(leaves[pos])
            # The old version loses its buffer to the new one (see Note [Versions]).
            self.phys[core.storage_of(old)] = _Buf(torch.UntypedStorage(0, device=st.device), owned=True)
            self.phys[core.storage_of(new)] = _Buf(st, owned=False)
            self.version[st._cdata] = new
            self.cdata_of.pop(old, None)
            self.cdata_of[new] = st._cdata
            h = self.handle[new] = self.handle[old]
            if h in self.alive:
                self.alive[h] = new
            writes.append((pos, old, new))
        writes += [(pos, t, -1) for pos, t in const_writes]
        if self.recorder is not None:
            self.recorder.call(func._schema.name.split("::")[-1], [self.handle[t] for t in ins],
                               [self.handle[t] for t in new_tensors], sizes, cost,
                               mutated=[self.handle[old] for _, old in plain_writes] +
                               [self.handle[t] for _, t in const_writes])
        core.end_call(op, cost)
        if any(isinstance(x, torch.Tensor) and _opaque(x) for x in leaves):
            for x in leaves:  # see Note [Other layouts]
                if isinstance(x, torch.Tensor) and _opaque(x):
                    for k, guard in _opaque_keys(x):
                        entry = self._opaque_readers.get(k)
                        if entry is None or entry[0].expired():  # (a key of something dead: reused)
                            entry = self._opaque_readers[k] = (guard, [])
                        entry[1].extend(new_tensors)
        if pending is not None:
            self.timer.defer(pending[0], (op, pending[1], func))
        handle, recent = self.handle, self._recent_ops
        recent.append([handle[t] for t in ins if t in handle] + [handle[t] for t in new_tensors])
        if len(recent) > _RECENT_OPS:
            del recent[0]
        if out_slots or writes:  # ops that produce nothing are never recomputed
            rleaves = list(leaves)
            if layouts is None:
                for k, i in enumerate(tpos):  # (layouts as they are now: an op such as as_strided_ changes them)
                    rleaves[i] = _slot(ins[k], leaves[i])
            else:
                for k, i in enumerate(tpos):
                    rleaves[i] = Slot(ins[k], leaves[i].storage_offset(), *layouts[i])
            # (tuples: see Note [Recipes and the cyclic GC])
            self.recipes[op] = Recipe(func, tuple(rleaves), spec, tuple(out_slots), tuple(writes), rng)
        for _, old, new in writes:
            if new < 0:
                continue
            n = self.versions[new] = self.versions.pop(old, 0) + 1
            if n >= _MAX_VERSIONS:
                if self.recorder is not None:
                    self.recorder.pin(self.handle[new])
                core.pin(new)
        if self.ops_seen - self._ops_at_gc > max(_GC_MIN_OPS, self._live_after_gc):
            self.collect()
        if self.thrash_limit != math.inf:
            allowed, rc = remat_allowance(self.thrash_limit, core.base_compute), core.remat_compute
            if rc > allowed:
                raise ThrashingError(rc, allowed, f"while running {func}")

    # Note [Other layouts]
    # dtr evicts and recomputes strided storages only. A tensor of another
    # layout (sparse COO/CSR/CSC/BSR/BSC, jagged, mkldnn) or a nested tensor
    # (of any layout) has no strides (or sizes) and no single storage of
    # plain elements: dtr leaves it alone (_opaque), as a value it neither tracks,
    # counts nor evicts, held as it is by the recipes that read it (the
    # recipes' outputs are tracked and evictable as usual). A recipe reads it
    # when it is recomputed, so an in-place write to it (S.mul_(2), a sparse
    # gradient accumulated) would change what the recipe recomputes: before
    # any op writes such a tensor, the outputs of the ops that read it (kept
    # in _opaque_readers) are treated as a constant about to be written: the
    # program's references to them are pinned, and so is everything the
    # program holds that was computed from them (Core.protect), brought back
    # first while the old value is still there. A view of such a tensor's
    # memory (S.values()) is never taken for a new storage (_view_positions).
    # Ops with such arguments have no meta prediction (their sizes are
    # accounted for after they ran). With a log, a protection is not recorded
    # (a replay may then keep less than the runtime did).
    def _before_opaque_writes(self, func, args, kwargs) -> None:
        """Pin what was computed from the non-strided tensors ``func`` is about to write (Note [Other layouts])."""
        names = None
        for p in written_args(func, args, kwargs):
            if p < len(args):
                x = args[p]
            else:
                names = names or [a.name for a in func._schema.arguments]
                x = kwargs.get(names[p])
            for y in (x if isinstance(x, (list, tuple)) else (x,)):
                if not isinstance(y, torch.Tensor):
                    continue
                for k in ([k for k, _ in _opaque_keys(y)] if _opaque(y) else [_storage(y)._cdata]):
                    entry = self._opaque_readers.pop(k, None)
                    if entry is None or entry[0].expired():  # (what it named is gone: y only reuses its key)
                        continue
                    self.poll()  # (pinning may recompute: it must not read a storage just dropped)
                    core = self.core
                    for t in entry[1]:
                        s = core.storage_of(t)
                        if core.collected(s):
                            continue
                        if core.refs(t) > 0:  # the program holds it: keep its value as it is now
                            if self.recorder is not None:
                                self.recorder.pin(self.handle[t])
                            core.pin(t)
                        core.protect(s)  # and what the program holds that was computed from it

    def _run_untracked_inputs(self, func, args, kwargs, leaves, spec):
        """An op without tracked inputs: a factory (zeros, randn) is tracked by its outputs.

        A factory on the budget's device makes room before it allocates (see
        Note [Factories]); any other op is accounted for after it ran.
        """
        rng = None
        if _SEEDED in func.tags:  # (a factory: the generator of the device it allocates on)
            device = kwargs.get("device")
            rng = _rng_capture(func, leaves, torch.device(device) if device is not None else torch.device("cpu"))
        reserved = self._reserve_factory(func, args, kwargs, leaves)
        if reserved is not None:
            op, sizes, predicted, metas = reserved
            try:
                out = func(*args, **kwargs)
            except BaseException:
                self.core.abort_call(op)
                raise
            flat_out = tree_flatten(out)[0]
            owning = [i for i, o in enumerate(flat_out) if self._trackable(o)]
            if owning == predicted and [_storage(flat_out[i]).nbytes() for i in owning] == sizes:
                self.ops_seen += 1
                cost = 1.0 if self.cost_model.measured else self.cost_model.estimate(func, (), {}, metas)
                self._commit(op, func, leaves, spec, [], [], sizes, owning, flat_out, [], [], rng, cost)
                return out
            self.core.abort_call(op)  # the meta run was wrong about it: account for what it made
        else:
            out = func(*args, **kwargs)
            flat_out = tree_flatten(out)[0]
            views = _view_positions(func, out)  # (S.values() of a sparse S: its memory, not a new storage)
            owning = [i for i, o in enumerate(flat_out) if self._trackable(o) and i not in views]
        if not owning:
            return out
        return self._account_after(func, out, flat_out, owning, leaves, spec, [], [], rng)

    # Note [Factories]
    # A factory (torch.ones, arange, randn, empty, full, and _to_copy onto the
    # device) has no tracked input, so the general path cannot make room for it
    # first. When its ``device`` argument names the budget's device, it runs
    # once on the meta device (cached by op and arguments, as for every op) and
    # the core makes room for its outputs before it allocates; the recorded
    # call is the same as when it was accounted for afterwards, so replays and
    # decisions do not change. Ops without a device argument, or whose meta run
    # fails or disagrees, are still accounted for after they ran.
    def _reserve_factory(self, func, args, kwargs, leaves):
        """(op, sizes, output positions, meta outputs) with room made for a factory's outputs, or None."""
        if self.device_type is None or not _has_device_argument(func):
            return None
        device = kwargs.get("device")
        if (torch.device(device).type if device is not None else "cpu") != self.device_type:
            return None
        sig = (func, "factory", tuple((tuple(x.shape), tuple(x.stride()), x.dtype, x.device)
                                      if isinstance(x, torch.Tensor) else _hashable(x) for x in leaves))
        pred = self.predictions.get(sig)
        if pred is None:
            try:
                mout = tree_flatten(func(*args, **dict(kwargs, device=torch.device("meta"))))[0]
                owning = [i for i, o in enumerate(mout) if isinstance(o, torch.Tensor) and o.is_meta
                          and not _opaque(o)]
                pred = _Prediction([_storage(mout[i]).nbytes() for i in owning], owning,
                                   [mout[i] for i in owning])
            except Exception:  # no meta kernel, or an argument the meta device refuses (pin_memory)
                pred = _Prediction(None, None, [])
            if len(self.predictions) >= _MAX_PREDICTIONS:
                self.predictions.clear()
            self.predictions[sig] = pred
        if pred.sizes is None or not pred.sizes:
            return None
        sizes = list(pred.sizes)
        if self.core.budget >= 0 and self.core.memory + sum(sizes) > self.core.budget:
            self.poll()  # what the program dropped is room too
        op = self.core.begin_call([], sizes, [-1] * len(sizes), [], 0.0)
        return op, sizes, pred.owning, pred.metas

    def _run_unpredicted(self, func, args, kwargs, leaves, spec, ins, tpos):
        """An op whose output sizes could not be predicted: run, then account (may overshoot by its outputs)."""
        if not all(map(self.core.defined, ins)):  # a recomputation must not read a storage just dropped
            self.poll()
        op0 = self.core.begin_call(ins, [], [], [], 0.0)  # brings the inputs back
        if self.recorder is not None:
            self.recorder.call(func._schema.name.split("::")[-1], [self.handle[t] for t in ins], [], [], 0.0)
        self.core.end_call(op0, 0.0)
        rng = _rng_capture(func, leaves, leaves[tpos[0]].device) if _SEEDED in func.tags else None
        out = func(*args, **kwargs)
        flat_out = tree_flatten(out)[0]
        known = {_storage(leaves[i])._cdata for i in tpos}
        views = _view_positions(func, out)
        owning = [i for i, o in enumerate(flat_out) if self._trackable(o)
                  and _storage(o)._cdata not in known and i not in views]
        return self._account_after(func, out, flat_out, owning, leaves, spec, ins, tpos, rng)

    def _account_after(self, func, out, flat_out, owning, leaves, spec, ins, tpos, rng):
        self.ops_seen += 1
        sizes = [_storage(flat_out[i]).nbytes() for i in owning]
        op = self.core.begin_call(ins, sizes, [-1] * len(sizes), [], 0.0)
        outs = [o for o in flat_out if isinstance(o, torch.Tensor)]
        cost = 1.0 if self.cost_model.measured else self.cost_model.estimate(func, (), {}, outs)
        self._commit(op, func, leaves, spec, ins, tpos, sizes, owning, flat_out, [], [], rng, cost)
        return out

    # Note [Written leaves]
    # The leaves an op writes are those of the arguments its schema (or a
    # hidden-write rule) marks as written, found by position, never by
    # identity: in a.add_(a) or torch.mul(a, b, out=a) the written tensor
    # object is also read through another argument, and matching by identity
    # made two writes of one storage (two new versions of it, the second
    # recorded from an already superseded one; the core then released a
    # tensor twice). One storage is written at most once per op: a second
    # written leaf on an already written storage (two written views of it) is
    # the same write. The core counts the reads: an input read twice holds two
    # locks, so a recomputation copies the old version instead of handing its
    # bytes over (Note [Handing bytes over on recomputation] in the core).
    def _written_leaves(self, func, args, kwargs, leaves) -> List[int]:
        """Leaf positions of the tracked tensors ``func`` writes, one per written storage."""
        positions = written_args(func, args, kwargs)
        if not positions:
            return []
        names = [a.name for a in func._schema.arguments]
        starts, n = {}, 0  # the first leaf of each argument (as tree_flatten orders them)
        for i, v in enumerate(args):
            starts[i] = n
            n += _count_leaves(v)
        for k, v in kwargs.items():
            starts[names.index(k)] = n
            n += _count_leaves(v)
        out, storages = [], set()
        for p in sorted(positions):
            if p not in starts:  # a written argument left at its default (None)
                continue
            v = args[p] if p < len(args) else kwargs[names[p]]
            for i in range(starts[p], starts[p] + _count_leaves(v)):
                x = leaves[i]
                if self._trackable(x):
                    cdata = _storage(x)._cdata
                    if cdata not in storages:
                        storages.add(cdata)
                        out.append(i)
        return out

    def escape(self, x: torch.Tensor, pin: bool = True) -> None:
        """x's memory is about to leave PyTorch's view: bring it back and (with pin) never evict it.

        Called by the wrappers of escapes.py (Note [Escaped memory]); only the
        program's own calls count, not dtr's (made with this mode off the stack).
        """
        if not self._trackable(x) or not self.receives_ops():
            return
        cdata = _storage(x)._cdata
        t = self.version.get(cdata)
        if t is None or self.phys[self.core.storage_of(t)].dead():
            return  # not dtr's: nothing to bring back
        with self.off():
            if not self.core.defined(t):
                self.poll()
            if pin:
                if self.recorder is not None:
                    self.recorder.pin(self.handle[t])
                self.core.pin(t)
            else:
                self.core.require(t)

    def collect(self) -> None:
        """Drop the recipes of ops the core will never run again and the buffers of storages it
        will never need again (graph GC); compact the core's tables when they are mostly garbage."""
        self._ops_at_gc = self.ops_seen
        core = self.core
        if self.recorder is not None:  # it frees storages: a replay must do the same
            self.recorder.collect()
        ops, storages = core.collect()
        self._collected_ops += len(ops)
        for op in ops:
            self.recipes.pop(op, None)
        for s in storages:
            self.phys.pop(s, None)
            for t in core.storage_tensors(s):
                self.handle.pop(t, None)
                self.versions.pop(t, None)
                cdata = self.cdata_of.pop(t, None)
                if cdata is not None and self.version.get(cdata) == t:
                    del self.version[cdata]
        self._live_after_gc = len(self.recipes)
        for k in [k for k, (guard, _) in self._opaque_readers.items() if guard.expired()]:
            del self._opaque_readers[k]  # (what they named is gone: see _opaque_keys)
        if core.num_ops >= _COMPACT_MIN_OPS and (
                2 * (core.num_collected_storages - self._collected_after_compact) > core.num_storages
                or 2 * self._collected_ops > core.num_ops):
            self.compact()

    def compact(self) -> None:
        """Compact the core's tables and renumber every core id dtr holds (see Note [Compaction])."""
        ops, tensors, storages = self.core.compact()
        self._compactions += 1

        def timed(tag: Any) -> Any:  # a pending measurement's op, renumbered (None: its op was dropped)
            if tag is _REMAT:
                return tag
            new = ops[tag[0]]
            return None if new < 0 else (new,) + tag[1:]

        self.timer.map_tags(timed)

        def slot(x: Any) -> Any:
            return x._replace(tensor=tensors[x.tensor]) if isinstance(x, Slot) else x

        recipes = {}
        for op, r in self.recipes.items():
            # A recipe's op can still run, so its inputs and outputs are all kept.
            recipes[ops[op]] = r._replace(leaves=tuple([slot(x) for x in r.leaves]),
                                          outputs=tuple([(pos, slot(x)) for pos, x in r.outputs]),
                                          writes=tuple([(pos, tensors[old], new if new < 0 else tensors[new])
                                                        for pos, old, new in r.writes]))
        self.recipes = recipes
        self.phys = {storages[s]: b for s, b in self.phys.items() if storages[s] >= 0}
        self.handle = {tensors[t]: h for t, h in self.handle.items() if tensors[t] >= 0}
        self.cdata_of = {tensors[t]: k for t, k in self.cdata_of.items() if tensors[t] >= 0}
        self.versions = {tensors[t]: n for t, n in self.versions.items() if tensors[t] >= 0}
        self.version = {k: tensors[t] for k, t in self.version.items() if tensors[t] >= 0}
        self.alive = {h: tensors[t] for h, t in self.alive.items()}  # referenced: always kept
        self._opaque_readers = {k: (guard, [tensors[t] for t in ts if tensors[t] >= 0])
                                for k, (guard, ts) in self._opaque_readers.items() if not guard.expired()}
        self._collected_after_compact = self.core.num_collected_storages
        self._collected_ops = 0

    # ------------------------------------------------------------------ closing
    # Note [The end of a block]
    # When a block ends, every tensor the program still holds must have its
    # bytes again: without the mode nothing could recompute it, and a tensor
    # whose storage holds 0 bytes reads freed memory. If what the program holds
    # does not fit in the budget (it kept more activations than the budget
    # allows), or bringing it back passes the thrashing limit, the failure is
    # still raised (OutOfBudgetError naming what was needed, ThrashingError),
    # but only after everything came back with that limit lifted, so that a
    # program that catches it loses nothing. A block left by an exception
    # (out of budget, thrashing, the program's own) brings back what the
    # program holds the same way before that exception propagates. Only if a
    # recomputation itself fails does a BudgetWarning say that the tensors
    # dtr had evicted stay unusable.
    def finish(self) -> None:
        """Bring back every tensor the program still holds (the output condition); see Note [The end of a block].

        Raises:
            OutOfBudgetError, ThrashingError: they did not fit, or took too much
                recomputation; raised after all of them came back regardless.
        """
        core = self.core
        self.poll()
        budget, lifted = core.budget, set()
        failure: Optional[tuple] = None  # (OutOfBudgetError, needed) or (ThrashingError, remat_compute, limit)
        while True:  # each limit is lifted once: at most three rounds
            try:
                core.pin_many(list(self.alive.values()))
                break
            except (ThrashingError, OutOfBudgetError) as e:
                kind = type(e)
                if kind in lifted:  # cannot happen with the limit gone; never loop on it
                    raise
                lifted.add(kind)
                # (the figures, not the exception: its traceback holds this frame, a cycle that kept the
                # failed block's tensors alive until the next garbage collection; see budget.py's
                # Note [Nothing of a failed block stays alive])
                if failure is None:
                    failure = (kind, e.needed) if isinstance(e, OutOfBudgetError) else (kind, e.remat_compute,
                                                                                         e.limit)
                if kind is ThrashingError:
                    core.set_remat_limit(float("inf"))
                else:
                    core.set_budget(None)
        self.timer.flush()  # the device's last measurements (one wait, at the end of the block)
        if failure is not None and failure[0] is OutOfBudgetError:
            raise OutOfBudgetError(budget, max(failure[1], core.memory),
                                   "the tensors the program holds at the end of the block; they were all "
                                   "brought back beyond the budget and can be used") from None
        if failure is not None:
            raise ThrashingError(failure[1], failure[2],
                                 "while bringing back the tensors the program holds at the end of the block; "
                                 "they were all brought back regardless and can be used") from None


def _opaque(x: torch.Tensor) -> bool:
    """Whether dtr leaves ``x`` alone: a layout other than strided, or a nested tensor (Note [Other layouts])."""
    return x.layout != torch.strided or x.is_nested


class _ObjectGuard:
    """Whether an object is gone, without keeping it (StorageWeakRef's ``expired()`` for any object)."""

    __slots__ = ("ref",)

    def __init__(self, x: Any):
        self.ref = weakref.ref(x)

    def expired(self) -> bool:
        return self.ref() is None


def _opaque_keys(x: torch.Tensor) -> List[Tuple[Any, Any]]:
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
    return [(("object", id(x)), _ObjectGuard(x))] + [(_storage(p)._cdata, StorageWeakRef(_storage(p)))
                                                     for p in parts if not _opaque(p)]


def _view_positions(func: Any, out: Any) -> Tuple[int, ...]:
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
        m = _count_leaves(o)
        if k in views:
            got.extend(range(n, n + m))
        n += m
    return tuple(got)


_REBINDS = frozenset(getattr(torch.ops.aten.set_, o) for o in torch.ops.aten.set_.overloads())
_RESIZES = frozenset(("aten::resize_", "aten::resize_as_", "aten::resize_as_sparse_"))  # (a storage's size changes)


def _size_warning(func: Any, got: int, predicted: int) -> None:
    log.warning("dtr: %s allocated %d bytes where %d were predicted", func, got, predicted)


def _native_op_info(func: Any) -> Tuple[bool, bool, str, Any, bool]:
    """(whether the native path may run ``func``, whether it is random, its name in logs, what to call,
    whether it may run it as an in-place op on its first argument).

    The native path runs ops that write nothing (no declared or hidden write:
    see effects.may_write) and are not aten::set_; and in-place ops whose one
    write, declared by the schema, is their first argument, a single tensor
    that they return (``add_``, ``mul_``, ...), when that is neither random,
    nor a fill (Note [Adopting recomputed bytes]), nor a change of metadata
    (``t_``, ``as_strided_``: tagged inplace_view) or of the storage's size
    (``resize_``), nor under a hidden-write rule. What it calls to run the op is the overload's bound C++ operator
    (``func._op``, what ``OpOverload.__call__`` calls) when ``func`` is a plain
    ``OpOverload``: one Python frame less per op; anything else is called as it is.
    """
    call = func._op if type(func) is torch._ops.OpOverload else func
    seeded = _SEEDED in func.tags
    schema = func._schema
    writes = schema_writes(func)[0] if type(func) is torch._ops.OpOverload else None  # (metadata writes excluded:)
    inplace = (writes == (0,) and func not in _REBINDS and not seeded and not overwrites_self(func)
               and not has_hidden_writes(func) and schema.name not in _RESIZES
               and torch.Tag.inplace_view not in func.tags and len(schema.returns) == 1
               and schema.returns[0].alias_info is not None and schema.returns[0].alias_info.is_write
               and isinstance(schema.arguments[0].type, torch.TensorType))
    return (func not in _REBINDS and not may_write(func), seeded, schema.name.split("::")[-1], call, inplace)
_DEVICE_ARGUMENT: Dict[Any, bool] = {}


def _has_device_argument(func: Any) -> bool:
    """Whether the op's schema takes a ``device`` (factories and device copies), cached per overload."""
    got = _DEVICE_ARGUMENT.get(func)
    if got is None:
        got = _DEVICE_ARGUMENT[func] = any(a.name == "device" for a in func._schema.arguments)
    return got


def _hashable(x: Any) -> Any:
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)


# Note [Random ops]
# A recomputed random op must draw exactly what it drew the first time. An op
# tagged nondeterministic_seeded draws from the torch.Generator passed to it
# (generator=) or, without one, from the default generator of the device it
# runs on (for a factory, the device it allocates on; CUDA's state is its
# philox seed and offset). Just before the op first runs, the state of each
# generator it may draw from is saved in its recipe; a recomputation sets
# those states, runs the op, and puts back the states the program's
# generators had, so neither the recomputed value nor the program's later
# draws depend on when (or whether) dtr recomputed. Saving the state right
# before each op makes torch.manual_seed, fork_rng and set_state between ops
# (they are not dispatched) harmless, and a block's first op is no exception.
# Every ATen op that takes a Generator carries the tag (checked by a test).

def _default_generator(device: torch.device) -> torch.Generator:
    """The default generator of ``device`` (CPU's, or the accelerator's of that index)."""
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type)
    if hasattr(module, "_lazy_init"):
        module._lazy_init()
    index = device.index if device.index is not None else module.current_device()
    return module.default_generators[index]


_RngStates = Tuple[Tuple[torch.Generator, torch.Tensor], ...]  # (generator, its state) pairs


def _rng_capture(func: Any, leaves: List[Any], device: torch.device) -> _RngStates:
    """(generator, state) of each generator random op ``func`` may draw from, before it runs (Note [Random ops])."""
    gens = [x for x in leaves if isinstance(x, torch.Generator)]
    if not gens:
        gens = [_default_generator(device)]
    return tuple([(g, g.get_state()) for g in gens])


def _rng_state(states: _RngStates) -> _RngStates:
    """The current states of the generators in ``states``."""
    return tuple([(g, g.get_state()) for g, _ in states])


def _set_rng_state(states: Tuple[Tuple[torch.Generator, torch.Tensor], ...]) -> None:
    for g, state in states:
        g.set_state(state)
