"""Graph extraction, the schedule evaluator, and DTR's export agreeing with the simulator."""
from __future__ import annotations

import json
import random

import pytest
from support.paths import LOGS
from support.random_logs import random_log, with_collects, with_inplace

from dtr.cli import main
from dtr.core import ReplayStatus, replay_program
from dtr.sim import parse_text, read_log
from dtr.sim.chain import chain_log
from dtr.sim.compare import compare
from dtr.sim.export import ExportError, export_schedule
from dtr.sim.graph import GraphError, PlanGraphError, graph_from_log, plan_graph
from dtr.sim.replay import baseline, replay
from dtr.sim.schedule import COMPUTE, FREE, evaluate, load_schedule, plan_schedule

HEURISTICS = ("dtr", "eqclass", "local", "lru")
ZOO_LOGS = LOGS


def _agree(log, fracs=(None, 0.8, 0.5, 0.3), thrash=4.0):
    g = graph_from_log(log)
    peak = baseline(log)["peak_memory"]
    checked = 0
    for frac in fracs:
        b = None if frac is None else int(peak * frac)
        for h in HEURISTICS:
            ex = export_schedule(log, h, b, thrash_limit=thrash, graph=g)
            if ex.status != ReplayStatus.OK:
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
    assert g.storage_constant == (True, False, False)
    assert g.op_alloc == (100, 0, 40, 100, 0)
    # v (now the mutated copy) and the split views s1, s2 of y are referenced at the end
    assert set(g.referenced_at_end) == {0, 3, 4, 5}  # x is still referenced too


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
    # freeing an output referenced at the end: invalid
    assert "referenced at the end" in evaluate(g, good + [(FREE, 5)]).error
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
    assert not ev.valid and "referenced at the end" in ev.error


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


# --- the runtime's log features (dtr.budget's recorded logs) ----------------
# tests/data/runtime_features.jsonl (meta: free_dead_constants, keep_needed):
# x, w, rm, n, z (0 bytes), t, c constants; an output-less view of z; add_ of
# the counter n in place (a constant: written where it is); a = aux(c), then
# `protect c` pins a, so inc_(a) in place makes no new version either; bn
# writes the constant rm in place next to its outputs y, sm; y2 = copy of y,
# relu_(y) in place: a new version of y that both handles move to; a view v
# of it; dropout -> d, mask; mul_ (mutate, inplace) makes a new version of d;
# mask and z are released and collected (z is a constant of no bytes); pin
# sm, add_ to it in place (pinned: no new version); releasing t frees a dead
# constant after pinning the loss l computed from it (so scale_(l) in place
# makes no new version), releasing a frees the storage `protect c` pinned.
# Then p, q = f(w), q is collected, and a budget
# that evicts p makes its recomputation bring q back for an instant.

def _rt_log(data_dir):
    return read_log(data_dir / "runtime_features.jsonl")


def test_graph_follows_the_core_on_runtime_features(data_dir):
    g = graph_from_log(_rt_log(data_dir))
    name = dict(zip(g.op_line, g.op_name))
    by_line = {line: k for k, line in enumerate(g.op_line)}
    # output-less ops: the view of z, add_ of the constant n, inc_ of the protected a, add_ of the pinned
    # sm, scale_ of the loss l (pinned when its constant t died)
    for line in (9, 10, 14, 27, 32):
        assert g.op_outputs[by_line[line]] == () and g.op_overwrites[by_line[line]] == (), name[line]
    bn, relu, mul = by_line[15], by_line[18], by_line[22]
    assert len(g.op_outputs[bn]) == 2 and g.op_overwrites[bn] == ()  # rm is a constant: no new version
    (y_old,) = g.op_overwrites[relu]
    (y_new,) = g.op_fresh[relu]
    assert g.storage_op[y_old] == bn and g.storage_size[y_new] == g.storage_size[y_old] == 128
    assert g.tensor_storage[g.op_inputs[by_line[19]][0]] == y_new  # y2 moved to the new version
    assert len(g.op_overwrites[mul]) == 1 and g.op_kind[mul] == "mutate"
    # a run under no budget numbers everything as the graph (export checks operators and storages)
    ex = export_schedule(_rt_log(data_dir), "eqclass", None, graph=g)
    assert ex.status == ReplayStatus.OK and evaluate(g, ex.schedule.steps).valid


def test_export_agrees_on_runtime_features(data_dir):
    log = _rt_log(data_dir)
    g = graph_from_log(log)
    peak = baseline(log)["peak_memory"]
    fracs = (None, 0.98, 0.96, 0.94, 0.92, 0.9, 0.88, 0.86, 0.84, 0.8)  # below 0.84: oom
    assert _agree(log, fracs=fracs, thrash=10.0) == 4 * 9
    steps = export_schedule(log, "eqclass", int(peak * 0.9), graph=g).schedule.steps
    # the in-place write runs in place: its old version is freed right before it
    relu = g.op_line.index(18)
    k = steps.index((COMPUTE, relu))
    assert steps[k - 1] == (FREE, g.op_overwrites[relu][0])
    # the dead constant t and the collected empty constant z are freed
    t, z = g.op_fresh[5][0], g.op_fresh[4][0]
    assert (FREE, t) in steps and (FREE, z) in steps and g.storage_constant[t] and g.storage_constant[z]
    # q (collected) comes back with p's recomputation and is freed at once
    f = g.op_line.index(43)
    q = g.op_fresh[f][1]
    k = steps.index((COMPUTE, f), steps.index((COMPUTE, f)) + 1)
    assert steps[k + 1] == (FREE, q)


def test_export_agrees_with_handed_over_recomputations():
    # Random logs with in-place writes under the runtime's semantics, including
    # a recomputed write taking over its old version's bytes (the core's Note
    # [Handing bytes over on recomputation]): the trace frees the old version
    # right before the write, which the evaluator reads as a handover, so each
    # exported schedule is valid with the replay's own peak and compute.
    meta = {"op": "meta", "version": 1, "free_dead_constants": True, "keep_needed": True, "inplace_handover": True}
    checked = handed = 0
    for seed in range(12):
        lines = with_collects(with_inplace(random_log(seed, steps=250), seed), seed).splitlines()
        log = parse_text("\n".join([json.dumps(meta)] + lines[1:]) + "\n", path=f"<random {seed}>")
        checked += _agree(log, fracs=(None, 0.7, 0.45, 0.3), thrash=6.0)
        peak = baseline(log)["peak_memory"]
        for frac in (0.7, 0.45, 0.3):
            on = replay(log, "eqclass", int(peak * frac), thrash_limit=6)
            off = replay(log, "eqclass", int(peak * frac), thrash_limit=6,
                         semantics=log.semantics.replace(inplace_handover=False))
            handed += (on.remats, on.evictions) != (off.remats, off.evictions)
    assert checked > 50 and handed > 0


def test_compare_on_runtime_features(data_dir):
    log = _rt_log(data_dir)
    peak = baseline(log)["peak_memory"]
    rows = compare(log, [int(peak * 0.9), peak], ["chen"], heuristics=["eqclass"], baseline_peak=peak)
    assert [(r.planner, r.status) for r in rows] == [("chen", "oom"), ("eqclass", "ok"), ("chen", "ok"),
                                                     ("eqclass", "ok")]
    for r in rows[1:]:
        assert r.valid and r.peak_bytes <= r.budget_bytes, r


def test_inplace_output_viewing_the_overwritten_storage_is_refused():
    text = "\n".join(json.dumps(d) for d in [
        {"op": "constant", "id": "w", "size": 8},
        {"op": "call", "name": "f", "inputs": ["w"], "outputs": ["x"], "sizes": [100], "aliases": [None], "cost": 1},
        {"op": "call", "name": "add_", "inputs": ["x"], "outputs": ["y"], "sizes": [100], "aliases": ["x"],
         "cost": 1, "mutated": ["x"]}])
    with pytest.raises(GraphError, match=r"<string>:3: output 'y' views 'x'"):
        graph_from_log(parse_text(text))


def test_graph_is_the_cores_tables(data_dir):
    # the graph is read off a core that replayed the log without a budget: the same ids as the core's trace
    log = _rt_log(data_dir)
    g = graph_from_log(log)
    raw = replay_program(log.program, "eqclass", None, trace=True, semantics=log.semantics)
    assert list(raw["op_instr"]) == list(g.op_instr)
    assert [g.storage_op[s] for s in range(g.num_storages)] == list(raw["storage_op"])
    records = list(log.records())
    assert [records[k].kind for k in g.op_instr] == list(g.op_kind)
    assert [records[k].line for k in g.op_instr] == list(g.op_line)


def test_export_refuses_a_run_that_pins_what_the_graph_does_not():
    # Under a budget, p is evicted, then pinned back through its root without its (released) view v;
    # protecting c then walks on through p (a pinned storage with an undefined tensor: the core's Note
    # [Protecting a constant]) and pins d, so add_(d) writes d where it is. Without a budget p stays whole,
    # the walk stops there and add_(d) makes a new version: the ids differ from there on, and the run is
    # refused rather than exported as a schedule that does not describe it.
    text = "\n".join(json.dumps(d) for d in [
        {"op": "constant", "id": "c", "size": 8},
        {"op": "call", "name": "f", "inputs": ["c"], "outputs": ["p"], "sizes": [100], "aliases": [None], "cost": 1},
        {"op": "call", "name": "view", "inputs": ["p"], "outputs": ["v"], "sizes": [100], "aliases": ["p"],
         "cost": 0},
        {"op": "release", "id": "v"},
        {"op": "call", "name": "g", "inputs": ["p"], "outputs": ["d"], "sizes": [100], "aliases": [None], "cost": 1},
        {"op": "call", "name": "h", "inputs": ["d"], "outputs": ["e"], "sizes": [100], "aliases": [None],
         "cost": 100},
        {"op": "release", "id": "e"},
        {"op": "pin", "id": "p"},
        {"op": "protect", "id": "c"},
        {"op": "call", "name": "add_", "inputs": ["d"], "outputs": [], "sizes": [], "aliases": [], "cost": 1,
         "mutated": ["d"]}]) + "\n"
    log = parse_text(text)
    g = graph_from_log(log)
    (add,) = [k for k in range(g.num_ops) if g.op_name[k] == "add_"]
    assert len(g.op_overwrites[add]) == 1  # without a budget: a new version of d
    assert _agree(log, fracs=(None, 1.0)) == 8
    with pytest.raises(ExportError, match=r"<string>:10: the run under budget 208 bytes numbers storage 4 "):
        export_schedule(log, "lru", 208, graph=g)
    # compare reports that run as a row that says why, and goes on with the others.
    rows = compare(log, [208], planners=[], heuristics=["lru", "eqclass"])
    (lru,) = [r for r in rows if r.planner == "lru"]
    assert lru.status == "n/a" and "numbers storage 4 differently" in lru.message
    assert {r.planner for r in rows} == {"lru", "eqclass"}


def test_evaluator_hands_an_overwritten_version_over_in_place(data_dir):
    g = graph_from_log(_rt_log(data_dir))
    relu = g.op_line.index(18)
    (old,) = g.op_overwrites[relu]
    before = [(COMPUTE, k) for k in range(relu)]
    after = [(COMPUTE, k) for k in range(relu + 1, g.num_ops)]
    inplace = evaluate(g, before + [(FREE, old), (COMPUTE, relu)] + after)
    kept = evaluate(g, before + [(COMPUTE, relu), (FREE, old)] + after)
    assert inplace.valid and kept.valid, (inplace.error, kept.error)
    # only right before the write: a compute step in between ends the hand-over
    late = evaluate(g, before[:-1] + [(FREE, old)] + before[-1:] + [(COMPUTE, relu)] + after)
    assert not late.valid and "not resident" in late.error
    # and only to the operator that overwrites it
    other = g.op_line.index(19)  # the view of the new version reads y2, now the new version
    assert old not in g.op_overwrites[other]


def test_evaluator_frees_a_dropped_constant_for_good(data_dir):
    g = graph_from_log(_rt_log(data_dir))
    t = g.op_fresh[5][0]  # the constant t, released by the log
    loss = g.op_line.index(30)
    steps = [(COMPUTE, k) for k in range(loss + 1)]
    assert evaluate(g, steps + [(FREE, t)] + [(COMPUTE, k) for k in range(loss + 1, g.num_ops)]).valid
    ev = evaluate(g, steps + [(FREE, t), (COMPUTE, 5)] + [(COMPUTE, k) for k in range(loss + 1, g.num_ops)])
    assert not ev.valid and "cannot be brought back" in ev.error
    w = g.op_fresh[1][0]  # w is still referenced at the end
    ev = evaluate(g, steps + [(FREE, w)])
    assert not ev.valid and "constant the log keeps" in ev.error


def runtime_random_log(seed: int, steps: int = 150) -> str:
    """A random v1 log with the runtime's features: in-place writes, pins, reads, protects, collects."""
    rng = random.Random(seed)
    meta = {"op": "meta", "version": 1, "seed": seed, "free_dead_constants": rng.random() < 0.7,
            "keep_needed": rng.random() < 0.7}
    lines, live, n = [json.dumps(meta)], [], 0

    def new():
        nonlocal n
        n += 1
        return f"t{n}"

    def constant():
        t = new()
        lines.append(json.dumps({"op": "constant", "id": t, "size": rng.choice([0, 8, 16, 40])}))
        live.append(t)

    for _ in range(4):
        constant()
    for _ in range(steps):
        r = rng.random()
        if len(live) > 12 and r < 0.4:
            lines.append(json.dumps({"op": "release", "id": live.pop(rng.randrange(len(live)))}))
        elif r < 0.4 or len(live) < 2:
            ins = rng.sample(live, k=min(len(live), rng.randint(1, 3)))
            outs = [new() for _ in range(rng.choice([0, 1, 1, 2]))]
            writes = rng.random() < 0.4  # (an in-place write's outputs view nothing: see GraphError)
            d = {"op": "call", "name": "f", "inputs": ins, "outputs": outs,
                 "sizes": [rng.randint(0, 60) for _ in outs],
                 "aliases": [rng.choice(ins) if not writes and rng.random() < 0.2 else None for _ in outs],
                 "cost": rng.choice([0, 1, 2, 3.5, 7])}
            if writes:
                d["mutated"] = rng.sample(ins, k=rng.randint(1, len(ins)))
            lines.append(json.dumps(d))
            live += outs
        elif r < 0.5:
            ins = rng.sample(live, k=min(len(live), rng.randint(1, 3)))
            lines.append(json.dumps({"op": "mutate", "name": "g_", "inputs": ins, "mutated": [ins[0]],
                                     "inplace": rng.random() < 0.6, "cost": rng.choice([1, 2, 5])}))
        elif r < 0.56:
            constant()
        elif r < 0.62:
            t = new()
            lines.append(json.dumps({"op": "copy", "dst": t, "src": rng.choice(live)}))
            live.append(t)
        elif r < 0.67:
            lines.append(json.dumps({"op": "copyfrom", "dst": rng.choice(live), "src": rng.choice(live)}))
        elif r < 0.69:
            lines.append(json.dumps({"op": "pin", "id": rng.choice(live)}))
        elif r < 0.71:
            lines.append(json.dumps({"op": "read", "id": rng.choice(live)}))
        elif r < 0.75:
            lines.append(json.dumps({"op": "protect", "id": rng.choice(live)}))
        elif r < 0.79:
            lines.append(json.dumps({"op": "collect"}))
        else:
            lines.append(json.dumps({"op": "release", "id": live.pop(rng.randrange(len(live)))}))
    for t in live[4:]:
        if rng.random() < 0.7:
            lines.append(json.dumps({"op": "release", "id": t}))
    return "\n".join(lines) + "\n"


def test_export_agrees_on_random_runtime_logs():
    n = sum(_agree(parse_text(runtime_random_log(seed), path=f"<runtime random {seed}>"),
                   fracs=(None, 0.9, 0.8, 0.7, 0.6, 0.5)) for seed in range(40))
    assert n >= 200


def test_compare_runs_on_a_recorded_zoo_log():
    log = read_log(ZOO_LOGS / "unet.jsonl.gz")  # the smallest recorded log
    peak = baseline(log)["peak_memory"]
    rows = compare(log, [int(peak * 0.5), int(peak * 0.8)], ["chen"], heuristics=["eqclass"], baseline_peak=peak)
    dtr_rows = [r for r in rows if r.kind == "dtr"]
    assert [r.status for r in dtr_rows] == ["ok", "ok"]
    for r in dtr_rows:
        assert r.valid and r.peak_bytes == replay(log, "eqclass", r.budget_bytes).peak_bytes <= r.budget_bytes
    chen = [r for r in rows if r.kind == "static"]
    assert all(r.valid for r in chen if r.status == "ok") and chen[1].status == "ok"


def test_cli_compare_on_a_recorded_zoo_log(capsys):
    assert main(["compare", str(ZOO_LOGS / "unet.jsonl.gz"), "--budget", "50%", "--planners", "chen",
                 "--heuristics", "eqclass", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    (dtr_row,) = [r for r in rows if r["planner"] == "eqclass"]
    assert dtr_row["status"] == "ok" and dtr_row["valid"] is True


def test_an_op_without_outputs_runs_at_its_turn_in_a_schedule():
    # A gradient declared at the block's start (every step after the first) and accumulated in place after
    # another op: the accumulation must run where the log has it, and what it reads stay until then. Folded
    # into the node of its input instead, it ran before h, and the schedule freed d before the program's add_.
    text = "\n".join(json.dumps(d) for d in [
        {"op": "constant", "id": "w", "size": 8},
        {"op": "constant", "id": "grad", "size": 100},
        {"op": "call", "name": "f", "inputs": ["w"], "outputs": ["x"], "sizes": [100], "aliases": [None], "cost": 1},
        {"op": "call", "name": "mm", "inputs": ["x"], "outputs": ["d"], "sizes": [100], "aliases": [None], "cost": 1},
        {"op": "call", "name": "h", "inputs": ["x"], "outputs": ["e"], "sizes": [100], "aliases": [None], "cost": 1},
        {"op": "release", "id": "x"},
        {"op": "call", "name": "add_", "inputs": ["grad", "d"], "outputs": [], "sizes": [], "aliases": [],
         "cost": 1, "mutated": ["grad"]},
        {"op": "release", "id": "d"}]) + "\n"
    log = parse_text(text)
    g = graph_from_log(log)
    pg = plan_graph(g)
    (add,) = [k for k in range(g.num_ops) if g.op_name[k] == "add_"]
    (h,) = [k for k in range(g.num_ops) if g.op_name[k] == "h"]
    (mm,) = [k for k in range(g.num_ops) if g.op_name[k] == "mm"]
    assert pg.storage_node[g.op_fresh[h][0]] == next(n for n, ops in enumerate(pg.ops) if add in ops)
    steps = plan_schedule(pg, range(pg.n)).steps
    at = {s: i for i, s in enumerate(steps)}
    assert at[(COMPUTE, h)] < at[(COMPUTE, add)] < at[(FREE, g.op_fresh[mm][0])]
    assert evaluate(g, steps, None).valid
