"""Autograd's modes under a budget: the grad mode a recomputation runs under, vmap, and forward-mode AD's zero tensors.

Both were found by hand (a helper's hunt, 2026-11-29): an nn.LSTM's weight gradients differed from plain
PyTorch's in the last bits (Note [What a recomputation restores] in dtr/runtime/recompute.py), and forward-mode
AD raised at its first eviction (Note [Other layouts] in dtr/runtime/reference.py).
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.autograd.forward_ad as fwAD  # noqa: E402
from torch import nn  # noqa: E402

import dtr  # noqa: E402


def _lstm_step():
    torch.manual_seed(0)
    m = nn.LSTM(64, 64, batch_first=True)
    x = torch.randn(64, 40, 64, requires_grad=True)
    h = m(m(x)[0])[0]  # the same LSTM twice: the first call's output is the second's input
    loss = h.pow(2).mean()
    loss.backward()
    return [loss.detach(), x.grad] + [p.grad for p in m.parameters()]


def _peak(fn) -> int:
    with dtr.budget(None, cost_model="flops") as b:
        fn()
    return b.stats["peak_bytes"]


def test_a_recomputation_runs_under_the_grad_mode_its_op_ran_under():
    """CPU LSTMs (aten::mkldnn_rnn_layer) compute other bits with grad mode off, as backward runs: exact only if
    the forward ops recomputed in backward run with grad mode on again. It differed before the fix."""
    want = _lstm_step()
    with dtr.budget(int(_peak(_lstm_step) * 0.85), cost_model="flops") as b:
        got = _lstm_step()
    assert b.stats["evictions"] > 0 and b.stats["remats"] > 0
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_a_recomputation_in_forward_under_no_grad_keeps_grad_mode_off():
    """The other direction: an op that ran under no_grad, recomputed while grad mode is on, runs with it off."""
    torch.manual_seed(1)
    w = torch.randn(256, 256) / 16
    x = torch.randn(256, 256)

    def run():
        with torch.no_grad():
            hs = [torch.tanh(x @ w)]
            for _ in range(5):
                hs.append(torch.tanh(hs[-1] @ w))
        with torch.enable_grad():
            return [h.sum() for h in hs]  # each read may recompute what no_grad computed

    want = run()
    with dtr.budget(int(_peak(run) * 0.6), cost_model="flops") as b:
        got = run()
        modes = {(r.func.name(), r.grad) for r in b._driver.recomputer.recipes.values()}
    assert b.stats["remats"] > 0
    assert {m for m in modes if m[0] != "aten::sum"} == {("aten::mm", False), ("aten::tanh", False)}
    assert ("aten::sum", True) in modes
    for g, v in zip(got, want):
        assert torch.equal(g, v)


def _dual_chain(x, tx):
    with fwAD.dual_level():
        h = fwAD.make_dual(x, tx)
        for _ in range(8):
            h = torch.sin(h) * 1.5  # a tangent the AD knows is zero is a zero tensor (torch._efficientzerotensor)
        p, t = fwAD.unpack_dual(h.sum(0))
        return p.clone(), t.clone()


def test_forward_mode_ad_is_exact_under_eviction():
    """Forward-mode AD makes zero tensors (a storage without memory): dtr leaves them alone, evicts the rest.
    Before the fix, the first eviction raised "Attempted to call resize_() on an invalid python storage"."""
    torch.manual_seed(2)
    x, tx = torch.randn(1024, 64), torch.randn(1024, 64)
    want = _dual_chain(x, tx)
    with dtr.budget(int(_peak(lambda: _dual_chain(x, tx)) * 0.8), cost_model="flops") as b:
        got = _dual_chain(x, tx)
    assert b.stats["evictions"] > 0 and b.stats["remats"] > 0
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def _batched_grads_step():
    torch.manual_seed(0)
    ws = [nn.Parameter(torch.randn(64, 64) / 8) for _ in range(10)]
    x = torch.randn(1024, 64, requires_grad=True)  # a random op's result, evicted and recomputed in backward
    h = x
    for w in ws:
        h = torch.tanh(h @ w)
    v = torch.randn(4, *h.shape)
    return torch.autograd.grad(h, x, v, is_grads_batched=True)[0]


@pytest.mark.parametrize("entry", [{"entry": "key"}, {"entry": "mode"}, {"native": False}],
                         ids=["key", "mode", "reference"])
def test_a_recomputation_inside_a_vmap_runs_outside_it(entry):
    """autograd.grad(..., is_grads_batched=True) runs backward under a vmap: a random op recomputed there met
    vmap's check for random ops and raised on the mode's entries (Note [What a recomputation restores])."""
    want = _batched_grads_step()
    with dtr.budget(int(_peak(_batched_grads_step) * 0.5), cost_model="flops", **entry) as b:
        got = _batched_grads_step()
    assert b.stats["evictions"] > 0 and b.stats["remats"] > 0, b.stats
    assert torch.equal(got, want)


def _tangent_of_a_view(ps):
    v4 = ps[3] * ps[3]
    v5 = ps[1].narrow(0, 1, 2)
    with fwAD.dual_level():
        d = fwAD.make_dual(v5.detach(), torch.ones_like(v5))
        for _ in range(3):
            d = torch.sin(d) * 1.5
        _, t = fwAD.unpack_dual(d)
    v22 = t * v5
    loss = v22.sum() + v4.sum() * 0.5 + v5.sum() * 0.25
    loss.backward()
    return [loss.detach(), v22.detach(), v4.detach()] + [p.grad for p in ps if p.grad is not None]


def test_a_tangent_of_a_view_is_exact_under_eviction():
    """Forward-mode AD over a narrow view of a parameter, under lru at a tight budget (found by a helper's
    extension of the random programs: seed 15). The view's tangent is as large as the view's base, which the
    meta run predicted at the view's size: dtr raised "size does not match, self was 256 bytes but src was
    384 bytes" at the end of the block, and the program's tensors lost their values (Note [Outputs sized by
    an input's storage] in dtr/runtime/prediction.py)."""
    shapes = [(16, 16), (16, 32), (32, 16), (32, 32)]

    def leaves():
        g = torch.Generator().manual_seed(15)
        return [torch.randn(s, generator=g).requires_grad_() for s in shapes]

    want = _tangent_of_a_view(leaves())
    with dtr.budget(None, cost_model="flops", heuristic="lru"):
        kept = _tangent_of_a_view(leaves())  # (held: an earlier block's tensors count in the next one)
    with dtr.budget(26 * 1024, cost_model="flops", heuristic="lru") as b:
        got = _tangent_of_a_view(leaves())
    assert b.stats["evictions"] > 0 and b.stats["remats"] > 0, b.stats
    assert all(torch.equal(g, w) for g, w in zip(got + kept, want + want))
