"""Nested dtr.budget blocks (Note [Nested blocks] in dtr/runtime/budget.py): the tighter budget binds inside,
each block has its own stats, results stay exact, and what cannot nest raises dtr.NestingError."""
from __future__ import annotations

import threading

import pytest

import dtr

torch = pytest.importorskip("torch")


def _scaled_tanh_chain(x: torch.Tensor, n: int) -> torch.Tensor:
    for i in range(n):
        x = torch.tanh(x * (1.0 + 0.01 * i))
    return x


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh())
                                 for _ in range(12)])


def _step_with_inner_block(model, x, inner=None):
    """A training step; the middle layers run inside ``inner`` (a block a library opens), if given."""
    layers = list(model)
    h = x
    for layer in layers[:4]:
        h = layer(h)
    with (inner if inner is not None else _null()):
        for layer in layers[4:8]:
            h = layer(h)
    for layer in layers[8:]:
        h = layer(h)
    loss = h.square().mean()
    loss.backward()
    return loss.detach()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_the_tighter_inner_budget_binds_and_each_block_has_its_own_stats():
    x = torch.randn(256, 256)
    with dtr.budget(None, cost_model="flops") as outer:
        _scaled_tanh_chain(x, 4)
        before = outer.stats
        with dtr.budget(3 * x.nbytes, cost_model="flops") as inner:
            assert dtr.active_budget() is inner
            # every step keeps its input alive through autograd? no: only the chain's values
            y = _scaled_tanh_chain(x, 40)
            assert inner.stats["peak_bytes"] <= 3 * x.nbytes
        assert dtr.active_budget() is outer
        z = _scaled_tanh_chain(x, 40)  # the outer block has no limit again: nothing is evicted
        after_inner = outer.stats
    got = inner.stats
    assert got["budget_bytes"] == 3 * x.nbytes and got["peak_bytes"] <= 3 * x.nbytes
    assert got["ops"] == 80 and got["evictions"] + got["eager_evictions"] > 0
    # The outer block counts everything, the inner block's work included; its peak covers the inner's.
    assert outer.stats["ops"] == 4 * 2 + 80 + 80 == after_inner["ops"]
    assert outer.stats["peak_bytes"] >= got["peak_bytes"]
    assert outer.stats["evictions"] == before["evictions"] + got["evictions"]
    assert torch.equal(y, _scaled_tanh_chain(x, 40)) and torch.equal(z, y)


def test_a_looser_inner_budget_leaves_the_outer_one_binding():
    x = torch.randn(256, 256)
    with dtr.budget(3 * x.nbytes, cost_model="flops") as outer:
        with dtr.budget(100 * x.nbytes) as inner:
            y = _scaled_tanh_chain(x, 30)
    assert inner.stats["peak_bytes"] <= 3 * x.nbytes and outer.stats["peak_bytes"] <= 3 * x.nbytes
    assert torch.equal(y, _scaled_tanh_chain(x, 30))


@pytest.mark.parametrize("outer_limit", [None, 0.6])
def test_a_training_step_with_a_library_s_inner_block_is_exact(outer_limit):
    x = torch.randn(64, 256)
    model = _model()
    want_loss = _step_with_inner_block(model, x)
    want_grads = [p.grad for p in model.parameters()]
    model = _model()
    with dtr.budget(None, cost_model="flops") as probe:
        _step_with_inner_block(model, x)
    peak = probe.stats["peak_bytes"]
    model = _model()
    weights = sum(p.nbytes for p in model.parameters())
    # The library's block: room for what is resident when it begins, its layers' weights (first touched inside
    # it) and two of their activations.
    inner_weights = sum(p.nbytes for layer in list(model)[4:8] for p in layer.parameters())
    inner = _Tighter(lambda memory: memory + inner_weights + 2 * x.nbytes)
    const = 2 * weights + x.nbytes  # weights and gradients, the input: resident by the step's end
    limit = None if outer_limit is None else int(const + outer_limit * (peak - const))
    with dtr.budget(limit, cost_model="flops") as outer:
        loss = _step_with_inner_block(model, x, inner)
    assert torch.equal(loss, want_loss)
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want_grads))
    assert inner.block.stats["peak_bytes"] <= inner.block.budget_bytes
    assert inner.block.stats["evictions"] > 0 and outer.stats["remats"] > 0
    if limit is not None:
        assert outer.stats["peak_bytes"] <= limit


class _Tighter:
    """A library's block whose budget is chosen when it begins, from the memory resident then."""

    def __init__(self, limit_of):
        self.limit_of, self.block = limit_of, None

    def __enter__(self):
        self.block = dtr.budget(self.limit_of(dtr.active_budget().stats["memory_bytes"]))
        return self.block.__enter__()

    def __exit__(self, *exc):
        return self.block.__exit__(*exc)


def test_an_inner_budget_error_caught_inside_the_outer_block_leaves_it_running():
    x = torch.randn(256, 256)
    with dtr.budget(None, cost_model="flops") as outer:
        kept = [x * 2.0, x * 3.0]
        with pytest.raises(dtr.OutOfBudgetError):
            with dtr.budget(x.nbytes):  # less than what the program holds
                kept.append(x * 4.0)
        assert outer._core.budget < 0  # the outer block's own budget (none) again
        y = _scaled_tanh_chain(x, 10)
    assert torch.equal(y, _scaled_tanh_chain(x, 10)) and torch.equal(kept[1], x * 3.0)
    assert outer.stats["peak_bytes"] >= 3 * x.nbytes


def test_what_an_inner_block_cannot_change_raises_nesting_error():
    x = torch.randn(8, 8)
    with dtr.budget(None, heuristic="dtr"):
        with dtr.budget(None, heuristic="dtr", cost_model="time"):  # the same: fine
            x.sin()
        with dtr.budget(None):  # defaults: inherits the outer block's
            x.sin()
        for bad in (dict(heuristic="lru"), dict(cost_model="flops"), dict(log="/tmp/never-written.jsonl"),
                    dict(native=not dtr.active_budget().native)):
            with pytest.raises(dtr.NestingError, match=next(iter(bad))):
                with dtr.budget(None, **bad):
                    pass
        assert dtr.active_budget().heuristic.name == "dtr"
        y = x.cos()
    assert torch.equal(y, x.cos())
    assert dtr.active_budget() is None


def test_blocks_must_end_in_order():
    """An outer block that ends first ends the inner one too, and both say so (Note [Blocks that end out of
    order] in dtr/runtime/budget.py); nothing stays active."""
    outer, inner = dtr.budget(None), dtr.budget(None)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(dtr.NestingError, match="reverse order"):
        outer.__exit__(None, None, None)
    assert dtr.active_budget() is None
    with pytest.raises(dtr.NestingError, match="already ended"):
        inner.__exit__(None, None, None)
    with pytest.raises(RuntimeError, match="not active"):
        outer.__exit__(None, None, None)
    assert dtr.active_budget() is None


def _generator_with_a_block(x):
    with dtr.budget("1MiB", cost_model="flops"):
        y = x * 2
        yield
        yield y + 1


def test_generators_whose_blocks_end_out_of_order_leave_no_block_active():
    """Two generators that hold blocks across a yield, interleaved: the first to end got a NestingError and its
    block stayed active for good (later blocks nested in it, code outside any block ran under its budget)."""
    import gc

    x = torch.randn(64, 64)
    g1, g2 = _generator_with_a_block(x), _generator_with_a_block(x)
    next(g1)
    next(g2)
    assert torch.equal(next(g1), x * 2 + 1)
    with pytest.raises(dtr.NestingError, match="entered after it"):
        next(g1)  # g1's block ends while g2's is the innermost
    assert dtr.active_budget() is None and gc.get_freeze_count() == 0
    with pytest.raises(dtr.NestingError, match="already ended"):
        list(g2)
    with dtr.budget(None, heuristic="lru", cost_model="flops") as b:  # a top-level block of its own
        assert dtr.active_budget() is b
        _scaled_tanh_chain(x, 3)
    assert b.stats["ops"] == 6 and dtr.active_budget() is None


def test_a_block_ended_from_another_thread_says_so_and_stays_usable():
    b = dtr.budget(None)
    b.__enter__()
    err = {}

    def other():
        try:
            b.__exit__(None, None, None)
        except dtr.NestingError as e:
            err["e"] = e

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert "another thread" in str(err["e"])
    assert dtr.active_budget() is b
    b.__exit__(None, None, None)
    assert dtr.active_budget() is None


def test_blocks_in_other_threads_are_not_nested():
    x = torch.randn(64, 64)
    seen = {}

    def worker():
        with dtr.budget(None, cost_model="flops") as b:
            seen["active"] = dtr.active_budget() is b
            seen["y"] = _scaled_tanh_chain(x, 5)
        seen["stats"] = b.stats

    with dtr.budget(None, cost_model="flops") as main:
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        _scaled_tanh_chain(x, 3)
    assert seen["active"] and seen["stats"]["ops"] == 10 and main.stats["ops"] == 6
    assert torch.equal(seen["y"], _scaled_tanh_chain(x, 5))


@pytest.mark.parametrize("ends_first", ["evicting", "other"])
def test_a_block_s_escapes_stay_its_own_while_another_thread_runs_a_block(ends_first):
    """Each thread's block handles its own thread's escapes (Note [Escapes in several threads] in
    dtr/runtime/escapes.py). Before, the last block entered took every escape over: the evicting thread's
    .tolist() raised (pickle gave NaNs), and the first block to end restored torch's methods under the
    other's feet."""
    import pickle

    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    want = [_scaled_tanh_chain(x, i + 1) for i in range(12)]
    original = torch.Tensor.__reduce_ex__
    entered, done, out = threading.Event(), threading.Event(), {}

    def other():
        with dtr.budget(None, cost_model="flops"):
            entered.set()
            done.wait(30)
            out["other"] = pickle.loads(pickle.dumps(_scaled_tanh_chain(x, 2)))

    t = threading.Thread(target=other)
    with dtr.budget(6 * 64 * 64 * 4, cost_model="flops") as b:
        ys = [_scaled_tanh_chain(x, 1)]
        for i in range(1, 12):
            ys.append(torch.tanh(ys[-1] * (1.0 + 0.01 * i)))
        t.start()
        entered.wait(30)
        got = [y.tolist() for y in ys]  # (the early ones are evicted)
        del ys
        if ends_first == "other":
            done.set()
            t.join()
    if ends_first == "evicting":
        done.set()
        t.join()
    assert b.stats["evictions"] > 0 and b.stats["remats"] > 0, b.stats
    assert got == [w.tolist() for w in want]
    assert torch.equal(out["other"], want[1])
    assert torch.Tensor.__reduce_ex__ is original
    from torch._dynamo.testing import CompileCounter
    counter = CompileCounter()
    torch.compile(lambda a: a * 2, backend=counter)(x)
    assert counter.frame_count == 1  # the compiler's stance came back (Note [Compiled code in a block])
