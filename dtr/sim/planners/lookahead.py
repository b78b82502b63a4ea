"""``lookahead``: evictions on demand, chosen with the future known (Belady's rule, weighted by recomputation).

See Note [Eviction with the future known].
"""
from __future__ import annotations

import bisect
import random
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from dtr.sim.graph import PlanGraph
from dtr.sim.planners.base import PlanOptions, PlanResult, register_planner
from dtr.sim.schedule import sequence_profile, sequence_steps

__all__ = ["plan_lookahead", "lookahead_sequence", "SCORES"]

# Note [Eviction with the future known]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# DTR decides online: its heuristic knows only the past (staleness). A static
# planner knows the whole program, so it can run the same on-demand scheme
# with the future in view, as Belady's MIN does for caches:
# - the nodes are computed in the log's order; a node whose input is not
#   resident recomputes it first, recursively from resident values (a
#   post-order over the missing ancestry);
# - before a computation, while its bytes do not fit the budget, resident
#   values are evicted, cheapest score first, where
#       score(u) = r(u) / (bytes(u) * (next(u) - now)),
#   next(u) the position in the log's order of u's next reader after the
#   node being computed now, and r(u) the recomputation u's eviction would
#   cost. A value no later node reads is freed (score -inf); a value kept to
#   the end (a final gradient) leaves only those bytes resident once its last
#   reader has run;
# - the inputs of the node being computed are locked; the inputs of its
#   callers up the recursion are locked too, but may be evicted when nothing
#   else frees enough (they are recomputed when their turn comes).
# r(u) has three estimates (SCORES), each a separate plan; the cheapest plan
# within the budget wins:
# - ``one``: u's cost plus the costs of its non-resident inputs. Cheap and
#   short-sighted, yet the cheapest of the three on our LSTM log at 50%
#   (1.481x, against 1.638x and 3.37x), where no other planner here finds a
#   schedule at all;
# - ``exact``: the cost of u's whole non-resident ancestry, each node once
#   (capped at EXACT_CAP nodes);
# - ``paths``: the same summed over paths (an ancestor reached twice counts
#   twice: an overestimate that grows with fan-in, memoized per eviction
#   round).
# The planner's memory model never counts less than the evaluator's:
# sequence_steps frees each computation's storages after their last use,
# never later than this model's evictions and frees; a node's storages are
# held together until its last reader (a node whose outputs die at different
# times is over-counted), and an evicted or finished node keeps the bytes of
# its storages kept to the end until it is computed again (the evaluator
# keeps the latest computation's). Each plan is still measured with
# sequence_profile before it is accepted. A plan that recomputes more than MAX_RECOMPUTE times the graph's
# nodes is abandoned as thrashing. Complexity: one scan of the resident
# values per eviction round, O(rounds * resident) score evaluations; seconds
# on graphs of thousands of nodes. With more than SAMPLE_ABOVE resident values
# a round first scores a seeded sample of SAMPLE of them (as DTR samples:
# simrd's paper), and all of them only if the sample does not free enough:
# our 45k-node treelstm log at 50% then takes 7-15 s per estimate, where a
# full scan per round did not finish in 60 s. The time limit is checked every
# CHECK_EVERY computations and every CHECK_EVERY scores.

#: The recomputation estimates, one plan each, in the order tried.
SCORES = ("one", "exact", "paths")
#: ``exact`` walks at most this many ancestors per value.
EXACT_CAP = 512
#: A plan computing more than this many times the graph's nodes is given up (thrashing).
MAX_RECOMPUTE = 20
#: With more resident values than this, an eviction round scores a seeded sample of SAMPLE of them.
SAMPLE_ABOVE = 2048
SAMPLE = 512
#: The time limit is checked every this many computations (and scores of an eviction round).
CHECK_EVERY = 256


class _GiveUp(Exception):
    """The plan cannot go on: ``why`` says if memory ran out, it thrashed or the time ran out."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def lookahead_sequence(pg: PlanGraph, budget: int, score: str = "one",
                       deadline: Optional[float] = None) -> List[int]:
    """The compute sequence of the on-demand plan (Note [Eviction with the future known]).

    Args:
        pg: the planning graph.
        budget: bytes, constants included.
        score: one of :data:`SCORES`.
        deadline: ``time.perf_counter()`` value to give up at (None: no limit).

    Returns:
        The sequence of node computations (recomputations repeat nodes).

    Raises:
        _GiveUp: ``memory`` (locked values alone exceed the budget), ``thrash``
            (MAX_RECOMPUTE exceeded) or ``time``.
        ValueError: unknown score.
    """
    if score not in SCORES:
        raise ValueError(f"unknown score {score!r}; the scores are: {', '.join(SCORES)}")
    n, deps, mem, cost, pinned = pg.n, pg.deps, pg.mem, pg.cost, pg.pinned
    users = [sorted(set(us)) for us in pg.users()]
    last = [us[-1] if us else -1 for us in users]
    kept_bytes = [0] * n
    size = pg.graph.storage_size
    for s in pg.storages_referenced_at_end:
        kept_bytes[pg.storage_node[s]] += size[s]
    res = bytearray(n)            # the node's latest computation is usable
    retired = [0] * n             # bytes a retired kept node still holds
    lock = [0] * n                # how many pending computations read the node
    resident: set = set()         # evictable resident nodes
    seq: List[int] = []
    cur = 0
    limit = MAX_RECOMPUTE * n
    rng = random.Random(0)

    def one(u: int, _memo: Dict[int, float]) -> float:
        return cost[u] + sum(cost[d] for d in deps[u] if not res[d])

    def exact(u: int, _memo: Dict[int, float]) -> float:
        seen, stack, tot = {u}, [u], 0.0
        while stack and len(seen) < EXACT_CAP:
            x = stack.pop()
            tot += cost[x]
            for d in deps[x]:
                if not res[d] and not pinned[d] and d not in seen:
                    seen.add(d)
                    stack.append(d)
        return tot

    def paths(u: int, memo: Dict[int, float]) -> float:
        stack = [(u, False)]
        while stack:
            x, ready = stack.pop()
            if x in memo:
                continue
            if ready:
                memo[x] = cost[x] + sum(memo[d] for d in deps[x] if not res[d] and not pinned[d])
                continue
            stack.append((x, True))
            stack.extend((d, False) for d in deps[x] if not res[d] and not pinned[d] and d not in memo)
        return memo[u]

    recompute: Callable[[int, Dict[int, float]], float] = {"one": one, "exact": exact, "paths": paths}[score]

    def drop(u: int) -> None:
        # Evicted or past its last reader: its kept bytes stay until it is computed again (the evaluator
        # keeps the latest computation's kept storages to the end and frees the older ones).
        nonlocal cur
        res[u] = 0
        resident.discard(u)
        cur -= mem[u] - kept_bytes[u]
        retired[u] = kept_bytes[u]

    def evict(need: int, now: int, soft: bool, hard: Sequence[int]) -> bool:
        # One round: score the resident values (a seeded sample of them when there are many, then all of
        # them if the sample did not free enough), evict the lowest scores until the need fits.
        nonlocal cur
        memo: Dict[int, float] = {}
        held = set(hard)
        pools = [resident] if len(resident) <= SAMPLE_ABOVE else [rng.sample(sorted(resident), SAMPLE), resident]
        for pool in pools:
            cands: List[Tuple[float, int]] = []
            for i, u in enumerate(pool):
                if deadline is not None and i % CHECK_EVERY == CHECK_EVERY - 1 and time.perf_counter() > deadline:
                    raise _GiveUp("time")
                freed = mem[u] - kept_bytes[u]
                if not res[u] or freed <= 0 or (lock[u] and (not soft or u in held)):
                    continue
                us = users[u]
                j = bisect.bisect_right(us, now)
                if j == len(us):
                    cands.append((float("-inf"), u))
                    continue
                cands.append((recompute(u, memo) / (freed * (us[j] - now)), u))
            cands.sort()
            for _, u in cands:
                if cur + need <= budget:
                    return True
                drop(u)
            if cur + need <= budget:
                return True
        return False

    def compute(x: int, now: int) -> None:
        nonlocal cur
        need = mem[x] - retired[x]
        if cur + need > budget and not evict(need, now, False, ()) and not evict(need, now, True, deps[x]):
            raise _GiveUp("memory")
        seq.append(x)
        res[x] = 1
        cur += need
        retired[x] = 0
        if not pinned[x]:
            resident.add(x)
        if len(seq) % CHECK_EVERY == 0:
            if len(seq) > limit:
                raise _GiveUp("thrash")
            if deadline is not None and time.perf_counter() > deadline:
                raise _GiveUp("time")

    def ensure(root: int, now: int) -> None:
        stack = [(root, False)]
        while stack:
            x, ready = stack.pop()
            if ready:
                missing = [d for d in deps[x] if not res[d]]
                if missing:  # an input evicted under a soft lock: compute it again first
                    stack.append((x, True))
                    stack.extend((d, False) for d in missing)
                    continue
                compute(x, now)
                for d in deps[x]:
                    lock[d] -= 1
                continue
            if res[x]:
                continue
            stack.append((x, True))
            for d in deps[x]:
                lock[d] += 1
            stack.extend((d, False) for d in deps[x] if not res[d])

    for i in range(n):
        start = len(seq)
        ensure(i, i)
        for d in set(deps[i]).union(seq[start:]):  # free (or retire) what no later node reads
            if d in resident and last[d] <= i:
                drop(d)
    return seq


@register_planner("lookahead")
def plan_lookahead(pg: PlanGraph, budget: int, options: PlanOptions) -> PlanResult:
    """On-demand evictions with the future known, one plan per recomputation estimate; the cheapest wins.

    Returns:
        ``ok`` with the cheapest plan within the budget; ``oom`` when every
        estimate ran out of memory or thrashed (one may still exist); ``timeout``
        when the time limit passed before any plan fit.
    """
    deadline = time.perf_counter() + options.time_limit
    best: Optional[Tuple[float, List[int], str]] = None
    why: List[str] = []
    for score in SCORES:
        if time.perf_counter() > deadline:
            why.append(f"{score}: no time left")
            continue
        try:
            seq = lookahead_sequence(pg, budget, score, deadline)
        except _GiveUp as e:
            why.append(f"{score}: {e.why}")
            continue
        peak, c = sequence_profile(pg, sequence_steps(pg, seq))
        if peak > budget:  # the model is conservative; this guards it
            why.append(f"{score}: peak {peak} over the budget")
            continue
        if best is None or c < best[0]:
            best = (c, seq, score)
    if best is None:
        status = "timeout" if any(w.endswith("time") or w.endswith("no time left") for w in why) else "oom"
        return PlanResult("lookahead", status, None, message="no plan fits: " + "; ".join(why))
    return PlanResult("lookahead", "ok", tuple(best[1]), predicted_cost=best[0],
                      message=f"recomputation estimate {best[2]!r}" + (f" ({'; '.join(why)})" if why else ""))
