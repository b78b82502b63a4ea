"""Constants under a budget: memory that escaped, constants the program drops, and writes to constants.

A constant is a storage dtr did not compute (a parameter, an input, a buffer whose bytes left through NumPy).
It is never evicted; when the program drops one that something evicted was computed from, dtr keeps it or pins
what needs it (Note [Keeping a dead constant] in dtr/runtime/liveness.py), and a write to one is a new constant.
"""
from __future__ import annotations

import ctypes
import json

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from support.chains import chain_budget, tanh_matmul_chain  # noqa: E402
from support.models import mlp  # noqa: E402
from support.training import constant_bytes_per_tensor  # noqa: E402

import dtr  # noqa: E402
from dtr.core import ReplayStatus  # noqa: E402
from dtr.sim import replay  # noqa: E402

# Storage introspection that does not count as the program's memory escaping (dtr/runtime/escapes.py).
_storage = torch._C.TensorBase.untyped_storage


def test_escaped_memory_is_never_evicted():
    """After .numpy() the buffer belongs to NumPy too: dtr must never free it."""
    torch.manual_seed(0)
    model, x, y = mlp(), torch.randn(2048, 256), torch.randint(0, 10, (2048,))  # (test_runtime.py's "mlp")
    big = torch.cat([x, x])
    torch.manual_seed(5)
    with torch.no_grad():
        ref = [model[:k](x) for k in (2, 5, 8)]
    ref0 = ref[0].numpy().copy()
    act = x.shape[0] * 256 * 4
    limit = constant_bytes_per_tensor(model, x, y, big) + 7 * act  # 3 held + a forward of `big` (~4.5) do not fit
    torch.manual_seed(5)
    with dtr.budget(limit, cost_model="flops") as b:
        with torch.no_grad():
            held = [model[:k](x) for k in (2, 5, 8)]
            arr = held[0].numpy()
            mode = b._driver
            s = mode.core.storage_of(mode.table.version[_storage(held[0])._cdata])
            for _ in range(2):
                model(big)
                assert mode.core.resident(s)
                assert (arr == ref0).all()  # (a torch view of arr would be a new tensor for dtr)
            assert held[1].tolist() == ref[1].tolist()  # read out (brought back, not pinned)
    assert b.stats["evictions"] > 0
    assert torch.equal(torch.from_numpy(arr), ref[0])
    for h, r in zip(held, ref):
        assert torch.equal(h, r)


def test_dropped_constant_protects_a_value_computed_from_it():
    """Regression: a constant and an activation dropped together, while a held tensor computed from both
    is evicted: the poll must release the activation before protecting (recomputing from) the constant."""
    n = 1 << 16
    x, c = torch.randn(n), torch.randn(n)
    ref = c + x * 2
    with torch.no_grad(), dtr.budget(2 * 4 * n + 4 * (4 * n), cost_model="flops") as b:
        d = x * 2
        e = c + d
        keep = [torch.mm(d.view(256, 256), d.view(256, 256)).view(-1) for _ in range(3)]
        del c, d
        keep[0] + 1
    assert b.stats["evictions"] > 0
    assert torch.equal(e, ref)


def full_poll(b):
    """A full poll as the mode runs one: with the mode off, so that what it recomputes is not seen as new ops."""
    with b._driver.off():
        b._driver.poll()


def test_a_dropped_constant_is_kept_rather_than_pinning_what_needs_it(tmp_path):
    """A small constant dropped while large tensors computed from it are held is kept, not protected.

    Protecting it would pin all eight of them, which the budget cannot hold (as
    in Hugging Face GPT-2's causal mask: Note [Keeping a dead constant]). Once
    nothing held needs it, it is released.
    """
    n = 1 << 16
    x, c = torch.randn(n), torch.tensor([1.5])
    ref = [x * c]
    for _ in range(7):
        ref.append(torch.sin(ref[-1]))
    ref_sums = torch.stack([r.sum() for r in ref])
    del ref
    limit, path = 4 * n * 6, tmp_path / "kept.jsonl"  # x and five more
    with torch.no_grad(), dtr.budget(limit, cost_model="flops", log=path) as b:
        acts = [x * c]
        for _ in range(7):
            acts.append(torch.sin(acts[-1]))
        del c
        full_poll(b)
        assert b.stats["evictions"] > 0
        sums = torch.stack([a.sum() for a in acts])
        assert b.stats["remats"] > 0  # x * c among them, from the kept constant
        got = sums.tolist()  # a copy: sums' memory does not escape
        del acts
        full_poll(b)
        assert b.stats["memory_bytes"] == 4 * n + 32 + 4  # x, sums and c, which sums is computed from
        del sums
        full_poll(b)
        assert b.stats["memory_bytes"] == 4 * n  # c went with the last thing that needed it
    assert got == ref_sums.tolist()
    r = replay(path, "eqclass", limit)  # the log has the protect and release where they happened
    assert (r.status, r.evictions, r.remats) == (ReplayStatus.OK, b.stats["evictions"], b.stats["remats"])


def test_a_constant_write_does_not_bring_back_what_the_program_dropped():
    """Writing a constant protects what still needs its old value, not what the program dropped.

    The program's drop is seen at the next poll only; until then the core still
    counts a reference. An evicted tensor dropped in between must not be
    recomputed and pinned (held by dtr for good): see Note [Dropped buffers].
    """
    w = torch.randn(256, 256)
    n = _storage(w).nbytes()
    ref = w * 3
    with torch.no_grad():
        with dtr.budget(n * 5 // 2, cost_model="flops") as b:
            h = w * 2      # computed from w
            k = w * 3      # no room for both: h is evicted
            assert b.stats["evictions"] == 1
            del h          # not polled yet
            w.add_(1)      # protects what needs the old w: k (resident) is pinned; h must not come back
            assert b.stats["remats"] == 0
            assert b.stats["memory_bytes"] <= 2 * n + n // 2
            b._driver.poll()
            assert len(b._driver.table.alive) == 2  # w and k
    assert torch.equal(k, ref)


SELF_READING_WRITES = {
    "add_(a, a)": lambda a, b: a.add_(a),
    "mul_(a, a)": lambda a, b: a.mul_(a),
    "copy_(a, a)": lambda a, b: a.copy_(a),
    "mul(a, b, out=a)": lambda a, b: torch.mul(a, b, out=a),
    "mul(a, a, out=a)": lambda a, b: torch.mul(a, a, out=a),
    "addcmul_(a, a, b)": lambda a, b: a.addcmul_(a, b),
}


@pytest.mark.parametrize("write", sorted(SELF_READING_WRITES))
def test_a_write_that_also_reads_its_target_is_one_write(tmp_path, write):
    """An in-place op whose written tensor is also another argument makes one new version of its storage.

    Matching written arguments by identity once made two writes of one
    storage (Note [Written leaves] in dtr/runtime/reference.py): the core released a
    tensor twice. Checked without a limit, and at a budget where both the
    written tensor and what reads it are evicted and recomputed (the old
    version is read twice, so it is copied rather than handed over).
    """
    f = SELF_READING_WRITES[write]
    x = torch.randn(64, 64)
    n = _storage(x).nbytes()

    def program():
        a, b = x.exp(), x.sin()
        c = a.tanh()    # reads the old version of a
        f(a, b)
        d = a * 2       # reads the new one
        filler = [x.cos() for _ in range(3)]  # pushes everything out under the budget
        del filler
        return a + d + c + b

    want = program()
    log = tmp_path / "w.jsonl"
    with dtr.budget(None, cost_model="flops", log=str(log)):
        assert torch.equal(program(), want)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    writes = [c for c in calls if c.get("mutated")]
    assert len(writes) == 1 and len(writes[0]["mutated"]) == 1, writes
    tight = tmp_path / "tight.jsonl"
    with dtr.budget(n * 5, cost_model="flops", log=str(tight)) as b:
        got = program()
    assert b.stats["remats"] > 0
    assert torch.equal(got, want)
    r = replay(tight, "eqclass", n * 5, thrash_limit=float("inf"))  # the simulator agrees
    assert (r.status, r.evictions, r.remats) == (ReplayStatus.OK, b.stats["evictions"], b.stats["remats"])


def _fill(t: torch.Tensor, a) -> None:
    a[:] = 5.0


def _memset(t: torch.Tensor, p: int) -> None:
    ctypes.memset(p, 0, t.nbytes)


# How the bytes escape (what the write needs), and the write itself.
_RAW_WRITES = {
    "numpy": (lambda t: t.numpy(), _fill),  # (looked up in the block, where dtr wraps it)
    "data_ptr": (lambda t: t.data_ptr(), _memset),
    "dlpack": (np.from_dlpack, _fill),
    "storage-data_ptr": (lambda t: t.untyped_storage().data_ptr(), _memset),
    "typed-storage-data_ptr": (lambda t: t._typed_storage()._data_ptr(), _memset),
}


@pytest.mark.parametrize("how", sorted(_RAW_WRITES))
@pytest.mark.parametrize("when", ["before", "after"])
def test_values_computed_from_bytes_written_outside_pytorch_are_exact(how, when):
    """Note [Bytes written outside PyTorch] in dtr/runtime/driver.py: bytes that escaped (a NumPy array, a
    data pointer, DLPack, a storage's data pointer) and are written there. Escaped before the chain, its first
    op's result is pinned; escaped after it, what the program holds that was computed from it is protected.
    Before, an evicted value came back computed from the new bytes (y.sum() 163840 against 32768; through a
    storage's data pointer, until it was wrapped too)."""
    escape, write = _RAW_WRITES[how]
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(7)) * 0.05

    def step(budget):
        t = torch.ones(64, 256)
        with dtr.budget(budget, cost_model="flops") as b:
            a = escape(t) if when == "before" else None
            y = t * 2
            hs = [y]
            for i in range(16 if when == "before" else 4):
                hs.append(torch.tanh(hs[-1] @ w + i))
            if when == "after":
                a = escape(t)
            write(t, a)
            more = [torch.tanh(y * i) for i in range(6 if when == "before" else 12)]
            sums = [h.sum().item() for h in hs + more]
            del hs, y, more
        return sums, b.stats

    want, _ = step(None)
    got, stats = step((4 + 1 + 10) * 64 * 256 * 4 if when == "before" else (4 + 1 + 12) * 64 * 256 * 4)
    assert stats["evictions"] > 0 and stats["remats"] > 0
    assert got == want


def test_values_computed_from_numpy_memory_written_there_are_exact():
    """A tensor over memory PyTorch does not own (torch.from_numpy, before the block) whose array the program
    writes between ops: what is computed from it is pinned (its storage cannot be resized: volatile)."""
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(7)) * 0.05

    def step(budget):
        a = np.ones((64, 256), dtype=np.float32)
        t = torch.from_numpy(a)
        with dtr.budget(budget, cost_model="flops") as b:
            hs = [t * 2]
            for i in range(16):
                hs.append(torch.tanh(hs[-1] @ w + i))
            a[:] = 3.0  # a new batch loaded into the same array
            hs.append(t * 2)
            sums = [h.sum().item() for h in hs]
            del hs
        return sums, b.stats

    want, _ = step(None)
    got, stats = step((4 + 1 + 10) * 64 * 256 * 4)
    assert stats["evictions"] > 0 and stats["remats"] > 0
    assert got == want


@pytest.mark.parametrize("entry", [{"entry": "key"}, {"entry": "mode"}, {"native": False}],
                         ids=["key", "mode", "reference"])
def test_an_evicted_tensor_prints_as_plain_pytorch_prints_it(entry):
    """torch formats a tensor with every dispatch mode off, so through the mode's entry ``repr`` of an evicted
    tensor read its empty storage and raised ("out of bounds for storage of size 0"): repr brings it back
    first, as .tolist() does (Note [Escaped memory] in dtr/runtime/escapes.py)."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(32, 32, generator=g) * 0.3 for _ in range(12)]
    x = torch.randn(1024, 32, generator=g)

    def step():
        hs, h = [], x
        for w in ws:
            h = torch.tanh(h @ w)
            hs.append(h)
        return repr(hs[3]), str(hs[4]), [h.sum() for h in hs]

    want = step()
    with dtr.budget(12 * 1024 * 32 * 4 // 2, cost_model="flops", **entry) as b:
        got = step()
    assert b.stats["evictions"] > 0 and b.stats["remats"] > 0, b.stats
    assert got[:2] == want[:2]
    assert all(torch.equal(a, c) for a, c in zip(got[2], want[2]))


_NEW_PARAMETERS = {
    "from_numpy": lambda: torch.from_numpy(np.full((32, 32), 0.05, dtype=np.float32)),
    "escaped": lambda: _escaped(torch.full((32, 32), 0.05)),
    "sparse": lambda: torch.full((32, 32), 0.05).to_sparse(),
}


def _escaped(t: torch.Tensor) -> torch.Tensor:
    t.numpy()
    return t


@pytest.mark.parametrize("make", sorted(_NEW_PARAMETERS))
@pytest.mark.parametrize("entry", [{"entry": "key"}, {"entry": "mode"}, {"native": False}],
                         ids=["key", "mode", "reference"])
def test_a_parameter_made_in_the_block_from_a_pinned_unseen_or_sparse_tensor(entry, make):
    """nn.Parameter(t) gives the result of t's detach a new Python object, which torch refuses for a tensor
    that has one: through the key, the reference's result had one when dtr pinned t or had not seen it
    (Note [A new tensor for detach and alias] in csrc/native/fastpath.cpp). The parameter then trains exactly."""
    g = torch.Generator().manual_seed(0)
    x, w2 = torch.randn(1024, 32, generator=g), torch.randn(32, 32, generator=g) * 0.3

    def step():
        p = torch.nn.Parameter(_NEW_PARAMETERS[make]())
        w = p.to_dense() if p.is_sparse else p
        hs = [torch.tanh(x @ w)]  # (what reads pinned memory is pinned: the chain goes on with another weight)
        for _ in range(12):
            hs.append(torch.tanh(hs[-1] @ w2))
        hs[-1].sum().backward()
        return p.grad.to_dense(), [h.sum() for h in hs]

    want = step()
    with dtr.budget(8 * 1024 * 32 * 4, cost_model="flops", **entry) as b:
        got = step()
    assert b.stats["evictions"] > 0 and b.stats["remats"] > 0, b.stats
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, c) for a, c in zip(got[1], want[1]))


@pytest.mark.parametrize("read", ["tolist", "repr"])
@pytest.mark.parametrize("heuristic", ["lru", "eqclass"])
@pytest.mark.parametrize("entry", [{"entry": "key"}, {"entry": "mode"}, {"native": False}],
                         ids=["key", "mode", "reference"])
def test_a_block_that_reads_evicted_tensors_outside_pytorch_replays_to_its_decisions(tmp_path, entry, heuristic,
                                                                                       read):
    """.tolist() and repr bring an evicted tensor back without pinning it: the log says so with a ``read``
    record (docs/log-format.md). Before, the log left it out, and a replay made fewer evictions and
    recomputations than the block (6 and 4 against 11 and 13)."""
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))

    def step():
        hs = [x]
        for _ in range(8):
            hs.append(torch.tanh(hs[-1] * 1.01))
        seen = hs[2].tolist() if read == "tolist" else repr(hs[2])  # (hs[2] is evicted by now)
        z = hs[-1]
        for i in range(4):
            z = z + hs[3 + i]
        return seen, z.sum()

    with dtr.budget(None, cost_model="flops") as b:
        want = step()
    log, budget = tmp_path / "step.jsonl", int(b.stats["peak_bytes"] * 0.6)
    with dtr.budget(budget, heuristic=heuristic, cost_model="flops", log=str(log), **entry) as b:
        got = step()
    assert b.stats["evictions"] > 0 and b.stats["remats"] > 0, b.stats
    assert got[0] == want[0] and torch.equal(got[1], want[1])
    r = replay(log, heuristic, budget, thrash_limit=float("inf"))
    assert (r.evictions, r.remats, r.peak_bytes) == (b.stats["evictions"], b.stats["remats"], b.stats["peak_bytes"])


# --------------------------------------------------------------- constants of no bytes

def _zero_byte_chain():
    g = torch.zeros(0)
    for _ in range(10):  # a version chain, pinned after limits.MAX_VERSIONS writes
        g.add_(1)
    return g


def _zero_byte_protected(c):
    d = c[:0] * 2  # nothing in it, computed from constant c
    c.add_(1)      # a write to c: protecting it pins d
    return d


def _zero_byte_escaped(x):
    idx = (x * 2 > 100).nonzero()  # no hits: an empty result
    idx.numpy().tolist()           # its memory escapes: pinned
    return idx


@pytest.mark.parametrize("how", ["version-chain", "protected", "escaped"])
def test_a_dropped_constant_of_no_bytes_is_released_cleanly(how):
    """A constant of no bytes stays in the core after its release (there is nothing to free), so it is held
    strongly (Note [Constants held weakly] in dtr/runtime/storage_table.py): held weakly, its release found a
    resident storage without memory and "forgot" it, which a pinned storage cannot be, and the block failed."""
    def program(c, x, check=lambda: None):  # (c, x from before the block: constants)
        torch.manual_seed(0)
        for _ in range(3):
            z = {"version-chain": _zero_byte_chain, "protected": lambda: _zero_byte_protected(c),
                 "escaped": lambda: _zero_byte_escaped(x)}[how]()
            check()
            del z  # the program drops the empty constant; the next ops' polls release it
            hs = tanh_matmul_chain(torch.randn(64, 256), 8)
            check()
        return c.clone(), hs[-1]

    torch.manual_seed(1)
    c, x = torch.randn(16), torch.randn(64)
    want = program(c.clone(), x)
    with dtr.budget(chain_budget(4)) as b:
        got = program(c, x, b._check)
    assert b.stats["evictions"] > 0
    assert all(torch.equal(g, w) for g, w in zip(got, want))
