"""The runtime's storage table: what each core id stands for in torch (buffers, storage addresses, handles).

The core (dtr._C) knows tensors, storages and ops by number only. Everything
the runtime keeps per core id about the program's torch objects lives in one
:class:`StorageTable`: one owner for how those maps change together (a new
tensor, an in-place version, a release, a collection, a renumbering) and for
the invariants that tie them (``_check``). The native per-op path
(csrc/native/table.cpp) reads and writes the same maps through the table's
slots, so both paths share one table.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch

__all__ = ["Buf", "StorageTable", "as_plain", "names_subclasses", "opaque", "resize_storage", "subclass_types",
           "trackable", "wrapper"]

#: ``UntypedStorage.resize_`` as torch defines it: dtr frees and refills storages with this one, never with the
#: method a block wraps for the program's own resizes (Note [Storages the program resizes] in driver.py).
resize_storage = torch._C.StorageBase.resize_  # type: ignore[attr-defined]

_use_count = torch._C._storage_Use_Count
_expired = torch.UntypedStorage._expired  # StorageWeakRef.expired() without its two Python frames
_free_weak_ref = torch.UntypedStorage._free_weak_ref
_refcount = sys.getrefcount


_PYTHON_KEY = torch._C.DispatchKey.Python
_dispatch_keys = torch._C._dispatch_keys
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_as_subclass = torch._C.TensorBase.as_subclass


def wrapper(x: torch.Tensor) -> bool:
    """Whether ``x`` is a tensor subclass that dispatches in Python (TwoTensor, DTensor, a float8 wrapper).

    Its storage is no memory of its own (resizing it raises): what it wraps
    are plain tensors, which dtr tracks when the subclass runs ops on them
    (Note [Tensor subclasses] in reference.py). O(1); dearer only for subclasses.
    """
    return type(x) not in _PLAIN and _dispatch_keys(x).has(_PYTHON_KEY)


#: The ``__torch_dispatch__`` of torch.Tensor, nn.Parameter and every subclass that does not define its own.
_NO_HANDLER = torch._C._disabled_torch_dispatch_impl


# Note [Subclasses without a handler]
# torch names a subclass in a mode's ``types`` even when it has no
# __torch_dispatch__ of its own: reading ``.data`` of a subclass instance
# (a ``class MyParam(nn.Parameter)``, LazyLinear's UninitializedParameter
# as it materializes, a plain ``class T(torch.Tensor)``) calls aten::detach
# with ``types = (type(x),)``. The mode declined the op (Note [Tensor
# subclasses] in reference.py), the subclass's disabled handler declined it
# too, and torch raised "Multiple dispatch failed" on the mode and reference
# entries, where plain PyTorch and the dispatch key's entry run it (a
# helper's hunt, 2026-11-29). Such a subclass is a plain strided tensor to
# dtr (it has no Python key: ``wrapper`` is false), so its ops are the
# mode's to run. The mode runs them on plain aliases of its instances
# (``as_plain``): a subclass may override what dtr reads in Python
# (UninitializedParameter's ``shape`` raises), and an alias has the same
# storage, offset, sizes, strides and version counter.
def subclass_types(types: Any) -> bool:
    """Whether a ``__torch_dispatch__``'s ``types`` name a tensor subclass with a handler of its own (Note
    [Subclasses without a handler])."""
    return any(t not in _PLAIN and getattr(t, "__torch_dispatch__", _NO_HANDLER) is not _NO_HANDLER for t in types)


def names_subclasses(types: Any) -> bool:
    """Whether ``types`` name any tensor subclass, with or without a handler."""
    return any(t not in _PLAIN for t in types)


def as_plain(leaves: Sequence[Any]) -> List[Any]:
    """``leaves`` with each tensor of a subclass (without a handler: ``subclass_types`` said so) replaced by a
    plain tensor aliasing it (Note [Subclasses without a handler])."""
    return [_as_subclass(x, torch.Tensor) if isinstance(x, torch.Tensor) and type(x) not in _PLAIN else x
            for x in leaves]


def opaque(x: torch.Tensor) -> bool:
    """Whether dtr leaves ``x`` alone: a layout other than strided, a nested, zero or quantized tensor (Note
    [Other layouts] in reference.py), or a wrapper subclass; the table never holds such a tensor's memory."""
    return x.layout != torch.strided or x.is_nested or x._is_zerotensor() or x.is_quantized or wrapper(x)


def trackable(x: Any, device_type: Optional[str]) -> bool:
    """Whether a block on ``device_type`` tracks ``x``: a strided tensor (neither nested, meta, zero nor quantized,
    nor a wrapper subclass) on that device; with ``device_type`` None, one that could set the block's
    device. The one rule (the native path's twins: ``first_trackable`` in csrc/native/dispatch.cpp and
    ``scan_value`` in csrc/native/prediction.cpp)."""
    return (isinstance(x, torch.Tensor) and x.layout == torch.strided and not x.is_nested and not x.is_meta
            and not x._is_zerotensor() and not x.is_quantized and (device_type is None or x.device.type == device_type)
            and (type(x) in _PLAIN or not wrapper(x)))


class Buf:
    """The buffer of one storage version: the program's or dtr's own.

    The program's activations are held weakly (freed when the program drops
    them). Constants (``shared`` set) are held strongly once something computed
    from them may need their value, so that when the program drops one, that
    can be protected before it goes; they are dead once dtr's is the only
    reference. A constant nothing was computed from is held weakly, as an
    activation is (Note [Constants held weakly]). A buffer dtr allocates to
    bring back a version whose program storage is gone (``dropped`` set) is
    dead from the start: see Note [Dropped buffers] in driver.py.
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
        """The storage, or None once the program dropped a weakly held one."""
        if self.strong is not None:
            return self.strong
        if _expired(self.weak):
            return None
        return torch.UntypedStorage._new_with_weak_ptr(self.weak)

    def dead(self) -> bool:
        """Whether the program no longer references the storage."""
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


# Note [Constants held weakly]
# A constant (a pinned storage) is held strongly so that, when the program
# drops it, what may still need its value can be protected first (Note
# [Keeping a dead constant] in liveness.py). That second reference is seen:
# autograd sums a gradient in place only while the sum holds its storage's one
# reference (torch's InputBuffer reads the storage's use count). Through the
# dispatch key, once a gradient's version chain was pinned (Note [Version
# chains] in reference.py), every later sum into it was made out of place: a new
# buffer, a slower kernel, one more storage to track and one more dead
# constant to settle, 109 of the 277 gradient sums of a TreeLSTM step. Yet
# nothing needs the value of a storage nothing was computed from. So a storage
# pinned while no storage in the core was computed from it is held weakly
# (``Buf(st, owned=False, shared=True)``): the program's drop frees it at
# once, and the next poll releases it with nothing to protect. The first op
# that computes from it a new storage or a new version of an unpinned one
# (``computed_from``) holds it strongly, before anything computed so could be
# evicted. Writes to constants add no dependents (a later sum into it, an
# optimizer's update that reads it), so they leave it weak. A constant of no
# bytes is always held strongly: the core keeps it after its release (nothing
# to free), and a resident storage whose memory is gone would be "forgotten"
# (Liveness.release), which a pinned one cannot be. Invariant (checked by
# ``_check``): protect() would pin nothing for a weakly held constant, and
# once released it is banished.


# Note [The storage table]
# Six maps, each keyed by the id it is looked up by on the hot path:
#   version   storage address (``UntypedStorage._cdata``) -> the core tensor of
#             its current version, for every program storage dtr tracks;
#   cdata_of  core tensor -> its storage's address, for current versions (the
#             inverse of ``version`` where both are set: an address a dead
#             storage left behind may name a new storage already);
#   phys      core storage -> its Buf;
#   handle    core tensor -> its handle (Note [Handles] in driver.py), shared by
#             all versions of one program storage;
#   alive     handle -> core tensor, for each storage the program may still
#             hold, in creation order (Note [Liveness] in liveness.py);
#   versions  core tensor -> how many in-place versions lead to it (Note
#             [Version chains] in reference.py).
# They were once parallel attributes of the dispatch mode, each kept in step by hand
# wherever a tensor came or went and renumbered one by one at compaction; a
# missed one left a stale id behind. Each change now has one method here, and
# ``_check`` states what must hold between them after every op.
class StorageTable:
    """What each core tensor and storage stands for in torch; see Note [The storage table].

    The native per-op path reads these slots at fixed offsets (Note [The
    driver's slots] in driver.py): the maps are replaced only by ``renumber``,
    which the native path never caches across.
    """

    __slots__ = ("version", "cdata_of", "phys", "handle", "alive", "versions", "_next_handle")

    def __init__(self) -> None:
        self.version: Dict[int, int] = {}
        self.cdata_of: Dict[int, int] = {}
        self.phys: Dict[int, Buf] = {}
        self.handle: Dict[int, int] = {}
        self.alive: Dict[int, int] = {}
        self.versions: Dict[int, int] = {}
        self._next_handle = 0

    def new_handle(self) -> int:
        """A new program tensor's handle: ints from 1, each made once (Note [Handles] in driver.py)."""
        self._next_handle += 1
        return self._next_handle

    def add(self, t: int, s: int, st: torch.UntypedStorage, buf: Buf) -> int:
        """Register ``st`` as new core tensor ``t`` (core storage ``s``, buffer ``buf``); its new handle. O(1)."""
        cdata = st._cdata
        self.version[cdata] = t
        self.cdata_of[t] = cdata
        self.phys[s] = buf
        h = self.handle[t] = self.new_handle()
        self.alive[h] = t
        return h

    def write(self, old: int, new: int, old_storage: int, new_storage: int, st: torch.UntypedStorage) -> int:
        """An in-place write made version ``new`` of ``old`` (storage ``st``); the versions behind ``new``. O(1).

        The new version takes the buffer; the old one keeps an empty one of its
        own (see Note [Versions] in recompute.py), and the handle moves to the new one.
        """
        self.phys[old_storage] = Buf(torch.UntypedStorage(0, device=st.device), owned=True)
        self.phys[new_storage] = Buf(st, owned=False)
        cdata = st._cdata
        self.version[cdata] = new
        self.cdata_of.pop(old, None)
        self.cdata_of[new] = cdata
        h = self.handle[new] = self.handle[old]
        if h in self.alive:
            self.alive[h] = new
        n = self.versions[new] = self.versions.pop(old, 0) + 1
        return n

    def pinned(self, s: int, strongly: bool) -> None:
        """Core storage ``s`` became a constant: hold it strongly, or weakly (Note [Constants held weakly]). O(1)."""
        buf = self.phys.get(s)
        if buf is not None and buf.weak is not None:
            st = buf.get()
            if st is not None:
                self.phys[s] = Buf(st, owned=strongly, shared=True)

    def computed_from(self, ins: Iterable[int], storage_of: Any) -> None:
        """An op computed a new storage or version from core tensors ``ins``: hold the constants among them
        that were held weakly strongly (Note [Constants held weakly]). O(len(ins))."""
        phys = self.phys
        for t in ins:
            s = storage_of(t)
            buf = phys.get(s)
            if buf is not None and buf.shared and buf.strong is None:
                self.hold(s)

    def hold(self, s: int) -> None:
        """Hold core storage ``s``'s buffer strongly, as a constant's, if it is held weakly and still there. O(1)."""
        buf = self.phys.get(s)
        if buf is not None and buf.weak is not None:
            st = buf.get()
            if st is not None:
                self.phys[s] = Buf(st, owned=True, shared=True)

    def drop(self, h: int) -> int:
        """The program dropped the storage of handle ``h``: forget its address; its core tensor. O(1)."""
        t = self.alive.pop(h)
        self.forget_address(t)
        return t

    def forget_address(self, t: int) -> None:
        """Core tensor ``t`` no longer stands for the program storage at its address (if it still did). O(1)."""
        cdata = self.cdata_of.pop(t, None)
        if cdata is not None and self.version.get(cdata) == t:
            del self.version[cdata]

    def collected(self, s: int, tensors: Iterable[int]) -> None:
        """Core storage ``s`` (with ``tensors``, its versions) was collected: forget all of it. O(len(tensors))."""
        self.phys.pop(s, None)
        for t in tensors:
            self.handle.pop(t, None)
            self.versions.pop(t, None)
            self.forget_address(t)

    def renumber(self, tensors: Sequence[int], storages: Sequence[int]) -> None:
        """Follow a core compaction: ``tensors[t]``/``storages[s]`` are the new ids, -1 if dropped. O(entries)."""
        self.phys = {storages[s]: b for s, b in self.phys.items() if storages[s] >= 0}
        self.handle = {tensors[t]: h for t, h in self.handle.items() if tensors[t] >= 0}
        self.cdata_of = {tensors[t]: k for t, k in self.cdata_of.items() if tensors[t] >= 0}
        self.versions = {tensors[t]: n for t, n in self.versions.items() if tensors[t] >= 0}
        self.version = {k: tensors[t] for k, t in self.version.items() if tensors[t] >= 0}
        self.alive = {h: tensors[t] for h, t in self.alive.items()}  # referenced: always kept

    def clear(self) -> None:
        """Drop every buffer and map (the end of a block: nothing here is used again)."""
        for m in (self.version, self.cdata_of, self.phys, self.handle, self.alive, self.versions):
            m.clear()

    def _check(self, core: Any, max_versions: int) -> None:
        """Assert the invariants of Note [The storage table] against ``core``. O(entries).

        Raises:
            AssertionError: one does not hold (a bug in the runtime).
        """
        n_tensors, n_storages = core.num_tensors, core.num_storages
        for cdata, t in self.version.items():
            assert 0 <= t < n_tensors, f"version[{cdata}] = {t}: not a core tensor"
            assert self.cdata_of.get(t) == cdata, f"version[{cdata}] = {t} but cdata_of[{t}] = {self.cdata_of.get(t)}"
        for t in self.cdata_of:
            assert 0 <= t < n_tensors, f"cdata_of has {t}: not a core tensor"
        assert all(0 <= s < n_storages and isinstance(b, Buf) for s, b in self.phys.items()), "phys: a bad entry"
        for h, t in self.alive.items():  # (handle[t] == h: no tensor is alive under two handles)
            assert 1 <= h <= self._next_handle, f"alive has handle {h}, never made (last {self._next_handle})"
            assert 0 <= t < n_tensors, f"alive[{h}] = {t}: not a core tensor"
            assert self.handle.get(t) == h, f"alive[{h}] = {t} but handle[{t}] = {self.handle.get(t)}"
            assert core.storage_of(t) in self.phys, f"alive tensor {t} has no buffer"
        for t, h in self.handle.items():
            assert 0 <= t < n_tensors and 1 <= h <= self._next_handle, f"handle[{t}] = {h}: a bad entry"
        for t, n in self.versions.items():
            assert 0 <= t < n_tensors and 1 <= n <= max_versions, f"versions[{t}] = {n}: a bad entry"
        for s, b in self.phys.items():  # see Note [Constants held weakly]
            if b.shared and b.strong is None:  # (a released one is banished: it had bytes to free)
                assert core.pinned(s) or core.banished(s), f"storage {s} is held weakly as a constant but is neither"
                assert not core.pinned(s) or not core.protect_targets(s), \
                    f"constant {s} is held weakly, but protecting it would pin {core.protect_targets(s)}"
