"""Every run ends: recomputation is planned (no exponential re-recomputation), and the thrash limit counts
recomputations as well as their cost, so ops that cost nothing cannot be recomputed for ever (the core's
Note [Planned recomputation] and Note [Counting recomputations]; dtr/semantics.py, Note [The thrash limit])."""
from __future__ import annotations

import json
import math
import time

import pytest

import dtr
from dtr.core import Core
from dtr.semantics import RUNTIME, SIMRD, remat_allowance, remat_count_allowance
from dtr.sim import replay


def _diamonds(core: Core, n: int):
    """y_i = f(p_i, q_i) with p_i and q_i both computed from y_{i-1}: every level a diamond (a KV cache's shape).
    Returns the last y, with everything else released and evicted."""
    x = core.constant(8)
    y = core.call([x], [8], [-1], 1.0)[0]
    made = [y]
    for _ in range(n):
        p = core.call([y], [8], [-1], 1.0)[0]
        q = core.call([y], [8], [-1], 1.0)[0]
        y = core.call([p, q], [8], [-1], 1.0)[0]
        made += [p, q, y]
    core.set_budget(16)
    core.call([x], [8], [-1], 1.0)  # evicts the last y (nothing else is resident but the constant)
    for t in made[:-1]:
        core.release(t)
    assert not core.defined(y)
    core.set_budget(None)
    return y


@pytest.mark.parametrize("n", [8, 20])
def test_bringing_back_a_graph_of_diamonds_recomputes_each_op_once(n):
    c = Core("eqclass", semantics=RUNTIME)
    y = _diamonds(c, n)
    start = c.counters["remats"]
    c.require(y)
    assert c.counters["remats"] - start == 3 * n + 1  # (it was 2^(n+1) - 3)
    c.check()


def test_pinning_many_brings_back_what_they_share_once():
    c = Core("eqclass", semantics=RUNTIME)
    x = c.constant(8)
    shared = c.call([x], [8], [-1], 1.0)[0]
    outs = [c.call([shared], [8], [-1], 1.0)[0] for _ in range(10)]
    c.set_budget(16)
    c.call([x], [8], [-1], 1.0)
    c.release(shared)
    c.set_budget(None)
    assert not any(c.defined(t) for t in outs)
    start = c.counters["remats"]
    c.pin_many(outs)
    assert c.counters["remats"] - start == 11  # the shared input once, each output once
    c.check()


def test_the_allowances():
    assert remat_count_allowance(3.0, 10) == 20
    assert remat_count_allowance(1.0, 10) == 0
    assert remat_count_allowance(math.inf, 10) == 2 ** 63 - 1
    assert remat_count_allowance(2.5, 3) == 4  # rounded down
    assert remat_allowance(2.0, 0.0) == math.inf  # nothing cost anything: the count is what stops such a run


def _zero_cost_recomputation(core: Core) -> None:
    """Ops that cost nothing, under a budget that holds two of them: the chain's first link is evicted, then read."""
    x = core.constant(8)
    chain = [core.call([x], [8], [-1], 0.0)[0]]
    for _ in range(3):
        chain.append(core.call([chain[-1]], [8], [-1], 0.0)[0])
    assert not core.defined(chain[0])
    core.call([chain[0]], [8], [-1], 0.0)


def test_recomputing_ops_that_cost_nothing_is_counted():
    """Ops of no cost allow any recomputation by cost (Note [The thrash limit]): only the count can stop them."""
    c = Core("lru", budget=24, semantics=RUNTIME, thrash_limit=1.0)  # 1: no recomputation at all
    with pytest.raises(dtr.ThrashingError) as info:
        _zero_cost_recomputation(c)
    e = info.value
    assert (e.remat_compute, e.limit, e.remats, e.count_limit) == (0.0, math.inf, 1, 0)
    assert "thrashing: 1 recomputations passed the limit of 0" in str(e)
    free = Core("lru", budget=24, semantics=RUNTIME, thrash_limit=2.0)  # 4 ops computed: 4 allowed
    _zero_cost_recomputation(free)
    assert free.counters["remats"] == 1


def test_a_replay_of_ops_that_cost_nothing_is_counted(tmp_path):
    lines = [{"op": "meta", "version": 1}, {"op": "constant", "id": "x", "size": 8}]
    prev = "x"
    for i in range(4):
        lines.append({"op": "call", "name": "f", "inputs": [prev], "outputs": [f"c{i}"], "sizes": [8],
                      "aliases": [None], "cost": 0})
        prev = f"c{i}"
    for r in range(100):  # the chain's two ends in turn: each read recomputes the other end's chain
        for name, ins in (("g", ["c0"]), ("h", ["c3"])):
            lines.append({"op": "call", "name": name, "inputs": ins, "outputs": [f"{name}{r}"], "sizes": [8],
                          "aliases": [None], "cost": 0})
            lines.append({"op": "release", "id": f"{name}{r}"})
    lines += [{"op": "release", "id": f"c{i}"} for i in range(4)]  # (nothing is wanted at the end)
    path = tmp_path / "zero.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    free = replay(path, "lru", 24, thrash_limit=None)
    assert free.status == "ok" and free.remats > 204  # more recomputations than the log has ops
    start = time.perf_counter()
    r = replay(path, "lru", 24, thrash_limit=2)
    assert r.status == "thrash" and r.remats == 204 + 1 and time.perf_counter() - start < 10
    assert replay(path, "lru", 24, thrash_limit=2, semantics=SIMRD).status == "thrash"
