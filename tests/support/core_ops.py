"""Driving the core with random ops (tests/core/test_differential.py, tests/core/test_compact.py)."""
from __future__ import annotations

import random
from typing import Any, Callable, Tuple

from dtr.errors import OutOfBudgetError, ThrashingError
from support.reference_core import RefOutOfBudget, RefThrashing


def outcome(fn: Callable[..., Any], *args: Any) -> Tuple[str, Any]:
    """('ok', result) or ('oob', needed) or ('thrash', None), from the C++ core or the reference alike."""
    try:
        return "ok", fn(*args)
    except (OutOfBudgetError, RefOutOfBudget) as e:
        return "oob", e.needed
    except (ThrashingError, RefThrashing):
        return "thrash", None


def random_size(rng: random.Random, zero: float) -> int:
    """0 bytes with probability ``zero``; else 1-40 bytes, or 41-100 one time in ten."""
    x = rng.random()
    if x < zero:
        return 0
    return rng.randint(1, 40) if x < 0.9 else rng.randint(41, 100)


def random_cost(rng: random.Random) -> float:
    # Multiples of 1/8: every sum of costs is exact in floating point, so the
    # order in which either implementation adds them cannot matter, and exact
    # score ties (which exercise the tie-breaking) really happen.
    return 0.0 if rng.random() < 0.15 else rng.randint(1, 80) / 8
