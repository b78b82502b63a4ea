"""The ways a tensor's bytes leave PyTorch's dispatcher, wrapped while a budget is active.

# Note [Escaped memory]
# dtr sees an op only when it is dispatched. Some ways out read (or hand
# out) a storage's raw bytes without any dispatched op: an evicted storage
# holds 0 bytes, so without care ``torch.save`` wrote nothing for it,
# ``copy.deepcopy`` returned zeros, and a NumPy array or a DLPack capsule
# would alias memory dtr later frees. While a block is active each of them
# first calls the mode's ``escape(tensor, pin)``:
#
# - pin (bring the storage back, and never evict it again): the bytes are
#   read at a time dtr does not see, or stay shared with someone else:
#   ``.numpy()``, ``__array__`` (``np.asarray``), ``data_ptr``,
#   ``const_data_ptr``, DLPack (``__dlpack__``, ``torch.utils.dlpack.to_dlpack``
#   and ``torch.to_dlpack``), ``__cuda_array_interface__``, ``share_memory_``,
#   the storage objects (``untyped_storage()``, ``storage()``: whoever holds
#   one can read or share its bytes at any time; their writes are dispatched,
#   except through the storage's own ``data_ptr``, which is WRITE as a
#   tensor's is: a value computed from bytes written through it came back
#   computed from the new bytes), and pickling
#   (``__reduce_ex__``: ``pickle``, ``torch.save``, ``copy.copy`` and
#   multiprocessing queues; ``torch.save`` reduces every tensor before it
#   writes any storage's bytes, so bringing them back one at a time could
#   evict an earlier one before its bytes are written).
#   Those that hand the memory out writable (``.numpy()``, ``__array__``,
#   ``data_ptr``, DLPack, ``__cuda_array_interface__``, ``share_memory_``:
#   WRITE) also make it volatile: its bytes may change without a dispatched
#   op, so nothing computed from it is ever recomputed from it (Note [Bytes
#   written outside PyTorch] in driver.py). ``apply_``, ``map_`` and
#   ``map2_`` run a Python function over the elements in place, no op
#   dispatched: WRITE too (an evicted result lost their writes; run on an
#   evicted tensor, they crashed on its empty storage).
# - bring back only: the bytes are read at once, before any other op:
#   ``.tolist()``, ``copy.deepcopy`` (its copy is a dispatched op from then
#   on, which dtr tracks like any other) and ``repr`` (``print``, ``str``:
#   torch formats a tensor with every dispatch mode off, so through the mode's
#   entry an evicted tensor's format read its empty storage and raised).
# The other tensors a wrapped method takes (``map_``'s and ``map2_``'s
# operands) are pinned: bringing one back must not evict another.
#
# A storage the program resizes itself (``UntypedStorage.resize_``, no
# dispatched op: FSDP2 frees its unsharded parameters after use and allocates
# them again before the next) first calls the mode's ``resize(storage,
# nbytes)``: its old bytes are gone, and what was computed from them may need
# them (Note [Storages the program resizes] in driver.py).
#
# ``__dlpack_c_exchange_api__`` (a capsule of C functions that convert a tensor
# to DLPack without calling any Python method) is hidden while the block is
# active, so consumers fall back to ``__dlpack__``. An escape inside another
# (``__reduce_ex__`` calling ``untyped_storage()``) is the outer one's
# business, and dtr's own calls (made while its mode is off the stack) do
# not escape at all. What is not covered: a function bound before the block
# that reads raw memory by itself (``from torch.utils.dlpack import
# to_dlpack`` made before ``with``), and C++ extensions that read a tensor's
# data pointer without dispatching an op: call ``.data_ptr()`` on such inputs
# first, or keep them outside the block.
"""
from __future__ import annotations

import functools
import sys
import threading
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.utils.dlpack

from dtr.runtime.storage_table import resize_storage

__all__ = ["ESCAPING", "PIN", "READ", "WRITE", "in_raw_call", "patch_escapes"]

#: How a way out treats the memory: READ brings it back, PIN also pins it, WRITE also marks it as memory
#: that can be written outside PyTorch (Note [Bytes written outside PyTorch] in driver.py).
READ, PIN, WRITE = "read", "pin", "write"
# Tensor method name -> how the memory escapes.
ESCAPING: Dict[str, str] = {
    "numpy": WRITE,
    "__array__": WRITE,
    "data_ptr": WRITE,
    "const_data_ptr": PIN,
    "__dlpack__": WRITE,
    "share_memory_": WRITE,
    "untyped_storage": PIN,  # (a storage's own methods that write are dispatched, and resize_ is wrapped)
    "storage": PIN,
    "__reduce_ex__": PIN,
    "tolist": READ,
    "__repr__": READ,  # (torch formats a tensor with every mode off: the mode's entry saw none of its ops)
    "__deepcopy__": READ,
    "apply_": WRITE,
    "map_": WRITE,
    "map2_": WRITE,
}
# Properties of torch.Tensor whose getter hands the memory out (WRITE).
_ESCAPING_PROPERTIES = ("__cuda_array_interface__",)
# Module-level functions that export a tensor's memory: (module, name); WRITE.
_ESCAPING_FUNCTIONS = ((torch.utils.dlpack, "to_dlpack"), (torch, "to_dlpack"))
# Module-level functions that read a tensor's bytes at once, no op dispatched: (module, name); READ
# (Note [Generator states read from tensors]).
_READING_FUNCTIONS = ((torch, "set_rng_state"), (torch.random, "set_rng_state"))

# Note [Generator states read from tensors]
# ``torch.set_rng_state(s)`` hands ``s`` to ``Generator.set_state``, which reads its bytes in C++ with no
# op dispatched. A state the block computed (``torch.get_rng_state().repeat(k)[:n]``, a state sliced out
# of a saved batch of them) is an evictable tensor: once evicted, set_state raised "its data is not
# allocated yet" where plain PyTorch ran (a helper's hunt). torch.set_rng_state now brings it back
# first. ``Generator.set_state`` itself belongs to an immutable C type and cannot be wrapped: a
# program that calls ``g.set_state(s)`` on a state it computed inside a block calls ``s.tolist()`` (or
# passes the tensor get_state returned, which dtr never tracks) first.
# Note [Ops that touch bytes through raw pointers]
# A few of PyTorch's own ops are C++ above the dispatcher that reads or
# writes a tensor's bytes through its data pointer, with no op dispatched
# for that: tensor_split given a tensor of split points, ctc_loss given
# length tensors, and pad_packed_sequence, which reads the batch sizes and
# writes the lengths it returns into a tensor from aten::empty. An evicted
# argument was read as an empty storage (torch raised "data is not
# allocated yet"), and the lengths, evicted and recomputed, came back as
# whatever aten::empty gave. While a block is active these are wrapped:
# their integer tensor arguments (split points, lengths, batch sizes: small)
# are pinned first, and so are their integer outputs. The functions are
# wrapped where torch looks them up at each call (torch._VF for
# pad_packed_sequence), so that a name the program imported before the
# block still goes through the wrapper.
# pack_padded_sequence reads its lengths and writes the batch sizes it returns the same way, and the packed
# LSTM and GRU read those batch sizes; a tensor the function allocates and writes through its pointer while
# it runs is pinned as it is made (Note [Tensors a raw function allocates] in unpredicted.py).
_RAW_FUNCTIONS = ((torch, "tensor_split"), (torch, "ctc_loss"), (torch._VF, "_pad_packed_sequence"),
                  (torch._VF, "_pack_padded_sequence"))
_RAW_METHODS = ("tensor_split",)
# Class attributes hidden during a block (see the Note).
_HIDDEN = ("__dlpack_c_exchange_api__",)

_depth = threading.local()  # escapes in progress on this thread


class _Hooks(NamedTuple):
    """A block's callbacks, which the wrappers call (see patch_escapes)."""

    escape: Callable[[torch.Tensor, str], None]
    resize: Optional[Callable[[torch.UntypedStorage, int], None]]
    escape_storage: Optional[Callable[[torch.UntypedStorage, str], None]]


# Note [Escapes in several threads]
# The wrappers are process-wide (they replace torch's methods), blocks are
# per thread. Each thread's blocks register their hooks in that thread's
# stack, and a wrapper calls the hooks of its own thread's outermost block (a
# nested block runs on the outer one). Before, one process-wide slot held the
# last block entered: a second thread's block took every escape over, and
# ignored the first thread's (its evicted tensors pickled as NaNs, .tolist()
# raised); and the first block's end restored torch's methods under the
# second's feet. A thread without a block of its own uses the only block
# there is, if there is one (autograd's device threads run a block's
# backward), and none otherwise. The methods are replaced while any block is
# active, and restored when the last one ends.
_lock = threading.Lock()
_hooks_by_thread: Dict[int, List[_Hooks]] = {}
_saved: List[Tuple[object, str, object, bool]] = []  # what is replaced: (owner, name, original, in owner's __dict__)
_wrappers: Dict[Tuple[int, str], Tuple[Callable, Callable]] = {}  # (id(original), how) -> (original, wrapper)


def _hooks() -> Optional[_Hooks]:
    """The hooks of the calling thread's outermost block (Note [Escapes in several threads])."""
    stack = _hooks_by_thread.get(threading.get_ident())
    if stack:
        return stack[0]
    stacks = list(_hooks_by_thread.values())
    return stacks[0][0] if len(stacks) == 1 and stacks[0] else None


def _guarded(original: Callable, how: str) -> Callable:
    """``original(tensor, ...)`` after the active block's ``escape(tensor, how)``, unless inside another escape."""
    key = (id(original), how)
    made = _wrappers.get(key)
    if made is not None and made[0] is original:
        return made[1]

    def wrapper(self, *args, **kwargs):
        hooks = _hooks()
        if hooks is None or getattr(_depth, "n", 0):
            return original(self, *args, **kwargs)
        escape = hooks.escape
        try:  # (set inside: see Note [Interrupted patching])
            _depth.n = 1
            if isinstance(self, torch.Tensor):
                escape(self, how)
            for x in args:  # (operands read outside the dispatcher too: map_, map2_)
                if isinstance(x, torch.Tensor):
                    escape(x, PIN)
            return original(self, *args, **kwargs)
        finally:
            _depth.n = 0

    functools.update_wrapper(wrapper, original)
    _wrappers[key] = (original, wrapper)
    return wrapper


def _raw_integers(original: Callable) -> Callable:
    """``original(...)`` with its integer tensor arguments and outputs pinned (Note [Ops that touch bytes
    through raw pointers])."""
    key = (id(original), "raw")
    made = _wrappers.get(key)
    if made is not None and made[0] is original:
        return made[1]

    def wrapper(*args, **kwargs):
        hooks = _hooks()
        if hooks is None or getattr(_depth, "n", 0):
            return original(*args, **kwargs)
        escape = hooks.escape
        try:  # (set inside: see Note [Interrupted patching])
            _depth.n = 1
            for x in (*args, *kwargs.values()):
                if isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex():
                    escape(x, PIN)
            try:  # (set inside: see Note [Interrupted patching])
                _depth.raw = 1
                out = original(*args, **kwargs)
            finally:
                _depth.raw = 0
            for x in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex():
                    escape(x, PIN)
            return out
        finally:
            _depth.n = 0

    functools.update_wrapper(wrapper, original)
    _wrappers[key] = (original, wrapper)
    return wrapper


_resize_original = resize_storage


def _resize_wrapper(self, *args, **kwargs):
    """``UntypedStorage.resize_`` after the active block's ``resize(storage, nbytes)`` (Note [Escaped memory])."""
    hooks = _hooks()
    resize = hooks.resize if hooks is not None else None
    if resize is not None and not getattr(_depth, "n", 0) and len(args) + len(kwargs) == 1:
        try:  # (set inside: see Note [Interrupted patching])
            _depth.n = 1
            resize(self, int(args[0] if args else next(iter(kwargs.values()))))
        finally:
            _depth.n = 0
    return _resize_original(self, *args, **kwargs)


functools.update_wrapper(_resize_wrapper, _resize_original)

#: UntypedStorage methods that hand a storage's bytes out -> how, when torch's own code calls them (WRITE
#: from anywhere else): the data pointer (Note [A storage's data pointer]), and the moves to shared memory that
#: torch.multiprocessing's queues make (the receiving process may write it: a value computed from a tensor put
#: in a queue came back computed from what the receiver wrote).
_STORAGE_ESCAPES = {"data_ptr": PIN, "_share_fd_cpu_": WRITE, "_share_filename_cpu_": WRITE,
                    "share_memory_": WRITE}


def _storage_guarded(original: Callable, torch_how: str) -> Callable:
    """``UntypedStorage.<method>`` after the active block's ``escape_storage(storage, how)`` (Note [Escaped
    memory]): WRITE, or ``torch_how`` when torch itself asks (Note [A storage's data pointer])."""
    def wrapper(self, *args, **kwargs):
        hooks = _hooks()
        escape = hooks.escape_storage if hooks is not None else None
        if escape is not None and not getattr(_depth, "n", 0):
            frame = sys._getframe(1)
            while frame.f_back is not None and frame.f_globals.get("__name__") == "torch.storage":
                frame = frame.f_back  # (TypedStorage's methods ask on their caller's behalf)
            caller = frame.f_globals.get("__name__", "")
            try:  # (set inside: see Note [Interrupted patching])
                _depth.n = 1
                escape(self, torch_how if caller == "torch" or caller.startswith("torch.") else WRITE)
            finally:
                _depth.n = 0
        return original(self, *args, **kwargs)

    functools.update_wrapper(wrapper, original)
    return wrapper


# Note [A storage's data pointer]
# torch's own Python code asks a storage for its data pointer to tell
# storages apart, never to write through it: torch.save's persistent ids
# (after __reduce_ex__ has returned, so outside that escape), FSDP's checks
# of its parameters. As WRITE, a tensor saved inside a block made everything
# computed from it pinned (a saved tensor's dependents then ran a tight block
# out of budget). So a call from a torch module pins the storage (brought
# back, never evicted), and a call from anywhere else is WRITE: the program
# may write through the pointer (ctypes), as through a tensor's data_ptr.
# torch.storage's TypedStorage.data_ptr asks for its caller: the caller decides.


def in_raw_call() -> bool:
    """Whether a function of Note [Ops that touch bytes through raw pointers] is running in this thread."""
    return bool(getattr(_depth, "raw", 0))


def patch_escapes(escape: Callable[[torch.Tensor, str], None],
                  resize: Optional[Callable[[torch.UntypedStorage, int], None]] = None,
                  escape_storage: Optional[Callable[[torch.UntypedStorage, str], None]] = None) -> Callable[[], None]:
    """Wrap the ways out of the dispatcher to call ``escape(tensor, how)`` first (Note [Escaped memory]).

    Args:
        escape: called before a tensor's bytes leave the dispatcher.
        resize: called before the program resizes a storage itself (``UntypedStorage.resize_``).
        escape_storage: called before a storage's bytes leave the dispatcher (``UntypedStorage.data_ptr``, its
            moves to shared memory).

    Returns:
        A function that restores everything as it was.
    """
    hooks, tid = _Hooks(escape, resize, escape_storage), threading.get_ident()
    with _lock:
        if not _hooks_by_thread:
            try:  # (see Note [Interrupted patching])
                _install()
            except BaseException:
                _uninstall()
                raise
        _hooks_by_thread.setdefault(tid, []).append(hooks)

    def restore() -> None:
        with _lock:
            stack = _hooks_by_thread.get(tid, [])
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] is hooks:
                    del stack[i]
                    break
            if not stack:
                _hooks_by_thread.pop(tid, None)
            if not _hooks_by_thread:
                try:
                    _uninstall()
                finally:  # (interrupted: the rest once more, see Note [Interrupted patching])
                    if _saved and not _hooks_by_thread:
                        _uninstall()

    return restore


# Note [Interrupted patching]
# A KeyboardInterrupt (or any exception a signal handler raises) can land
# between any two of the replacements below. Before, an install interrupted
# part way (a block's enter) left torch's methods half replaced and _saved
# holding them, with no block to restore them; the next install saved the
# wrappers as "originals", and uninstalling deleted an inherited attribute
# twice: every later block raised AttributeError (UntypedStorage.data_ptr),
# for the rest of the process. Now an install that fails is undone at once,
# an uninstall restores and forgets one replacement at a time (so that one
# interrupted can be finished later, and restoring twice is harmless), and an
# install first finishes what an interrupted uninstall left. A wrapper marks
# its escape in progress (_depth) inside the try that unmarks it: marked just
# before it, an interrupt in between left it marked, and the thread's later
# escapes (in every later block) were skipped: evicted tensors read empty.
def _install() -> None:
    """Replace the ways out with their wrappers (while no block was active: Note [Escapes in several threads])."""
    if _saved:  # (an uninstall was interrupted: Note [Interrupted patching])
        _uninstall()

    def replace(owner: object, name: str, new: object) -> None:
        own = name in vars(owner) if isinstance(owner, type) else True
        _saved.append((owner, name, getattr(owner, name), own))
        setattr(owner, name, new)

    for name, how in ESCAPING.items():
        original = getattr(torch.Tensor, name, None)
        if original is not None:
            replace(torch.Tensor, name, _guarded(original, how))
    for name in _ESCAPING_PROPERTIES:
        prop = torch.Tensor.__dict__.get(name)
        if isinstance(prop, property) and prop.fget is not None:
            replace(torch.Tensor, name, property(_guarded(prop.fget, WRITE), doc=prop.__doc__))
    for module, name in _ESCAPING_FUNCTIONS:
        original = getattr(module, name, None)
        if original is not None:
            replace(module, name, _guarded(original, WRITE))
    for module, name in _READING_FUNCTIONS:
        original = getattr(module, name, None)
        if original is not None:
            replace(module, name, _guarded(original, READ))
    for module, name in _RAW_FUNCTIONS:
        original = getattr(module, name, None)
        if original is not None:
            replace(module, name, _raw_integers(original))
    for name in _RAW_METHODS:
        original = getattr(torch.Tensor, name, None)
        if original is not None:
            replace(torch.Tensor, name, _raw_integers(original))
    if torch.UntypedStorage.resize_ is _resize_original:
        replace(torch.UntypedStorage, "resize_", _resize_wrapper)
    for name, torch_how in _STORAGE_ESCAPES.items():
        original = getattr(torch.UntypedStorage, name, None)
        if original is not None:
            replace(torch.UntypedStorage, name, _storage_guarded(original, torch_how))
    for name in _HIDDEN:
        if name in vars(torch.Tensor):
            _saved.append((torch.Tensor, name, vars(torch.Tensor)[name], True))
            delattr(torch.Tensor, name)


def _uninstall() -> None:
    """Put back what _install replaced (the last block has ended), last first, each forgotten once restored."""
    while _saved:
        owner, name, original, own = _saved[-1]
        if own:
            setattr(owner, name, original)
        elif name in vars(owner):  # inherited (from torch._C.TensorBase): drop the wrapper to uncover it
            delattr(owner, name)
        _saved.pop()
