"""The core's work per eviction stays bounded as the pool grows (issue 15, item 7).

No timing: the core counts "storage accesses" (metadata touched choosing and
upkeeping, the paper's overhead proxy). On a chain that keeps every other
output alive, the pool grows with the program; a choice that scored the whole
pool touched O(pool) storages per eviction (quadratic replays), the bound tree
of the core's Note [Choosing without scanning] touches O(log pool).
"""
from __future__ import annotations

import pytest

from dtr.core import Core
from dtr.errors import OutOfBudgetError


def accesses_per_eviction(heuristic: str, calls: int) -> float:
    """Replay the chain (budget: a quarter of the calls) and its output condition."""
    c = Core(heuristic, calls // 4)
    prev, alive = None, []
    for i in range(calls):
        out = c.call([] if prev is None else [prev], [1], [-1], 1.0)[0]
        if prev is not None:
            if i % 2 == 0:
                c.release(prev)  # an odd output, read once
            else:
                alive.append(prev)
        prev = out
    with pytest.raises(OutOfBudgetError):  # every kept output wanted: more than the budget
        for t in alive + [prev]:
            c.pin(t)
    k = c.counters
    assert k["evictions"] > calls // 3
    # The policy still "evaluates" the whole pool (the paper's count); it just scores few.
    assert k["heuristic_evals"] > 10 * k["evictions"]
    return k["storage_accesses"] / k["evictions"]


@pytest.mark.parametrize("heuristic", ["eqclass", "eqclass-split", "lru", "local"])
def test_work_per_eviction_stays_bounded(heuristic):
    small = accesses_per_eviction(heuristic, 2_000)
    large = accesses_per_eviction(heuristic, 20_000)
    # 10x the pool: a few more tree levels, not 10x the work.
    assert large < 1.6 * small, (small, large)
    assert large < 400, large
