"""How a block's ops reach its driver: a dispatch mode, or the native dispatch key; chosen when the block begins.

Three entries, one object each, made by :func:`enter` for a :class:`~dtr.runtime.driver.Driver`:

* :class:`ReferenceMode`: a TorchDispatchMode whose ``__torch_dispatch__`` is the Python reference
  (:meth:`ReferencePath._dispatch <dtr.runtime.reference.ReferencePath._dispatch>`);
* :class:`NativeMode`: a TorchDispatchMode whose ``__torch_dispatch__`` is the native path's FastPath
  over the driver (csrc/native/), which hands the reference what it does not take;
* :class:`KeyEntry`: no Python mode at all: a C++ fallback on a dispatch key below autograd calls the
  FastPath (Note [The dispatch-key entry] in csrc/native/), the native steps or, for a block on the
  reference (``native=False``), the reference for every op.

This module is where the runtime's classes and the native module meet: :func:`native_runtime` hands the
native module the classes, helpers and limits it mirrors (native.py only loads it and chooses), once.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
    _unset_infra_mode,
)

from dtr import core
from dtr.errors import OutOfBudgetError, ThrashingError
from dtr.runtime import effects, failures, limits, native, prediction, recompute, storage_table, timing
from dtr.runtime.driver import Driver
from dtr.runtime.liveness import Liveness

__all__ = ["KeyEntry", "ModeEntry", "NativeMode", "ReferenceMode", "abandon", "enter", "native_runtime"]

_configured: dict = {}  # "module": the native module, once configured


def native_runtime() -> Any:
    """``dtr._native``, configured with what it mirrors (the driver's classes, helpers and limits), or None.

    Raises:
        RuntimeError: the native path is unavailable (native.use_native said so first, with a warning).
    """
    m = native.native_module()
    if m is None:
        raise RuntimeError(f"dtr: the native per-op path is unavailable: {native.why_unavailable()}")
    if _configured.get("module") is not m:
        m.configure({
            "Mode": Driver, "Table": storage_table.StorageTable, "Buf": storage_table.Buf,
            "Liveness": Liveness, "Recomputer": recompute.Recomputer, "Slot": recompute.Slot,
            "Recipe": recompute.Recipe, "WallTimer": timing.WallTimer,
            "TRANSLATED": core._TRANSLATED, "name_failure": failures.name_failure,
            "rng_capture": recompute.rng_capture, "size_warning": prediction.size_warning,
            "op_info": effects.native_op_info, "effects": effects, "RECENT_OPS": limits.RECENT_OPS,
            "GC_MIN_OPS": limits.GC_MIN_OPS, "MAX_PREDICTIONS": limits.MAX_PREDICTIONS,
            "MAX_VERSIONS": limits.MAX_VERSIONS,
        })
        _configured["module"] = m
    return m


class ModeEntry(TorchDispatchMode):
    """A TorchDispatchMode entry: the block's ops come to it while it is on the thread's mode stack."""

    kind = "mode"

    def __init__(self, driver: Driver):
        super().__init__()
        self.driver = driver

    def enter(self) -> bool:
        self.__enter__()
        return True

    def exit(self, exc_type: Any = None, exc: Any = None, tb: Any = None) -> None:
        self.__exit__(exc_type, exc, tb)

    def receives_ops(self) -> bool:
        return self in _get_current_dispatch_mode_stack()

    def off(self) -> Any:
        return _BelowMode(self)


class ReferenceMode(ModeEntry):
    """The reference per-op path as a dispatch mode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return self.driver._dispatch(func, types, args, kwargs)
        except (OutOfBudgetError, ThrashingError) as e:  # the core names ids; the user reads op names
            failures.name_failure(self.driver, e, func)
            raise


class NativeMode(ModeEntry):
    """The native per-op path as a dispatch mode: its ``__torch_dispatch__`` is the FastPath itself (an instance
    attribute set when it is made: no Python frame per op)."""

    def __init__(self, driver: Driver, fast: Any):
        super().__init__(driver)
        # (torch calls mode.__torch_dispatch__(func, types, args, kwargs): an instance attribute, set once here,
        # whose __self__ must be this mode, as a bound method's is)
        fast.__self__ = self
        self.__torch_dispatch__ = fast  # type: ignore[method-assign]


class KeyEntry:
    """The native dispatch key: the FastPath is called from C++ for every op below autograd."""

    kind = "key"

    def __init__(self, fast: Any, reference_only: bool):
        self.fast, self.reference_only = fast, reference_only

    def enter(self) -> bool:
        """Take the key; False (nothing taken) while another block holds it or where dtr cannot have it."""
        return native.key_enter(self.fast, self.reference_only)

    def exit(self, exc_type: Any = None, exc: Any = None, tb: Any = None) -> None:
        native.key_exit()

    def receives_ops(self) -> bool:
        return native.key_active()

    def off(self) -> Any:
        return _KeyOff()


# Note [Where dtr's own work runs]
# An op the block records ran below every mode the program had entered before
# the block (a mode entry: dtr's mode is on top of them and hands each op
# down through them) or below all of them (the key entry: the key lies below
# the Python modes, whose handlers ran first). dtr's own work outside an op
# (an escape such as .tolist(), the program's resize_, the end of the block)
# runs its recomputations in that same place, or a program's own mode that
# changes values (a mode that scales every matmul, say) was left out of the
# recomputed bytes: a mode entry's off() takes its own mode and those above
# it off the stack and keeps those below; the key entry's takes the key and
# every mode off. torch's own modes (make_fx's tracing, fake tensors) are
# never part of dtr's work: a recomputation at the end of a block inside
# make_fx was traced, and failed on the storage it sets.
_INFRA_KEYS = (torch._C._TorchDispatchModeKey.PROXY, torch._C._TorchDispatchModeKey.FUNCTIONAL)


class _BelowMode:
    """While it is active, ``mode`` and the modes above it are off this thread's stack (no-op if it is not on it)."""

    __slots__ = ("_mode", "_popped")

    def __init__(self, mode: TorchDispatchMode):
        self._mode = mode
        self._popped: List[TorchDispatchMode] = []

    def __enter__(self) -> None:
        stack = _get_current_dispatch_mode_stack()
        if self._mode in stack:  # (torch's own modes, tracing or faking, come after it: popped too)
            for _ in range(len(stack) - stack.index(self._mode)):
                self._popped.append(_pop_mode())
        else:  # (the block's end, its mode gone: torch's own modes never see dtr's work either)
            for key in _INFRA_KEYS:
                if torch._C._get_dispatch_mode(key) is not None:
                    try:
                        self._popped.append(_unset_infra_mode(key))
                    except RuntimeError:  # (one torch keeps elsewhere: left as it is)
                        pass

    def __exit__(self, *exc: Any) -> None:
        while self._popped:
            _push_mode(self._popped.pop())


class _KeyOff:
    """While it is active, neither the dispatch key nor any Python mode sees this thread's ops."""

    __slots__ = ("_key", "_modes")

    def __enter__(self) -> None:
        self._key, self._modes = native.key_off(), _disable_current_modes()
        self._key.__enter__()
        self._modes.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            self._modes.__exit__(*exc)
        finally:
            self._key.__exit__(*exc)


def enter(driver: Driver, use_native: bool, entry: str) -> Any:
    """Start feeding the thread's ops to ``driver``: make its entry, enter it, and return it.

    Args:
        driver: the block's driver.
        use_native: whether the block runs the native per-op path.
        entry: ``"mode"`` or ``"key"`` (native.use_entry chose it). The key needs the native module even for a
            block on the reference; where it cannot be taken (another block holds it, or another extension
            registered it: a warning says so, once), the block is a mode.
    """
    fast: Optional[Any] = None
    if use_native or entry == "key":
        fast = native_runtime().FastPath(driver, Driver._dispatch)  # (it takes over the core's hooks)
        driver.attach_native(fast)
    made: Any = None
    if entry == "key":
        assert fast is not None
        key = KeyEntry(fast, reference_only=not use_native)
        if key.enter():
            made = key
    if made is None:
        made = NativeMode(driver, fast) if use_native and fast is not None else ReferenceMode(driver)
        made.enter()
    driver.entry = made
    return made


def abandon(driver: Driver, keep: bool = False) -> None:
    """Give back what :func:`enter` took for ``driver`` (its mode, or the key) if it still holds it, also where it
    was interrupted before it returned: a top-level block whose enter failed or whose end was interrupted (Notes
    [An interrupted enter] and [An interrupted end] in budget.py). ``keep``: the driver keeps its entry object
    (its off() is used at the end of the block)."""
    made = driver.entry
    if not keep:
        driver.entry = None
    if made is not None:
        if made.receives_ops():
            made.exit()
        return
    stack = _get_current_dispatch_mode_stack()
    if stack and isinstance(stack[-1], ModeEntry) and stack[-1].driver is driver:
        _pop_mode()
    elif native.key_active():  # (a top-level enter found the key free: it is this block's)
        native.key_exit()
