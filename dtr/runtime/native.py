"""The native per-op path (``dtr._native``): loading it, checking it matches torch, and choosing it.

The runtime's reference is DTRMode.__torch_dispatch__ in Python; ``dtr._native``
runs the common op through the same steps in C++ (Note [The native per-op
path] in csrc/native/fastpath.cpp). It is built against one torch: a module
built against another (or not built at all: no compiler, or ``pip install .``
in an isolated build environment without torch) is not used, and the runtime
warns once, saying why and how to rebuild, then runs the reference.

Which path a block runs: ``dtr.budget(..., native=True/False)``, or, when
that is None (the default), the environment variable ``DTR_NATIVE`` (``0``
selects the reference); otherwise the native path wherever it is available.

How a block's ops reach it: ``dtr.budget(..., entry="mode"/"key")``, or, when
that is None, ``$DTR_ENTRY``, else the default entry (:func:`default_entry`).
``"mode"`` is a TorchDispatchMode, ``"key"`` a C++ fallback on a dispatch key
(Note [The dispatch-key entry] in csrc/native/fastpath.cpp), which needs
dtr._native.
"""
from __future__ import annotations

import os
import warnings
from types import ModuleType
from typing import Any, Optional

import torch

__all__ = ["ENTRIES", "ENTRY_ENV_VAR", "ENV_VAR", "available", "default_entry", "fast_path", "key_active",
           "key_enter", "key_off", "native_module", "use_entry", "use_native"]

ENV_VAR = "DTR_NATIVE"
ENTRY_ENV_VAR = "DTR_ENTRY"
ENTRIES = ("mode", "key")
_REBUILD = ("to build it against this torch, reinstall dtr with torch installed: `pip install --no-build-isolation .` "
            "(`-e .` for a checkout)")

_state: dict = {}  # "module": the configured module or None, "why": the reason it is None


def _load() -> Optional[ModuleType]:
    try:
        from dtr import _native
    except ImportError as e:
        _state["why"] = f"dtr._native could not be imported ({e}); {_REBUILD}"
        return None
    built, running = _native.TORCH_VERSION, torch.__version__
    if built != running:
        _state["why"] = f"dtr._native was built against torch {built}, but torch {running} is running; {_REBUILD}"
        return None
    if bool(_native.CXX11_ABI) != bool(torch._C._GLIBCXX_USE_CXX11_ABI):
        _state["why"] = (f"dtr._native was built with _GLIBCXX_USE_CXX11_ABI={_native.CXX11_ABI}, unlike torch; "
                         f"{_REBUILD}")
        return None
    from dtr import core
    from dtr.errors import ThrashingError
    from dtr.runtime import effects, liveness, mode, prediction, recompute, storage_table, timing
    _native.configure({
        "Mode": mode.DTRMode, "Table": storage_table.StorageTable, "Buf": storage_table.Buf,
        "Liveness": liveness.Liveness, "Recomputer": recompute.Recomputer, "Slot": recompute.Slot,
        "Recipe": recompute.Recipe, "WallTimer": timing.WallTimer,
        "ThrashingError": ThrashingError, "TRANSLATED": core._TRANSLATED,
        "rng_capture": recompute.rng_capture, "size_warning": mode._size_warning, "op_info": mode._native_op_info,
        "effects": effects, "RECENT_OPS": liveness.RECENT_OPS, "GC_MIN_OPS": mode._GC_MIN_OPS,
        "MAX_PREDICTIONS": prediction.MAX_PREDICTIONS, "MAX_VERSIONS": mode._MAX_VERSIONS,
    })
    return _native


def native_module() -> Optional[ModuleType]:
    """The configured ``dtr._native``, or None if it is missing or does not match the running torch."""
    if "module" not in _state:
        _state["module"] = _load()
    return _state["module"]


def available() -> bool:
    """Whether the native path can run in this process."""
    return native_module() is not None


def use_native(native: Optional[bool]) -> bool:
    """Whether a block runs the native path: ``native`` if given, else ``$DTR_NATIVE``, else wherever available.

    Asking for it (or leaving the choice to the default) where it is not
    available runs the reference, with one warning per process saying why.

    Raises:
        ValueError: ``$DTR_NATIVE`` is not one of 0/1/true/false/yes/no/on/off.
    """
    if native is None:
        raw = os.environ.get(ENV_VAR, "").strip().lower()
        if raw in ("", "1", "true", "yes", "on"):
            native = True
        elif raw in ("0", "false", "no", "off"):
            native = False
        else:
            raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r}: use 1 (the native per-op path, the default "
                             f"where it is built) or 0 (the Python reference)")
    if not native:
        return False
    if native_module() is None:
        if not _state.get("warned"):
            _state["warned"] = True
            warnings.warn(f"dtr: the native per-op path is unavailable, running the Python reference "
                          f"(slower per op, same results): {_state['why']}", RuntimeWarning, stacklevel=3)
        return False
    return True


# Note [The default entry]
# The dispatch-key entry costs the least host time per op on CPU (the TreeLSTM's
# tracking at 1.27-1.37x plain on the test machine, 1.31-1.32x since gradient
# sums stay in place, against 1.47-1.61x as a mode, whose do-nothing floor
# alone is 1.26-1.46x; benchmarks/RUNTIME.md), and the whole suite passes
# through it. Through the key, autograd sums gradients in place as without dtr
# (Note [Constants held weakly] in storage_table.py); under any
# TorchDispatchMode, a do-nothing one too, autograd sums every gradient out of
# place (the Python tensors a mode returns hold a second reference).
# It has not yet run on an accelerator, where the autograd engine runs backward
# ops on device threads (the key travels with torch's thread-local state, but
# that is untested). So it is the default for a block on the CPU (named, or
# unnamed where torch sees no accelerator) that runs the native path, and a
# mode is the default elsewhere, until a GPU run validates the key there
# (`dtr.budget(..., entry="key")` or DTR_ENTRY=key opts in). A block on the
# Python reference (native=False) is a mode: the reference as it always was.
def default_entry(native: bool = True, device: Optional[torch.device] = None) -> str:
    """The entry a block uses when neither ``entry`` nor ``$DTR_ENTRY`` says (Note [The default entry]).

    Args:
        native: whether the block runs the native path.
        device: the block's device, if it names one.

    Returns:
        ``"key"`` for a native block on the CPU (``device``, or where torch
        sees no accelerator), else ``"mode"``. Does not initialize CUDA.
    """
    if not native or native_module() is None:
        return "mode"
    if device is not None:
        return "key" if device.type == "cpu" else "mode"
    accelerator = getattr(torch, "accelerator", None)
    present = accelerator.is_available() if accelerator is not None else torch.cuda.is_available()
    return "mode" if present else "key"


def use_entry(entry: Optional[str], native: bool = True, device: Optional[torch.device] = None) -> str:
    """How a block's ops reach dtr: ``entry`` if given, else ``$DTR_ENTRY``, else :func:`default_entry`.

    ``"key"`` where dtr._native is not available runs ``"mode"``, with the
    warning of :func:`use_native`.

    Raises:
        ValueError: the entry is not one of ENTRIES.
    """
    source = "entry"
    if entry is None:
        entry, source = os.environ.get(ENTRY_ENV_VAR, "").strip().lower(), f"${ENTRY_ENV_VAR}"
        if not entry:
            return default_entry(native, device)
    if entry not in ENTRIES:
        raise ValueError(f"{source}={entry!r}: use 'mode' (a TorchDispatchMode) or 'key' (a C++ dispatch key: less "
                         f"host work per op; needs dtr._native); unset, {default_entry(native, device)!r} here")
    if entry == "key" and not use_native(True):
        return "mode"
    return entry


def key_enter(fast: Any, reference: bool) -> bool:
    """Take the dispatch key for a block's FastPath; False (the block is then a mode) if it cannot be taken.

    It cannot while another block holds it, nor where another extension
    registered a fallback for the key (one warning per process says so).
    """
    m = native_module()
    if m is None or _state.get("key_failed"):
        return False
    try:
        return bool(m.key_enter(fast, reference))
    except RuntimeError as e:
        _state["key_failed"] = True
        warnings.warn(f"dtr: entry='key' is unavailable in this process, running entry='mode' (same results, more "
                      f"host time per op): {str(e).splitlines()[0]}", RuntimeWarning, stacklevel=4)
        return False


def key_active() -> bool:
    """Whether this thread's ops go to a block through the dispatch key now."""
    m = _state.get("module")  # (a block that took the key has loaded it)
    return m is not None and bool(m.key_active())


class key_off:
    """While it is active, ops in this thread do not come through the dispatch key (dtr's own work outside an op)."""

    __slots__ = ("_prev",)

    def __enter__(self) -> None:
        m = native_module()
        self._prev = m.key_exclude(True) if m is not None else None

    def __exit__(self, *exc: Any) -> None:
        m = native_module()
        if self._prev is not None and m is not None:
            m.key_exclude(self._prev)


def fast_path(mode: Any, fallback: Any) -> Any:
    """The native ``__torch_dispatch__`` for ``mode``; ``fallback`` (the reference) takes what it does not."""
    m = native_module()
    if m is None:
        raise RuntimeError(f"dtr: the native per-op path is unavailable: {_state['why']}")
    return m.FastPath(mode, fallback)
