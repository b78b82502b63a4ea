"""One budget object over many blocks: one block at a time, and nothing a failed enter or an interrupted end
leaves behind (Note [One block at a time] in dtr/runtime/budget.py). Found by a helper's hunt, 2026-11-29."""
from __future__ import annotations

import threading
import weakref

import pytest

torch = pytest.importorskip("torch")

import dtr  # noqa: E402
from dtr.runtime import driver as driver_mod  # noqa: E402
from dtr.runtime.native import key_active  # noqa: E402
from dtr.runtime.step_plans import PlanPolicy  # noqa: E402

INLINE = PlanPolicy(background="inline", time_limit=6)


def _chain(n=6):
    torch.manual_seed(0)
    hs = [torch.randn(256, 256)]
    for _ in range(n):
        hs.append(torch.tanh(hs[-1] * 1.5))
    return hs[-1].sum()


def _usable(b) -> None:
    """``b`` (and a fresh budget) run a block that evicts, exactly, and leave no runtime behind."""
    want = _chain()
    for budget in (b, dtr.budget(4 * 256 * 256 * 4)):
        with budget:
            got = _chain()
        assert torch.equal(got, want)
        assert not key_active() and dtr.active_budget() is None


def test_a_budget_in_use_in_another_thread_is_refused_and_both_go_on():
    mem = dtr.budget(4 * 256 * 256 * 4, plan=INLINE)
    inside, leave = threading.Event(), threading.Event()
    errors = []

    def other():
        try:
            with mem:
                inside.set()
                leave.wait(30)
                _chain()
        except BaseException as e:  # (reported below)
            errors.append(e)
            inside.set()

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(30)
    with pytest.raises(RuntimeError, match="in use: a block of it is running, in this thread or another"):
        with mem:
            pass
    leave.set()
    t.join(30)
    assert not errors, errors
    _usable(mem)


def test_a_budget_entered_again_inside_its_own_block_is_refused():
    mem = dtr.budget(4 * 256 * 256 * 4, plan=INLINE)
    with mem:
        with pytest.raises(RuntimeError, match="in use"):
            with mem:
                pass
        _chain()
    _usable(mem)


def test_a_failed_enter_leaves_the_budget_enterable(tmp_path):
    b = dtr.budget(None, log=tmp_path / "missing" / "step.jsonl")
    for _ in range(2):  # the same error again, not "entered twice"
        with pytest.raises(FileNotFoundError):
            with b:
                pass
        assert not key_active() and dtr.active_budget() is None
    (tmp_path / "missing").mkdir()
    with b:
        _chain()
    assert (tmp_path / "missing" / "step.jsonl").exists()


def test_closing_a_planned_budget_keeps_it_usable():
    """close() stops planning and removes the work files; the plans stay, and so does the budget."""
    mem = dtr.budget(4 * 256 * 256 * 4, plan=INLINE)
    mem.close()  # (before the first step too: it records into the work directory)
    for _ in range(3):
        with mem:
            _chain()
        mem.close()
    assert mem.stats["plan"] in ("recorded", "planned", "online")
    _usable(mem)


def test_an_interrupted_end_of_block_leaves_nothing_behind(monkeypatch):
    """A KeyboardInterrupt landing in the end of a block (here: where it carries out what the block leaves):
    the budget is usable again, no runtime stays active, and the block's tensors are not held."""
    mem = dtr.budget(4 * 256 * 256 * 4, plan=INLINE)
    with mem:
        _chain()
    carry_out = driver_mod.Driver.carry_out

    def interrupted(self):
        monkeypatch.setattr(driver_mod.Driver, "carry_out", carry_out)
        raise KeyboardInterrupt

    monkeypatch.setattr(driver_mod.Driver, "carry_out", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with mem:
            x = torch.randn(256, 256)
            _chain()
    held = weakref.ref(x.untyped_storage())
    del x
    assert held() is None
    assert not key_active() and dtr.active_budget() is None
    _usable(mem)
