"""The native per-op path (``dtr._native``): loading it, checking it matches torch, and choosing it.

The runtime's reference is ReferencePath._dispatch in Python; ``dtr._native``
runs the common op through the same steps in C++ (Note [The native per-op
path] in csrc/native/fastpath.cpp). It is built against one torch: the one an
install built (setup.py, next to the torch it found), if that is the running
torch; else one built on first use against the running torch, into a cache
(Note [Building the native path on first use] in native_build.py). Where
neither can be had (no compiler, say), the runtime warns once, saying why and
what to run, and runs the reference; ``python -m dtr info`` says which.

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

import json
import os
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple, Optional, Tuple

import torch

from dtr.runtime import native_build

__all__ = ["ENTRIES", "ENTRY_ENV_VAR", "ENV_VAR", "NativeStatus", "available", "default_entry", "key_active",
           "key_enter", "key_exit", "key_off", "native_module", "status", "use_entry", "use_native", "why_unavailable"]

ENV_VAR = "DTR_NATIVE"
ENTRY_ENV_VAR = "DTR_ENTRY"
ENTRIES = ("mode", "key")
_INFO = "`python -m dtr info` says what is active and why"
#: What the installed dtr._native was built against (setup.py writes it: Note [Finding the user's torch]).
SIDECAR = Path(__file__).resolve().parent.parent / "_native_build.json"

_state: dict = {}  # "module": the configured module or None, "why": the reason it is None, "origin": where from


def _installed() -> Tuple[Optional[ModuleType], str]:
    """The dtr._native an install built, if it was built against the running torch: (module or None, why not).

    What it was built against is read first (``_native_build.json`` beside it, written by setup.py): a module
    built against another torch is never imported (its symbols and layouts need not match this torch's).
    """
    sidecar = SIDECAR
    if not sidecar.is_file():
        return None, "the install did not build dtr._native"
    try:
        built = json.loads(sidecar.read_text())
        version, abi = built["torch"], int(built["cxx11_abi"])
    except (OSError, ValueError, KeyError, TypeError):
        return None, f"{sidecar} is unreadable"
    if version != torch.__version__:
        return None, f"the installed dtr._native was built against torch {version}, but torch {torch.__version__} runs"
    if abi != int(torch._C._GLIBCXX_USE_CXX11_ABI):
        return None, f"the installed dtr._native was built with _GLIBCXX_USE_CXX11_ABI={abi}, unlike torch"
    try:
        from dtr import _native
    except ImportError as e:
        return None, f"the installed dtr._native could not be imported ({e})"
    return _native, ""


def _built_on_first_use(why: str) -> Tuple[Optional[ModuleType], str]:
    """dtr._native built against the running torch into the cache (Note [Building the native path on first use]
    in native_build.py): (module or None, why not)."""
    if not native_build.build_allowed():
        return None, f"{why}, and builds on first use are turned off (${native_build.BUILD_ENV_VAR}=0)"
    try:
        module = native_build.load(native_build.build())
    except (native_build.NativeBuildError, ImportError, OSError) as e:
        return None, f"{why}, and building it against this torch failed: {e}"
    if module.TORCH_VERSION != torch.__version__:  # (cannot happen: the build's key names the torch)
        return None, f"the build on first use is for torch {module.TORCH_VERSION}, not {torch.__version__}"
    return module, ""


def _cached(why: str) -> Tuple[Optional[ModuleType], str]:
    """dtr._native from an earlier build on first use for the running torch, without building: (module, why not)."""
    try:
        path = native_build.built_path()
    except native_build.NativeBuildError as e:  # ($CXX is not a command line)
        return None, f"{why}, and {e}"
    if path is None or not path.is_file():
        return None, f"{why}, and no build on first use is cached for torch {torch.__version__}"
    try:
        return native_build.load(path), ""
    except ImportError as e:
        return None, f"{why}, and the build on first use at {path} could not be imported ({e})"


def _load(allow_build: bool = True) -> Optional[ModuleType]:
    module, why = _installed()
    origin = "installed with dtr"
    if module is None:
        module, why = _cached(why)
        origin = "built on first use"
    if module is None and allow_build:
        module, why = _built_on_first_use(why)
    if module is None:
        _state["why"] = why
        return None
    _state["origin"] = origin
    _state["path"] = module.__file__
    return module


def native_module() -> Optional[ModuleType]:
    """``dtr._native`` for the running torch (not yet configured: dtr/runtime/entry.py does that before a block
    uses it), or None if it is missing and cannot be built (``_state["why"]`` says why)."""
    if "module" not in _state:
        _state["module"] = _load()
    return _state["module"]


def available() -> bool:
    """Whether the native path can run in this process (building it first if it must and can)."""
    return native_module() is not None


class NativeStatus(NamedTuple):
    """Whether the native per-op path is active here, and if not, why and what fixes it (``python -m dtr info``).

    Attributes:
        active: dtr._native is loaded for the running torch (or can be, without building).
        origin: ``"installed with dtr"`` or ``"built on first use"`` (None when not active).
        path: the module's file (None when not active).
        why: why it is not active ("" when it is).
        fix: the one command that makes it active ("" when it is).
    """

    active: bool
    origin: Optional[str]
    path: Optional[str]
    why: str
    fix: str


def status() -> NativeStatus:
    """The native path's state in this process; never builds (``python -m dtr build`` does)."""
    module = _state.get("module") if "module" in _state else _load(allow_build=False)
    if "module" not in _state and module is not None:
        _state["module"] = module  # (loaded and configured: a block uses it)
    if module is not None:
        return NativeStatus(True, _state.get("origin"), _state.get("path"), "", "")
    why = _state.get("why", "not loaded")
    try:
        bad_cxx, no_cxx = False, native_build.compiler() is None
    except native_build.NativeBuildError:  # ($CXX is not a command line: `why` says so)
        bad_cxx, no_cxx = True, True
    if native_build.source_dir() is None:
        fix = "pip install --force-reinstall --no-binary torch-dtr torch-dtr  (the sources were not installed)"
    elif bad_cxx:
        fix = "set $CXX to a compiler command (such as g++), or unset it; then: python -m dtr build"
    elif no_cxx:
        fix = "install a C++ compiler (g++ or clang++, or set $CXX), then: python -m dtr build"
    else:
        fix = "python -m dtr build"
    return NativeStatus(False, None, None, why, fix)


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
                          f"(slower per op, same results): {_state['why']}. {_INFO}; `python -m dtr build` "
                          f"builds it", RuntimeWarning, stacklevel=3)
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


def key_exit() -> None:
    """Give the dispatch key back (the end of a block that took it with :func:`key_enter`)."""
    m = native_module()
    assert m is not None, "entered through the key without dtr._native"
    m.key_exit()


def why_unavailable() -> str:
    """Why the native path is unavailable in this process ("" when it is available)."""
    return "" if native_module() is not None else _state.get("why", "")


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
