"""The autograd Functions and blocks the random programs (random_programs.py) call: a user-defined Function,
products through a storage the program frees and allocates again (FSDP2's unsharded parameters), the block
``torch.utils.checkpoint`` recomputes, and the instructions through lazy conjugate and negative views, a storage
``resize_`` grows, a quantized round trip, forward-mode AD, float32 matmuls inside a bfloat16 autocast region,
ops under another default dtype and Python functions run over elements in place; and the tables of the
unary, binary, in-place and view instructions."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

__all__ = ["BINARY", "INPLACE", "LAYOUTS", "ScaledMul", "UNARY", "Unsharded", "VIEWS", "block", "float64_default",
           "fp32_island", "grown", "lazy_bits", "python_elementwise", "quantized", "tangent"]


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


def lazy_bits(a: torch.Tensor) -> torch.Tensor:
    """Products through views with torch's lazy conjugate and negative bits (Note [Lazy bits] in
    dtr/runtime/recompute.py): ``z.conj()`` is read with its conjugate bit, ``z.conj().imag`` with its
    negative bit, each by an op whose result the block may evict and recompute."""
    z = torch.complex(a, a * 0.5)
    prod = (z.conj() * 1.5).real       # conj(z) * 1.5 = (1.5 a, -0.75 a): real part 1.5 a
    neg = torch.tanh(z.conj().imag)    # -0.5 a, read through the negative bit
    return prod + neg * a


def grown(a: torch.Tensor) -> torch.Tensor:
    """A tensor whose storage ``Tensor.resize_`` grows (Note [Tensors the program resizes] in
    dtr/runtime/effects.py), its new half filled, and one an out= op grows from no elements (Note [Outputs an
    op grows] in dtr/runtime/reference.py), read with ``a``."""
    n = a.shape[0]
    b = torch.tanh(a.detach() * 1.0)  # (resize_ refuses a tensor that requires grad)
    b.resize_(2 * n, *a.shape[1:])
    b[n:] = a.detach() * 0.5
    c = torch.empty(0, dtype=b.dtype, device=b.device)
    torch.sin(b[n:], out=c)
    return (b[:n] + b[n:] + c) * a


def quantized(a: torch.Tensor) -> torch.Tensor:
    """A round trip through a quantized tensor (its quantizer is not in its storage: Note [Other layouts])."""
    with warnings.catch_warnings():  # (quantized tensors are deprecated in torch 2.13)
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_tensor(a.detach(), 0.05, 3, torch.qint8)
    return q.dequantize() * a


def tangent(a: torch.Tensor) -> torch.Tensor:
    """Forward-mode AD through a few ops: its tangents include zero tensors (torch._efficientzerotensor)."""
    with fwAD.dual_level():
        d = fwAD.make_dual(a.detach(), torch.ones_like(a))
        for _ in range(3):
            d = torch.sin(d) * 1.5
        _, t = fwAD.unpack_dual(d)
    return t * a


def fp32_island(a: torch.Tensor) -> torch.Tensor:
    """Matmuls run with autocast off inside a bfloat16 autocast region, then read inside it by ops autocast
    leaves alone: recomputed there, they must not come back computed in bfloat16 (Note [What a recomputation
    restores] in dtr/runtime/recompute.py)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autocast("cpu", enabled=False):
            ys = [torch.tanh(a * (i + 1)) @ a.t() for i in range(3)]
        h = (a @ (a.t() @ a)).float()  # (bfloat16 matmuls)
        s = ys[0] * 0.5 + ys[1] * 0.25 + ys[2] * 0.125
    return (s @ a) + h


def float64_default(a: torch.Tensor) -> torch.Tensor:
    """Tensors whose dtype comes from the default dtype (a factory without dtype=, an integer tensor times a
    Python float), made while the program has set float64, used after it set the default back."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        r = torch.arange(a.numel()).view(a.shape) * 0.001
        u = torch.rand(a.shape)
    finally:
        torch.set_default_dtype(prev)
    return a * (r * u).float()


def python_elementwise(a: torch.Tensor) -> torch.Tensor:
    """``Tensor.apply_`` and ``map_``: Python functions over the elements, in place, with no op dispatched."""
    b = torch.tanh(a.detach() * 1.0)
    b.apply_(lambda v: v * 0.5 + 1.0)
    c = torch.sigmoid(a.detach())
    c.map_(b, lambda x, y: x + y)
    return c * a


#: What a "layout" instruction of the random programs runs, by name.
LAYOUTS = {"lazy_bits": lazy_bits, "grown": grown, "quantized": quantized, "tangent": tangent,
           "fp32_island": fp32_island, "float64_default": float64_default, "python_elementwise": python_elementwise}


# What "unary", "binary", "inplace" and "view" instructions run, by name.
UNARY: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "neg": torch.neg,
    "square": lambda a: a * a, "exp": lambda a: torch.exp(a.clamp(max=3.0)), "abs": torch.abs,
    "softmax": lambda a: torch.softmax(a, dim=-1), "layer_norm": lambda a: F.layer_norm(a, a.shape[-1:]),
    "clone": torch.clone, "contiguous": lambda a: a.t().contiguous(),
}
BINARY: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add, "mul": torch.mul, "sub": torch.sub, "maximum": torch.maximum,
}
INPLACE: Dict[str, Callable[..., Any]] = {
    "mul_": lambda a: a.mul_(0.5), "add_": lambda a, b: a.add_(b), "relu_": lambda a: a.relu_(),
    "clamp_": lambda a: a.clamp_(-1.0, 1.0), "copy_": lambda a, b: a.copy_(b), "zero_": lambda a: a.zero_(),
    "masked_fill_": lambda a: a.masked_fill_(a > 0.5, 0.25), "sigmoid_": lambda a: a.sigmoid_(),
    "bernoulli_": lambda a: a.bernoulli_(0.5),
}
VIEWS: Dict[str, Callable[..., torch.Tensor]] = {
    "t": lambda a: a.t(),
    "rows": lambda a, i, j, s: a[i:j:s],
    "cols": lambda a, i, j, s: a[:, i:j:s],
    "flat_half": lambda a: a.reshape(-1)[: a.numel() // 2].view(a.shape[0] // 2, a.shape[1]),
    "detach": lambda a: a.detach(),
    "split0": lambda a: a.split(a.shape[0] // 2, dim=0)[0],
    "diag_row": lambda a: a.narrow(0, 1, 2),
}
