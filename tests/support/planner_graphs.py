"""Small graph logs for the planner tests, the least cost of any schedule (brute force), and the schedule check."""
from __future__ import annotations

import heapq
import json
import math
import random

from dtr.sim import parse_text
from dtr.sim.graph import graph_from_log, plan_graph
from dtr.sim.planners import STATUSES
from dtr.sim.schedule import evaluate, plan_schedule, sequence_profile, sequence_steps


def hetero_chain(n: int, rng: random.Random) -> str:
    """A forward-backward chain (the toy chain's shape) with random sizes and costs."""
    d = json.dumps
    lines = [d({"op": "meta", "version": 1})]

    def call(name, ins, out):
        lines.append(d({"op": "call", "name": name, "inputs": ins, "outputs": [out],
                        "sizes": [rng.randint(1, 4)], "aliases": [None], "cost": rng.randint(1, 5)}))

    call("f", [], "t1")
    for i in range(2, n + 1):
        call("f", [f"t{i - 1}"], f"t{i}")
    call("b", [f"t{n}"], f"g{n}")
    for k in range(n - 1, -1, -1):
        lines.append(d({"op": "release", "id": f"t{k + 1}"}))
        call("b", ([f"t{k}"] if k >= 1 else []) + [f"g{k + 1}"], f"g{k}")
        lines.append(d({"op": "release", "id": f"g{k + 1}"}))
    return "\n".join(lines) + "\n"


def random_dag(seed: int, n: int = 9, *, kept: int = 0, multi: bool = False) -> str:
    """A small random DAG log without views (every planner applies).

    With ``kept``, 1 to ``kept`` of its outputs are kept to the end (a model's final gradients), the
    constant is 1-3 bytes, and ops read up to three values of 1-5 bytes. With ``multi``, about a third
    of the ops have two outputs (a convolution's backward: a gradient to pass on and one to keep), so
    a node can hold a kept output beside one freed after its readers.
    """
    rng = random.Random(seed)
    d = json.dumps
    fan_in, top = (3, 5) if kept else (2, 4)
    lines = [d({"op": "meta", "version": 1}),
             d({"op": "constant", "id": "w", "size": rng.randint(1, 3) if kept else 1})]
    names = ["w"]
    for i in range(n):
        ins = rng.sample(names, k=min(len(names), rng.randint(1, fan_in)))
        outs = [f"x{i}"] + ([f"y{i}"] if multi and rng.random() < 0.35 else [])
        lines.append(d({"op": "call", "name": "f", "inputs": ins, "outputs": outs,
                        "sizes": [rng.randint(1, top) for _ in outs], "aliases": [None] * len(outs),
                        "cost": rng.randint(1, 4)}))
        names.extend(outs)
    keep = set(rng.sample(names[1:-1], k=rng.randint(1, kept))) if kept else set()
    for x in names[1:-1]:
        if x not in keep:
            lines.append(d({"op": "release", "id": x}))
    return "\n".join(lines) + "\n"


def brute_force(pg, budget):
    """Least total cost of ANY schedule (any order, any recomputation) within the budget:
    Dijkstra over (resident set, computed-once set)."""
    n, allm = pg.n, (1 << pg.n) - 1
    goal = [v for v in range(n) if pg.referenced_at_end[v]]
    dist = {(0, 0): 0.0}
    pq = [(0.0, 0, 0)]
    while pq:
        c, res, done = heapq.heappop(pq)
        if dist.get((res, done), math.inf) < c:
            continue
        if done == allm and all(res >> v & 1 for v in goal):
            return c
        mem = sum(pg.mem[v] for v in range(n) if res >> v & 1)
        for v in range(n):
            if res >> v & 1:
                if pg.pinned[v]:
                    continue
                nxt, nc = (res & ~(1 << v), done), c
            else:
                if any(not (res >> d & 1) for d in pg.deps[v]) or mem + pg.mem[v] > budget:
                    continue
                nxt, nc = (res | (1 << v), done | (1 << v)), c + pg.cost[v]
            if nc < dist.get(nxt, math.inf):
                dist[nxt] = nc
                heapq.heappush(pq, (nc, nxt[0], nxt[1]))
    return None


def no_remat_peak(pg) -> int:
    """The peak of the log's own order with no recomputation."""
    return sequence_profile(pg, sequence_steps(pg, range(pg.n)))[0]


def graphs(text: str):
    """The graph of a v1 log's text and its planner's view: (g, pg)."""
    g = graph_from_log(parse_text(text))
    return g, plan_graph(g)


def check_schedule(g, pg, r, budget):
    """A planner's result: a known status and, if it made a schedule, one that the one evaluator finds valid and
    within the budget (its evaluation, or None without a schedule)."""
    assert r.status in STATUSES
    if r.sequence is None:
        return None
    ev = evaluate(g, plan_schedule(pg, r.sequence).steps, budget)
    assert ev.valid, (r.planner, ev.error)
    assert ev.peak_bytes <= budget
    return ev
