"""A KeyboardInterrupt landing inside dtr's own Python code (a signal handler's exception is delivered between
any two bytecodes): the interrupt reaches the program, the block is ended, torch's methods are the originals
again, and a new block works. Each test injects it at a fixed line through sys.settrace. Found by a helper's
hunt (/tmp/hE/inject.py), 2026-11-29."""
from __future__ import annotations

import gc
import inspect
import sys
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack  # noqa: E402

import dtr  # noqa: E402
from dtr.runtime import entry as entry_mod  # noqa: E402
from dtr.runtime import escapes  # noqa: E402
from dtr.runtime.budget import Budget  # noqa: E402
from dtr.runtime.native import key_active  # noqa: E402
from dtr.runtime.recompute import Recomputer  # noqa: E402

ENTRIES = [dict(), dict(entry="mode"), dict(native=False)]
_ORIGINALS = {n: getattr(torch.Tensor, n) for n in ("numpy", "tolist", "__reduce_ex__")}
_STORAGE_DATA_PTR = vars(torch.UntypedStorage).get("data_ptr")


def _chain(n: int = 6) -> torch.Tensor:
    torch.manual_seed(0)
    hs = [torch.randn(256, 256)]
    for _ in range(n):
        hs.append(torch.tanh(hs[-1] * 1.5))
    return hs[-1].sum()


def _interrupt_at(fn: Callable, text: str, hit: int = 1) -> Callable:
    """A trace function raising KeyboardInterrupt the ``hit``-th time ``fn`` reaches its line containing ``text``."""
    lines, first = inspect.getsourcelines(fn.__code__)
    target = first + next(i for i, line in enumerate(lines) if text in line)
    code, seen = fn.__code__, [0]

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not code:
            return None
        if event == "line" and frame.f_lineno == target:
            seen[0] += 1
            if seen[0] == hit:
                raise KeyboardInterrupt(f"injected at {fn.__qualname__}: {text}")
        return trace

    return trace


def _interrupted_block(trace: Callable, **kw: Any) -> None:
    """A block over _chain with ``trace`` set while it runs: the interrupt reaches the program."""
    old = sys.gettrace()
    with pytest.raises(KeyboardInterrupt, match="injected"):
        sys.settrace(trace)
        try:
            with dtr.budget(4 * 256 * 256 * 4, **kw):
                _chain()
        finally:
            sys.settrace(old)


def _nothing_left(**kw: Any) -> None:
    """No block, mode, key or patched method is left, and a new block evicts and is exact."""
    assert dtr.active_budget() is None and not key_active() and not _get_current_dispatch_mode_stack()
    assert {n: getattr(torch.Tensor, n) for n in _ORIGINALS} == _ORIGINALS
    assert vars(torch.UntypedStorage).get("data_ptr") is _STORAGE_DATA_PTR
    assert not escapes._saved
    want = _chain()
    with dtr.budget(4 * 256 * 256 * 4, **kw) as b:
        got = _chain()
    assert torch.equal(got, want) and b.stats["evictions"] > 0


@pytest.mark.parametrize("kw", ENTRIES, ids=["key", "mode", "reference"])
@pytest.mark.parametrize("text", ["replace(torch.Tensor, name, _guarded", "replace(module, name, _guarded"])
def test_an_interrupt_while_the_block_patches_escapes(kw, text):
    """Interrupted half way through replacing torch's methods (a block's enter): before, the methods stayed
    half replaced, and every later block raised AttributeError (Note [Interrupted patching] in escapes.py)."""
    _interrupted_block(_interrupt_at(escapes._install, text), **kw)
    _nothing_left(**kw)
    _nothing_left(**kw)


@pytest.mark.parametrize("kw", ENTRIES, ids=["key", "mode", "reference"])
@pytest.mark.parametrize("where", [(Budget._enter, "gc.freeze()"), (Budget._enter, "active.append(self)"),
                                   (entry_mod.enter, "driver.entry = made")])
def test_an_interrupt_after_the_block_took_its_entry(kw, where):
    """Interrupted in a block's enter after its mode or key was taken: before, the mode or key stayed for good,
    and every later block raised NestingError (Note [An interrupted enter] in budget.py)."""
    _interrupted_block(_interrupt_at(*where), **kw)
    assert gc.get_freeze_count() == 0
    _nothing_left(**kw)


@pytest.mark.parametrize("kw", ENTRIES, ids=["key", "mode", "reference"])
def test_an_interrupt_as_an_escape_begins(kw):
    """Interrupted as a wrapped method (``.tolist()``) marks its escape in progress: before, the mark stayed,
    and every later escape of the thread was skipped (Note [Interrupted patching] in escapes.py)."""
    wrapper = escapes._guarded(_ORIGINALS["tolist"], escapes.READ)
    old = sys.gettrace()
    with pytest.raises(KeyboardInterrupt, match="injected"):
        with dtr.budget(4 * 256 * 256 * 4, **kw):
            x = _chain()
            sys.settrace(_interrupt_at(wrapper, "try:"))
            try:
                x.tolist()
            finally:
                sys.settrace(old)
    assert not getattr(escapes._depth, "n", 0)
    _nothing_left(**kw)


@pytest.mark.parametrize("kw", ENTRIES, ids=["key", "mode", "reference"])
def test_an_interrupt_at_the_start_of_the_end_of_a_block(kw):
    """Interrupted right after the block left this thread's active blocks: before, its mode or key, torch's
    patched methods and the compiler stance stayed, with no block to end them."""
    _interrupted_block(_interrupt_at(Budget.__exit__, "assert restore is not None"), **kw)
    assert torch.compiler.is_compiling() is False
    _nothing_left(**kw)


@pytest.mark.parametrize("kw", ENTRIES, ids=["key", "mode", "reference"])
def test_an_interrupt_at_the_end_of_a_nested_block(kw):
    """Interrupted while a nested block ends: the outer block's budget binds again (before, the inner's
    tighter one stayed for the rest of the outer block)."""
    old, want = sys.gettrace(), _chain()
    with dtr.budget(8 * 256 * 256 * 4, **kw) as outer:
        with pytest.raises(KeyboardInterrupt, match="injected"):
            sys.settrace(_interrupt_at(Budget._exit_nested, "self._final = self._read_stats()"))
            try:
                with dtr.budget(4 * 256 * 256 * 4):
                    _chain()
            finally:
                sys.settrace(old)
        assert dtr.active_budget() is outer and outer._core.budget == 8 * 256 * 256 * 4
        got = _chain()
    assert torch.equal(got, want)
    _nothing_left(**kw)


@pytest.mark.parametrize("kw", ENTRIES, ids=["key", "mode", "reference"])
def test_an_interrupt_before_the_end_brings_back_what_the_program_holds(kw):
    """Interrupted as the block begins to end, before it restores torch's methods and brings back: the tensors
    the program holds are brought back anyway, exact (before, the evicted ones held 0 bytes: Note [An
    interrupted end])."""
    torch.manual_seed(0)
    want = [torch.randn(256, 256)]
    for _ in range(8):
        want.append(torch.tanh(want[-1] * 1.5))
    old, got = sys.gettrace(), []
    with pytest.raises(KeyboardInterrupt, match="injected"):
        sys.settrace(_interrupt_at(Budget.__exit__, "budget_error = isinstance(exc"))
        try:
            with dtr.budget(5 * 256 * 256 * 4, **kw) as b:
                torch.manual_seed(0)
                got.append(torch.randn(256, 256))
                for _ in range(8):
                    got.append(torch.tanh(got[-1] * 1.5))
        finally:
            sys.settrace(old)
    assert b.stats["evictions"] > 0
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    del got, want
    _nothing_left(**kw)


@pytest.mark.parametrize("kw", ENTRIES, ids=["key", "mode", "reference"])
def test_an_interrupt_in_a_random_op_s_recomputation_leaves_the_generator_as_the_program_had_it(kw):
    """Interrupted in the recomputation of a random op right after it set the generator to the state the op
    first saw: before, the generator stayed there, and the program's next random numbers repeated old ones."""
    lines, first = inspect.getsourcelines(Recomputer.run)
    target = first + next(i for i, line in enumerate(lines) if "if grad != r.grad:  # see Note" in line)
    code, hits = Recomputer.run.__code__, []

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not code:
            return None
        if event == "line" and frame.f_lineno == target and frame.f_locals["r"].rng is not None and not hits:
            hits.append(1)
            raise KeyboardInterrupt("injected in a random op's recomputation")
        return trace

    old = sys.gettrace()
    with pytest.raises(KeyboardInterrupt, match="injected"):
        with dtr.budget(4 * 256 * 256 * 4, **kw):
            torch.manual_seed(0)
            hs = [torch.rand(256, 256)]
            for _ in range(8):
                hs.append(torch.tanh(hs[-1] * 1.5))
            state = torch.get_rng_state()
            sys.settrace(trace)
            try:
                sum(h.sum() for h in hs)  # (brings back the evicted ones: torch.rand's output among them)
            finally:
                sys.settrace(old)
    assert hits and torch.equal(torch.get_rng_state(), state)
    del hs
    _nothing_left(**kw)

