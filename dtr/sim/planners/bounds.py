"""A memory lower bound for every schedule of a planning graph: budgets below it are proven infeasible.

See Note [A memory lower bound].
"""
from __future__ import annotations

from typing import NamedTuple

from dtr.sim.graph import PlanGraph

__all__ = ["MemoryBound", "memory_lower_bound"]

# Note [A memory lower bound]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Whatever a schedule recomputes and in whatever order, two moments are in
# every schedule (dtr.sim.schedule.evaluate's memory model):
# - each node's computation: the storages it allocates and every storage its
#   operators read are resident together (a node's operators run as one step,
#   no free between them). The storages it overwrites in place are left out:
#   their bytes may be handed over to the new version (Note [In-place writes
#   in a schedule]), so counting them could claim more than a schedule needs;
# - the end: every storage referenced at the end is resident.
# The bound is the larger of the two maxima. It ignores everything else that
# is live at those moments, so it is loose, but a budget below it is
# infeasible for every planner (``infeasible``, with the bytes needed), which
# no search could discover by failing. O(nodes + reads).


class MemoryBound(NamedTuple):
    """Bytes every schedule needs, and where."""

    bytes: int
    reason: str


def memory_lower_bound(pg: PlanGraph) -> MemoryBound:
    """The most memory any schedule of ``pg`` needs at one of two moments (Note [A memory lower bound]).

    Returns:
        (bytes, a sentence naming the moment that needs them).
    """
    g = pg.graph
    size = g.storage_size
    best, why = 0, "nothing to compute"
    for v in range(pg.n):
        overwritten = {s for op in pg.ops[v] for s in g.op_overwrites[op]}
        own = sum(size[s] for s in pg.storages[v])
        need = own + sum(size[s] for s in pg.reads[v] if s not in overwritten)
        if need > best:
            k = pg.ops[v][0]
            best, why = need, (f"computing {g.op_name[k]} (log line {g.op_line[k]}) needs its inputs and its "
                               f"{own} bytes of outputs resident together")
    at_end = sum(size[s] for s in pg.storages_referenced_at_end)
    if at_end > best:
        best, why = at_end, "the storages still referenced at the end of the log must be resident together"
    return MemoryBound(best, why)
