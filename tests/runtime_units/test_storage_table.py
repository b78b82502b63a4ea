"""The runtime's storage table (dtr/runtime/storage_table.py) driven beside a real core.

A seeded random stress test applies every kind of change the runtime makes
(new constants and outputs, in-place versions, releases, collection and
compaction) to a core and to a StorageTable together, calling both ``_check``
methods after every step and comparing the table with a model kept in plain
dicts; other tests show that ``_check`` catches what it claims to.
"""
from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from dtr.core import Core  # noqa: E402
from dtr.runtime.storage_table import Buf, StorageTable  # noqa: E402

MAX_VERSIONS = 8


class Model:
    """Each tracked program storage by handle: its storage object and current core tensor; plain Python."""

    def __init__(self) -> None:
        self.storage = {}   # handle -> UntypedStorage
        self.tensor = {}    # handle -> current core tensor
        self.chain = {}     # handle -> in-place versions behind the current one


def _add(core: Core, table: StorageTable, model: Model, t: int, st: torch.UntypedStorage, owned: bool) -> None:
    h = table.add(t, core.storage_of(t), st, Buf(st, owned=owned, shared=owned))
    assert h not in model.tensor
    model.storage[h], model.tensor[h], model.chain[h] = st, t, 0


def _random_change(rng: random.Random, core: Core, table: StorageTable, model: Model) -> None:
    live = sorted(model.tensor)
    kind = rng.choice(["constant", "call", "call", "write", "release", "release", "collect"] if live else ["constant"])
    if kind == "constant":
        st = torch.UntypedStorage(rng.randrange(1, 64))
        _add(core, table, model, core.constant(st.nbytes()), st, owned=True)
    elif kind == "call":
        ins = [model.tensor[h] for h in rng.sample(live, min(len(live), rng.randrange(1, 3)))]
        sts = [torch.UntypedStorage(rng.randrange(1, 64)) for _ in range(rng.randrange(1, 3))]
        outs = core.call(ins, [s.nbytes() for s in sts], [-1] * len(sts), 1.0)
        for t, st in zip(outs, sts):
            _add(core, table, model, t, st, owned=False)
    elif kind == "write":
        h = live[0] if rng.random() < 0.5 else rng.choice(live)  # (long chains too: pinned at MAX_VERSIONS)
        old = model.tensor[h]
        if core.pinned(core.storage_of(old)):
            return
        new, = core.mutate_inplace([old], [0], 1.0)
        n = table.write(old, new, core.storage_of(old), core.storage_of(new), model.storage[h])
        model.chain[h] += 1
        assert n == model.chain[h]
        model.tensor[h] = new
        if n >= MAX_VERSIONS:
            core.pin(new)
            model.chain[h] = 0  # (a constant now: written without new versions in the runtime)
    elif kind == "release":
        h = rng.choice(live)
        t = table.drop(h)
        assert t == model.tensor.pop(h)
        del model.storage[h], model.chain[h]
        core.release(t)
    else:
        _, storages = core.collect()
        for s in storages:
            table.collected(s, core.storage_tensors(s))
        if rng.random() < 0.5:
            _, tensors, storage_map = core.compact()
            table.renumber(tensors, storage_map)
            model.tensor = {h: tensors[t] for h, t in model.tensor.items()}


@pytest.mark.parametrize("seed", range(12))
def test_random_changes_keep_the_table_consistent(seed):
    rng = random.Random(seed)
    core, table, model = Core("eqclass", None), StorageTable(), Model()
    for _ in range(300):
        _random_change(rng, core, table, model)
        core.check()
        table._check(core, MAX_VERSIONS)
        assert table.alive == model.tensor
        for h, t in model.tensor.items():
            assert table.handle[t] == h
            assert table.version[model.storage[h]._cdata] == t
            assert table.phys[core.storage_of(t)].get() is not None
        assert all(table.versions.get(t, 0) == model.chain[h] or model.chain[h] == 0
                   for h, t in model.tensor.items())


def _filled() -> tuple:
    core, table = Core("eqclass", None), StorageTable()
    sts = [torch.UntypedStorage(8) for _ in range(3)]
    c = core.constant(8)
    table.add(c, core.storage_of(c), sts[0], Buf(sts[0], owned=True, shared=True))
    outs = core.call([c], [8, 8], [-1, -1], 1.0)
    for t, st in zip(outs, sts[1:]):
        table.add(t, core.storage_of(t), st, Buf(st, owned=False))
    table._check(core, MAX_VERSIONS)
    return core, table, sts


@pytest.mark.parametrize("corrupt,message", [
    (lambda t: t.alive.update({1: t.alive[2]}), r"alive\[1\] = 1 but handle\[1\] = 2"),  # (alive twice)
    (lambda t: t.handle.update({0: 3}), "handle"),
    (lambda t: t.cdata_of.clear(), "cdata_of"),
    (lambda t: t.alive.update({99: 0}), "never made"),
    (lambda t: t.phys.clear(), "no buffer"),
    (lambda t: t.versions.update({0: MAX_VERSIONS + 1}), "versions"),
    (lambda t: t.version.update({1234: 77}), "not a core tensor"),
])
def test_check_catches_an_inconsistent_table(corrupt, message):
    core, table, _ = _filled()
    corrupt(table)
    with pytest.raises(AssertionError, match=message):
        table._check(core, MAX_VERSIONS)


def test_a_dropped_address_stays_with_a_newer_tensor():
    """An address a dead storage left behind may name a new one already: drop() must not forget the new one."""
    core, table, sts = _filled()
    h_old = 2
    t_old = table.alive[h_old]
    t_new = core.constant(8)
    # A new storage at the old one's address (here: the same object) before the old one's release is seen.
    table.add(t_new, core.storage_of(t_new), sts[1], Buf(sts[1], owned=True, shared=True))
    assert table.drop(h_old) == t_old
    assert table.version[sts[1]._cdata] == t_new and t_old not in table.cdata_of
    table._check(core, MAX_VERSIONS)
