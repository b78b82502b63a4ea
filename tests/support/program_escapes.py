"""What an "escape" instruction of the random programs (random_programs.py) runs: ways a value leaves dtr's
view, enters it from outside, or is written or read behind the dispatcher's back. Each takes a float32 matrix
``a`` the program holds (which a tight budget may have evicted) and returns a tensor of its shape, computed
from ``a``, so that what the escape did reaches the loss, the gradients or the values the test compares.

Each was a class of programs that failed under eviction before its fix (CHANGELOG, 2026-11-29 (late)):
bytes written through a storage's data pointer, ``repr`` of an evicted tensor, ``nn.Parameter`` of a tensor
dtr pinned, has not seen, or holds sparse, meta tensors and a meta random factory, packed sequences through
an RNN and CTC's mean (C++ that fills tensors through their pointers), and a recomputation inside the vmap of
``autograd.grad(..., is_grads_batched=True)``."""
from __future__ import annotations

import ctypes
import warnings
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

__all__ = ["ESCAPES"]

#: What an "escape" instruction runs, by name (filled by @_escape).
ESCAPES: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}


def _escape(f: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    ESCAPES[f.__name__] = f
    return f


def _chain(x: torch.Tensor, n: int = 4) -> List[torch.Tensor]:
    """``x`` and ``n`` values computed from it one after another, all held: room a tight budget must make
    (by evicting them or what the program held before), so that evictions and recomputations happen around
    an escape. :func:`_mix` reads them all back."""
    hs = [x]
    for i in range(n):
        hs.append(torch.tanh(hs[-1] * (0.5 + 0.125 * i)))
    return hs


def _mix(hs: List[torch.Tensor]) -> torch.Tensor:
    return sum((h * 0.5 ** k for k, h in enumerate(hs[1:], 1)), hs[0])


def _halve_every_fifth(ptr: int, nbytes: int) -> None:
    """A write outside PyTorch: every fifth float32 of the ``nbytes`` at ``ptr`` halved (no op dispatched)."""
    floats = (ctypes.c_float * (nbytes // 4)).from_address(ptr)
    for i in range(0, len(floats), 5):
        floats[i] *= 0.5


@_escape
def storage_write(a: torch.Tensor) -> torch.Tensor:
    """Bytes of a value the program holds written through its untyped storage's data pointer, after values
    were computed from them (which the program still holds, or autograd saved): those must not come back
    computed from the new bytes."""
    b = torch.tanh(a.detach() * 1.5)
    c = b * a  # computed from b's old bytes, saved by autograd (through a)
    s = a.detach().untyped_storage()
    _halve_every_fifth(s.data_ptr(), s.nbytes())
    t = b.untyped_storage()
    _halve_every_fifth(t.data_ptr(), t.nbytes())
    return c + b * a


@_escape
def typed_storage_write(a: torch.Tensor) -> torch.Tensor:
    """The same through a TypedStorage's data pointer (``t.storage()``, deprecated but still used)."""
    b = torch.sigmoid(a.detach()) * 2.0
    hs = _chain(torch.tanh(b) * a)  # computed from b's old bytes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (TypedStorage is deprecated)
        st = b.storage()
        ptr, nbytes = st.data_ptr(), st.nbytes()
    _halve_every_fifth(ptr, nbytes)
    return _mix(hs) - b * a


@_escape
def printed(a: torch.Tensor) -> torch.Tensor:
    """``repr`` and ``str`` of a value the program holds (evicted, maybe) and of one just computed; what they
    print reaches the result (torch formats with every dispatch mode off: dtr brings the tensor back first)."""
    hs = _chain(a * 0.75, 5)
    text = repr(a) + str(hs[1]) + repr(hs[2].detach())  # (the oldest values: the likeliest evicted)
    return _mix(hs) * (1.0 + len(text) % 7)


@_escape
def parameter_from_numpy(a: torch.Tensor) -> torch.Tensor:
    """``nn.Parameter`` of a tensor dtr has not seen (``torch.from_numpy``) and of one it pinned (escaped
    through ``.numpy()``), both trained through the loss."""
    unseen = nn.Parameter(torch.from_numpy(a.detach().numpy().copy()) * 0.5)  # (made in the block: seen)
    raw = nn.Parameter(torch.from_numpy(a.detach().numpy().copy()))  # (never through an op: unseen)
    pinned = torch.tanh(a.detach())
    pinned.numpy()
    return _mix(_chain((unseen + raw * nn.Parameter(pinned)) * a))


@_escape
def sparse_parameter(a: torch.Tensor) -> torch.Tensor:
    """``nn.Parameter`` of a sparse COO tensor made from a value the program holds, used in a product."""
    p = nn.Parameter(a.detach().relu().to_sparse())
    return torch.sparse.mm(p, a.t()) @ a * 0.125


@_escape
def meta(a: torch.Tensor) -> torch.Tensor:
    """Meta tensors in the program: a meta random factory, a module built on the meta device, a value the
    program holds moved there. Their results have no bytes to compare; only their shapes reach the result."""
    r = torch.randn(a.shape, device="meta")
    lin = nn.Linear(a.shape[1], a.shape[1], device="meta")
    hs = _chain(a)
    y = lin(r + hs[2].detach().to("meta")).relu_()  # (hs[2]: evicted, maybe)
    return _mix(hs) * (float(y.shape == a.shape) + float(y.is_meta))


@_escape
def packed_rnn(a: torch.Tensor) -> torch.Tensor:
    """A value the program holds as a batch of padded sequences (time-major, 8 features), through
    ``pack_padded_sequence``, a GRU and ``pad_packed_sequence`` (whose C++ writes its lengths and batch sizes
    through their pointers); the returned lengths reach the result too."""
    x = a.reshape(4, -1, 8)
    lengths = torch.arange(x.shape[1]) % 4 + 1  # (unsorted: pack_padded_sequence sorts them in the block)
    rnn = nn.GRU(8, 8)  # (its weights drawn from the program's default generator)
    out, _ = rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))
    y, lens = pad_packed_sequence(out, total_length=4)
    return (y * lens.view(1, -1, 1)).reshape(a.shape) + a


@_escape
def ctc_mean(a: torch.Tensor) -> torch.Tensor:
    """CTC's loss with mean reduction over log-probabilities computed from a value the program holds: its C++
    divides by target lengths that it fills through their pointer."""
    lp = a.reshape(8, 4, -1).log_softmax(2)
    targets = torch.arange(12).view(4, 3) % (lp.shape[2] - 1) + 1
    input_lengths, target_lengths = torch.full((4,), 8) - torch.arange(4), torch.arange(4) % 3 + 1  # (in the block)
    loss = F.ctc_loss(lp, targets, input_lengths, target_lengths, reduction="mean", zero_infinity=True)
    return a * loss


@_escape
def batched_grads(a: torch.Tensor) -> torch.Tensor:
    """``autograd.grad(..., is_grads_batched=True)`` through a random op: its backward runs under vmap, and a
    value it saved, evicted, is recomputed there (a random op among what it reruns)."""
    x = a.detach().requires_grad_()
    h = torch.tanh(F.dropout(x * 1.5, p=0.5, training=True))
    hs = [h]
    for i in range(3):  # (more saved values: room a tight budget must make)
        hs.append(torch.tanh(hs[-1] * (0.5 + 0.25 * i)))
    v = torch.stack([torch.ones_like(h), torch.full_like(h, 0.5)])
    g, = torch.autograd.grad(hs[-1], x, v, is_grads_batched=True)
    return (g[0] + g[1]) * a
