"""The dispatch-key entry of the native path (Note [The dispatch-key entry] in csrc/native/fastpath.cpp).

Ops reach dtr through a C++ fallback on a dispatch key instead of a TorchDispatchMode. Its steps are
fast_call's, compared with the reference in test_native.py through the mode's entry. Its op stream is not
a mode's, and not even the same with every op sent to the reference (Python objects made for the
reference's results change which gradient sums autograd does in place), so here it is checked on its own:
values bit-equal to plain PyTorch under budgets that evict, and its recorded log replaying to the decisions
it made.
"""
from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch")
from support.model_losses import model_losses  # noqa: E402
from support.models import mlp  # noqa: E402
from support.random_programs import generate, run  # noqa: E402
from support.same_values import assert_equal, same_bits  # noqa: E402
from support.training import train_step  # noqa: E402

import dtr  # noqa: E402
from dtr.runtime import native  # noqa: E402

pytestmark = pytest.mark.skipif(not native.available() and os.environ.get("DTR_REQUIRE_NATIVE") != "1",
                                reason="dtr._native is not built for this torch (make test requires it)")


def _key_run(tmp_path, name, fn, limit):
    from dtr.core import ReplayStatus
    from dtr.sim import replay
    path = tmp_path / f"{name}.jsonl"
    torch.manual_seed(0)
    with dtr.budget(limit, cost_model="flops", log=path, entry="key", thrash_limit=None) as b:
        got = fn()
    assert b.entered == "key"
    r = replay(path, "eqclass", limit, thrash_limit=float("inf"))
    assert r.status == ReplayStatus.OK, name
    assert (r.evictions, r.remats, r.peak_bytes) == (b.stats["evictions"], b.stats["remats"],
                                                     b.stats["peak_bytes"]), name
    return got, b.stats


@pytest.mark.parametrize("seed", range(8))
def test_random_programs_through_the_dispatch_key(tmp_path, seed):
    p = generate(seed)
    want = run(p)
    _, stats = _key_run(tmp_path, f"seed{seed}", lambda: run(p), None)
    evicted = 0
    for f in (0.6, 0.4):
        try:
            got, st = _key_run(tmp_path, f"seed{seed}-{f}", lambda: run(p), int(f * stats["peak_bytes"]))
        except (dtr.OutOfBudgetError, dtr.ThrashingError):
            continue  # (as on the mode's entry, some programs cannot run in 40%)
        evicted += st["evictions"]
        assert_equal(got, want, f"seed {seed} at {f}")
    assert evicted > 0, "no budget evicted: the test does not cover recomputation through the key"


@pytest.mark.parametrize("name", sorted(model_losses()))
def test_models_through_the_dispatch_key(tmp_path, name):
    torch.manual_seed(0)
    model, loss = model_losses()[name]()

    def step():
        model.zero_grad(set_to_none=True)
        out = loss()
        if out.requires_grad:  # (train_step runs its own backward)
            out.backward()
        return [out.detach()] + [q.grad.clone() for q in model.parameters() if q.grad is not None]

    torch.manual_seed(0)
    want = step()
    _, stats = _key_run(tmp_path, name, step, None)
    got, st = _key_run(tmp_path, f"{name}-0.7", step, int(0.7 * stats["peak_bytes"]))
    assert st["evictions"] > 0
    assert len(got) == len(want) and all(same_bits(a, c) for a, c in zip(want, got)), name


def test_the_dispatch_key_runs_most_ops_natively_and_ends_with_the_block():
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    model = mlp(width=32, depth=3, p=0.0)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    with dtr.budget(None, entry="key") as b:
        assert native.key_active() and _get_current_dispatch_mode() is None
        fast = b._driver._fast
        train_step(model, x, y)
        nat, ref = fast.counts
        with b._driver.off():
            assert not native.key_active()
            before = b.stats["ops"]
            torch.ones(3) * 2  # not seen
            assert b.stats["ops"] == before
    assert not native.key_active()
    assert nat > 3 * ref, (nat, ref)  # (the reference: gradient sums done in place, copies)
    before = b.stats["ops"]
    torch.ones(3) * 2  # after the block: not seen
    assert b.stats["ops"] == before


def _sum_counts(fn):
    """How many out-of-place and in-place adds ``fn`` runs (torch's profiler: it sees below the key too)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts = {e.key: e.count for e in prof.key_averages()}
    return counts.get("aten::add", 0), counts.get("aten::add_", 0)


def test_gradient_sums_stay_in_place_through_the_key_as_without_dtr():
    """Autograd sums a gradient in place while it holds the storage's one reference. A version chain pinned
    at _MAX_VERSIONS sums is a constant nothing was computed from, held weakly (Note [Constants held weakly]
    in storage_table.py): the later sums stay in place, run natively, and the gradients are exact."""
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(8, 64)

    def step():
        w.grad = None
        h = x
        for _ in range(20):  # w's gradient is a sum of 20 terms: a version chain pinned after 8
            h = torch.tanh(h @ w)
        h.sum().backward()
        return w.grad.clone()

    want = step()
    plain = _sum_counts(step)
    with dtr.budget(None, entry="key"):
        step()  # (first sight of each signature runs its meta kernel, which the profiler counts)
    with dtr.budget(None, entry="key") as b:
        fast = b._driver._fast
        nat0, ref0 = fast.counts
        got: list = []
        counts = _sum_counts(lambda: got.append(step()))
        nat, ref = fast.counts
        b._check()
    assert plain[0] == 0 and plain[1] >= 19 and counts == plain, (plain, counts)  # (all in place, as plain)
    assert same_bits(got[0], want)
    assert ref - ref0 <= 2, f"{ref - ref0} ops went to the reference (the sums into a constant should not)"
    assert nat - nat0 > 50


@pytest.mark.parametrize("how", ["key", "mode", "reference"])
def test_a_weakly_held_constant_is_held_once_something_computed_from_it_may_need_it(how):
    """A version chain pinned while nothing was computed from it is held weakly; the first op that computes
    from it holds it strongly, so that when the program drops it after that result was evicted, protecting
    the result can still recompute it from the constant's value (Note [Constants held weakly])."""
    n = 256 * 256
    kib = n * 4 // 1024
    x = torch.randn(256, 256)  # from before the block: a constant

    def program(b=None):
        check = b._check if b is not None else (lambda: None)
        g = x * 1
        for _ in range(10):  # a chain of in-place versions, pinned after 8: a constant nothing needs yet
            g.add_(x)
            check()
        e = g.sin()          # computed from it: from now on e may need its value
        check()
        big = torch.ones(n)  # no room for e too: e is evicted
        check()
        del g                # the program drops the constant; protecting e recomputes it from g's value
        out = big[:4] + 1
        check()
        return e.clone(), out

    want = program()
    kw = {"native": False} if how == "reference" else {"entry": how}
    with dtr.budget(f"{3 * kib + kib // 4}KiB", **kw) as b:
        got = program(b)
        stats = b.stats
    assert stats["evictions"] > 0 and stats["remats"] > 0, stats
    assert all(same_bits(a, c) for a, c in zip(got, want))


def test_the_dispatch_key_keeps_errors_and_program_modes():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):  # the program's own mode: which ops reach it
        def __init__(self):
            super().__init__()
            self.ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    model = mlp(width=32, depth=3, p=0.0)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    torch.manual_seed(0)
    train_step(model, x, y)
    want = [q.grad.clone() for q in model.parameters()]
    with dtr.budget(None, entry="key") as b:
        with Seen() as c:  # the program's mode sees the ops first, then dtr does
            model.zero_grad(set_to_none=True)
            train_step(model, x, y)
    assert "aten::addmm" in c.ops and "aten::threshold_backward" in c.ops, sorted(set(c.ops))
    assert b.stats["ops"] >= len(c.ops)
    assert all(torch.equal(a, q.grad) for a, q in zip(want, model.parameters()))
    with pytest.raises(dtr.OutOfBudgetError):  # raised inside the key's C++ fallback: the same exception
        with dtr.budget("1KiB", entry="key"):
            train_step(model, x, y)
    with pytest.raises(RuntimeError, match="shape"):  # an op's own error passes through as it is
        with dtr.budget(None, entry="key"):
            torch.randn(2, 3) @ torch.randn(2, 3)
    with dtr.budget(None, entry="key") as outer:
        with dtr.budget("1MiB") as inner:  # a nested block runs on the outer block's runtime: the key
            torch.randn(2, 2).sin()
        assert native.key_active() and inner.stats["ops"] == 2 and inner.entry == "key"
    assert outer.stats["ops"] == 2
    assert not native.key_active()


def test_the_entry_is_chosen_by_argument_or_environment(monkeypatch):
    monkeypatch.setenv("DTR_ENTRY", "key")
    assert dtr.budget(None).entry == "key"
    assert dtr.budget(None, entry="mode").entry == "mode"
    monkeypatch.setenv("DTR_ENTRY", "sideways")
    with pytest.raises(ValueError, match="DTR_ENTRY='sideways'.*'mode'.*'key'"):
        dtr.budget(None)
    with pytest.raises(ValueError, match="entry='x'"):
        dtr.budget(None, entry="x")


def test_a_key_dtr_cannot_take_makes_the_block_a_mode_with_one_warning(monkeypatch):
    """Another extension that registered a fallback on the key: dtr warns once and runs the mode's entry."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    m = native.native_module()

    def taken(fast, reference):
        raise RuntimeError("dtr: cannot take the Fake dispatch key for the native entry: already registered")

    monkeypatch.setattr(m, "key_enter", taken)
    monkeypatch.setitem(native._state, "key_failed", False)
    model = mlp(width=16, depth=2, p=0.0)
    x, y = torch.randn(4, 16), torch.randint(0, 10, (4,))
    with pytest.warns(RuntimeWarning, match="entry='key' is unavailable.*already registered"):
        with dtr.budget(None, entry="key") as b:
            assert b.entered == "mode" and _get_current_dispatch_mode() is b._driver.entry
            train_step(model, x, y)
    assert b.stats["ops"] > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        with dtr.budget(None, entry="key") as b:
            train_step(model, x, y)
    assert b.entered == "mode"
