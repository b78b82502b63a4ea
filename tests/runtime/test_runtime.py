"""The runtime against plain PyTorch: exact results, budgets, replay parity, failure modes."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

import dtr  # noqa: E402

# Storage introspection that does not count as the program's memory escaping (dtr/runtime/escapes.py).
_storage = torch._C.TensorBase.untyped_storage

from support.models import cnn, mlp  # noqa: E402
from support.paths import child_env  # noqa: E402
from support.training import budget_at, constant_bytes_per_tensor, peak_of, train_step  # noqa: E402

from dtr.core import ReplayStatus  # noqa: E402
from dtr.runtime.recompute import _SWAP  # noqa: E402
from dtr.sim import replay  # noqa: E402


def snapshot(model):
    return [p.grad.clone() for p in model.parameters()], [b.clone() for b in model.buffers()]


def assert_same(model, ref_model, loss, ref_loss):
    assert torch.equal(loss, ref_loss)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p.grad, q.grad)
    for b, c in zip(model.buffers(), ref_model.buffers()):
        assert torch.equal(b, c)


def train_step_budget(model, x, y, f):
    """The budget at fraction ``f`` from the step's constants to its plain peak (dtr's accounting, no limit)."""
    m = copy.deepcopy(model)
    return budget_at(constant_bytes_per_tensor(model, x, y), peak_of(lambda: train_step(m, x, y)), f)


# The O(1) way of bringing a recomputed value back (Note [Adopting recomputed bytes] in dtr/runtime/recompute.py)
# needs UntypedStorage._swap_data_ptr_, which older torch (2.11) lacks; there the runtime copies instead.
NO_SWAP = pytest.mark.skipif(not _SWAP, reason=f"torch {torch.__version__} lacks UntypedStorage._swap_data_ptr_: "
                             "the runtime copies recomputed values (the copy case covers that)")


MODELS = {
    "mlp": lambda: (mlp(), torch.randn(2048, 256), torch.randint(0, 10, (2048,))),
    "cnn": lambda: (cnn(), torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))),
}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("heuristic", ["eqclass", "dtr", "lru"])
@pytest.mark.parametrize("f", [0.7, 0.5, 0.35])
def test_exact_gradients_and_buffers_within_budget(name, heuristic, f):
    torch.manual_seed(0)
    model, x, y = MODELS[name]()
    ref = copy.deepcopy(model)
    ref_loss = train_step(ref, x, y)
    limit = train_step_budget(model, x, y, f)
    try:
        with dtr.budget(limit, heuristic=heuristic, cost_model="flops") as b:
            loss = train_step(model, x, y)
    except (dtr.ThrashingError, dtr.OutOfBudgetError):
        if heuristic == "lru":  # the baseline heuristic may thrash at low budgets: a clean, loud failure
            return
        raise
    assert_same(model, ref, loss, ref_loss)
    assert b.stats["peak_bytes"] <= limit
    if f <= 0.5:
        assert b.stats["evictions"] > 0 and b.stats["remats"] > 0


@pytest.mark.parametrize("adopt", [pytest.param(True, marks=NO_SWAP), False], ids=["adopt", "copy"])
def test_recomputed_bytes_adopted_or_copied_are_exact(monkeypatch, adopt):
    """Both ways of bringing a recomputed value back (see Note [Adopting recomputed bytes])."""
    from dtr.runtime import recompute as recompute_mod
    monkeypatch.setattr(recompute_mod, "_SWAP", adopt)
    calls = {"adopted": 0, "copied": 0}
    adopt_fn, refill_fn = recompute_mod.Recomputer._adopt, recompute_mod.Recomputer.refill

    def spy_adopt(self, slot, o):
        ok = adopt_fn(self, slot, o)
        calls["adopted"] += ok
        return ok

    def spy_refill(self, t):
        calls["copied"] += 1
        return refill_fn(self, t)
    monkeypatch.setattr(recompute_mod.Recomputer, "_adopt", spy_adopt)
    monkeypatch.setattr(recompute_mod.Recomputer, "refill", spy_refill)
    torch.manual_seed(0)
    model, x, y = MODELS["cnn"]()
    ref = copy.deepcopy(model)
    ref_loss = train_step(ref, x, y)
    limit = train_step_budget(model, x, y, 0.35)
    with dtr.budget(limit, cost_model="flops") as b:
        loss = train_step(model, x, y)
    assert_same(model, ref, loss, ref_loss)
    assert b.stats["remats"] > 0
    if adopt:
        assert calls["adopted"] > 0
    else:
        assert calls["adopted"] == 0 and calls["copied"] > 0


@pytest.mark.parametrize("swap", [pytest.param(True, marks=NO_SWAP), False], ids=["swap", "copy"])
def test_recomputed_in_place_writes_take_over_their_old_versions(monkeypatch, swap):
    """Bringing back a value written in place twice reruns both writes on one buffer (the core's Note
    [Handing bytes over on recomputation]); the values are exact and the budget holds, with the O(1) buffer
    swap or with its fallback (copy, then free the old buffer at once)."""
    from dtr.runtime import recompute as recompute_mod
    monkeypatch.setattr(recompute_mod, "_SWAP", swap)
    handed = []
    hand_over = recompute_mod.Recomputer._hand_over

    def spy(self, old, new, slot, overwrites_all):
        handed.append(old)
        return hand_over(self, old, new, slot, overwrites_all)
    monkeypatch.setattr(recompute_mod.Recomputer, "_hand_over", spy)
    mib = 2 ** 20
    x = torch.randn(256, 1024)  # 1 MiB
    ref = ((x * 2).relu() * 3)
    limit = 4 * mib + 8192
    with dtr.budget(limit, heuristic="lru", cost_model="flops") as b:
        with torch.no_grad():
            a = x * 2
            a.relu_()
            a.mul_(3)
            ys = [x + i for i in range(3)]  # 1 + 1 + 3 MiB: a goes (least recently used)
            total = a.sum()                 # a comes back: x * 2, then relu_ and mul_ on the same buffer
            del ys
    assert b.stats["evictions"] > 0 and b.stats["remats"] == 3 and len(handed) == 2
    assert b.stats["peak_bytes"] <= limit
    assert torch.equal(a, ref) and torch.equal(total, ref.sum())


@pytest.mark.parametrize("swap", [pytest.param(True, marks=NO_SWAP), False], ids=["swap", "copy"])
def test_a_failed_recomputation_after_a_handover_recovers(monkeypatch, swap):
    """A recomputed in-place write that raises after taking its old version's bytes: the old version
    is evicted (its bytes may be half written), the locks taken are given back, and a retry computes
    exact values (regression: the core kept the old version resident, and a retry read garbage)."""
    from dtr.runtime import recompute as recompute_mod
    monkeypatch.setattr(recompute_mod, "_SWAP", swap)

    class FailingRelu:  # the recipe's op, failing once
        _schema = torch.ops.aten.relu_.default._schema

        def __call__(self, *args, **kwargs):
            raise RuntimeError("simulated failure inside relu_")
    recompute = recompute_mod.Recomputer.run
    failed = []

    def failing_once(self, op):
        r = self.recipes[op]
        if not failed and r.func is torch.ops.aten.relu_.default:
            failed.append(op)
            self.recipes[op] = r._replace(func=FailingRelu())
            try:
                return recompute(self, op)
            finally:
                self.recipes[op] = r
        return recompute(self, op)
    monkeypatch.setattr(recompute_mod.Recomputer, "run", failing_once)
    mib = 2 ** 20
    x = torch.randn(256, 1024)
    ref = (x * 2).relu() * 3
    with dtr.budget(4 * mib + 8192, heuristic="lru", cost_model="flops") as b:
        with torch.no_grad():
            a = x * 2
            a.relu_()
            a.mul_(3)
            ys = [x + i for i in range(3)]
            with pytest.raises(RuntimeError, match="simulated failure"):
                a.sum()
            core = b._driver.core
            core.check()
            assert all(core.locks(s) == 0 for s in range(core.num_storages) if not core.pinned(s))
            total = a.sum()
            del ys
    assert failed and torch.equal(a, ref) and torch.equal(total, ref.sum())


def test_recomputing_an_op_that_changed_its_argument_layout():
    """as_strided_ changes its argument's offset: the recipe records the layout the op read and wrote
    as it is after the op (regression: taking shape and stride from before it and the offset from after
    made a slot past the end of its storage)."""
    mib = 2 ** 20
    x = torch.randn(256, 1024)
    ref = (x * 2).flatten()[128 * 1024:].view(128, 1024)
    with dtr.budget(4 * mib + 8192, heuristic="lru", cost_model="flops") as b:
        with torch.no_grad():
            a = x * 2
            a.as_strided_((128, 1024), (1024, 1), 128 * 1024)
            ys = [x + i for i in range(3)]
            total = a.sum()  # a comes back
            del ys
    assert b.stats["remats"] > 0 and b.stats["peak_bytes"] <= 4 * mib + 8192
    assert torch.equal(a, ref) and torch.equal(total, ref.sum())


@pytest.mark.parametrize("heuristic", ["lru", "dtr", "eqclass"])
def test_recomputing_an_op_whose_other_outputs_were_collected(heuristic):
    """A sibling output the program dropped (and the graph GC collected) stays freed when the op runs again.

    Regression: the recomputation looked up the collected sibling's buffer (a KeyError), and a merely
    banished one would have been refilled with bytes the core does not count.
    """
    mib = 2 ** 20
    x = torch.randn(256, 1024)  # 1 MiB
    ref = torch.ops.aten.native_layer_norm(x, [1024], None, None, 1e-5)[0]
    with dtr.budget(5 * mib + 8192, heuristic=heuristic, cost_model="flops") as b:
        with torch.no_grad():
            out, mean, rstd = torch.ops.aten.native_layer_norm(x, [1024], None, None, 1e-5)
            del mean, rstd
            b._driver.poll()
            b._driver.collect()
            a = out * 2
            ys = [a + i for i in range(3)]  # the sixth MiB: something must go
            total = out.sum()               # out comes back if it went
            del ys
    assert b.stats["evictions"] > 0 and b.stats["peak_bytes"] <= 5 * mib + 8192
    assert torch.equal(out, ref) and torch.equal(a, ref * 2) and torch.equal(total, ref.sum())
    if b.stats["remats"] == 0:
        pytest.fail(f"{heuristic} never brought out back: the test no longer covers the recomputation")


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("heuristic", ["eqclass", "dtr", "lru"])
def test_recorded_log_replays_to_the_same_decisions(tmp_path, name, heuristic):
    torch.manual_seed(0)
    model, x, y = MODELS[name]()
    limit = train_step_budget(model, x, y, 0.5)
    path = tmp_path / "step.jsonl"
    with dtr.budget(limit, heuristic=heuristic, cost_model="flops", log=path) as b:
        train_step(model, x, y)
    meta = json.loads(path.read_text().splitlines()[0])
    assert meta["cost_unit"] == "flop"
    # The replay reads these semantics from the meta line.
    assert meta["eqclass_split"] is True and meta["keep_needed"] is True and meta["deep_first"] is True
    r = replay(path, heuristic, limit, thrash_limit=float("inf"))
    assert r.status == ReplayStatus.OK
    assert (r.evictions, r.remats, r.peak_bytes) == (b.stats["evictions"], b.stats["remats"], b.stats["peak_bytes"])


def test_optimizer_step_inside_the_budget_is_exact():
    torch.manual_seed(0)
    model, x, y = MODELS["cnn"]()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    limit = train_step_budget(model, x, y, 0.5)
    for step in range(3):
        ref_loss = train_step(ref, x, y, seed=step)
        ref_opt.step()
        with dtr.budget(limit + 200_000, cost_model="flops"):  # room for the momentum buffers
            loss = train_step(model, x, y, seed=step)
            opt.step()
        assert torch.equal(loss, ref_loss)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q)


def test_tensors_held_after_the_block_are_usable():
    torch.manual_seed(0)
    model, x, y = MODELS["mlp"]()
    big = torch.cat([x, x])  # a later, larger batch puts the held tensors under pressure
    torch.manual_seed(5)
    with torch.no_grad():
        ref_hidden = [model[:k](x) for k in (2, 5, 8)]
    act = x.shape[0] * 256 * 4
    # The 3 held tensors, and at exit room to recompute one of them (2 act);
    # a forward of `big` needs about 4.5 act on top of the held 3.
    limit = constant_bytes_per_tensor(model, x, y, big) + 6 * act
    torch.manual_seed(5)
    with dtr.budget(limit, cost_model="flops") as b:
        with torch.no_grad():
            hidden = [model[:k](x) for k in (2, 5, 8)]
            for _ in range(2):
                model(big)
    assert b.stats["evictions"] > 0
    for h, r in zip(hidden, ref_hidden):
        assert torch.equal(h, r)


def test_infeasible_budget_raises_with_the_need():
    torch.manual_seed(0)
    model, x, y = MODELS["mlp"]()
    limit = constant_bytes_per_tensor(model, x, y) + 1000
    with pytest.raises(dtr.OutOfBudgetError) as e:
        with dtr.budget(limit):
            train_step(model, x, y)
    assert e.value.budget == limit and e.value.needed > limit
    assert str(limit) in str(e.value) and str(e.value.needed) in str(e.value)


def test_thrash_limit_raises():
    torch.manual_seed(0)
    model, x, y = MODELS["mlp"]()
    limit = train_step_budget(model, x, y, 0.35)
    with pytest.raises(dtr.ThrashingError):
        with dtr.budget(limit, heuristic="lru", cost_model="flops", thrash_limit=1.01):
            train_step(model, x, y)


def test_budget_strings_and_stats():
    b = dtr.budget("6GiB")
    assert b.stats["budget_bytes"] == 6 * 2**30
    assert dtr.budget("500MB").budget_bytes == 500 * 10**6
    with pytest.raises(dtr.errors.BudgetError):
        dtr.budget("lots")
    with pytest.raises(ValueError, match="valid"):
        dtr.budget(None, heuristic="belady")
    with dtr.budget(None) as b:
        torch.ones(10).sum()
        assert "evictions" in b.stats
    for k in ("evictions", "remats", "remat_seconds", "peak_bytes", "budget_bytes"):
        assert k in b.stats


RSS_SCRIPT = textwrap.dedent("""
    import copy, json, sys, torch, torch.nn.functional as F
    import dtr
    from support.models import mlp
    torch.manual_seed(0)
    torch.set_num_threads(1)
    mode, limit, keep_grads, width, batch = sys.argv[1], sys.argv[2], sys.argv[3] == '1', *map(int, sys.argv[4:])
    model = mlp(width=width, depth=8, p=0.0)
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))
    def rss():
        d = dict(l.split(':', 1) for l in open('/proc/self/status'))
        return int(d['VmHWM'].split()[0]) * 1024, int(d['VmRSS'].split()[0]) * 1024
    def step():
        model.zero_grad(set_to_none=not keep_grads)
        F.cross_entropy(model(x), y).backward()
    step()  # warm up allocator and kernels; grads exist from now on
    with dtr.budget(None):
        step()  # warm up the dispatch machinery (its first use imports torch._dynamo: ~60 MB of RSS)
        # (and, as any earlier block, tell the next one what is resident: the weights and grads)
    open('/proc/self/clear_refs', 'w').write('5')
    base = rss()[1]
    if mode == 'plain':
        step()
        print(json.dumps(dict(increase=rss()[0] - base)))
    else:
        with dtr.budget(int(limit), cost_model='flops') as b:
            step()
        print(json.dumps(dict(increase=rss()[0] - base, stats=b.stats)))
""")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc for VmHWM")
@pytest.mark.parametrize("keep_grads,width,batch", [(False, 512, 4096), (True, 1024, 1024)],
                         ids=["grads-set-to-none", "grads-kept"])
def test_budget_holds_by_rss_high_water_mark(tmp_path, keep_grads, width, batch):
    """An independent measurement: the process's peak RSS during the step.

    With gradients kept across steps (zeroed in place), the forward runs while
    they are resident but before the step touches them: the budget must count
    them from the start (Note [Constants from earlier blocks]).
    """
    script = tmp_path / "rss.py"
    script.write_text(RSS_SCRIPT)
    env = child_env(MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")

    def run(*args):
        p = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)

    shape = (str(int(keep_grads)), str(width), str(batch))
    plain = run("plain", "0", *shape)["increase"]
    # Above the tensors that exist before the step (weights, input, grads),
    # give dtr half of the plain step's measured increase.
    torch.manual_seed(0)
    model = mlp(width=width, depth=8, p=0.0)
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))
    grads = sum(p.numel() * 4 for p in model.parameters())
    const = constant_bytes_per_tensor(model, x, y) + grads
    limit = const + int(0.5 * plain)
    got = run("dtr", str(limit), *shape)
    one_op = batch * width * 4  # one op's output (documented slack), the largest any op here makes
    if keep_grads:
        assert grads > one_op  # counting them only from the backward on would show
    # Without UntypedStorage._swap_data_ptr_ (older torch), a recomputed output is copied into its
    # storage, so one op's outputs are held twice for a moment (Note [Adopting recomputed bytes]).
    slack = one_op if _SWAP else 2 * one_op
    assert got["stats"]["evictions"] > 0
    assert got["increase"] <= int(0.5 * plain) + slack, (got["increase"], plain, slack)


def test_a_block_counts_what_earlier_blocks_touched_from_its_first_op():
    """Note [Constants from earlier blocks]: resident weights and grads count before the step touches them."""
    torch.manual_seed(0)
    model, x, y = MODELS["mlp"]()
    with dtr.budget(None, cost_model="flops"):
        train_step(model, x, y)
    weights = sum(p.numel() * 4 for p in model.parameters())
    held = torch.randn(1000)  # never seen by a block: not counted
    dropped = torch.ones(5000)
    with dtr.budget(None, cost_model="flops"):
        dropped.sum()
    del dropped
    with dtr.budget(None, cost_model="flops") as b:
        torch.ones(3).sum()  # touches nothing of the model's
        seen = b.stats["memory_bytes"]
    assert seen >= 2 * weights + x.numel() * 4  # weights and grads, and the batch
    assert seen < 2 * weights + x.numel() * 4 + y.numel() * 8 + 4 * (held.numel() + 5000)
    with pytest.raises(RuntimeError):  # a failed block changes nothing of what the next one counts
        with dtr.budget(None, cost_model="flops"):
            (model[0].weight * 2).sum()
            raise RuntimeError("boom")
    with dtr.budget(None, cost_model="flops") as b:  # (Note [A failed block leaves nothing to the next])
        torch.ones(3).sum()
        assert b.stats["memory_bytes"] == seen


def test_a_block_freezes_the_gc_only_while_it_runs():
    """Note [Garbage collection during a block]: pre-existing objects are left out, then given back."""
    import gc
    # Something earlier in this process may have frozen objects (a library about to fork workers does, as
    # torch.distributed.checkpoint's async executor): start from none frozen, and freeze again at the end.
    was_frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    try:
        _check_the_block_freezes_the_gc_only_while_it_runs()
    finally:
        if was_frozen:
            gc.freeze()


def _check_the_block_freezes_the_gc_only_while_it_runs():
    import gc
    assert gc.get_freeze_count() == 0
    with dtr.budget(None, cost_model="flops"):
        torch.ones(3).sum()
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError):
        with dtr.budget(None, cost_model="flops"):
            raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0
    gc.freeze()  # the program's own freeze is left alone
    try:
        frozen = gc.get_freeze_count()
        with dtr.budget(None, cost_model="flops"):
            torch.ones(3).sum()
        assert gc.get_freeze_count() > frozen // 2  # not unfrozen (a frozen object may have died meanwhile)
    finally:
        gc.unfreeze()


def test_flops_cost_model_uses_torch_flop_formulas():
    # Matrix products and convolutions are costed by torch's flop formulas, not by
    # the elements they touch (a call with the wrong keyword once made every
    # formula fail silently and fall back to counting elements).
    from dtr.runtime.costs import FlopModel
    model = FlopModel()
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    mm = torch.ops.aten.mm.default
    assert model.estimate(mm, (a, b), {}, [mm(a, b)]) == 2 * 64 * 32 * 16
    x, w = torch.randn(8, 3, 32, 32), torch.randn(24, 3, 3, 3)
    conv = torch.ops.aten.convolution.default
    args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert model.estimate(conv, args, {}, [conv(*args)]) == 2 * 8 * 24 * 32 * 32 * 27
    relu = torch.ops.aten.relu.default  # no formula: elements read and written
    assert model.estimate(relu, (x,), {}, [relu(x)]) == 2 * x.numel()


class _Executed(torch.utils._python_dispatch.TorchDispatchMode):
    """Entered before dtr's mode, so it sees each op when dtr runs it (not the meta runs that predict sizes)."""

    def __init__(self, events):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("device") != torch.device("meta"):
            self.events.append(("run", func._schema.name))
        return func(*args, **kwargs)


@pytest.mark.parametrize("factory", ["ones", "randn", "arange"])
def test_a_factory_makes_room_before_it_allocates(monkeypatch, factory):
    """torch.ones / randn / arange have no tracked input: the core still evicts before they allocate
    (regression: they were accounted for after running, over the budget by their outputs)."""
    from dtr.runtime.driver import Driver
    events = []
    evict = Driver._on_evict
    monkeypatch.setattr(Driver, "_on_evict", lambda self, s: (events.append(("evict", s)), evict(self, s)))
    n = 1 << 16  # floats: 256 KiB per tensor
    make = {"ones": lambda: torch.ones(n), "randn": lambda: torch.randn(n),
            "arange": lambda: torch.arange(n, dtype=torch.float32)}[factory]
    x = torch.randn(n)
    with _Executed(events):  # (the mode's entry: through the key, a program's mode sees ops before dtr does)
        with dtr.budget(5 * 4 * n, cost_model="flops", entry="mode") as b:
            hs = [x * 2]
            for _ in range(3):
                hs.append(hs[-1] * 2)  # x and 4 activations: the budget is full
            events.clear()
            y = make()
            order = list(events)
            assert b.stats["peak_bytes"] <= 5 * 4 * n
            assert y.shape == (n,)
            del hs[1:]  # room to bring the rest back at the end of the block
    runs = [i for i, e in enumerate(order) if e[0] == "run"]
    evictions = [i for i, e in enumerate(order) if e[0] == "evict"]
    assert evictions and runs and max(evictions) < runs[0], order
    assert torch.equal(hs[0], x * 2)


@pytest.mark.compact_floor
def test_only_large_tables_are_compacted():
    """Note [Compaction]: a short block never compacts; a long one does, and its results stay exact."""
    from dtr.runtime import limits
    floor = limits.COMPACT_MIN_OPS
    w = torch.randn(8, 8) / 8
    x = torch.randn(4, 8)

    def chain(n):
        total = torch.zeros(4, 8)
        for _ in range(n):  # every result dies at once and needs only constants: collectable garbage
            total = total.add_(torch.tanh(x @ w))
        return total

    def compactions(n):
        with dtr.budget(None) as b:
            out = chain(n)
            done = b._driver._compactions
        assert torch.equal(out, chain(n))
        return done

    assert compactions(floor // 8) == 0
    assert compactions(floor) >= 1  # (3 ops a link: the tables pass the floor a third of the way)
