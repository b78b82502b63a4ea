"""Seeded random programs under dtr.budget against eager PyTorch: bit-for-bit equal, or a clean budget error.

Each program (tests/random_programs.py) mixes views, in-place writes through
views, random ops, factories and dropped names; it runs eagerly, then under
``dtr.budget`` without a limit and at fractions of its own peak, with each
heuristic (flop costs: reproducible decisions) and with measured op times.
Every run must give the eager loss, gradients and final values bit for bit,
or raise ``OutOfBudgetError`` / ``ThrashingError`` (an infeasible budget);
anything else is a failure. Across the programs, tight budgets must really
evict and recompute, or the comparison proves nothing.
"""
from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")

import dtr  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from random_programs import Result, generate, run  # noqa: E402

SEEDS = range(48)
FRACTIONS = (0.6, 0.35, 0.2)


def assert_equal(got: Result, want: Result, what: str) -> None:
    assert torch.equal(got.loss, want.loss), f"{what}: loss {got.loss} != {want.loss}"
    for i, (g, w) in enumerate(zip(got.grads, want.grads)):
        assert (g is None) == (w is None), f"{what}: gradient {i} present in one run only"
        if g is not None:
            assert torch.equal(g, w), f"{what}: gradient {i} differs (max |diff| {(g - w).abs().max()})"
    assert got.values.keys() == want.values.keys()
    for n in want.values:
        assert torch.equal(got.values[n], want.values[n]), f"{what}: value {n} differs"


def _constant_bytes(p) -> int:
    return sum(4 * r * c for r, c in p.params + p.inputs) * 2  # leaves and their gradients


@pytest.mark.parametrize("heuristic,cost_model", [("eqclass", "flops"), ("dtr", "flops"), ("lru", "flops"),
                                                  ("eqclass", "time")])
def test_random_programs_are_exact_or_fail_cleanly(heuristic, cost_model):
    evicting = exact = infeasible = 0
    for seed in SEEDS:
        p = generate(seed)
        want = run(p)
        b = dtr.budget(None, cost_model=cost_model, heuristic=heuristic)
        assert_equal(run(p, b), want, f"seed {seed}, no limit")
        peak = b.stats["peak_bytes"]
        const = _constant_bytes(p)
        for f in FRACTIONS:
            limit = int(const + f * max(peak - const, 0))
            b = dtr.budget(limit, cost_model=cost_model, heuristic=heuristic)
            what = f"seed {seed}, {heuristic} ({cost_model}) at {f:.0%} ({limit} bytes)"
            try:
                got = run(p, b)
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
