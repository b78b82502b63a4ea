"""Graph extraction, the schedule evaluator, and DTR's export agreeing with the simulator."""
from __future__ import annotations

import json

import pytest

from dtr.sim import parse_text, read_log
from dtr.sim.chain import chain_log
from dtr.sim.cli import main
from dtr.sim.export import export_schedule
from dtr.sim.graph import PlanGraphError, graph_from_log, plan_graph
from dtr.sim.replay import baseline
from dtr.sim.schedule import COMPUTE, FREE, evaluate, load_schedule
from test_stress import random_log

HEURISTICS = ("dtr", "eqclass", "local", "lru")


def _agree(log, fracs=(None, 0.8, 0.5, 0.3), thrash=4.0):
    g = graph_from_log(log)
    peak = baseline(log)["peak_memory"]
    checked = 0
    for frac in fracs:
        b = None if frac is None else int(peak * frac)
        for h in HEURISTICS:
            ex = export_schedule(log, h, b, thrash_limit=thrash, graph=g)
            if ex.status != "ok":
                continue
            ev = evaluate(g, ex.schedule.steps, b)
            assert ev.valid, (log.path, frac, h, ev.error)
            assert ev.peak_bytes == ex.peak_bytes, (log.path, frac, h)
            assert ev.total_compute == pytest.approx(ex.total_compute, rel=1e-12, abs=1e-9)
            checked += 1
    return checked


def test_graph_of_views_log(data_dir):
    g = graph_from_log(read_log(data_dir / "views.jsonl"))
    assert g.op_kind == ("constant", "call", "call", "mutate", "call")
    assert g.tensor_view[1] and g.tensor_storage[1] == g.tensor_storage[0]  # v views x
    assert g.storage_size == (100, 40, 100)  # x, y, the mutate's fresh copy of x
    assert g.storage_pinned == (True, False, False)
    assert g.op_alloc == (100, 0, 40, 100, 0)
    # v (now the mutated copy) and the split views s1, s2 of y are wanted
    assert set(g.wanted) == {0, 3, 4, 5}  # x is still referenced too


@pytest.mark.parametrize("name", ["small.jsonl", "views.jsonl", "small.simrd.log", "views.simrd.log"])
def test_export_agrees_with_simulator_on_data_logs(data_dir, name):
    assert _agree(read_log(data_dir / name)) >= 4


def test_export_agrees_on_chain_and_random_logs():
    assert _agree(parse_text(chain_log(32))) >= 12
    n = sum(_agree(parse_text(random_log(seed), path=f"<random {seed}>")) for seed in range(15))
    assert n >= 100


def test_export_agrees_on_published_logs(simrd_logs):
    for name in ("resnet32.log.gz", "transformer.log.gz"):
        log = read_log(simrd_logs / name)
        assert _agree(log, fracs=(0.5, 0.3), thrash=2.0) >= 4


def test_evaluator_rejects_bad_schedules(data_dir):
    g = graph_from_log(read_log(data_dir / "small.jsonl"))
    good = [(COMPUTE, k) for k in range(g.num_ops)]
    ev = evaluate(g, good)
    assert ev.valid and ev.peak_bytes == 55 and ev.total_compute == 15
    assert not evaluate(g, good, budget=54).valid
    assert "not resident" in evaluate(g, [(COMPUTE, 0), (COMPUTE, 2)]).error
    assert "constant" in evaluate(g, good + [(FREE, 0)]).error
    # freeing a (wanted) output at the end: invalid
    assert "wanted" in evaluate(g, good + [(FREE, 5)]).error
    # a free then recompute of an intermediate is fine and costs again
    ev = evaluate(g, good[:3] + [(FREE, 1), (COMPUTE, 1)] + good[3:])
    assert ev.valid and ev.total_compute == 16 and ev.recomputes == 1
    # skipping an operator is not allowed
    assert "never computed" in evaluate(g, good[:5]).error or not evaluate(g, good[:5]).valid


def test_view_must_be_recomputed_after_its_storage_comes_back(data_dir):
    g = graph_from_log(read_log(data_dir / "views.jsonl"))
    steps = [(COMPUTE, 0), (COMPUTE, 1), (COMPUTE, 2), (FREE, 1), (COMPUTE, 2), (COMPUTE, 3), (COMPUTE, 4)]
    assert evaluate(g, steps).valid
    # free y (storage 1), bring it back, then use the split view without rerunning it
    steps2 = [(COMPUTE, 0), (COMPUTE, 1), (COMPUTE, 2), (COMPUTE, 3), (COMPUTE, 4), (FREE, 1), (COMPUTE, 2)]
    ev = evaluate(g, steps2)
    assert not ev.valid and "wanted" in ev.error


def test_plan_graph_folds_views(data_dir):
    pg = plan_graph(graph_from_log(read_log(data_dir / "views.jsonl")))
    assert pg.n == 3 and pg.ops[0] == (0, 1) and pg.ops[1] == (2, 4) and pg.pinned == (True, False, False)
    with pytest.raises(PlanGraphError):
        plan_graph(graph_from_log(parse_text(random_log(0))))


def test_cli_export(tmp_path, data_dir, capsys):
    out = tmp_path / "s.json"
    assert main(["export", str(data_dir / "small.jsonl"), "--budget", "80%", "--heuristic", "dtr",
                 "-o", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["valid"] and d["peak_bytes"] == d["simulator_peak_bytes"]
    assert d["total_compute"] == d["simulator_total_compute"] > d["base_compute"]
    sched = load_schedule(out)
    assert len(sched.steps) == d["steps"] and sched.meta["planner"] == "dtr"
    g = graph_from_log(read_log(data_dir / "small.jsonl"))
    assert evaluate(g, sched.steps).peak_bytes == d["peak_bytes"]
    assert main(["export", str(data_dir / "small.jsonl"), "--budget", "10%", "-o", str(out)]) == 2
