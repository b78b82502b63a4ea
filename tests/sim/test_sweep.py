"""Sweeps: ratio specs, rows equal to single replays, resuming from the CSV, the CLI."""
from __future__ import annotations

import csv
import json
import math
import subprocess
import sys

import pytest

from dtr.cli import main
from dtr.core import ReplayStatus
from dtr.errors import DtrError
from dtr.heuristics import get_heuristic, heuristic_names
from dtr.sim import chain_log, replay
from dtr.sim.replay import PLAN_FIELDS, ReplayResult
from dtr.sim.sweep import FIELDS, parse_heuristics, parse_ratios, read_rows, sweep


def run(capsys, *argv):
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


# -- parse_ratios ------------------------------------------------------------

def test_ratio_range_includes_stop_without_float_drift():
    rs = parse_ratios("0.1:1.0:0.05")
    assert len(rs) == 19 and rs[0] == 0.1 and rs[-1] == 1.0 and 0.15 in rs and 0.3 in rs


@pytest.mark.parametrize("spec,expected", [("0.5", [0.5]), ("0.5,0.2,0.5", [0.2, 0.5]), ("0.2:0.3:0.1", [0.2, 0.3]),
                                           ("0.2:0.25:0.1", [0.2])])
def test_ratio_forms(spec, expected):
    assert parse_ratios(spec) == expected


@pytest.mark.parametrize("spec,fragment", [("0.1:1.0", "START:STOP:STEP"), ("a:1:0.1", "'a' is not a number"),
                                           ("0.5:0.1:0.1", "below START"), ("0:1:0.1", "not > 0"),
                                           ("0.1:1:0", "not > 0"), ("", "empty"), ("0.1:1:0.00001", "at most")])
def test_bad_ratio_specs_say_the_expected_form(spec, fragment):
    with pytest.raises(ValueError, match="START:STOP:STEP") as e:
        parse_ratios(spec)
    assert fragment in str(e.value)


@pytest.mark.parametrize("ratios", [[0.5, 10 ** 400], [0.5, -1.0], [0.5, math.nan], []])
def test_bad_ratio_lists_are_value_errors(data_dir, ratios):
    with pytest.raises(ValueError, match="budget ratios must be finite and > 0"):  # (10**400: not an OverflowError)
        sweep([data_dir / "small.jsonl"], "dtr", ratios, jobs=1)


def test_heuristic_specs():
    assert [h.name for h in parse_heuristics("all")] == heuristic_names()
    assert [h.name for h in parse_heuristics("lru, dtr,lru")] == ["lru", "dtr"]
    with pytest.raises(ValueError, match="valid: dtr, eqclass"):
        parse_heuristics("dtr,nope")


# -- sweep -------------------------------------------------------------------

def test_rows_equal_single_replays(data_dir):
    path = str(data_dir / "small.jsonl")
    rows = sweep([path], "eqclass,lru", "0.7,0.8,1.0", thrash_limit=3, jobs=1)
    assert [(r.heuristic, r.budget_ratio) for r in rows] == [
        ("eqclass", 0.7), ("eqclass", 0.8), ("eqclass", 1.0), ("lru", 0.7), ("lru", 0.8), ("lru", 1.0)]
    for r in rows:
        single = replay(path, r.heuristic, f"{100 * r.budget_ratio:g}%", thrash_limit=3).to_dict()
        d = r.to_dict()
        assert {k: d[k] for k in single} == single
        assert r.model == "hand-made five-op chain" and r.log == path
    assert rows[0].status == ReplayStatus.OOM and rows[2].status == ReplayStatus.OK and rows[2].evictions == 0


def test_row_fields_are_the_replay_fields_plus_sweep_columns():
    # (but those only a replay following a plan fills: a sweep follows none)
    replay_fields = [f for f in ReplayResult.__dataclass_fields__ if f not in PLAN_FIELDS]
    assert [f for f in FIELDS if f not in ("model", "budget_ratio")] == replay_fields
    assert set(PLAN_FIELDS) <= set(ReplayResult.__dataclass_fields__)
    assert FIELDS[:3] == ("log", "model", "budget_ratio")


def test_parallel_sweep_matches_serial_and_writes_csv(tmp_path, data_dir):
    chain = tmp_path / "chain.jsonl"
    chain.write_text(chain_log(64))
    logs = [str(data_dir / "small.jsonl"), str(chain)]
    serial = sweep(logs, "all", "0.2:1.0:0.2", thrash_limit=3, jobs=1)
    out = tmp_path / "s.csv"
    parallel = sweep(logs, "all", "0.2:1.0:0.2", thrash_limit=3, jobs=2, out=out)
    assert serial == parallel and len(parallel) == 2 * len(heuristic_names()) * 5
    back = read_rows(out)
    assert sorted(back, key=lambda r: r.key) == sorted(parallel, key=lambda r: r.key)
    with open(out, newline="") as f:
        assert tuple(next(csv.reader(f))) == FIELDS
    assert {r.model for r in back} == {"hand-made five-op chain", "chain (n 64)"}


def test_rerun_skips_rows_already_in_the_file(tmp_path, data_dir):
    path = str(data_dir / "small.jsonl")
    out = tmp_path / "s.csv"
    seen = []
    sweep([path], "eqclass", "0.8,1.0", thrash_limit=3, jobs=1, out=out, progress=lambda d, t, r: seen.append(t))
    assert seen == [2, 2]
    seen.clear()
    rows = sweep([path], "eqclass,lru", "0.6,0.8,1.0", thrash_limit=3, jobs=1, out=out,
                 progress=lambda d, t, r: seen.append((r.heuristic, r.budget_ratio)))
    assert sorted(seen) == [("eqclass", 0.6), ("lru", 0.6), ("lru", 0.8), ("lru", 1.0)]
    assert len(rows) == 6 and len(read_rows(out)) == 6
    # a different thrash limit is a different row
    seen.clear()
    sweep([path], "eqclass", "1.0", thrash_limit=math.inf, jobs=1, out=out,
          progress=lambda d, t, r: seen.append(r.thrash_limit))
    assert seen == [math.inf]
    inf_rows = [r for r in read_rows(out) if math.isinf(r.thrash_limit)]
    assert len(inf_rows) == 1 and inf_rows[0].to_dict()["thrash_limit"] is None


def test_ablated_heuristics_sweep(data_dir):
    h = get_heuristic("dtr").ablate(cost="local", size=False)
    rows = sweep([str(data_dir / "small.jsonl")], [h], "0.8", thrash_limit=3, jobs=1)
    assert rows[0].heuristic == "dtr[local,nosize,stale]"


def test_bad_inputs(tmp_path, data_dir):
    with pytest.raises(DtrError, match="missing.jsonl"):
        sweep([str(tmp_path / "missing.jsonl")], "dtr", "0.5", jobs=1)
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(DtrError, match="missing columns"):
        sweep([str(data_dir / "small.jsonl")], "dtr", "0.5", jobs=1, out=bad)
    with pytest.raises(ValueError, match="thrash limit"):
        sweep([str(data_dir / "small.jsonl")], "dtr", "0.5", thrash_limit=0.5, jobs=1)


def test_truncated_csv_row_is_reported_with_its_line(tmp_path, data_dir):
    out = tmp_path / "s.csv"
    sweep([str(data_dir / "small.jsonl")], "dtr", "0.8,1.0", jobs=1, out=out)
    text = out.read_text()
    out.write_text(text + text.splitlines()[-1][:20] + "\n")
    with pytest.raises(DtrError, match=r"s\.csv:4: .*interrupted"):
        read_rows(out)


def test_published_log_sweep_keeps_the_paper_ordering(simrd_logs):
    # transformer at 30%: dtr and eqclass well below local, lru thrashes (simrd Figure 4's ordering).
    rows = sweep([str(simrd_logs / "transformer.log.gz")], "dtr,eqclass,local,lru", "0.3", thrash_limit=2, jobs=2)
    by = {r.heuristic: r for r in rows}
    assert by["dtr"].status == by["eqclass"].status == by["local"].status == ReplayStatus.OK
    assert abs(by["dtr"].overhead / by["eqclass"].overhead - 1) < 0.02
    assert by["eqclass"].overhead < by["local"].overhead - 0.2
    assert by["lru"].status == ReplayStatus.THRASH


# -- CLI ---------------------------------------------------------------------

def test_cli_sweep_writes_and_resumes(capsys, tmp_path, data_dir):
    out = tmp_path / "s.csv"
    status, stdout, err = run(capsys, "sweep", data_dir / "small.jsonl", "--heuristic", "dtr,lru",
                              "--budgets", "0.5:1.0:0.25", "--out", out, "--jobs", "1")
    assert status == 0 and "6 runs" in stdout and "6 run, 0 already" in stdout and err == ""
    status, stdout, _ = run(capsys, "sweep", data_dir / "small.jsonl", "--heuristic", "all",
                            "--budgets", "0.5:1.0:0.25", "--out", out, "--jobs", "1", "--progress")
    n = 3 * len(heuristic_names())
    assert status == 0 and f"{n} runs" in stdout and f"{n - 6} run, 6 already" in stdout
    assert len(read_rows(out)) == n


def test_cli_progress_line_only_when_asked(capsys, tmp_path, data_dir):
    status, _, err = run(capsys, "sweep", data_dir / "small.jsonl", "--heuristic", "dtr", "--budgets", "1.0",
                         "--out", tmp_path / "s.csv", "--jobs", "1", "--progress")
    assert status == 0 and "sweep [" in err and "1/1" in err


@pytest.mark.parametrize("argv,fragment", [
    (["--heuristic", "nope"], "valid: dtr, eqclass"),
    (["--budgets", "0.1-1.0"], "START:STOP:STEP"),
    (["--jobs", "0"], "--jobs must be at least 1"),
])
def test_cli_sweep_bad_input_exits_2(capsys, tmp_path, data_dir, argv, fragment):
    status, out, err = run(capsys, "sweep", data_dir / "small.jsonl", "--out", tmp_path / "s.csv", *argv)
    assert status == 2 and fragment in err and err.startswith("dtr-sim: error:") and len(err.splitlines()) == 1


def test_cli_sweep_bad_log_names_it(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"op": "call"}\n')
    status, _, err = run(capsys, "sweep", bad, "--out", tmp_path / "s.csv", "--jobs", "1")
    assert status == 2 and "bad.jsonl:1" in err
    assert not (tmp_path / "s.csv").exists() or (tmp_path / "s.csv").stat().st_size == 0


def test_sweep_and_plot_commands_stay_light_to_import():
    code = ("import sys; from dtr.cli import build_parser; build_parser();"
            "import dtr.cli.sweep, dtr.cli.plot;"
            "heavy = [m for m in ('torch', 'matplotlib', 'numpy', 'scipy', 'concurrent.futures.process')"
            " if m in sys.modules]; print(json.dumps(heavy))")
    res = subprocess.run([sys.executable, "-c", "import json;" + code], capture_output=True, text=True, check=True)
    assert json.loads(res.stdout) == []
