"""The autograd Functions and blocks the random programs (random_programs.py) call: a user-defined Function,
products through a storage the program frees and allocates again (FSDP2's unsharded parameters), and the block
``torch.utils.checkpoint`` recomputes."""
from __future__ import annotations

import torch

__all__ = ["ScaledMul", "Unsharded", "block"]


class ScaledMul(torch.autograd.Function):
    """A user-defined autograd function that saves both inputs for its backward."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b * 0.5

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad * b * 0.5, grad * a * 0.5


class Unsharded(torch.autograd.Function):
    """``a @ w`` through a copy of ``w`` whose storage exists only while it is used (FSDP2's unsharded
    parameter: ``resize_`` and a copy before each use, ``resize_(0)`` after it, here and in the backward)."""

    @staticmethod
    def forward(ctx, a, w):
        full = torch.empty_like(w)
        _gather(full, w)
        out = a @ full
        full.untyped_storage().resize_(0)
        ctx.save_for_backward(a, w)
        ctx.full = full
        return out

    @staticmethod
    def backward(ctx, grad):
        a, w = ctx.saved_tensors
        full = ctx.full
        _gather(full, w)
        grads = grad @ full.t(), a.t() @ grad
        full.untyped_storage().resize_(0)
        return grads


def _gather(full: torch.Tensor, w: torch.Tensor) -> None:
    full.untyped_storage().resize_(w.numel() * w.element_size())
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(full):
        full.copy_(w)


def block(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * torch.sigmoid(x) + x
