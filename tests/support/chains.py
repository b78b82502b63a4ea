"""A small chain of activations for exactness tests: tanh(h @ W + i), 64x256 float32 rows."""
from __future__ import annotations

import torch

#: The chain's weight (fixed, from its own generator: no test's random state is touched).
W = torch.randn(256, 256, generator=torch.Generator().manual_seed(7)) * 0.05
#: Bytes of one activation.
ROW = 64 * 256 * 4


def tanh_matmul_chain(first: torch.Tensor, n: int = 16) -> list:
    """``first`` and the ``n`` activations computed from it, in order."""
    hs = [first]
    for i in range(n):
        hs.append(torch.tanh(hs[-1] @ W + i))
    return hs


def chain_budget(k: int) -> int:
    """A budget of W plus ``k`` activations, in bytes."""
    return W.nbytes + k * ROW
