"""Seeded random programs under dtr.budget against eager PyTorch: bit-for-bit equal, or a clean budget error.

Each program (tests/random_programs.py) mixes views, in-place writes through
views, random ops, factories, dropped names and more; it runs eagerly, then under
``dtr.budget`` without a limit and at fractions of its own peak, with each
heuristic (flop costs: reproducible decisions) and with measured op times.
Every run must give the eager loss, gradients and final values bit for bit,
or raise ``OutOfBudgetError`` / ``ThrashingError`` (an infeasible budget);
anything else is a failure. Across the programs, tight budgets must really
evict and recompute, or the comparison proves nothing.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")

import dtr  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from random_programs import Instr, Program, Result, generate, run, run_steps  # noqa: E402

SEEDS = range(48)
FRACTIONS = (0.6, 0.35, 0.2)


_BITS = {torch.float32: torch.int32, torch.float64: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaNs included, which ``torch.equal`` never finds equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in _BITS:
        a, b = a.contiguous().view(_BITS[a.dtype]), b.contiguous().view(_BITS[b.dtype])
    return torch.equal(a, b)


def assert_equal(got: Result, want: Result, what: str) -> None:
    assert same_bits(got.loss, want.loss), f"{what}: loss {got.loss} != {want.loss}"
    for i, (g, w) in enumerate(zip(got.grads, want.grads)):
        assert (g is None) == (w is None), f"{what}: gradient {i} present in one run only"
        if g is not None:
            assert same_bits(g, w), f"{what}: gradient {i} differs (max |diff| {(g - w).abs().max()})"
    assert got.values.keys() == want.values.keys()
    for n in want.values:
        assert same_bits(got.values[n], want.values[n]), f"{what}: value {n} differs"


def _constant_bytes(p) -> int:
    """Roughly what exists before the program: its leaves, and as much again for gradients (sets budgets)."""
    return sum(4 * r * c for r, c in p.params + p.inputs) * 2


@pytest.mark.parametrize("heuristic,cost_model", [("eqclass", "flops"), ("dtr", "flops"), ("lru", "flops"),
                                                  ("eqclass", "time")])
def test_random_programs_are_exact_or_fail_cleanly(heuristic, cost_model):
    evicting = exact = infeasible = 0
    for seed in SEEDS:
        p = generate(seed)
        want = run(p)
        b = dtr.budget(None, cost_model=cost_model, heuristic=heuristic)
        assert_equal(run(p, b, check=b._check), want, f"seed {seed}, no limit")
        peak = b.stats["peak_bytes"]
        const = _constant_bytes(p)
        for f in FRACTIONS:
            limit = int(const + f * max(peak - const, 0))
            b = dtr.budget(limit, cost_model=cost_model, heuristic=heuristic)
            what = f"seed {seed}, {heuristic} ({cost_model}) at {f:.0%} ({limit} bytes)"
            try:  # (the runtime's invariants are checked after every instruction)
                got = run(p, b, check=b._check)
            except (dtr.OutOfBudgetError, dtr.ThrashingError):
                infeasible += 1
                continue
            assert_equal(got, want, what)
            assert b.stats["peak_bytes"] <= limit, what
            exact += 1
            evicting += b.stats["remats"] > 0
    # The comparisons must cover real evictions and recomputations, not only easy budgets.
    assert exact >= len(SEEDS) * len(FRACTIONS) // 2, (exact, infeasible)
    assert evicting >= len(SEEDS) // 2, (evicting, exact, infeasible)


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
        const = _constant_bytes(p)
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


REGRESSIONS = pathlib.Path(__file__).parent / "data" / "random_program_regressions.json"


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
    const = _constant_bytes(p)
    limit = int(const + case["fraction"] * (b.stats["peak_bytes"] - const))
    b = dtr.budget(limit, cost_model=case["cost_model"], heuristic=case["heuristic"])
    assert_equal(run(p, b), want, case["why"])
    assert b.stats["remats"] > 0


def _tensors_alive() -> int:
    import gc
    return sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())  # (type(): no __class__ lookups)


def test_random_programs_that_fail_with_a_budget_error_go_on():
    """A program that fails with a budget error inside its block, caught, then runs again: the next run is
    exact, and the failed blocks' tensors do not pile up (counted without gc.collect()).

    (Only "do not pile up": plain PyTorch itself keeps some tensors of a program that raised, such as
    those a torch.utils.checkpoint region held, until its next failure.)"""
    import gc
    failed = 0
    for seed in range(12):
        p = generate(300 + seed)
        want = run(p)
        b = dtr.budget(None, cost_model="flops")
        run(p, b)
        const = _constant_bytes(p)
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
