"""Training steps, the bytes that exist before a step, budgets between them and a step's peak, gradient checks.

Budgets are set the same way throughout the runtime's tests: constants (parameters, buffers, inputs)
+ f x (dtr's peak with no limit - constants), so that any f < 1 forces evictions (budget_at).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import dtr


def storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def constant_bytes(model: Optional[nn.Module], *inputs: torch.Tensor) -> int:
    """Bytes of the tensors that exist before the step: parameters, buffers, inputs (each storage once)."""
    ts = list(inputs)
    if model is not None:
        ts += list(model.parameters()) + list(model.buffers())
    return storage_bytes(ts)


def constant_bytes_per_tensor(model: nn.Module, *inputs: torch.Tensor) -> int:
    """As constant_bytes, but summed tensor by tensor: a storage that two of them share counts twice."""
    ts = list(model.parameters()) + list(model.buffers()) + list(inputs)
    return sum(t.untyped_storage().nbytes() for t in ts)


def peak_of(fn: Callable[[], object]) -> int:
    """dtr's accounting of ``fn`` run with no limit: its peak."""
    with dtr.budget(None, cost_model="flops") as b:
        fn()
    return b.stats["peak_bytes"]


def budget_at(const: int, peak: int, f: float) -> int:
    """The budget at fraction ``f`` of the way from the constants to the plain peak."""
    return int(const + f * (peak - const))


def grads_of(model: nn.Module) -> List[Optional[torch.Tensor]]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def seeded_step(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor], seed: int = 1) -> torch.Tensor:
    """One training step with a fixed seed (zero grads, loss, backward); returns the detached loss."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model)
    loss.backward()
    return loss.detach()


def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """One seeded training step of a classifier (cross-entropy of ``model(x)`` against ``y``)."""
    return seeded_step(model, lambda m: F.cross_entropy(m(x), y), seed)


def assert_same_grads(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), f"gradient of {name} differs"
    for b, c in zip(model.buffers(), ref.buffers()):
        assert torch.equal(b, c)


def assert_same_state(model: nn.Module, ref: nn.Module, opt, ref_opt, what: str = "") -> None:
    """Parameters, buffers and every optimizer state entry equal bit for bit."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{what}parameter {name} differs"
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        assert torch.equal(b, c), f"{what}buffer {name} differs"
    ps, qs = list(model.parameters()), list(ref.parameters())
    assert len(opt.state) == len(ref_opt.state) > 0, what
    for i, (p, q) in enumerate(zip(ps, qs)):
        s, r = opt.state.get(p, {}), ref_opt.state.get(q, {})
        assert s.keys() == r.keys(), f"{what}optimizer state keys of parameter {i}"
        for k in s:
            if isinstance(s[k], torch.Tensor):
                assert s[k].dtype == r[k].dtype and torch.equal(s[k], r[k]), f"{what}optimizer {k} of parameter {i}"
            else:
                assert s[k] == r[k], f"{what}optimizer {k} of parameter {i}"
    for g, h in zip(opt.param_groups, ref_opt.param_groups):
        assert {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in h.items() if k != "params"}, what
