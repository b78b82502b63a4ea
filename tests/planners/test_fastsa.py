"""FastSA (dtr/sim/planners/fastsa.py, csrc/fastsa.cpp): the annealer's memory model agrees with the
evaluator, the node grouping keeps every node, and cold starts find valid plans within the budget."""
from __future__ import annotations

import json
import math
import random
import time

import pytest
from support.planner_graphs import brute_force, check_schedule, graphs, hetero_chain, no_remat_peak, random_dag

from dtr.sim.chain import chain_log
from dtr.sim.planners import PlanOptions, run_planner
from dtr.sim.planners.bounds import memory_lower_bound
from dtr.sim.planners.fastsa import _spread, anneal, group_nodes, group_problem, node_problem
from dtr.sim.schedule import evaluate, out_of_order, plan_schedule, sequence_profile, sequence_steps

COLD = PlanOptions(time_limit=10, sa_steps=1_000_000, seed=1, warm_start=False)


def _random_sequence(pg, rng, extra):
    """The log's order with ``extra`` recomputations inserted where their inputs exist."""
    seq = list(range(pg.n))
    movable = [v for v in range(pg.n) if not pg.pinned[v]]
    for _ in range(extra):
        v = rng.choice(movable)
        first = max((seq.index(d) for d in pg.deps[v]), default=-1)
        seq.insert(rng.randrange(first + 1, len(seq) + 1), v)
    return seq


@pytest.mark.parametrize("seed", range(6))
def test_model_peak_matches_the_evaluator(seed):
    rng = random.Random(seed)
    g, pg = graphs(random_dag(seed, n=12) if seed % 2 else hetero_chain(8, rng))
    for _ in range(5):
        seq = _random_sequence(pg, rng, rng.randrange(12))
        st = anneal(node_problem(pg), _spread(seq, pg.n), 10**15, 0, (1.0, 1.0), 1.0, 0, 0.0, False)
        peak, cost = sequence_profile(pg, sequence_steps(pg, seq))
        assert st.peak == peak and st.cost == pytest.approx(cost)
        assert [v for v in st.slots if v >= 0] == seq


def test_grouping_fuses_chain_forward_and_keeps_every_node():
    g, pg = graphs(chain_log(12))
    gr = group_nodes(pg)
    assert any(gr.fused) and len(gr.units) < pg.n
    assert sorted({m for ms in gr.members for m in ms}) == list(range(pg.n))
    for v, ms in zip(gr.units, gr.members):
        assert ms[-1] == v and not (pg.referenced_at_end[v] is False and gr.fused[v])
    # the grouped sequence alone is a valid (recomputing) schedule, and the model counts its peak
    seq = [m for ms in gr.members for m in ms]
    ev = evaluate(g, plan_schedule(pg, seq).steps)
    assert ev.valid
    st = anneal(group_problem(pg, gr), _spread(range(len(gr.units)), len(gr.units)), 10**15, 0, (1.0, 1.0), 1.0,
                0, 0.0, False)
    assert st.peak >= ev.peak_bytes


def test_grouping_recomputes_a_cheap_large_value_in_each_reader():
    d = json.dumps
    log = "\n".join([d({"op": "constant", "id": "a", "size": 1}),
                     d({"op": "call", "name": "f", "inputs": ["a"], "outputs": ["x"], "sizes": [8], "aliases": [None],
                        "cost": 1}),
                     d({"op": "call", "name": "g", "inputs": ["x"], "outputs": ["y"], "sizes": [1], "aliases": [None],
                        "cost": 5}),
                     d({"op": "call", "name": "h", "inputs": ["x"], "outputs": ["z"], "sizes": [1], "aliases": [None],
                        "cost": 5}),
                     d({"op": "release", "id": "x"})]) + "\n"
    g, pg = graphs(log)
    gr = group_nodes(pg)
    assert gr.fused == (False, True, False, False) and gr.members[1:] == ((1, 2), (1, 3))
    assert gr.extra[1:] == (8, 8)  # x is an intermediate of each group, on top of its own value
    seq = [m for ms in gr.members for m in ms]
    ev = evaluate(g, plan_schedule(pg, seq).steps)
    assert ev.valid and ev.recomputes == 1 and ev.peak_bytes == 1 + 8 + 1 + 1


@pytest.mark.parametrize("frac", [0.5, 0.3])
def test_cold_start_fits_hetero_chains(frac):
    rng = random.Random(7)
    g, pg = graphs(hetero_chain(30, rng))
    budget = max(int(frac * no_remat_peak(pg)),
                 max(pg.mem[v] + sum(pg.mem[d] for d in pg.deps[v]) for v in range(pg.n)))
    r = run_planner("fastsa", pg, budget, COLD)
    assert r.status == "ok", r.message
    ev = check_schedule(g, pg, r, budget)
    assert ev.overhead < 2.0 and "cold start" in r.message


def test_close_to_the_optimum_on_small_dags():
    worse = []
    for seed in range(4):
        g, pg = graphs(random_dag(seed, n=8))
        budget = max(pg.mem[v] + sum(pg.mem[d] for d in pg.deps[v]) for v in range(pg.n)) + 1 + pg.pinned_bytes
        best = brute_force(pg, budget)
        r = run_planner("fastsa", pg, budget, PlanOptions(time_limit=10, sa_steps=50_000, warm_start=False))
        if best is None:
            assert r.status == "oom"
            continue
        assert r.status == "ok", r.message
        ev = check_schedule(g, pg, r, budget)
        assert ev.total_compute >= best - 1e-9
        worse.append(ev.total_compute / best)
    assert worse and max(worse) <= 1.25


def test_seeded_and_time_limited():
    g, pg = graphs(chain_log(40))
    opts = PlanOptions(time_limit=10, sa_steps=30_000, seed=5, warm_start=False)
    budget = int(0.4 * no_remat_peak(pg))
    a = run_planner("fastsa", pg, budget, opts)
    b = run_planner("fastsa", pg, budget, opts)
    assert a.status == "ok" and a.sequence == b.sequence
    assert a.sequence is not None  # (check_schedule passes a result without a schedule)
    check_schedule(g, pg, a, budget)
    g, pg = graphs(chain_log(400))
    t0 = time.perf_counter()
    r = run_planner("fastsa", pg, 2 * math.ceil(2 * math.sqrt(400)), PlanOptions(time_limit=0.5))
    assert time.perf_counter() - t0 < 3.0 and r.status in ("ok", "oom")  # 0.5 s (unlimited: 20M iterations, > 20 s)
    if r.sequence is not None:
        check_schedule(g, pg, r, 2 * math.ceil(2 * math.sqrt(400)))


def test_inconsistent_problem_is_refused():
    from dtr import _C
    with pytest.raises(ValueError, match="inconsistent"):
        _C.fastsa_anneal([0, 1], [5], [0, 1], [0], [0], [1.0], [0], [1], [0], [0, -1], 10, 10, 1.0, 1.0, 1.0, 0, 0.0,
                         False)
    with pytest.raises(ValueError, match="before producing"):
        _C.fastsa_anneal([0, 0, 1], [0], [0, 1, 2], [0, 1], [0, 0], [1.0, 1.0], [0, 0], [1, 1], [0, 0], [1, 0], 10,
                         10, 1.0, 1.0, 1.0, 0, 0.0, False)


def test_soft_peak_anneals_to_a_valid_plan():
    g, pg = graphs(hetero_chain(12, random.Random(3)))
    budget = max(int(0.5 * no_remat_peak(pg)), memory_lower_bound(pg).bytes)
    st = anneal(node_problem(pg), _spread(range(pg.n), pg.n), budget, 300_000, (1e-3, 1e-7), 0.0, 1, 10.0, False,
                soft_peak=True)
    seq = [v for v in st.slots if v >= 0]
    peak, cost = sequence_profile(pg, sequence_steps(pg, seq))
    assert (peak, cost) == (st.peak, pytest.approx(st.cost))
    if st.feasible:
        assert evaluate(g, plan_schedule(pg, seq).steps, budget).valid


def _in_order_case(seed):
    """Anneal a random graph's lookahead plan with and without the order; whether the free run broke it."""
    rng = random.Random(seed)
    g, pg = graphs(random_dag(seed, n=30) if seed % 2 else hetero_chain(20, rng))
    budget = max(int(0.5 * no_remat_peak(pg)), memory_lower_bound(pg).bytes)
    # the same start: the lookahead plan (in order, within the budget)
    start = run_planner("lookahead", pg, budget, PlanOptions()).sequence
    assert start is not None and out_of_order(start) is None
    moved = []
    for keep in (False, True):
        st = anneal(node_problem(pg), _spread(start, pg.n), budget, 200_000, (1e-3, 1e-7), 0.0, seed, 10.0, False,
                    keep_order=keep)
        seq = [v for v in st.slots if v >= 0]
        moved.append(out_of_order(seq) is not None)
        peak, cost = sequence_profile(pg, sequence_steps(pg, seq))
        assert peak == st.peak and cost == pytest.approx(st.cost)
    assert moved[1] is False
    r = run_planner("fastsa", pg, budget, PlanOptions(time_limit=10, sa_steps=200_000, seed=seed, in_order=True))
    assert r.status == "ok" and r.sequence is not None and out_of_order(r.sequence) is None, r.message
    check_schedule(g, pg, r, budget)
    return moved[0]


def test_in_order_annealing_keeps_first_computations_in_the_graphs_order():
    # Note [Schedules a step can follow]: a runtime step runs its ops once, in order
    moved = [_in_order_case(seed) for seed in range(6)]
    assert any(moved)  # (the unconstrained annealer does break the order, so the checks above could fail)


def test_in_order_annealing_refuses_a_start_out_of_order():
    g, pg = graphs(random_dag(1, n=12))
    seq = list(range(pg.n))
    i = next(i for i in range(pg.n - 1) if i not in pg.deps[i + 1] and not pg.pinned[i] and not pg.pinned[i + 1])
    seq[i], seq[i + 1] = seq[i + 1], seq[i]
    assert out_of_order(seq) == (i + 1, i)
    anneal(node_problem(pg), _spread(seq, pg.n), 10**15, 10, (1.0, 1.0), 1.0, 0, 0.0, False)  # (fine unordered)
    with pytest.raises(ValueError, match="out of order"):
        anneal(node_problem(pg), _spread(seq, pg.n), 10**15, 10, (1.0, 1.0), 1.0, 0, 0.0, False, keep_order=True)
