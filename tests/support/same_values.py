"""Bit-for-bit comparison of tensors and of two runs of a random program."""
from __future__ import annotations

import torch

from support.random_programs import Result

__all__ = ["assert_equal", "same_bits"]

_BITS = {torch.float32: torch.int32, torch.float64: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaNs included, which ``torch.equal`` never finds equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in _BITS:
        a, b = a.contiguous().view(_BITS[a.dtype]), b.contiguous().view(_BITS[b.dtype])
    return torch.equal(a, b)


def assert_equal(got: Result, want: Result, what: str) -> None:
    assert same_bits(got.loss, want.loss), f"{what}: loss {got.loss} != {want.loss}"
    for i, (g, w) in enumerate(zip(got.grads, want.grads)):
        assert (g is None) == (w is None), f"{what}: gradient {i} present in one run only"
        if g is not None:
            assert same_bits(g, w), f"{what}: gradient {i} differs (max |diff| {(g - w).abs().max()})"
    assert got.values.keys() == want.values.keys()
    for n in want.values:
        assert same_bits(got.values[n], want.values[n]), f"{what}: value {n} differs"


