"""The liveness unit (dtr/runtime/liveness.py) on a real core and storage table, without a dispatch mode."""
from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

from dtr.core import Core  # noqa: E402
from dtr.runtime.limits import POLL_EVERY, RECENT_OPS  # noqa: E402
from dtr.runtime.liveness import Liveness  # noqa: E402
from dtr.runtime.storage_table import Buf, StorageTable  # noqa: E402
from dtr.semantics import RUNTIME  # noqa: E402


def _liveness_on_core(budget=None):
    core = Core("eqclass", budget, semantics=RUNTIME)  # (as dtr.budget's: dead constants are freed)
    table = StorageTable()
    return core, table, Liveness(core, table, None)


def _constant(core, table, nbytes):
    st = torch.UntypedStorage(nbytes)
    t = core.constant(nbytes)
    return table.add(t, core.storage_of(t), st, Buf(st, owned=True, shared=True)), st


def _outputs(core, table, ins, storages):
    outs = core.call(ins, [s.nbytes() for s in storages], [-1] * len(storages), 1.0)
    return [table.add(t, core.storage_of(t), st, Buf(st, owned=False)) for t, st in zip(outs, storages)]


def test_a_poll_releases_what_the_program_dropped():
    core, table, live = _liveness_on_core()
    hc, c = _constant(core, table, 64)
    a, b = torch.UntypedStorage(128), torch.UntypedStorage(256)
    ha, hb = _outputs(core, table, [table.alive[hc]], [a, b])
    assert core.memory == 64 + 128 + 256
    del a
    gc.collect()
    live.poll(1, [ha, hb])  # a partial poll of the last op's handles
    assert ha not in table.alive and hb in table.alive and hc in table.alive
    assert core.memory == 64 + 256
    del b
    live.poll(2)  # a full poll
    assert list(table.alive) == [hc] and core.memory == 64
    table._check(core, 8)
    live._check()


def _dropped_constant(const_bytes, out_bytes):
    """A constant and one output computed from it; the program drops the constant and polls."""
    core, table, live = _liveness_on_core()
    hc, c = _constant(core, table, const_bytes)
    out = torch.UntypedStorage(out_bytes)
    ho, = _outputs(core, table, [table.alive[hc]], [out])
    del c
    live.poll(1)
    return core, table, live, hc, ho, out


def test_a_dropped_constant_is_kept_while_that_is_cheaper_than_protecting():
    """Note [Keeping a dead constant]: 16 bytes kept rather than pinning 4096 computed from them."""
    core, table, live, hc, ho, out = _dropped_constant(16, 4096)
    assert hc in table.alive and not core.pinned(core.storage_of(table.alive[ho]))
    del out  # what needed it is gone: now it goes
    live.poll(2)
    assert not table.alive and core.memory == 0


def test_a_dropped_constant_worth_less_than_it_costs_is_protected_and_released():
    core, table, live, hc, ho, out = _dropped_constant(4096, 16)
    assert hc not in table.alive and core.pinned(core.storage_of(table.alive[ho]))  # protected: pinned
    assert core.memory == 16


def test_scheduling_and_recent_ops():
    core, table, live = _liveness_on_core(budget=1 << 20)
    assert live.on_schedule and not live.due(POLL_EVERY - 1, 0) and live.due(POLL_EVERY, 0)
    keep = [_constant(core, table, 8) for _ in range(8 * POLL_EVERY)]
    live.poll(100)  # under a budget, not recording: every len(alive) / 4 ops when more live
    assert live.next_full_poll == 100 + len(keep) // 4
    for k in range(2 * RECENT_OPS):
        live.saw([keep[k][0]])
    assert live.recent == [[keep[k][0]] for k in range(RECENT_OPS, 2 * RECENT_OPS)]
    tracking = _liveness_on_core()[2]  # no budget, no log: a scheduled poll waits for an op that could set a new peak
    assert not tracking.on_schedule and not tracking.due(POLL_EVERY, 0) and tracking.due(POLL_EVERY, 1)
