"""Figures and chain traces: thrash/OOM markers, shading, files written, traces consistent with the replay."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
from support.paths import DATA

from dtr.cli import main
from dtr.core import ReplayStatus
from dtr.errors import DtrError
from dtr.sim import chain_log, parse_text, replay
from dtr.sim.chain import chain_budget
from dtr.sim.plot import (
    ablation_heuristics,
    check_figure_path,
    last_ok_ratio,
    plot_ablation,
    plot_accesses,
    plot_chain_scaling,
    plot_memory_traces,
    plot_overhead,
    shaded_shares,
)
from dtr.sim.sweep import sweep
from dtr.sim.trace import GRADIENT, RESIDENT, chain_scaling, chain_trace, memory_trace

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    d = tmp_path_factory.mktemp("plot")
    chain = d / "chain.jsonl"
    chain.write_text(chain_log(32))
    return sweep([str(DATA / "small.jsonl"), str(chain)], "all", "0.2:1.0:0.1", thrash_limit=3, jobs=1)


def test_last_ok_ratio_walks_down_from_the_top(rows):
    small = [r for r in rows if r.model.startswith("hand-made") and r.heuristic == "eqclass"]
    ratio, why = last_ok_ratio(small)
    ok_ratios = sorted(r.budget_ratio for r in small if r.status == ReplayStatus.OK)
    assert why == ReplayStatus.OOM and ratio == min(ok_ratios)

    def mk(x, s):
        return replace(small[0], budget_ratio=x, status=s)
    ok, oom, thrash = ReplayStatus.OK, ReplayStatus.OOM, ReplayStatus.THRASH
    assert last_ok_ratio([mk(1.0, ok), mk(0.5, ok), mk(0.4, thrash), mk(0.3, ok)]) == (0.5, thrash)
    assert last_ok_ratio([mk(1.0, ok), mk(0.5, ok)]) == (None, None)
    assert last_ok_ratio([mk(1.0, oom)]) == (None, None)


def test_shading_uses_the_largest_figures_seen(rows):
    small = [r for r in rows if r.model.startswith("hand-made")]
    const, op = shaded_shares(small)
    assert const == pytest.approx(5 / 45) and const < op <= 1
    shrunk = [replace(r, largest_op_bytes=1, constant_bytes=0) for r in small[:1]] + small[1:]
    assert shaded_shares(shrunk) == (const, op)


@pytest.mark.parametrize("name", ["o.png", "o.svg"])
def test_overhead_figure_is_written_in_the_format_of_its_extension(tmp_path, rows, name):
    path = tmp_path / name
    plot_overhead(rows, path)
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) if name.endswith(".png") else b"<svg" in data[:2000]
    if name.endswith(".svg"):
        text = data.decode()
        for label in ("hand-made five-op chain", "chain (n 32)", "last ratio before thrash", "eqclass", "lru",
                      "budget (fraction of peak memory without eviction)", "compute overhead"):
            assert label in text


def test_bad_figure_paths(tmp_path, rows):
    with pytest.raises(DtrError, match="use .png or .svg"):
        check_figure_path(tmp_path / "o.pdf")
    with pytest.raises(DtrError, match="does not exist"):
        plot_overhead(rows, tmp_path / "nope" / "o.png")
    with pytest.raises(DtrError, match="no sweep rows"):
        plot_overhead([], tmp_path / "o.png")


@pytest.mark.slow
def test_other_figures(tmp_path, rows):
    plot_accesses(rows, tmp_path / "a.png")
    pts = chain_scaling([16, 32, 64], ["dtr", "lru"], "sqrt") + chain_scaling([16, 32, 64], ["dtr"], "log")
    plot_chain_scaling(pts, tmp_path / "c.png")
    plot_memory_traces([chain_trace(21, "dtr", "sqrt"), chain_trace(21, "lru", "log")], tmp_path / "t.png")
    for name in ("a.png", "c.png", "t.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC)


def test_ablation_grid(tmp_path, data_dir):
    hs = ablation_heuristics()
    assert len(hs) == 16 and len({h.name for h in hs}) == 16 and hs[0].name == "dtr"
    assert {(h.cost, h.use_size, h.use_staleness) for h in hs} == {
        (c, s, t) for c in ("full", "eqclass", "local", "none") for s in (True, False) for t in (True, False)}
    abl = sweep([str(data_dir / "small.jsonl")], hs, "0.8,1.0", jobs=1)
    plot_ablation(abl, tmp_path / "g.png")
    assert (tmp_path / "g.png").read_bytes().startswith(PNG_MAGIC)
    with pytest.raises(DtrError, match="no ablation rows"):
        plot_ablation([r for r in abl if r.heuristic != "dtr" and False], tmp_path / "g.png")


def test_cli_plot(capsys, tmp_path, data_dir):
    out = tmp_path / "s.csv"
    assert main(["sweep", str(data_dir / "small.jsonl"), "--heuristic", "dtr,lru", "--budgets", "0.5:1.0:0.1",
                 "--out", str(out), "--jobs", "1"]) == 0
    capsys.readouterr()
    assert main(["plot", str(out), "-o", str(tmp_path / "o.svg")]) == 0
    assert main(["plot", str(out), "-o", str(tmp_path / "a.png"), "--kind", "accesses"]) == 0
    assert (tmp_path / "o.svg").exists() and (tmp_path / "a.png").exists()
    capsys.readouterr()
    assert main(["plot", str(out), "-o", str(tmp_path / "o.jpg")]) == 2
    assert "use .png or .svg" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "missing.csv"), "-o", str(tmp_path / "o.png")]) == 2
    assert "missing.csv" in capsys.readouterr().err
    assert main(["plot", str(out), "-o", str(tmp_path / "o.png"), "--heuristic", "eqclass"]) == 2
    assert "present: dtr, lru" in capsys.readouterr().err


# -- traces --------------------------------------------------------------------

@pytest.mark.parametrize("heuristic,budget", [("dtr", "sqrt"), ("lru", "sqrt"), ("dtr", "log")])
def test_chain_trace_agrees_with_the_replay(heuristic, budget):
    n = 40
    tr = chain_trace(n, heuristic, budget)
    b = chain_budget(n, budget)
    res = replay(parse_text(chain_log(n)), heuristic, b, banish=True, thrash_limit=math.inf)
    assert tr.extra_compute == res.total_compute - res.base_compute and tr.status == res.status == ReplayStatus.OK
    # one column per computation: 2n + 1 first computations plus the recomputations
    assert tr.steps == 2 * n + 1 + tr.extra_compute
    # never more resident than the budget; and the budget is used at some point
    per_step = [sum(1 for row in tr.cells if row[t]) for t in range(tr.steps)]
    assert max(per_step) <= b and max(per_step) >= b - 1
    # forward pass: step i - 1 computes t_i, so it is resident there; the last step is g_0
    for i in range(1, n + 1):
        assert tr.cells[i][i - 1] == RESIDENT
    assert tr.cells[0][-1] == GRADIENT and len(tr.rows) == n + 1


def test_generic_memory_trace_labels_storages(data_dir):
    from dtr.sim import read_log
    log = read_log(data_dir / "small.jsonl")
    tr = memory_trace(log, "eqclass", 35)
    assert "a" in tr.rows and tr.status == ReplayStatus.OK
    # constants are core ops too: one step each
    ops = sum(1 for r in log.records() if r.kind in ("constant", "call", "mutate"))
    assert tr.steps == ops + replay(log, "eqclass", 35).remats


def test_chain_scaling_matches_the_cli_chain():
    pts = chain_scaling([64, 256], ["dtr"], "sqrt")
    assert [p.budget for p in pts] == [16, 32]
    for p in pts:
        assert p.status == ReplayStatus.OK and 0 < p.extra_compute <= 1.1 * p.n
