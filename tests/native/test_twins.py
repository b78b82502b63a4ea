"""Each C++ twin of the native per-op path against its Python original, one function at a time.

dtr._native mirrors the Python reference function by function, each C++ function named after its twin
(csrc/native/fastpath.h). The end-to-end tests (test_native.py) compare whole recorded logs; here each
twin is called alone through ``dtr._native._twin`` (Note [Testing the twins] in csrc/native/twins.cpp) on a
real block's state, and its effect is compared with its twin's on the same state: the storage table's maps
(snapshotted and restored between the two), the liveness record, or, for twins that also change the core,
two identical blocks.
"""
from __future__ import annotations

import copy

import pytest

import dtr

torch = pytest.importorskip("torch")
from dtr.runtime import native  # noqa: E402
from dtr.runtime.storage_table import Buf  # noqa: E402

pytestmark = pytest.mark.skipif(not native.available(), reason="dtr._native is not built")
_TABLE = ("version", "cdata_of", "phys", "handle", "alive", "versions")


def _twin(name, fast, *args):
    return native.native_module()._twin(name, fast, *args)


def _buf(b: Buf) -> tuple:
    # (An empty buffer is named by its device: each twin of ``write`` makes one of its own for the old version,
    # and the second lands at the first one's freed address only as long as nothing allocated in between; in a
    # whole test run something sometimes did.)
    st = b.get()
    which = None if st is None else st._cdata if st.nbytes() else ("empty", str(st.device))
    return (b.strong is not None, b.weak is not None, b.shared, b.dropped, which)


def _state(table, versions: bool = True) -> dict:
    out = {name: dict(getattr(table, name)) for name in _TABLE if name != "phys" and (versions or name != "versions")}
    out["alive"] = list(table.alive.items())  # (in order)
    out["phys"] = {s: _buf(b) for s, b in table.phys.items()}
    out["next"] = table._next_handle
    return out


class _Snapshot:
    """The table's maps, copied, to give both twins the same state."""

    def __init__(self, table):
        self.table = table
        self.maps = {name: copy.copy(getattr(table, name)) for name in _TABLE}
        self.next = table._next_handle

    def restore(self):
        for name, m in self.maps.items():
            setattr(self.table, name, copy.copy(m))
        self.table._next_handle = self.next


def _mlp_block():
    """A small model and its input (a step through it leaves activations alive, held by autograd)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(6)])
    x = torch.randn(32, 64)
    return model, x


def _pair(table, python, cpp, versions=True):
    """Run ``python()`` and ``cpp()`` from the same table state; their results and resulting states."""
    snap = _Snapshot(table)
    r_py = python()
    s_py = _state(table, versions)
    snap.restore()
    r_c = cpp()
    s_c = _state(table, versions)
    snap.restore()
    return r_py, s_py, r_c, s_c


def test_the_table_twins_change_the_table_as_the_reference_does():
    model, x = _mlp_block()
    with dtr.budget(None, cost_model="flops", native=True) as b:
        h = model(x)  # (the program holds h; autograd holds the activations)
        d = b._driver
        fast, table, core = d._fast, d.table, d.core
        with d.off():
            # new_handle
            r_py, s_py, r_c, s_c = _pair(table, table.new_handle, lambda: _twin("table_new_handle", fast))
            assert (r_py, s_py) == (r_c, s_c)
            # add: a storage from outside the block, held as a constant is
            st = torch.randn(16).untyped_storage()
            t = core.constant(st.nbytes())
            s = core.storage_of(t)
            buf = Buf(st, owned=True, shared=True)
            r_py, s_py, r_c, s_c = _pair(table, lambda: table.add(t, s, st, buf),
                                         lambda: _twin("table_add", fast, t, s, st, buf))
            assert (r_py, s_py) == (r_c, s_c)
            # write: the current version of h's storage gets a new one (ids the table does not check)
            old = table.version[h.untyped_storage()._cdata]
            so = core.storage_of(old)
            new, sn = core.num_tensors + 5, core.num_storages + 5
            r_py, s_py, r_c, s_c = _pair(table, lambda: table.write(old, new, so, sn, h.untyped_storage()),
                                         lambda: _twin("table_write", fast, old, new, so, sn, h), versions=False)
            assert r_c == table.handle[old] and s_py == s_c  # (write's count of versions is commit's, in C++)
            # drop
            hh = table.handle[old]
            r_py, s_py, r_c, s_c = _pair(table, lambda: table.drop(hh), lambda: _twin("table_drop", fast, hh))
            assert (r_py, s_py) == (r_c, s_c) == (old, s_py)
            # hold / pinned on an activation's weakly held buffer, and computed_from on a weak constant
            assert table.phys[so].weak is not None
            for python, cpp in ((lambda: table.hold(so), lambda: _twin("table_hold", fast, so)),
                                (lambda: table.pinned(so, True), lambda: _twin("table_pinned", fast, so, True)),
                                (lambda: table.pinned(so, False), lambda: _twin("table_pinned", fast, so, False))):
                r_py, s_py, r_c, s_c = _pair(table, python, cpp)
                assert s_py == s_c and s_py["phys"][so] != _state(table)["phys"][so]  # (it did something)
            weak_const = torch.randn(8)
            tw = core.constant(weak_const.untyped_storage().nbytes())
            sw = core.storage_of(tw)
            table.add(tw, sw, weak_const.untyped_storage(), Buf(weak_const.untyped_storage(), owned=False,
                                                                shared=True))
            r_py, s_py, r_c, s_c = _pair(table, lambda: table.computed_from([tw, old], core.storage_of),
                                         lambda: _twin("table_computed_from", fast, [tw, old]))
            assert s_py == s_c and s_py["phys"][sw][0]  # held strongly now, by both
        loss = h.square().mean()
        loss.backward()


def test_buf_readings_are_the_reference_s():
    a = torch.randn(8)
    st = a.untyped_storage()
    with dtr.budget(None, native=True) as b:
        fast = b._driver._fast
        dead = torch.randn(4).untyped_storage()
        bufs = [Buf(st, owned=False), Buf(st, owned=True, shared=True), Buf(st, owned=True),
                Buf(dead, owned=False), Buf(torch.UntypedStorage(0), owned=True, dropped=True)]
        del dead
        extra = st  # (a shared buffer is dead only once nothing but dtr holds its storage)
        for buf in bufs:
            assert _twin("buf_dead", fast, buf) == buf.dead(), buf
            if not buf.dropped:  # (the twin reads a buffer the program may hold: never one dtr dropped)
                got = buf.get()
                assert _twin("buf_get", fast, buf) == (None if got is None else got._cdata)
        del extra


def test_the_liveness_twins_decide_as_the_reference_does():
    model, x = _mlp_block()
    with dtr.budget(None, cost_model="flops") as probe:
        model(x).square().mean().backward()
    peak = probe.stats["peak_bytes"]
    model.zero_grad(set_to_none=True)
    with dtr.budget(4 * peak, cost_model="flops", native=True) as b:  # (a budget: polls on schedule)
        h = model(x)
        d = b._driver
        fast, live, core = d._fast, d.liveness, d.core
        with d.off():
            for ops in (0, live.next_full_poll - 1, live.next_full_poll, live.next_full_poll + 100):
                for need in (0, core.peak_memory, core.peak_memory + 1):
                    assert _twin("liveness_due", fast, ops, need) == live.due(ops, need), (ops, need)
            recent = copy.deepcopy(live.recent)
            live.saw([1, 2, 3])
            after_py = copy.deepcopy(live.recent)
            live.recent[:] = recent
            _twin("liveness_saw", fast, [1, 2, 3])
            assert live.recent == after_py
            for s in range(core.num_storages):
                if core.pinned(s) and not core.collected(s):
                    assert _twin("liveness_worth_keeping", fast, s) == live.worth_keeping(s), s
        h.square().mean().backward()


_RELEASE_PROGRAM_STEPS = 4


def _release_in_a_block(use_twin: bool):
    """Drop a tensor the program holds and release its handle, by the reference or by the twin: the state."""
    torch.manual_seed(0)
    w = torch.randn(64, 64) / 8
    x = torch.randn(32, 64)
    with dtr.budget(200_000, cost_model="flops", native=True) as b:
        hs = [x]
        for _ in range(_RELEASE_PROGRAM_STEPS):
            hs.append(torch.tanh(hs[-1] @ w))
        d = b._driver
        victim = hs[2]
        t = d.table.version[victim.untyped_storage()._cdata]
        handle = d.table.handle[t]
        del hs[2], victim
        with d.off():
            if use_twin:
                _twin("liveness_release", d._fast, handle)
            else:
                d.liveness.release(handle)
            state = _state(d.table)
            core = {"counters": d.core.counters, "refs": [d.core.storage_refs(s) for s in range(d.core.num_storages)],
                    "resident": [d.core.resident(s) for s in range(d.core.num_storages)]}
        out = hs[-1].sum().item()
    state["version"] = sorted(state["version"].values())  # (addresses differ between blocks; the ids do not)
    state["cdata_of"] = sorted(state["cdata_of"])
    state["phys"] = {s: v[:4] for s, v in state["phys"].items()}
    return state, core, out


def test_release_twins_leave_the_same_table_and_core():
    assert _release_in_a_block(use_twin=False) == _release_in_a_block(use_twin=True)


def _track_in_a_block(use_twin: bool):
    """Track a tensor dtr has not seen (a constant on first sight), by the reference or by the twin."""
    torch.manual_seed(0)
    a, fresh, other = torch.randn(16, 16), torch.randn(32), torch.randn(8)
    with dtr.budget(None, cost_model="flops", native=True) as b:
        y = a * 2
        d = b._driver
        with d.off():
            if use_twin:
                t = _twin("mode_track", d._fast, fresh)
                again = _twin("mode_track", d._fast, fresh)
                const = _twin("mode_constant", d._fast, other.untyped_storage())
                carried = _twin("mode_carried", d._fast)
            else:
                fast, d._fast = d._fast, None  # (the reference itself: the driver delegates to its twin)
                try:
                    t = d._track(fresh)
                    again = d._track(fresh)
                    const = d._constant(other.untyped_storage())
                    carried = d._carried()
                finally:
                    d._fast = fast
            state = _state(d.table)
            counters = d.core.counters
        carried_sizes = sorted(buf.get().nbytes() for buf in carried)
        del y
    state["version"] = sorted(state["version"].values())
    state["cdata_of"] = sorted(state["cdata_of"])
    state["phys"] = {s: v[:4] for s, v in state["phys"].items()}
    return t, again, const, state, counters, carried_sizes


def test_track_constant_and_carried_twins_match_the_reference():
    got, want = _track_in_a_block(use_twin=True), _track_in_a_block(use_twin=False)
    assert got == want
    t, again, const, state, _, carried = got
    assert t == again and state["phys"][max(state["phys"])][2]  # a constant on first sight, the same after
    assert const == t + 1
    assert carried == sorted([16 * 16 * 4, 16 * 16 * 4, 32 * 4, 8 * 4])  # a, a * 2, the tracked, the constant


def test_every_named_twin_is_tested():
    """The twins this file pairs are every one _twin knows (a new twin needs a test here)."""
    fast_names = {"table_new_handle", "table_add", "table_write", "table_drop", "table_hold", "table_pinned",
                  "table_computed_from", "buf_dead", "buf_get", "liveness_due", "liveness_saw", "liveness_release",
                  "liveness_worth_keeping", "mode_track", "mode_constant", "mode_carried"}
    with dtr.budget(None, native=True) as b:
        fast = b._driver._fast
        with pytest.raises(ValueError, match="no twin named nothing"):
            _twin("nothing", fast)
        for name in fast_names:  # (each is known: a wrong count of arguments, not an unknown name)
            with pytest.raises(TypeError, match=name):
                _twin(name, fast, *([0] * 9))
