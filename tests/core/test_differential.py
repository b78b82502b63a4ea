"""Differential tests: the C++ core (through dtr.core.Core) against the pure-Python
reference of tests/support/reference_core.py, on seeded random operation sequences.

After every step both must agree on the returned ids, the evicted storages and
rematerialized ops (in order), the counters, the clock and the per-tensor and
per-storage state; and the core's own invariant check must pass. A failure
message carries the op sequence, which replays standalone with :func:`replay`.
"""
from __future__ import annotations

import math
import random
import subprocess
import sys
import textwrap

import pytest
from support.core_ops import outcome, random_cost, random_size
from support.reference_core import RefCore

from dtr.core import Core

HEURISTICS = ["dtr", "eqclass", "eqclass-split", "local", "lru", "largest"]
COUNTERS = ["base_compute", "remat_compute", "evictions", "eager_evictions", "remats", "memory",
            "peak_memory", "heuristic_evals", "largest_op_bytes", "constant_bytes", "banishments"]


class Pair:
    """The C++ core and the reference, driven in lockstep."""

    def __init__(self, heuristic, budget=None, remat_limit=math.inf):
        self.core = Core(heuristic, budget, remat_limit=remat_limit)
        self.ev, self.rm = [], []
        self.core.set_hooks(on_evict=self.ev.append, on_compute=self._computed)
        self.ref = RefCore(heuristic, budget, remat_limit=remat_limit)
        self.log = []

    def _computed(self, op, remat):
        if remat:
            self.rm.append(op)

    def do(self, name, *args):
        """Apply one op to both; returns (kind, value); asserts they agree."""
        self.log.append((name, args))
        got = outcome(getattr(self.core, name), *args)
        want = outcome(getattr(self.ref, name), *args)
        assert got == want, f"{name}{args}: core {got} != reference {want}"
        return got

    def compare(self):
        c, r = self.core, self.ref
        assert self.ev == r.evicted, f"evictions: core {self.ev} != reference {r.evicted}"
        assert self.rm == r.remat_ops, f"remats: core {self.rm} != reference {r.remat_ops}"
        got = c.counters
        for k in COUNTERS:
            assert got[k] == r.counters[k], f"counter {k}: core {got[k]} != reference {r.counters[k]}"
        assert c.clock == r.clock
        assert c.num_tensors == len(r.tensors) and c.num_storages == len(r.storages)
        assert c.pool_size == len(r.pool), f"pool size: core {c.pool_size} != reference {len(r.pool)}"
        # Local names: one attribute lookup per query, not one per id.
        defined, refs, storage_of = c.defined, c.refs, c.storage_of
        resident, pinned, locks, size, cost = c.resident, c.pinned, c.locks, c.storage_size, c.storage_cost
        for t, rt in enumerate(r.tensors):
            assert defined(t) == rt.defined, f"defined({t})"
            assert refs(t) == rt.refs, f"refs({t})"
            assert storage_of(t) == rt.storage, f"storage_of({t})"
        for s, rs in enumerate(r.storages):
            assert resident(s) == rs.resident, f"resident({s})"
            assert pinned(s) == rs.pinned, f"pinned({s})"
            assert locks(s) == rs.locks, f"locks({s})"
            assert size(s) == rs.size, f"storage_size({s})"
            assert cost(s) == rs.cost, f"storage_cost({s})"
        r.check()
        c.check()


def replay(log, heuristic, budget=None, remat_limit=math.inf):
    """Replay an op log on a fresh Pair, comparing after every step; returns the Pair."""
    p = Pair(heuristic, budget, remat_limit)
    for name, args in log:
        kind, _ = p.do(name, *args)
        if kind != "ok":
            break
        p.compare()
    return p


def run_random(heuristic, seed, steps=150, budget="random", remat_limit=math.inf):
    """Drive a Pair with a seeded random op sequence; returns (Pair, how it ended)."""
    rng = random.Random(f"{heuristic}/{seed}")
    if budget == "random":
        budget = None if rng.random() < 0.2 else rng.randint(150, 600)
    p = Pair(heuristic, budget, remat_limit)
    held = []  # one entry per reference the driver holds (a multiset of tensor ids)

    def ctx():
        return f"heuristic={heuristic!r} budget={budget} remat_limit={remat_limit} seed={seed}\nlog={p.log!r}"

    actions = ["call", "mutate", "retain", "release", "require", "pin", "constant"]
    weights = [40, 8, 6, 30, 8, 1, 2]
    for step in range(steps):
        live = sorted(set(held))
        act = "constant" if step < 3 else rng.choices(actions, weights)[0]
        if act in ("mutate", "retain", "release", "require", "pin") and not live:
            act = "call"
        try:
            if act == "constant":
                kind, out = p.do("constant", random_size(rng, 0.15))
                new = [out] if kind == "ok" else []
            elif act == "call":
                k = rng.randint(0, min(3, len(live)))
                inputs = [rng.choice(live) for _ in range(k)] if rng.random() < 0.2 else rng.sample(live, k)
                n = rng.randint(1, 3)
                alias = [rng.randrange(k) if k and rng.random() < 0.15 else -1 for _ in range(n)]
                sizes = [random_size(rng, 0.15) if a < 0 or rng.random() < 0.5 else 0 for a in alias]
                kind, new = p.do("call", inputs, sizes, alias, random_cost(rng))
            elif act == "mutate":
                inputs = rng.sample(live, rng.randint(1, min(3, len(live))))
                mutated = sorted(rng.sample(range(len(inputs)), rng.randint(1, len(inputs))))
                kind, new = p.do("mutate", inputs, mutated, random_cost(rng))
                if kind == "ok":
                    for j in mutated:
                        held.remove(inputs[j])
            elif act == "retain":
                t = rng.choice(live)
                kind, _ = p.do("retain", t)
                held.append(t)
                new = []
            elif act == "release":
                t = rng.choice(held)
                kind, _ = p.do("release", t)
                held.remove(t)
                new = []
            else:  # require, pin
                kind, _ = p.do(act, rng.choice(live))
                new = []
            if kind != "ok":
                return p, kind
            held.extend(new)
            # Often drop some fresh outputs at once: unreferenced intermediates.
            for t in new:
                if rng.random() < 0.3:
                    p.do("release", t)
                    held.remove(t)
            p.compare()
        except AssertionError as e:
            raise AssertionError(f"{e}\n{ctx()}") from None
        except RuntimeError as e:  # core.check() failed
            raise AssertionError(f"core.check(): {e}\n{ctx()}") from None
    return p, "done"


@pytest.mark.parametrize("heuristic", HEURISTICS)
def test_differential_random(heuristic):
    ends = {"done": 0, "oob": 0, "thrash": 0}
    evictions = remats = 0
    for seed in range(30):
        p, end = run_random(heuristic, seed)
        ends[end] += 1
        evictions += p.ref.counters["evictions"] + p.ref.counters["eager_evictions"]
        remats += p.ref.counters["remats"]
    # The sequences must actually exercise the interesting paths.
    assert ends["done"] >= 5 and ends["oob"] >= 1, ends
    assert evictions > 0 and remats > 0


@pytest.mark.parametrize("heuristic", HEURISTICS)
def test_differential_remat_limit(heuristic):
    ends = {"done": 0, "oob": 0, "thrash": 0}
    for seed in range(8):
        rng = random.Random(seed)
        p, end = run_random(heuristic, 1000 + seed, budget=rng.randint(200, 400),
                            remat_limit=rng.choice([0.0, 5.0, 20.0, 60.0]))
        ends[end] += 1
    assert ends["thrash"] >= 1, ends


@pytest.mark.parametrize("heuristic", HEURISTICS)
def test_differential_unlimited(heuristic):
    for seed in range(5):
        p, end = run_random(heuristic, 2000 + seed, budget=None)
        assert end == "done"
        assert p.ref.counters["evictions"] == 0 and p.ref.counters["remats"] == 0


def test_reference_tie_breaking():
    """The reference's choice rule on a hand-made case (guards the reference itself)."""
    # lru: all storages accessed at the same clock tie; the latest inserted wins.
    p = Pair("lru", budget=30)
    a = p.do("call", [], [10], [-1], 0.0)[1][0]
    b = p.do("call", [], [10], [-1], 0.0)[1][0]
    c = p.do("call", [], [10], [-1], 1.0)[1][0]
    p.compare()
    # a, b accessed at clock 0; c at clock 1. Staleness: a=b=1, c=0 (inf score).
    p.do("call", [], [10], [-1], 1.0)
    p.compare()
    assert p.ev == [p.core.storage_of(b)]  # tie between a and b: latest inserted
    assert p.ref.counters["heuristic_evals"] == 3
    del a, c


def _pending_outputs_scenario(c, use_mutate):
    """Storages s0..s5, then an op whose inputs i1, i2 are both evicted.

    Before the last op (clock 13): b (s0) and x (s3) are resident with
    last_access 11; i2 = f(b) (s1) and i1 (s2) are evicted. The last op
    creates s6 (cost 100), a dependent of s1. While i1 is rematerialized
    (i2 still evicted), make_room must evict one of b, x (y, s5, is fresh: inf):
      e*(b) = {s1, s6}: dependents s1 (evicted) -> s6 (never computed, not
      resident); score(b) = (1 + 1 + 100) / (10 * 2) = 5.1
      score(x) = 8 / (10 * 2) = 0.4
    so x (s3) goes first. Ignoring s6 would give score(b) = 2 / 20 = 0.1 and evict b.
    """
    b = c.call([], [10], [-1], 1.0)[0]        # s0
    i2 = c.call([b], [10], [-1], 1.0)[0]      # s1
    i1 = c.call([], [10], [-1], 1.0)[0]       # s2
    x = c.call([], [10], [-1], 8.0)[0]        # s3
    c.call([b, x], [0], [-1], 1.0)            # s4: size 0, touches b and x at clock 11
    c.call([], [20], [-1], 1.0)               # s5: evicts s1, then s2
    if use_mutate:
        c.mutate([i1, i2], [1], 100.0)        # s6; releases i2 afterwards
    else:
        c.call([i1, i2], [10], [-1], 100.0)   # s6


@pytest.mark.parametrize("use_mutate", [False, True], ids=["call", "mutate"])
def test_full_cost_sees_outputs_of_the_op_in_progress(use_mutate):
    """dtr's e*(S) must include the not-yet-computed outputs of the op being run.

    They are non-resident storages reachable from S through evicted
    storages (simrd counts them too: ``not material``). The C++ core counts
    them when it evaluates e* afresh, but not at the first evictions of the
    op (KNOWN DISCREPANCY, see the report: core evicts [0, 5, 0] instead of [3, 5]).
    """
    p = Pair("dtr", budget=40)
    _pending_outputs_scenario(p.ref, use_mutate)
    assert p.ref.evicted == [1, 2, 3, 5] + ([1] if use_mutate else [])  # the reference, by hand
    _pending_outputs_scenario(p.core, use_mutate)
    p.compare()


# ---------------------------------------------------------------- core only

_CHAIN = textwrap.dedent("""
    import sys
    from dtr.core import Core
    N = 100_000
    c = Core("lru", budget=3)
    ts = [c.call([], [1], [-1], 1.0)[0]]
    for _ in range(N):
        ts.append(c.call([ts[-1]], [1], [-1], 1.0)[0])
    before = c.counters
    evicted = [t for t in ts if not c.defined(t)]
    assert len(evicted) >= N - 3, len(evicted)
    target = max(evicted)
    assert all(not c.defined(t) for t in ts[:target + 1])
    c.pin(target)
    assert c.defined(target) and c.pinned(c.storage_of(target))
    after = c.counters
    remats = after["remats"] - before["remats"]
    assert target + 1 <= remats <= 2 * (target + 1), (target, remats)
    c.check()
    print("ok", target, remats)
""")


def test_core_deep_chain_remat():
    """Rematerializing a 100,000-long evicted chain must not overflow the C++ stack."""
    r = subprocess.run([sys.executable, "-c", _CHAIN], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"rc={r.returncode}\nstdout={r.stdout}\nstderr={r.stderr[-3000:]}"
    assert r.stdout.startswith("ok")
