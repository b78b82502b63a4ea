"""The native per-op path (dtr._native) against the Python reference (ReferencePath._dispatch).

The two must make the same decisions op by op: with the flop cost model a
recorded log is a complete transcript of what the runtime told the core
(every call, size, cost, release, pin and protect), so equal logs, equal
results and equal statistics are the differential test (as
tests/support/reference_core.py is for the core). The whole suite also runs on each
path: ``make test`` runs the runtime's test files a second time with
``DTR_NATIVE=0``.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
from support.model_losses import model_losses  # noqa: E402
from support.models import mlp  # noqa: E402
from support.random_programs import generate, run  # noqa: E402
from support.same_values import assert_equal, same_bits  # noqa: E402
from support.training import train_step  # noqa: E402

import dtr  # noqa: E402
from dtr.runtime import native  # noqa: E402
from dtr.runtime.driver import _CARRIED  # noqa: E402
from dtr.runtime.storage_table import Buf as _Buf  # noqa: E402

pytestmark = pytest.mark.skipif(not native.available() and os.environ.get("DTR_REQUIRE_NATIVE") != "1",
                                reason="dtr._native is not built for this torch (make test requires it)")


def test_the_native_path_is_available_where_required():
    # make test sets DTR_REQUIRE_NATIVE=1: the build must have produced a module that matches this torch.
    assert native.available(), native._state.get("why")


def _record(tmp_path, name, fn, limit, use_native, **kw):
    path = tmp_path / f"{name}-{'native' if use_native else 'ref'}.jsonl"
    _CARRIED.clear()  # each path starts as the first block would (Note [Constants from earlier blocks])
    # The paths allocate different numbers of Python objects, so the cyclic GC would run at different ops,
    # and a tensor held by a reference cycle would die (and be released) at a different op: hold it off.
    gc.collect()
    gc.disable()
    try:
        # (through the mode: through the key the reference's Python objects change autograd's op stream)
        with dtr.budget(limit, cost_model="flops", log=path, native=use_native, **{"entry": "mode", **kw}) as b:
            out = fn()
    finally:
        gc.enable()
    if use_native:  # the native path did run (not only its fallback)
        assert b.native
    return out, b.stats, path.read_text().splitlines()


def _same_runs(tmp_path, name, fn, limit, **kw):
    """Run ``fn`` on both paths under ``limit``; assert equal logs, statistics and results; the stats."""
    got = {}
    for use_native in (False, True):
        torch.manual_seed(0)
        try:
            got[use_native] = _record(tmp_path, name, fn, limit, use_native, **kw)
        except (dtr.OutOfBudgetError, dtr.ThrashingError) as e:
            got[use_native] = (type(e), str(e))
    ref, nat = got[False], got[True]
    if isinstance(ref[0], type):  # both paths must fail the same way
        assert nat == ref
        return None
    assert not isinstance(nat[0], type), nat
    (ref_out, ref_stats, ref_log), (nat_out, nat_stats, nat_log) = ref, nat
    assert len(nat_log) == len(ref_log), name
    for k, (a, b) in enumerate(zip(ref_log, nat_log)):
        assert a == b, f"{name}: log line {k + 1} differs:\n  reference: {a}\n  native:    {b}"
    for key in ("evictions", "remats", "peak_bytes", "memory_bytes", "base_compute", "remat_compute", "ops"):
        assert nat_stats[key] == ref_stats[key], (name, key)
    assert len(ref_out) == len(nat_out)
    for a, b in zip(ref_out, nat_out):
        assert same_bits(a, b), name
    return ref_stats


# Seeds 0 and 1 in make test-fast; each of the others takes about 3 s.
@pytest.mark.parametrize("seed", [0, 1] + [pytest.param(s, marks=pytest.mark.slow) for s in range(2, 12)])
def test_random_programs_make_the_same_decisions_on_both_paths(tmp_path, seed):
    p = generate(seed)
    want = run(p)
    stats = _same_runs(tmp_path, f"seed{seed}", lambda: _flat_result(run(p)), None)
    peak = stats["peak_bytes"]
    for f in (0.6, 0.4):
        _same_runs(tmp_path, f"seed{seed}-{f}", lambda: _flat_result(run(p)), int(f * peak))
    for entry in ("mode", "key"):  # without a log, on either entry: exact, or a clean budget error
        _CARRIED.clear()  # (as in _record: the budget was sized on a first block)
        try:
            got = run(p, dtr.budget(int(0.6 * peak), cost_model="flops", native=True, entry=entry))
        except (dtr.OutOfBudgetError, dtr.ThrashingError):
            continue
        assert_equal(got, want, f"seed {seed}, entry={entry!r}")


def test_a_partial_poll_settles_dropped_constants_as_the_reference_does(tmp_path, monkeypatch):
    """Constants the program drops while what was computed from them lives: the native partial poll protects
    and releases them itself (csrc/native/fastpath.cpp, settle_constants), or keeps one that is cheaper kept
    (Note [Keeping a dead constant]), with the reference's log line for line."""
    from dtr.runtime.liveness import Liveness
    partial = []
    poll = Liveness.poll
    monkeypatch.setattr(Liveness, "poll", lambda self, ops, handles=None: (
        partial.append(1) if handles is not None else None, poll(self, ops, handles))[1])
    logs, outs, calls = {}, {}, {}
    for use_native in (False, True):
        torch.manual_seed(0)
        cs = [torch.randn(64, 64) for _ in range(6)] + [torch.randn(8, 8)]  # from before the block: constants

        def fn(cs=cs):
            kept = []
            for i in range(6):
                kept.append(cs[i] * 2)   # computed from the constant, and kept
                cs[i] = None             # the program drops the constant
                kept.append(kept[-1] + 1)  # (the next op's partial poll finds it dead)
            kept.append(cs[6].repeat(16, 16))  # 64 times the small constant's size: cheaper to keep it
            cs[6] = None
            kept.append(kept[-1] + 1)
            return [k.clone() for k in kept]
        partial.clear()
        outs[use_native], _, logs[use_native] = _record(tmp_path, "settle", fn, None, use_native)
        calls[use_native] = len(partial)
    assert logs[True] == logs[False]
    assert sum('"protect"' in line for line in logs[True]) == 6, "each dropped 64x64 constant is protected"
    assert all(same_bits(a, b) for a, b in zip(outs[False], outs[True]))
    assert calls[False] > 0 and calls[True] == 0, calls  # the native path settled every partial poll itself


def _flat_result(r):
    return [r.loss, *[g for g in r.grads if g is not None], *r.values.values()]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "treelstm" else n  # (about 3.5 s)
                                  for n in sorted(model_losses())])
def test_models_make_the_same_decisions_on_both_paths(tmp_path, name):
    def step_of(model, loss):
        def step():
            model.zero_grad(set_to_none=True)
            out = loss()
            if out.requires_grad:
                out.backward()
            return [out.detach()] + [q.grad for q in model.parameters() if q.grad is not None]
        return step

    torch.manual_seed(0)
    model, loss = model_losses()[name]()
    step = step_of(model, loss)
    stats = _same_runs(tmp_path, name, step, None)
    for f in (0.7, 0.5):
        _same_runs(tmp_path, f"{name}-{f}", step, int(f * stats["peak_bytes"]))


def test_the_native_path_runs_most_ops_and_hands_the_rest_to_the_reference():
    model = mlp(width=32, depth=3, p=0.0)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with dtr.budget(None, native=True) as b:
        fast = b._driver._fast
        train_step(model, x, y)
        opt.step()  # in-place writes: the reference's
        nat, ref = fast.counts
    assert nat > 0 and ref > 0 and nat > ref, (nat, ref)
    assert b._driver._fast is None and b._driver.entry is None  # the block's end drops the cycle driver <-> path


def test_ops_after_memory_written_outside_pytorch_stay_native():
    """Note [Bytes written outside PyTorch] in dtr/runtime/driver.py: only the ops that read volatile memory go
    to the reference; the native path pins the results of the others that read it (through the reference's
    _pin_if_volatile), and runs the rest as before."""
    np = pytest.importorskip("numpy")
    a = np.ones((64, 64), dtype=np.float32)
    w = torch.randn(64, 64) / 8
    with dtr.budget(None, native=True) as b:
        fast = b._driver._fast
        x = torch.from_numpy(a) * 1.0       # reads memory PyTorch does not own: the reference, pinned
        y = torch.ones(64, 64)
        y.numpy()                           # escapes writable: y is volatile from here
        h0 = h = y @ w                      # reads it: pinned (on either path)
        before = fast.counts
        for _ in range(20):
            h = torch.tanh(h @ w)           # reads nothing volatile: native
        nat, ref = fast.counts
        core, table = b._driver.core, b._driver.table
        storage = torch._C.TensorBase.untyped_storage  # (unwrapped: the public method is an escape)
        pinned = [core.pinned(core.storage_of(table.version[storage(t)._cdata])) for t in (x, h0)]
    assert pinned == [True, True]
    assert nat - before[0] >= 40 and ref - before[1] <= 2, (before, (nat, ref))


def test_a_native_block_leaves_no_reference_cycle():
    """The native path's hooks (a C function among them) hold the mode while the block runs; its end lets go.

    The mode goes by reference counting alone, without the cyclic GC, whether the block ended normally or
    by a budget error. (A first block is run before: its torch.compiler.set_stance imports torch._dynamo,
    which leaves a reference cycle through the calling frames, the block's among them, on either path; the
    cyclic GC frees it.)"""
    import weakref

    model = mlp(width=16, depth=2, p=0.0)
    x, y = torch.randn(4, 16), torch.randint(0, 10, (4,))
    with dtr.budget(None, native=True):
        train_step(model, x, y)
    gc.collect()
    gc.disable()
    try:
        for limit in (None, "1KiB"):
            try:
                with dtr.budget(limit, native=True) as b:
                    ref = weakref.ref(b._driver)
                    assert b.native
                    train_step(model, x, y)
            except dtr.OutOfBudgetError:
                assert limit is not None
            del b
            assert ref() is None, f"budget({limit!r}): the mode is still held after the block"
    finally:
        gc.enable()


def test_full_polls_release_dropped_activations_natively(monkeypatch):
    """The native full poll releases the activations the program dropped itself; the reference's poll (a
    Python scan of every live tensor) runs only for a dropped constant. The accounting is the reference's."""
    from dtr.runtime.driver import Driver

    def program():
        torch.manual_seed(0)
        w = torch.randn(16, 16)
        keep = []
        for _ in range(200):  # tensors outlive the last ops' window, then the program drops them
            keep.append(torch.tanh(torch.randn(8, 16) @ w))
            if len(keep) > 12:
                del keep[0]
        return torch.stack(keep).sum()

    calls = []
    real = Driver.poll
    monkeypatch.setattr(Driver, "poll", lambda self, handles=None: (calls.append(handles), real(self, handles)))
    stats = {}
    for path in (True, False):
        calls.clear()
        with dtr.budget(None, native=path, cost_model="flops") as b:
            out = program()
            full = [h for h in calls if h is None]  # (the block's end polls on both paths)
        stats[path] = (b.stats["peak_bytes"], b.stats["memory_bytes"], float(out))
        del out  # (else the next block counts it as a constant it carries)
        gc.collect()
        if path:
            assert full == [], "the native full poll handed a scan to the reference"
        else:
            assert full
    assert stats[True] == stats[False]


def test_collecting_old_versions_stays_native(monkeypatch):
    """Collection frees the storages of old versions, whose buffers a write took (0 bytes): the reference's
    eviction hook has nothing to do for them, and the native hook does not call it. Results and accounting
    are the reference's."""
    from dtr.runtime.driver import Driver

    def program():
        torch.manual_seed(0)
        h = torch.randn(32, 32)
        w = torch.randn(32, 32)
        for _ in range(300):  # more ops than a collection waits for, each leaving an old version behind
            h = h @ w
            h.tanh_()
        return h

    calls = []
    real = Driver._on_evict
    monkeypatch.setattr(Driver, "_on_evict", lambda self, s: (calls.append(s), real(self, s))[1])
    got = {}
    for path in (False, True):
        calls.clear()
        with dtr.budget(None, native=path, cost_model="flops") as b:
            out = program()
            n = len(calls)
        got[path] = (b.stats["peak_bytes"], b.stats["memory_bytes"], out.numpy().tobytes())
        del out  # (a tensor kept from a block is a constant the next block carries)
        gc.collect()
        if path:
            assert n == 0, f"{n} evictions went to the reference's hook"
        else:
            assert n > 100, "the program no longer collects old versions: the test covers nothing"
    assert got[True] == got[False]


def test_buffer_liveness_reads_the_same_on_both_paths():
    """The native reading of _Buf.dead() (reference counts included) agrees with the reference's, state by state."""
    m = native.native_module()
    sts = [torch.ones(4).untyped_storage() for _ in range(4)]
    cases = [_Buf(sts[0], owned=False), _Buf(sts[1], owned=True), _Buf(sts[2], owned=True, shared=True),
             _Buf(sts[3], owned=True, dropped=True)]
    for b in cases:
        assert m.buf_dead(b) == b.dead()
    assert [b.dead() for b in cases] == [False, False, False, True]
    view = torch.empty(0).set_(sts[2])  # a tensor on the shared one: alive while it lives
    del sts  # the program drops them: the weak buffer expires; the strong ones are dtr's alone
    for b in cases:
        assert m.buf_dead(b) == b.dead()
    assert [b.dead() for b in cases] == [True, False, False, True]
    del view
    for b in cases:
        assert m.buf_dead(b) == b.dead()
    assert [b.dead() for b in cases] == [True, False, True, True]
    gone = _Buf(torch.ones(2).untyped_storage(), owned=False)
    assert m.buf_dead(gone) == gone.dead() is True


def test_a_missing_or_mismatched_module_falls_back_with_one_warning(monkeypatch, tmp_path):
    """(tests/install/test_install.py has the build on first use; here builds are off, so nothing can replace it.)"""
    sidecar = tmp_path / "_native_build.json"
    sidecar.write_text(json.dumps({"torch": "0.0.1", "cxx11_abi": int(torch._C._GLIBCXX_USE_CXX11_ABI)}))
    monkeypatch.setattr(native, "SIDECAR", sidecar)
    monkeypatch.setenv("DTR_BUILD_NATIVE", "0")
    monkeypatch.setenv("DTR_CACHE_DIR", str(tmp_path))  # (no build on first use cached there)
    monkeypatch.setattr(native, "_state", {})
    assert native.native_module() is None
    assert "built against torch 0.0.1" in native._state["why"] and "DTR_BUILD_NATIVE=0" in native._state["why"]
    with pytest.warns(RuntimeWarning, match="native per-op path is unavailable.*0.0.1.*python -m dtr info"):
        b = dtr.budget(None)
    assert b.native is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        b = dtr.budget(None)
        x = torch.ones(3)
        with b:
            y = (x * 2).sum()
    assert y.item() == 6.0
    sidecar.write_text(json.dumps({"torch": torch.__version__, "cxx11_abi": int(torch._C._GLIBCXX_USE_CXX11_ABI)}))
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.delattr(dtr, "_native", raising=False)
    monkeypatch.setitem(sys.modules, "dtr._native", None)  # not importable at all
    assert native.native_module() is None and "could not be imported" in native._state["why"]


@pytest.mark.parametrize("value,want", [("0", False), ("off", False), ("1", True), ("", True), (" yes ", True)])
def test_the_environment_variable_chooses_the_path(monkeypatch, value, want):
    monkeypatch.setenv("DTR_NATIVE", value)
    assert dtr.budget(None).native is want
    assert dtr.budget(None, native=False).native is False  # the argument wins


def test_bad_choices_say_what_is_valid(monkeypatch):
    monkeypatch.setenv("DTR_NATIVE", "fast")
    with pytest.raises(ValueError, match="DTR_NATIVE='fast'.*1.*0"):
        dtr.budget(None)
    with pytest.raises(TypeError, match="native must be True, False or None"):
        dtr.budget(None, native="yes")


def test_wrapper_subclasses_behave_as_on_the_reference():
    """A wrapper tensor subclass has no storage of its own: both paths let its handler run the ops on the
    plain tensors it wraps (before, both failed when the wrapper died: its storage cannot be resized)."""
    from torch.testing._internal.two_tensor import TwoTensor

    def run(use_native):
        a, b = torch.ones(4), torch.full((4,), 2.0)
        try:
            with dtr.budget(None, native=use_native):
                y = TwoTensor(a, b) * 3
            return ("ok", torch.equal(y.a, a * 3) and torch.equal(y.b, b * 3))
        except Exception as e:  # whatever the reference does, the native path must do the same
            return (type(e).__name__, str(e).split("\n")[0])
    assert run(True) == run(False) == ("ok", True)  # (reference.py's Note [Tensor subclasses])
