"""Seeded random programs under dtr.budget against eager PyTorch: bit-for-bit equal, or a clean budget error.

Each program (tests/support/random_programs.py) mixes views, in-place writes through
views, random ops, factories, dropped names and more; it runs eagerly, then under
``dtr.budget`` without a limit and at fractions of its own peak, with each
heuristic (flop costs: reproducible decisions) and with measured op times.
Every run must give the eager loss, gradients and final values bit for bit,
or raise ``OutOfBudgetError`` / ``ThrashingError`` (an infeasible budget);
anything else is a failure. Across the programs, tight budgets must really
evict and recompute, or the comparison proves nothing.
"""
from __future__ import annotations

import collections
import contextlib
import gc
import json
import time

import pytest

torch = pytest.importorskip("torch")

from support.paths import DATA  # noqa: E402
from support.program_escapes import ESCAPES  # noqa: E402
from support.program_functions import LAYOUTS  # noqa: E402
from support.random_programs import (  # noqa: E402
    Instr,
    Program,
    generate,
    leaf_and_grad_bytes,
    make_leaves,
    run,
    run_steps,
)
from support.same_values import assert_equal  # noqa: E402

import dtr  # noqa: E402
from dtr.runtime.step_plans import PlanPolicy  # noqa: E402
from dtr.sim import read_log  # noqa: E402
from dtr.sim.replay import replay  # noqa: E402

SEEDS = list(range(48))
FRACTIONS = (0.6, 0.35, 0.2)
BUDGET_ERRORS = (dtr.OutOfBudgetError, dtr.ThrashingError)


def nested(ratio):
    """The context of a "nested" instruction: a block inside the program's, at ``ratio`` times its budget."""
    outer = dtr.active_budget()
    limit = None if ratio is None or outer is None or outer.budget_bytes is None else int(outer.budget_bytes * ratio)
    return dtr.budget(limit)


def time_bound(plain: float) -> float:
    """How long a run under dtr may take (every run ends: far above what any of these programs needs)."""
    return 30.0 + 500.0 * plain


def exact_or_budget_errors(p: Program, heuristic: str = "eqclass", cost_model: str = "flops"):
    """Run ``p`` under no limit and at each of FRACTIONS of its peak: each run exact or a budget error.

    Returns:
        (exact runs, runs that ended with a budget error, exact runs that recomputed).
    """
    exact = infeasible = evicting = 0
    start = time.perf_counter()
    want = run(p)
    plain = time.perf_counter() - start
    b = dtr.budget(None, cost_model=cost_model, heuristic=heuristic)
    assert_equal(run(p, b, check=b._check, nested=nested), want, f"seed {p.seed}, no limit")
    peak = b.stats["peak_bytes"]
    const = leaf_and_grad_bytes(p)
    for f in FRACTIONS:
        limit = int(const + f * max(peak - const, 0))
        b = dtr.budget(limit, cost_model=cost_model, heuristic=heuristic)
        what = f"seed {p.seed}, {heuristic} ({cost_model}) at {f:.0%} ({limit} bytes)"
        start = time.perf_counter()
        try:  # (the runtime's invariants are checked after every instruction)
            got = run(p, b, check=b._check, nested=nested)
        except BUDGET_ERRORS:
            infeasible += 1
            continue
        finally:  # every run ends, exactly or with a budget error
            took = time.perf_counter() - start
            assert took < time_bound(plain), f"{what}: {took:.1f} s, plain {plain:.3f} s"
        assert_equal(got, want, what)
        assert b.stats["peak_bytes"] <= limit, what
        exact += 1
        evicting += b.stats["remats"] > 0
    return exact, infeasible, evicting


@pytest.mark.slow
@pytest.mark.parametrize("heuristic,cost_model", [("eqclass", "flops"), ("dtr", "flops"), ("lru", "flops"),
                                                  ("eqclass", "time")])
def test_random_programs_are_exact_or_fail_cleanly(heuristic, cost_model):
    exact = infeasible = evicting = 0
    for seed in SEEDS:
        e, i, v = exact_or_budget_errors(generate(seed), heuristic, cost_model)
        exact, infeasible, evicting = exact + e, infeasible + i, evicting + v
    # The comparisons must cover real evictions and recomputations, not only easy budgets.
    assert exact >= len(SEEDS) * len(FRACTIONS) // 2, (exact, infeasible)
    assert evicting >= len(SEEDS) // 2, (evicting, exact, infeasible)


@pytest.fixture
def one_rank(tmp_path):
    """A default process group of one rank (gloo, a file store), for programs with collectives."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.slow
def test_random_programs_with_collectives_are_exact_or_fail_cleanly(one_rank):
    """Note [Collectives]: an async all-reduce's tensor is written by gloo's thread; autograd saves it."""
    exact = infeasible = evicting = collectives = 0
    for seed in range(12):
        p = generate(500 + seed, collectives=True)
        collectives += sum(ins.kind == "collective" for ins in p.instrs)
        e, i, v = exact_or_budget_errors(p)
        exact, infeasible, evicting = exact + e, infeasible + i, evicting + v
    # (seen: 28 collectives, 32 exact runs of 36, all 32 recomputing; without the rule the process crashes)
    assert collectives >= 12 and exact >= 24 and evicting >= 16, (collectives, exact, infeasible, evicting)


def test_random_programs_that_resize_storages_are_exact_or_fail_cleanly():
    """Note [Storages the program resizes]: products through a weight's copy whose storage the program frees
    after each use and allocates again before the next (FSDP2's unsharded parameters), forward and backward."""
    exact = infeasible = evicting = resized = 0
    for seed in range(16):
        p = generate(700 + seed, length=40, resizes=True)
        resized += sum(ins.kind == "unsharded" for ins in p.instrs)
        e, i, v = exact_or_budget_errors(p)
        exact, infeasible, evicting = exact + e, infeasible + i, evicting + v
    # (seen: 33 such products, 39 exact runs of 48, all 39 recomputing; before the fixes, wrong values)
    assert resized >= 16 and exact >= 30 and evicting >= 24, (resized, exact, infeasible, evicting)


def test_random_programs_through_other_layouts_are_exact_or_fail_cleanly():
    """Values laid out or written in ways a recomputation must reproduce: lazy conjugate and negative views,
    a storage resize_ grows, quantized round trips, forward-mode AD's zero tensors, float32 matmuls read inside
    an autocast region, another default dtype, apply_ and map_ (program_functions.LAYOUTS), and in-place
    samplers given a generator (no meta kernel). Each gave wrong values or raised before its fix."""
    exact = infeasible = evicting = 0
    seen = collections.Counter()
    for seed in range(16):
        p = generate(900 + seed, length=40)
        seen.update(ins.args[0] for ins in p.instrs if ins.kind == "layout" or ins.kind == "sample"
                    and ins.args[0] in ("exponential_", "geometric_"))
        e, i, v = exact_or_budget_errors(p)
        exact, infeasible, evicting = exact + e, infeasible + i, evicting + v
    assert set(seen) == set(LAYOUTS) | {"exponential_", "geometric_"}, seen
    # (seen: 25 such instructions, 43 exact runs of 48, all 43 recomputing; before the fixes, wrong values or
    # "size does not match" from a recomputation)
    assert exact >= 32 and evicting >= 28, (seen, exact, infeasible, evicting)


@pytest.mark.slow
@pytest.mark.parametrize("one_with", [False, True], ids=["one-with-per-step", "one-with-around-all"])
def test_random_programs_over_training_steps_are_exact(one_with):
    """Three steps with accumulated gradients and an in-place SGD update (writes to constants) in each.

    One block per step starts from what the last one left (parameters,
    gradients, inputs the program wrote); one block around all steps keeps
    its graph across them.
    """
    recomputing = infeasible = 0
    for seed in range(16):
        p = generate(100 + seed)
        try:  # (valid for one step; a write that gives an input autograd history is not for three)
            want = run_steps(p, around=contextlib.nullcontext() if one_with else None)
        except RuntimeError:
            continue
        blocks = []

        def tracked(blocks=blocks):
            blocks.append(dtr.budget(None, cost_model="flops"))
            return blocks[-1]
        run_steps(p, around=tracked()) if one_with else run_steps(p, per_step=tracked)
        peak = max(b.stats["peak_bytes"] for b in blocks)
        const = leaf_and_grad_bytes(p)
        for f in (0.5, 0.25):
            limit = int(const + f * max(peak - const, 0))
            blocks = []

            def budgeted(blocks=blocks, limit=limit):
                blocks.append(dtr.budget(limit, cost_model="flops"))
                return blocks[-1]
            def check(blocks=blocks):  # (the current block's invariants, after every instruction)
                blocks[-1]._check()
            try:
                if one_with:
                    got = run_steps(p, around=budgeted(), check=check)
                else:
                    got = run_steps(p, per_step=budgeted, check=check)
            except (dtr.OutOfBudgetError, dtr.ThrashingError):
                infeasible += 1
                continue
            for k, (g, w) in enumerate(zip(got, want)):
                assert_equal(g, w, f"seed {100 + seed} at {f:.0%}, step {k}")
            recomputing += sum(b.stats["remats"] > 0 for b in blocks) > 0
    assert recomputing >= 8, (recomputing, infeasible)


@pytest.mark.slow
def test_random_programs_follow_their_plans_exactly(tmp_path):
    """Four training steps in one planned budget (dtr.budget(B, plan=...)): every step exact, and the last
    planned step replays with its plan to its own evictions and recomputations (record -> replay equality).

    Twelve programs at two budgets (2026-11-29, with the escapes and after Note [Sums in place or not] in
    csrc/core_follow.cpp): one program is invalid over four steps; of the other 22 runs, 9 are infeasible at
    25% (as they are online), 6 end with a planned step, 5 diverge in their last step at an op whose shapes
    depend on the data (masked_select, a branch on a value, a sparse tensor's nnz: the divergence path), and
    2 run it online (no plan gained). Before that Note, a sum out of place and one in place did not match,
    and only 2-3 runs ended planned (2 in a loaded CI run)."""
    policy = PlanPolicy(background="inline", time_limit=2)
    planned = diverged = infeasible = 0
    for seed in range(12):
        p = generate(100 + seed)
        try:
            want = run_steps(p, steps=4)
        except RuntimeError:  # (valid for one step; a write that gives an input autograd history is not for four)
            continue
        blocks = []

        def tracked(blocks=blocks):
            blocks.append(dtr.budget(None, cost_model="flops"))
            return blocks[-1]
        run_steps(p, steps=4, per_step=tracked)
        peak = max(b.stats["peak_bytes"] for b in blocks)
        const = leaf_and_grad_bytes(p)
        for f in (0.5, 0.25):
            limit = int(const + f * max(peak - const, 0))
            log = tmp_path / f"{seed}-{f}.jsonl"
            mem = dtr.budget(limit, plan=policy, cost_model="flops", log=log)
            try:
                got = run_steps(p, steps=4, per_step=lambda mem=mem: mem, check=mem._check)
            except (dtr.OutOfBudgetError, dtr.ThrashingError):
                infeasible += 1
                continue
            finally:
                mem.close()
            for k, (g, w) in enumerate(zip(got, want)):
                assert_equal(g, w, f"seed {100 + seed} at {f:.0%}, planned, step {k}")
            modes = [st["plan"] for st in mem.step_stats]
            assert modes[0] == "recorded", modes
            diverged += "diverged" in modes
            last = mem.step_stats[-1]
            if last["plan"] != "planned":
                continue
            planned += 1
            plan = mem.plans[last["plan_signature"]]
            r = replay(read_log(log), "eqclass", limit, thrash_limit=float("inf"), plan=plan)
            assert (r.status, r.evictions, r.planned_evictions, r.remats, r.remat_compute) == \
                ("ok", last["evictions"], last["planned_evictions"], last["remats"], last["remat_compute"]), seed
    assert planned >= 3, (planned, diverged, infeasible)


REGRESSIONS = DATA / "random_program_regressions.json"


def _regressions():
    for r in json.loads(REGRESSIONS.read_text()):
        p = Program(r["seed"], tuple(map(tuple, r["params"])), tuple(map(tuple, r["inputs"])),
                    tuple(Instr(k, out, tuple(args)) for k, out, args in r["instrs"]))
        yield pytest.param(r, p, id=f"seed-{r['seed']}")


@pytest.mark.parametrize("case,p", list(_regressions()))
def test_random_programs_that_once_failed(case, p):
    """Programs the generator once produced that made dtr fail, kept as they were (the generator moves on)."""
    want = run(p)
    b = dtr.budget(None, cost_model=case["cost_model"], heuristic=case["heuristic"])
    run(p, b)
    const = leaf_and_grad_bytes(p)
    limit = int(const + case["fraction"] * (b.stats["peak_bytes"] - const))
    b = dtr.budget(limit, cost_model=case["cost_model"], heuristic=case["heuristic"])
    assert_equal(run(p, b), want, case["why"])
    assert b.stats["remats"] > 0


def _tensors_alive() -> int:
    import gc
    return sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())  # (type(): no __class__ lookups)


@pytest.mark.slow
def test_random_programs_that_fail_with_a_budget_error_go_on():
    """A program that fails with a budget error inside its block, caught, then runs again: the next run is
    exact, and the failed blocks' tensors do not pile up (counted without gc.collect()).

    (Only "do not pile up": plain PyTorch itself keeps some tensors of a program that raised, such as
    those a torch.utils.checkpoint region held, until its next failure.)"""
    import gc
    failed = 0
    for seed in range(8):
        p = generate(300 + seed)
        want = run(p)
        b = dtr.budget(None, cost_model="flops")
        run(p, b)
        const = leaf_and_grad_bytes(p)
        limit = int(const + 0.02 * max(b.stats["peak_bytes"] - const, 0))
        gc.collect()
        gc.disable()
        try:
            alive = []
            for _ in range(4):
                try:
                    run(p, dtr.budget(limit, cost_model="flops"))
                except (dtr.OutOfBudgetError, dtr.ThrashingError):
                    failed += 1
                alive.append(_tensors_alive())
            assert alive[-1] <= alive[0], f"seed {300 + seed}: tensors of failed blocks pile up: {alive}"
        finally:
            gc.enable()
        assert_equal(run(p, dtr.budget(None, cost_model="flops")), want, f"seed {300 + seed}, after failures")
    assert failed >= 12, failed


def _reset(leaves, saved):
    """The program's leaves as they were before any run, over the same storages (what dtr remembers between
    blocks): their values, layouts and autograd state (a run may write a leaf in place, change its strides, or
    give it autograd history)."""
    params, inputs = leaves
    fresh = []
    with torch.no_grad():
        for x, v in zip(params + inputs, saved):
            y = torch.empty(0, dtype=v.dtype).set_(x.untyped_storage(), 0, v.shape, v.stride())
            y.copy_(v)
            fresh.append(y)
    return [y.requires_grad_() for y in fresh[:len(params)]], fresh[len(params):]


def _decisions(b) -> tuple:
    s = b.stats
    return tuple(s[k] for k in ("evictions", "eager_evictions", "remats", "peak_bytes", "base_compute",
                                "remat_compute", "ops"))


@pytest.mark.slow
def test_a_block_does_not_depend_on_the_blocks_before_it():
    """A program run twice in one process over the same leaves, the second time right after a block that failed,
    makes the same decisions both times (flop costs: reproducible), or fails both times the same way.

    Between the two runs a block of the same program fails with a budget error (a failed block once left nothing
    for the next block to count from its start, so the program's own parameters and inputs counted only once
    touched; and the failed step's garbage, alive until the cyclic collector ran, counted as constants).

    Garbage the cyclic collector has not reached yet is memory in use, with or without dtr: the first run of
    the pair starts after a collection, and dtr itself must collect what the failed block left."""
    compared = evicting = 0
    for seed in range(16):
        p = generate(400 + seed)
        leaves = make_leaves(p)
        saved = [x.detach().clone() for x in leaves[0] + leaves[1]]
        b = dtr.budget(None, cost_model="flops")
        run(p, b, nested=nested, leaves=_reset(leaves, saved))
        const = leaf_and_grad_bytes(p)
        peak = b.stats["peak_bytes"]
        limit = int(const + 0.35 * max(peak - const, 0))
        outcomes = []
        for fail_first in (False, True):
            if fail_first:  # a block that fails, caught as a training loop would
                with pytest.raises(BUDGET_ERRORS):
                    run(p, dtr.budget(int(const * 0.5), cost_model="flops"), nested=nested,
                        leaves=_reset(leaves, saved))
            else:
                gc.collect()
            b = dtr.budget(limit, cost_model="flops")
            try:
                run(p, b, nested=nested, leaves=_reset(leaves, saved))
                outcomes.append(("ok", _decisions(b)))
            except BUDGET_ERRORS as e:
                outcomes.append((type(e).__name__, _decisions(b)))
        assert outcomes[0] == outcomes[1], f"seed {400 + seed}: {outcomes}"
        compared += outcomes[0][0] == "ok"
        evicting += outcomes[0][1][2] > 0
    assert compared >= 8 and evicting >= 4, (compared, evicting)


@pytest.mark.slow
def test_generated_programs_cover_caches_nested_blocks_and_escapes():
    """The generator makes the instructions this suite relies on: cache loops of both kinds, with and without
    autograd, nested blocks of every ratio, and every escape (program_escapes.ESCAPES)."""
    kinds, escapes = set(), set()
    for seed in SEEDS:
        for ins in generate(seed).instrs:
            if ins.kind == "decode":
                kinds.add(("decode", ins.args[1], ins.args[3]))
            elif ins.kind == "nested":
                kinds.add(("nested", ins.args[1]))
            elif ins.kind == "escape":
                escapes.add(ins.args[0])
    assert set(ESCAPES) <= escapes, set(ESCAPES) - escapes
    assert {("decode", how, grad) for how in ("cat", "index_copy") for grad in (False, True)} <= kinds
    assert {("nested", r) for r in (None, 1.0, 0.9, 0.7)} <= kinds
