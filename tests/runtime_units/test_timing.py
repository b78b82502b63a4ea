"""Measured op costs: Core.set_cost, the lazy CUDA event timer (with fake events), and a CUDA run."""
from __future__ import annotations

import copy

import pytest

from dtr.core import Core

torch = pytest.importorskip("torch")

from support.models import mlp  # noqa: E402
from support.training import constant_bytes_per_tensor, train_step  # noqa: E402

import dtr  # noqa: E402
from dtr.runtime.timing import MEASURE_FIRST, RESAMPLE_EVERY, CudaEventTimer, ProvisionalCosts, WallTimer, make_timer  # noqa: E402

# ----------------------------------------------------------------- Core.set_cost

def chain(heuristic: str, budget, costs):
    """A constant and a chain of 10-byte ops with these costs; returns (core, tensors)."""
    c = Core(heuristic, budget)
    ts = [c.constant(10)]
    for cost in costs:
        [t] = c.call([ts[-1]], [10], [-1], cost)
        ts.append(t)
    return c, ts


def test_set_cost_updates_op_storage_and_base_compute_not_the_clock():
    c, ts = chain("eqclass", None, [2.0, 3.0])
    op, s = c.op_of(ts[1]), c.storage_of(ts[1])
    clock = c.clock
    c.set_cost(op, 7.0)
    assert c.op_cost(op) == 7.0 and c.storage_cost(s) == 7.0
    assert c.counters["base_compute"] == 10.0  # 7 + 3
    assert c.clock == clock                   # staleness is not rewritten
    c.check()


def test_set_cost_of_a_view_op_updates_the_shared_storage():
    c = Core("eqclass", None)
    a = c.constant(10)
    [x] = c.call([a], [10], [-1], 2.0)
    [v] = c.call([x], [0], [0], 1.0)  # a view of x: its op's cost joins x's storage
    s = c.storage_of(x)
    assert c.storage_cost(s) == 3.0
    c.set_cost(c.op_of(v), 4.0)
    assert c.storage_cost(s) == 6.0
    c.check()


def test_set_cost_rejects_unknown_unfinished_and_bad_costs():
    c, ts = chain("eqclass", None, [1.0])
    with pytest.raises(ValueError):
        c.set_cost(99, 1.0)
    with pytest.raises(ValueError):
        c.set_cost(c.op_of(ts[1]), -1.0)
    with pytest.raises(ValueError):
        c.set_cost(c.op_of(ts[1]), float("nan"))
    op = c.begin_call([ts[1]], [10], [-1], [-1], 1.0)
    with pytest.raises(ValueError, match="not ended"):
        c.set_cost(op, 2.0)
    c.end_call(op, 1.0)
    c.set_cost(op, 2.0)
    c.check()


def test_set_cost_of_evicted_storages_keeps_eqclass_components_consistent():
    # Budget 60: the two cheap middle storages x2, x3 are evicted, one component (value 2).
    c, ts = chain("eqclass", 60, [50.0, 1.0, 1.0, 50.0, 50.0, 1.0, 1.0])
    s = [c.storage_of(t) for t in ts]
    assert [c.resident(x) for x in s] == [True, True, False, False, True, True, True, True]
    assert c.neighbourhood_cost(s[1]) == c.neighbourhood_cost(s[4]) == 2.0
    c.set_cost(c.op_of(ts[2]), 11.0)  # x2 is evicted: its component's value follows
    c.check()
    assert c.neighbourhood_cost(s[1]) == c.neighbourhood_cost(s[4]) == 12.0
    c.set_budget(1000)
    remats = c.counters["remat_compute"]
    c.require(ts[2])  # x2 comes back at its new cost and leaves the component
    assert c.counters["remat_compute"] == remats + 11.0
    c.check()
    assert c.neighbourhood_cost(s[2]) == c.neighbourhood_cost(s[4]) == 1.0  # only x3 (cost 1) is left
    c.set_cost(c.op_of(ts[3]), 5.0)
    assert c.neighbourhood_cost(s[2]) == c.neighbourhood_cost(s[4]) == 5.0
    c.require(ts[3])
    c.check()
    assert all(c.neighbourhood_cost(x) == 0.0 for x in s)


def brute_estar(c, sid):
    """e*(S) from scratch: evicted storages reachable through evicted ones, up and down."""
    n = c.num_storages
    dependents = [[] for _ in range(n)]
    for x in range(n):
        for d in c.storage_deps(x):
            dependents[d].append(x)
    found = set()
    for nbrs in (lambda x: c.storage_deps(x), lambda x: dependents[x]):
        stack, seen = [sid], {sid}
        while stack:
            for y in nbrs(stack.pop()):
                if y not in seen and not c.resident(y):
                    seen.add(y)
                    found.add(y)
                    stack.append(y)
    found.discard(sid)
    return sum(c.storage_cost(y) for y in found)


def test_set_cost_of_evicted_storages_refreshes_full_neighbourhoods():
    c, ts = chain("dtr", 60, [50.0, 1.0, 1.0, 50.0, 50.0, 1.0, 1.0])
    s = [c.storage_of(t) for t in ts]
    evicted = [x for x in s if not c.resident(x)]
    assert evicted
    resident = [x for x in s if c.resident(x)]
    for x in resident:
        c.neighbourhood_cost(x)  # fill the e* caches
    for k, x in enumerate(evicted):
        c.set_cost(c.op_of(c.storage_root(x)), 20.0 + k)
        c.check()
        for r in resident:
            assert c.neighbourhood_cost(r) == brute_estar(c, r)


# ------------------------------------------------------------ the event timer

class FakeEvents:
    """A fake ``torch.cuda.Event`` factory for a GPU that runs ``lag`` ops behind the host.

    Events are recorded in start/end pairs; the i-th pair closes an op of
    ``ms(i)`` milliseconds. An event completes (query() is True) once ``lag``
    more ops were launched after it, or at synchronize().
    """

    def __init__(self, lag: int = 2, ms=None):
        self.lag = lag
        self.ms = ms or (lambda i: 0.001 * (i + 1))  # op i took (i + 1) µs
        self.now = 0.0
        self.records = 0
        self.syncs = 0
        self.synced = 0  # events up to this record index completed by a synchronize()
        self.made = 0
        self.durations = []  # the duration given to each start/end pair, in ns, in order

    def __call__(self):
        self.made += 1
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, fake: FakeEvents):
        self.fake = fake
        self.t = None
        self.done_at = 0

    def record(self, stream=None):
        f = self.fake
        f.records += 1
        if f.records % 2 == 0:  # an end event: the op took its duration
            d = f.ms(len(f.durations))
            f.durations.append(round(d * 1e6))
            f.now += d
        self.t = f.now
        self.index = f.records
        self.done_at = f.records + 2 * f.lag

    def query(self):
        f = self.fake
        return f.records >= self.done_at or self.index <= f.synced  # in stream order

    def synchronize(self):
        f = self.fake
        f.syncs += 1
        f.synced = max(f.synced, self.index)

    def elapsed_time(self, end):
        assert self.query() and end.query(), "elapsed_time on an event not completed"
        return end.t - self.t


def test_timer_resolves_oldest_first_without_synchronizing():
    fake = FakeEvents(lag=3)
    got = []
    timer = CudaEventTimer(lambda tag, ns: got.append((tag, ns)), event_factory=fake, max_pending=64)
    for i in range(10):
        timer.poll()
        m = timer.stop(timer.start())
        assert not isinstance(m, float) and m.host_ns >= 0
        timer.defer(m, i)
    assert fake.syncs == 0
    assert [t for t, _ in got] == list(range(len(got)))  # in order
    assert len(got) == 6 and len(timer.pending) == 4  # the GPU is 3 ops behind
    timer.flush()
    assert [t for t, _ in got] == list(range(10))
    assert [ns for _, ns in got] == fake.durations == [1000 * (i + 1) for i in range(10)]
    assert fake.made <= 2 * 5  # events are reused once resolved


def test_timer_bound_forces_the_oldest_to_resolve():
    fake = FakeEvents(lag=10**9)  # a GPU that never catches up by itself
    got = []
    timer = CudaEventTimer(lambda tag, ns: got.append(tag), event_factory=fake, max_pending=3)
    for i in range(10):
        timer.defer(timer.stop(timer.start()), i)
        timer.poll()
        assert len(timer.pending) <= 3
    assert got == list(range(7)) and fake.syncs == timer.forced_syncs == 7


def test_timer_sync_mode_map_tags_and_cancel():
    fake = FakeEvents(lag=5)
    got = []
    sync = CudaEventTimer(lambda tag, ns: got.append(tag), event_factory=fake, sync=True)
    assert sync.stop(sync.start()) == 1000.0 and fake.syncs == 1 and not sync.pending
    timer = CudaEventTimer(lambda tag, ns: got.append(tag), event_factory=fake)
    for i in range(4):
        timer.defer(timer.stop(timer.start()), i)
    timer.map_tags(lambda t: None if t == 1 else t * 10)  # op 1 dropped by compaction
    token = timer.start()
    timer.cancel(token)  # the op raised: its start event goes back to the pool
    timer.flush()
    assert got == [0, 20, 30]
    assert isinstance(make_timer(torch.device("cpu"), None), WallTimer)
    assert isinstance(make_timer(None, None), WallTimer)


def test_provisional_costs():
    p = ProvisionalCosts()
    assert p.guess("k1", "mm", 1234.4) == 1234.0  # nothing known: the host time
    p.observe("k1", "mm", 100.0)
    p.observe("k2", "mm", 301.0)
    assert p.guess("k1", "mm", 5.0) == 100.0      # same op and shapes: its last time
    assert p.guess("k3", "mm", 5.0) == 200.0      # same operator: its mean (whole ns)
    assert p.guess("k3", "relu", 5.0) == 5.0


def test_provisional_costs_sample_repeated_keys():
    p = ProvisionalCosts()
    assert [p.sampled("k") for _ in range(MEASURE_FIRST)] == [None] * MEASURE_FIRST  # the first runs: timed
    assert p.sampled("k") is None  # nothing measured yet: timed again
    p.observe("k", "mm", 70.0)
    runs = [p.sampled("k") for _ in range(MEASURE_FIRST + 1, 3 * RESAMPLE_EVERY + 1)]
    timed = [n for n, c in enumerate(runs, MEASURE_FIRST + 2) if c is None]
    assert timed == [RESAMPLE_EVERY, 2 * RESAMPLE_EVERY, 3 * RESAMPLE_EVERY]  # one in RESAMPLE_EVERY
    assert set(runs) == {None, 70.0}
    assert p.sampled("other") is None  # keys count apart


def fake_budget(limit, fake, max_pending=64, **kw):
    """A CPU budget whose ops are timed by the event timer on fake events."""
    b = dtr.budget(limit, cost_model="time", device="cpu", **kw)
    b.__enter__()
    mode = b._driver
    mode.timer = CudaEventTimer(mode._on_timed, event_factory=fake, max_pending=max_pending)
    resolved = {}
    on_timed = mode._on_timed

    def spy(tag, ns):
        if tag != "remat":
            resolved[tag[0]] = ns
        on_timed(tag, ns)
    mode.timer._on_resolved = spy
    return b, mode, resolved


def test_runtime_learns_real_costs_through_set_cost_without_synchronizing():
    torch.manual_seed(0)
    model, x, y = mlp(width=64, depth=3), torch.randn(32, 64), torch.randint(0, 10, (32,))
    ref = copy.deepcopy(model)
    ref_loss = train_step(ref, x, y)
    fake = FakeEvents(lag=3, ms=lambda i: 0.5 + (i % 7))  # op times of 0.5 to 6.5 ms
    b, mode, resolved = fake_budget(None, fake)
    try:
        loss = train_step(model, x, y)
        core = mode.core
        assert fake.syncs == 0 and mode.timer.forced_syncs == 0
        pending = [m.tag[0] for m in mode.timer.pending]
        assert pending  # the last ops' times are still in flight
        for op, ns in resolved.items():  # everything resolved reached the core
            assert core.op_cost(op) == ns
        mode.timer.flush()
        syncs = fake.syncs
        assert set(pending) <= set(resolved)
        for op, ns in resolved.items():
            assert core.op_cost(op) == ns
        assert sorted(resolved.values()) == sorted(d for d in fake.durations)
        # base_compute is the sum of the real costs (the untimed factories count 1 each).
        total = sum(core.op_cost(o) for o in range(core.num_ops))
        assert core.counters["base_compute"] == pytest.approx(total)
        assert core.clock != pytest.approx(total)  # the clock ran on provisional costs
        core.check()
    finally:
        b.__exit__(None, None, None)
    assert fake.syncs == syncs  # the block's flush found nothing left
    assert torch.equal(loss, ref_loss)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_the_event_timer_samples_an_op_that_repeats():
    """Only the first runs of an op key and one in RESAMPLE_EVERY are timed (Note [Sampled timing on CUDA])."""
    x, w = torch.randn(32, 32), torch.randn(32, 32) / 6
    ref = x
    for _ in range(40):
        ref = torch.mm(ref, w)
    fake = FakeEvents(lag=0, ms=lambda i: 1.0 + i)  # every op resolves by the next one; distinct times
    b, mode, resolved = fake_budget(None, fake)
    try:
        h, costs = x, []
        for _ in range(40):
            h = torch.mm(h, w)
            costs.append(mode.core.op_cost(mode.core.num_ops - 1))
        mode.timer.flush()
        n_timed = MEASURE_FIRST + 40 // RESAMPLE_EVERY
        assert len(fake.durations) == n_timed
        # An untimed run costs what the key's last measurement said.
        last = None
        for n, c in enumerate(costs, 1):
            if n <= MEASURE_FIRST or n % RESAMPLE_EVERY == 0:
                last = None  # timed: resolved later (its provisional cost may differ)
            else:
                last = c if last is None else last
                assert c == last
        mode.core.check()
    finally:
        b.__exit__(None, None, None)
    assert torch.equal(h, ref)


def test_runtime_under_a_budget_with_lazy_costs_and_a_small_bound():
    torch.manual_seed(0)
    model, x, y = mlp(width=128, depth=4), torch.randn(256, 128), torch.randint(0, 10, (256,))
    ref = copy.deepcopy(model)
    ref_loss = train_step(ref, x, y)
    copied = copy.deepcopy(model)
    with dtr.budget(None, cost_model="flops") as plain:
        train_step(copied, x, y)
    del copied  # alive, it would count in the next block (Note [Constants from earlier blocks])
    const = constant_bytes_per_tensor(model, x, y)
    limit = int(const + 0.5 * (plain.stats["peak_bytes"] - const))
    fake = FakeEvents(lag=10**9)  # nothing completes by itself: the bound does all the resolving
    b, mode, resolved = fake_budget(limit, fake, max_pending=4)
    try:
        loss = train_step(model, x, y)
        mode.timer.poll()
        assert len(mode.timer.pending) <= 4
        assert fake.syncs == mode.timer.forced_syncs > 0
        for op, ns in resolved.items():
            assert mode.core.op_cost(op) == ns
        mode.core.check()
    finally:
        b.__exit__(None, None, None)
    assert torch.equal(loss, ref_loss)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert b.stats["evictions"] > 0 and b.stats["remats"] > 0
    assert b.stats["remat_seconds"] > 0  # recomputations are timed by the events too
    assert b.stats["peak_bytes"] <= limit


def test_pending_costs_follow_compaction():
    torch.manual_seed(0)
    model, x, y = mlp(width=32, depth=3), torch.randn(16, 32), torch.randint(0, 10, (16,))
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    fake = FakeEvents(lag=40)  # many measurements in flight at every collection
    b, mode, _ = fake_budget(None, fake)
    compactions, checked = [], []
    compact = mode.compact
    mode.compact = lambda: (compactions.append(len(mode.timer.pending)), compact())
    on_timed = mode._on_timed

    def spy(tag, ns):  # at resolution, the tag names the op that was measured (renumbered)
        on_timed(tag, ns)
        if tag != "remat":
            op, _, func = tag
            assert mode.core.op_cost(op) == ns
            if op in mode.recomputer.recipes:
                assert mode.recomputer.recipes[op].func == func
                checked.append(op)
    mode.timer._on_resolved = spy
    try:
        for step in range(8):
            ref_loss = train_step(ref, x, y, seed=step)
            ref_opt.step()
            loss = train_step(model, x, y, seed=step)
            opt.step()
            assert torch.equal(loss, ref_loss)
        mode.core.check()
    finally:
        b.__exit__(None, None, None)
    assert compactions and max(compactions) > 0 and checked
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_cpu_time_model_uses_the_wall_timer():
    with dtr.budget(None, cost_model="time") as b:
        (torch.ones(10) * 2).sum()
        assert isinstance(b._driver.timer, WallTimer)
        assert b._driver.core.op_cost(b._driver.core.num_ops - 1) > 0


# The CUDA runs of the event timer (exactness, the budget by the allocator, recording): tests/devices/test_cuda.py.


def test_stream_recorder_caches_streams_by_handle_and_follows_a_change(monkeypatch):
    """Events are recorded on the current stream, looked up by its raw handle (one Python-level
    current_stream() per new stream, not per event), and a change of stream is followed."""
    from dtr.runtime import timing
    current = {"raw": 111}
    looked_up, recorded = [], []

    class FakeEventBase:
        @staticmethod
        def record(event, stream):
            recorded.append((event, stream))

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: current["raw"], raising=False)
    monkeypatch.setattr(torch._C, "_CudaEventBase", FakeEventBase, raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: looked_up.append(current["raw"]) or f"stream{current['raw']}")
    record = timing._StreamRecorder()
    for e in ("a", "b", "c"):
        record(e)
    current["raw"] = 222  # torch.cuda.stream(s)
    record("d")
    current["raw"] = 111
    record("e")
    assert recorded == [("a", "stream111"), ("b", "stream111"), ("c", "stream111"), ("d", "stream222"),
                        ("e", "stream111")]
    assert looked_up == [111, 222]
