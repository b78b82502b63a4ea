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
#   in a schedule]), so counting them could claim more than a schedule needs.
#   So is every constant storage the log keeps to the end (a parameter) whose
#   node is an ancestor of this one: an ancestor was computed before, and a
#   kept constant is never freed (the evaluator refuses that), so it is
#   resident now in any order of computation. This is what makes the bound
#   prove, for instance, that our unet log cannot run at 30% of its peak: its
#   parameters and the largest decoder step's operands do not fit together;
# - the end: every storage referenced at the end is resident;
# - the last computations of the nodes that hold such storages (a model's
#   final gradients). A storage becomes resident only when its node is
#   computed, so after a node's last computation its storages referenced at
#   the end stay resident to the end. Whichever order those last computations
#   come in, the j-th finds the earlier ones' kept storages resident beside
#   its own operands, outputs and kept constants: max_j(P_j + a_j), with P_j
#   the earlier ones' kept bytes and a_j the j-th's own need (its operands
#   kept at the end are left out of a_j: they may be among the earlier ones,
#   and counting them twice could claim too much). An order by a_j - s_j
#   descending (s_j: the node's kept bytes) minimizes that maximum (exchanging
#   two neighbours out of that order never lowers it), so the bound takes that
#   order's maximum, which holds for every schedule. This is what proves our
#   treelstm log infeasible at 30%: its parameters, its ten final gradients and
#   the operands of whichever gradient is finished last do not fit together.
# The bound is the largest of the three. It ignores everything else that
# is live at those moments, so it is loose, but a budget below it is
# infeasible for every planner (``infeasible``, with the bytes needed), which
# no search could discover by failing. The kept constants an ancestor set
# holds are a bitmask per node (the OR of its inputs' masks), summed once per
# distinct mask: O((nodes + reads) * K / 64) with K kept constants, and a
# fraction of a second on our 45k-node TreeLSTM log; the order of the last
# computations sorts the nodes holding kept storages: O(n log n) more.


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
    kept = [s for s in sorted(pg.storages_referenced_at_end) if g.storage_constant[s]]
    final = {s for s in pg.storages_referenced_at_end if not g.storage_constant[s]}
    bit = {s: 1 << i for i, s in enumerate(kept)}
    node_bits = [0] * pg.n
    for s in kept:
        node_bits[pg.storage_node[s]] |= bit[s]
    mask = [0] * pg.n       # per node: the kept constants among its ancestors and itself
    summed: dict = {0: 0}   # mask -> its bytes
    best, why = 0, "nothing to compute"
    lasts = []              # (a_j - s_j, a_j, s_j, node) of each node holding final storages
    for v in range(pg.n):
        m = node_bits[v]
        for d in pg.deps[v]:
            m |= mask[d]
        mask[v] = m
        overwritten = {s for op in pg.ops[v] for s in g.op_overwrites[op]}
        own = sum(size[s] for s in pg.storages[v])
        operands = [s for s in pg.reads[v] if s not in overwritten]
        held = m & ~node_bits[v]  # the kept constants of its ancestors, less what it reads or overwrites
        for s in (*operands, *overwritten):
            held &= ~bit.get(s, 0)
        if held not in summed:
            summed[held] = sum(size[s] for i, s in enumerate(kept) if held >> i & 1)
        need = own + sum(size[s] for s in operands) + summed[held]
        if need > best:
            k = pg.ops[v][0]
            best, why = need, (f"computing {g.op_name[k]} (log line {g.op_line[k]}) needs its inputs, its "
                               f"{own} bytes of outputs and the {summed[held]} bytes of kept constants computed "
                               f"before it resident together")
        s_v = sum(size[s] for s in pg.storages[v] if s in final)
        if s_v:
            # (a final storage it overwrote would be counted twice: in `own` and among the earlier ones)
            a_v = need - sum(size[s] for s in (*operands, *overwritten) if s in final)
            lasts.append((a_v - s_v, a_v, s_v, v))
    at_end = sum(size[s] for s in pg.storages_referenced_at_end)
    if at_end > best:
        best, why = at_end, "the storages still referenced at the end of the log must be resident together"
    lasts.sort(key=lambda x: (-x[0], x[3]))
    earlier = 0
    for _, a_v, s_v, v in lasts:
        if earlier + a_v > best:
            k = pg.ops[v][0]
            best, why = earlier + a_v, (
                f"the last computations of the {len(lasts)} nodes whose outputs are referenced at the end, in "
                f"any order: the one that needs the most finds the earlier ones' {earlier} bytes of such outputs "
                f"resident beside its own operands, outputs and kept constants ({a_v} bytes; e.g. "
                f"{g.op_name[k]} at log line {g.op_line[k]})")
        earlier += s_v
    return MemoryBound(best, why)
