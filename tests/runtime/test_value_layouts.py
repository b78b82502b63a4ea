"""Values a recomputation must rebuild as the op first saw them: lazy bits, grown storages, tensors dtr leaves
alone (zero and quantized), and in-place writes whose sizes the meta device cannot predict.

Each case is a chain whose activations the block evicts and recomputes, compared bit for bit with plain PyTorch;
each gave wrong values or raised before its fix (found by a helper's hunt, 2026-11-29). The random programs
produce all of them too (test_runtime_fuzz.py, "layout" and "sample" instructions).
"""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import dtr  # noqa: E402
from dtr.runtime.prediction import PREDICTIONS  # noqa: E402

_storage = torch._C.TensorBase.untyped_storage


def _chain(step, fraction=0.6):
    """``step()`` plainly, then under a budget at ``fraction`` of its peak: (plain, budgeted, stats)."""
    want = step()
    with dtr.budget(None, cost_model="flops") as b:
        step()
    with dtr.budget(int(b.stats["peak_bytes"] * fraction), cost_model="flops") as b:
        got = step()
    assert b.stats["evictions"] > 0 and b.stats["remats"] > 0
    return want, got


#: The budget options of each entry: the dispatch key (the default on the CPU), a mode, the Python reference.
_ENTRIES = {"default": {}, "mode": {"entry": "mode"}, "reference": {"native": False}}


def _w():
    return torch.randn(256, 256, generator=torch.Generator().manual_seed(7)) * 0.05


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_lazy_conjugate_and_negative_views_are_recomputed_with_their_bits(view):
    """Note [Lazy bits] in dtr/runtime/recompute.py: an input read through z.conj() (or z.conj().imag, the
    negative bit) is rebuilt from its storage with the bit set again."""
    w = _w()
    wc = torch.complex(w, w.t())

    def step():
        torch.manual_seed(0)
        hs = [torch.randn(64, 256)]
        for _ in range(10):
            z = torch.complex(hs[-1], hs[-1] * 0.5)
            if view == "conj":
                hs.append(torch.tanh(z.conj() @ wc).real)
            else:
                hs.append(torch.tanh(z.conj().imag @ w + hs[-1]))
        return [h.sum().item() for h in hs]

    want, got = _chain(step)
    assert got == want


@pytest.mark.parametrize("sampler", ["exponential_", "geometric_", "cauchy_", "log_normal_"])
def test_in_place_samplers_given_a_generator_are_recorded_as_writes(sampler):
    """Note [Writes without a prediction] in dtr/runtime/unpredicted.py: with generator=, these have no meta
    kernel; their write was not recorded, and an evicted result came back from the empty tensor it wrote."""
    w = _w()
    args = {"geometric_": (0.3,)}.get(sampler, ())

    def step():
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(5)
        h = torch.randn(64, 256)
        out = []
        for _ in range(10):
            noise = getattr(torch.empty(64, 256), sampler)(*args, generator=g)
            h = torch.tanh(h @ w) * noise.clamp(-3, 3)
            out.append(h)
        return [x.sum().item() for x in out]

    want, got = _chain(step, 0.7)
    assert got == want


def test_an_unpredicted_op_that_writes_pins_what_it_writes():
    """An op without a meta kernel that writes and allocates (a custom op without a fake kernel) writes pinned
    storages, protected first (Note [Writes without a prediction])."""
    @torch.library.custom_op("dtr_test::scaled_copy_", mutates_args=("x",))
    def scaled_copy_(x: torch.Tensor, k: float) -> torch.Tensor:
        x.mul_(k)
        return x * 2.0

    w = _w()

    def step():
        torch.manual_seed(0)
        hs = [torch.randn(64, 256)]
        for _ in range(8):
            h = torch.tanh(hs[-1] @ w)
            hs.append(scaled_copy_(h, 0.5) + h)
        return [x.sum().item() for x in hs]

    want, got = _chain(step, 0.9)
    assert got == want


def test_a_tensor_whose_storage_resize_grows_is_a_new_constant():
    """Note [Tensors the program resizes] in dtr/runtime/effects.py: the recomputation copied 128 KiB into the
    64 KiB the core still counted, and raised."""
    w = _w()

    def chain(x, n):
        hs = [x]
        for i in range(n):
            hs.append(torch.tanh(hs[-1] @ w + i))
        return hs

    def step():
        torch.manual_seed(0)
        hs = chain(torch.randn(64, 256), 12)
        x = torch.tanh(hs[3] * 2)
        x.resize_(128, 256)
        x[64:] = hs[4]
        y = x * 3
        more = chain(torch.randn(64, 256), 16)
        return [y.sum().item(), x.sum().item()] + [h.sum().item() for h in hs + more]

    want, got = _chain(step)
    assert got == want


def _square(n: int = 64) -> torch.Tensor:
    """A seeded n x n input (the out= tests' program starts from it)."""
    torch.manual_seed(0)
    return torch.randn(n, n)


def _peak(prog) -> int:
    """The peak of ``prog()`` in a block with no limit."""
    with dtr.budget(None, cost_model="flops") as b:
        prog()
    return b.stats["peak_bytes"]


@pytest.mark.parametrize("entry", sorted(_ENTRIES))
def test_a_storage_an_out_op_grows_is_counted_at_its_new_size(entry):
    """Note [Outputs an op grows] in dtr/runtime/reference.py: ``torch.tanh(x, out=torch.empty(0))`` grows the
    storage inside its kernel. The core counted the new version at 0 bytes, and bringing it back at the end of
    the block handed 16 KiB into a 0-byte buffer: the block raised RuntimeError and the tensors held 0xFF (a
    helper's hunt, 2026-11-29)."""
    def prog():
        a = _square()
        n = a.shape[0]
        x = torch.empty(n, n)
        torch.mm(a, a, out=x)
        y = torch.empty(n, n)
        torch.add(x, 1, out=y)
        torch.mul(y, x, out=x)
        z = torch.empty(0)
        torch.tanh(x, out=z)
        return [x, y, z, z @ y]

    want = prog()
    peak = _peak(prog)
    assert peak >= 5 * 64 * 64 * 4  # (a, x, y, z and z @ y: z counted at its grown size)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dtr.BudgetWarning)  # (no value may be lost)
        with pytest.raises(dtr.OutOfBudgetError):  # (the kept tensors do not fit: they come back beyond it)
            with dtr.budget(int(peak * 0.6), cost_model="flops", **_ENTRIES[entry]) as b2:
                got = prog()
    assert b2.stats["evictions"] > 0 and b2.stats["remats"] > 0
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("entry", sorted(_ENTRIES))
def test_out_ops_that_grow_nothing_leave_storages_as_plain_pytorch_does(entry):
    """Note [Outputs an op grows]: an out= view into a storage dtr evicted fits in it (the evicted storage
    reads 0 bytes: it was "grown" to the view's result, which shrank it); an out= tensor that is also an input
    is the kernel's to grow or refuse; PyTorch's resize warning comes once, not again from dtr's meta run (a
    helper's hunt, 2026-11-29)."""
    def prog():
        a = _square()
        base = torch.tanh(a @ a) + 1
        v = base.view(-1)[:0]  # (no elements, inside base's 16 KiB)
        b = a
        for _ in range(6):
            b = torch.tanh(b @ b * 0.01)  # (base is evicted)
        torch.tanh(b[:2], out=v)
        x = b[0].clone()
        with pytest.raises(RuntimeError, match="shape"):
            torch.add(x, b, out=x)  # (out is self: the broadcast result does not fit, in plain PyTorch too)
        z = torch.ones(3, 3)
        torch.tanh(b[:1], out=z)  # (too small and not empty: PyTorch warns, and resizes)
        return [base, v, x, z], [t.untyped_storage().nbytes() for t in (base, x, z)]

    with warnings.catch_warnings(record=True) as plain_warnings:
        warnings.simplefilter("always")
        want = prog()
    peak = _peak(prog)
    PREDICTIONS.clear()  # (each op's meta run happens again, in the block that records warnings)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with dtr.budget(int(peak * 0.6), cost_model="flops", **_ENTRIES[entry]) as b2:
            got = prog()
    assert b2.stats["evictions"] > 0
    assert all(torch.equal(g, w) for g, w in zip(got[0], want[0])) and got[1] == want[1]
    assert [str(w.message) for w in seen if not issubclass(w.category, dtr.BudgetWarning)] == \
        [str(w.message) for w in plain_warnings]


def test_quantized_and_zero_tensors_are_left_alone():
    """Note [Other layouts]: a quantized tensor's quantizer, and a zero tensor's missing memory, are not in a
    storage dtr could rebuild; dtr neither tracks nor evicts them, and what is computed from them is exact."""
    w = _w()
    z = torch._efficientzerotensor((64, 256))

    def step():
        torch.manual_seed(0)
        hs = [torch.randn(64, 256)]
        for i in range(12):
            with warnings.catch_warnings():  # (quantized tensors are deprecated in torch 2.13)
                warnings.simplefilter("ignore", UserWarning)
                q = torch.quantize_per_tensor(hs[-1], 0.05, 3, torch.qint8)
            hs.append(torch.tanh(q.dequantize() @ w + z + i))
        return [h.sum().item() for h in hs]

    want, got = _chain(step)
    assert got == want
    with dtr.budget(None) as b:
        y = torch.ones(64, 64) + torch._efficientzerotensor((64, 64))
        assert _storage(y)._cdata in b._driver.table.version
    assert torch.equal(y, torch.ones(64, 64))


@pytest.mark.parametrize("op", ["tensor_split", "ctc_loss", "pad_packed_sequence"])
@pytest.mark.parametrize("heuristic", ["eqclass", "lru"])
def test_ops_that_touch_bytes_through_raw_pointers_see_them(op, heuristic):
    """PyTorch ops that read integer arguments, or write the integer tensor they return, through a data
    pointer in C++ (no op dispatched): an evicted argument was read as an empty storage ("data is not
    allocated yet"), and pad_packed_sequence's lengths came back as whatever aten::empty gave (Note [Ops that
    touch bytes through raw pointers] in escapes.py)."""
    import torch.nn.functional as F
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence  # (bound before the block)

    def pressure():
        h, keep = torch.randn(64, 64), []
        for _ in range(10):
            h = torch.tanh(h * 1.01)
            keep.append(h)
        return keep[-1]

    def program():
        torch.manual_seed(0)
        if op == "tensor_split":
            idx = torch.arange(3) * 5 + 2  # split points computed in the block
            last = pressure()
            return [*torch.tensor_split(torch.randn(16, 8), idx), *torch.randn(16, 8).tensor_split(idx), last]
        if op == "ctc_loss":
            il, tl = torch.full((4,), 20) * 1, torch.full((4,), 5) + 0  # lengths computed in the block
            last = pressure()
            lp = torch.randn(20, 4, 6).log_softmax(2)
            return [F.ctc_loss(lp, torch.randint(1, 6, (4, 5)), il, tl), last]
        lengths = torch.tensor([10, 7, 5, 2])
        packed = pack_padded_sequence(torch.randn(10, 4, 16), lengths)
        padded, out_lengths = pad_packed_sequence(packed)
        last = pressure()
        return [padded * 1.0, out_lengths + 0, out_lengths, last]

    want = program()
    with dtr.budget(64 * 1024, cost_model="flops", heuristic=heuristic) as b:
        got = program()
    assert b.stats["evictions"] > 0, b.stats
    assert all(torch.equal(a, c) for a, c in zip(want, got))


def _ctc_step(packed: bool):
    """A loss whose C++ fills tensors through their pointers: CTC's mean over target lengths (at::tensor),
    and, packed, pack_padded_sequence's batch sizes and pad_packed_sequence's lengths."""
    from torch import nn
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    torch.manual_seed(0)
    if packed:
        body = nn.LSTM(16, 32, num_layers=2, bidirectional=True)
    else:
        body = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.Tanh())])
    head = nn.Linear(64, 20)
    torch.manual_seed(1)
    lengths = torch.randint(20, 41, (16,))
    lengths[0] = 40
    if packed:  # (the sorted lengths and the batch sizes are computed in the block)
        y, _ = body(pack_padded_sequence(torch.randn(40, 16, 16), lengths, enforce_sorted=False))
        y, lengths = pad_packed_sequence(y)
    else:
        y = body(torch.randn(40, 16, 64))
    lp = head(y).log_softmax(-1)
    loss = nn.CTCLoss(zero_infinity=True)(lp, torch.randint(1, 20, (16, 5)), lengths, torch.randint(1, 6, (16,)))
    loss.backward()
    return [loss.detach()] + [p.grad for p in [*body.parameters(), *head.parameters()]]


@pytest.mark.parametrize("packed", [False, True], ids=["ctc", "packed-lstm-ctc"])
@pytest.mark.parametrize("entry", sorted(_ENTRIES))
def test_ctc_and_packed_sequences_train_exactly_under_eviction(entry, packed):
    """Tensors that C++ fills through their data pointers while it runs (Note [Tensors a raw function
    allocates] in unpredicted.py): CTC's target lengths came back as whatever aten::empty gave (wrong
    gradients through the key), and a packed LSTM's lengths were evicted mid-call (glibc aborted)."""
    want = _ctc_step(packed)
    with dtr.budget(None, cost_model="flops") as b:
        _ctc_step(packed)
    with dtr.budget(int(b.stats["peak_bytes"] * (0.6 if packed else 0.45)), cost_model="flops",
                    **_ENTRIES[entry]) as b:
        got = _ctc_step(packed)
    assert b.stats["evictions"] > 0 and b.stats["remats"] > 0, b.stats
    assert all(torch.equal(a, c) for a, c in zip(want, got))
