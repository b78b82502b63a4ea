"""The dtr-sim command line: output, exit status and error paths."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from dtr.cli import main


def run(capsys, *argv):
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_replay_json_has_the_contract_fields(capsys, data_dir):
    status, out, err = run(capsys, "replay", data_dir / "small.jsonl", "--budget", "35", "--json")
    assert status == 0 and err == ""
    d = json.loads(out)
    for key in ("heuristic", "budget_bytes", "baseline_peak_bytes", "peak_bytes", "base_compute", "total_compute",
                "overhead", "evictions", "remats", "storage_accesses", "status"):
        assert key in d
    assert (d["heuristic"], d["budget_bytes"], d["status"], d["remats"]) == ("eqclass", 35, "ok", 1)


def test_replay_summary_is_readable(capsys, data_dir):
    status, out, _ = run(capsys, "replay", data_dir / "small.jsonl", "--budget", "30")
    assert status == 0
    assert "status         oom" in out and "needed" in out and "35 B" in out


@pytest.mark.parametrize("budget,expected", [("1KiB", 1024), ("1KB", 1000), ("100%", 45), ("50%", 22), ("64", 64)])
def test_budget_units(capsys, data_dir, budget, expected):
    status, out, _ = run(capsys, "replay", data_dir / "small.jsonl", "--budget", budget, "--json")
    assert status == 0 and json.loads(out)["budget_bytes"] == expected


def test_no_budget_is_the_baseline(capsys, data_dir):
    _, out, _ = run(capsys, "replay", data_dir / "small.jsonl", "--json")
    d = json.loads(out)
    assert d["budget_bytes"] is None and d["peak_bytes"] == d["baseline_peak_bytes"] == 45


def test_chain_sqrt_budget(capsys):
    status, out, _ = run(capsys, "chain", "--n", "64", "--budget", "sqrt", "--heuristic", "dtr", "--json")
    d = json.loads(out)
    assert status == 0 and d["status"] == "ok" and d["budget_bytes"] == 16
    assert d["base_compute"] == 2 * 64 + 1
    assert 0 < d["extra_compute"] <= 1.1 * 64
    assert d["extra_compute"] == d["total_compute"] - d["base_compute"]


def test_chain_unlimited_budget_needs_no_recomputation(capsys):
    _, out, _ = run(capsys, "chain", "--n", "10", "--budget", "1000", "--json")
    d = json.loads(out)
    assert (d["status"], d["extra_compute"], d["evictions"]) == ("ok", 0, 0)


def test_thrash_stops_at_the_limit(capsys):
    status, out, _ = run(capsys, "chain", "--n", "256", "--budget", "log", "--heuristic", "lru",
                         "--thrash-limit", "1.5", "--json")
    d = json.loads(out)
    assert status == 0 and d["status"] == "thrash"
    # Stopped as soon as rematerialization passed 0.5x base: just past it.
    assert d["remat_compute"] > 0.5 * d["base_compute"]
    assert d["remat_compute"] <= 0.5 * d["base_compute"] + 1


def test_oom_reports_the_need(capsys):
    status, out, _ = run(capsys, "chain", "--n", "16", "--budget", "2", "--json")
    d = json.loads(out)
    assert status == 0 and d["status"] == "oom" and d["needed_bytes"] == 3


_F_OF_A = ('{"op": "constant", "id": "a", "size": 1}\n'
           '{"op": "call", "name": "f", "inputs": ["a"], "outputs": ["b"], "sizes": [4], "aliases": [null], '
           '"cost": 1}\n')
_SIMRD_X = ('{"INSTRUCTION": "CONSTANT", "NAME": "w"}\n{"INSTRUCTION": "MEMORY", "NAME": "w", "MEMORY": "1"}\n'
            '{"INSTRUCTION": "CALL", "NAME": "f", "ARGS": ["w"], "RESULT": ["x"], "TIME": "1"}\n'
            '{"INSTRUCTION": "MEMORY", "NAME": "x", "MEMORY": "4"}\n'
            '{"INSTRUCTION": "ALIAS", "NAME": "x", "ALIAS": "-1"}\n')

BAD_LINES = [
    ('{"op": "constant", "id": "a", "size": 1}\n{"op": "call", "name": "f"', 2, "invalid JSON"),
    ('{"op": "constant", "id": "a", "size": 1}\n{"op": "release", "id": "zz"}\n', 2, "unknown id 'zz'"),
    ('{"op": "constant", "id": "a", "size": -4}\n', 1, "negative"),
    ('{"op": "constant", "id": "a"}\n', 1, "missing field 'size'"),
    ('{"op": "constant", "id": "a", "size": 1}\n{"op": "call", "name": "f", "inputs": ["a"], "outputs": ["b"], '
     '"sizes": [1, 2], "aliases": [null], "cost": 1}\n', 2, "one size per output"),
    ('{"op": "constant", "id": "a", "size": 1}\n{"op": "frobnicate"}\n', 2, "unknown op 'frobnicate'"),
    ('{"op": "constant", "id": "a", "size": 1}\n{"op": "constant", "id": "a", "size": 1}\n', 2, "defined twice"),
    ('{"op": "constant", "id": "a", "size": 1}\n{"op": "call", "name": "f", "inputs": ["a"], "outputs": ["b"], '
     '"sizes": [1], "aliases": ["q"], "cost": 1}\n', 2, "not an input"),
    ('{"INSTRUCTION": "CALL", "NAME": "f", "ARGS": [], "RESULT": ["x"], "TIME": "3"}\n'
     '{"INSTRUCTION": "RELEASE", "NAME": "x"}\n', 1, "not followed by the MEMORY"),
    ('{"INSTRUCTION": "CONSTANT", "NAME": "x"}\n{"INSTRUCTION": "MEMORY", "NAME": "x", "MEMORY": "-1"}\n', 2,
     "negative"),
    ('{"INSTRUCTION": "CONSTANT", "NAME": "x"}\n{"INSTRUCTION": "MEMORY", "NAME": "x", "MEMORY": "1"}\n'
     '{"INSTRUCTION": "MUTATE", "NAME": "f_", "ARGS": ["x"], "MUTATE": [3], "TIME": "1"}\n', 3,
     "not an argument index"),
    ('{"INSTRUCTION": "COPY", "DST": "b", "SRC": "nope"}\n', 1, "unknown id 'nope'"),
    ('["not", "an", "object"]\n', 1, "not a dtr log"),
    ('{"op": "meta", "version": 1, "cost_unit": "flop"}\n{"op": "meta", "version": 1, "cost_unit": "ns"}\n', 2,
     "a second 'meta' line (the first is line 1)"),
    ('{"op": "constant", "id": "a", "size": 1}\n{"op": "meta", "version": 1}\n', 2, "must be the log's first line"),
    ('{"op": "constant", "id": "a", "size": "5"}\n', 1, "field 'size' must be a number"),
    ('{"op": "constant", "id": "a", "size": 1}\n{"op": "call", "name": "f", "inputs": ["a"], "outputs": ["b"], '
     '"sizes": [1], "aliases": [null], "cost": "1"}\n', 2, "field 'cost' must be a number"),
    ('{"op": "constant", "id": "a", "size": 1}\n{"op": "call", "name": "f", "inputs": ["a"], "outputs": ["b"], '
     '"sizes": ["1"], "aliases": [null], "cost": 1}\n', 2, "'sizes' must be a list of numbers"),
    # An op writes each input once: one listed twice was released twice (a RuntimeError from the core).
    *[(_F_OF_A + line, 3, f"field '{field}' lists input 'b' twice") for line, field in [
        ('{"op": "mutate", "name": "m", "inputs": ["b"], "mutated": ["b", "b"], "cost": 1}\n', "mutated"),
        ('{"op": "mutate", "name": "m", "inputs": ["b"], "mutated": ["b", "b"], "cost": 1, "inplace": true}\n',
         "mutated"),
        ('{"op": "call", "name": "g", "inputs": ["b"], "outputs": ["c"], "sizes": [1], "aliases": [null], "cost": 1, '
         '"mutated": ["b", "b"]}\n', "mutated"),
    ]],
    *[(_SIMRD_X + '{"INSTRUCTION": "MUTATE", "NAME": "f_", "ARGS": ' + args + ', "TIME": "1"}\n', 6,
       "field 'MUTATE' lists input 'x' twice") for args in ['["x"], "MUTATE": [0, 0]', '["x", "x"], "MUTATE": [0, 1]']],
    ('\n\n', 0, "empty"),
]


@pytest.mark.parametrize("text,line,what", BAD_LINES)
@pytest.mark.parametrize("compress", [False, True])
def test_bad_log_lines_name_file_and_line(capsys, tmp_path, text, line, what, compress):
    path = tmp_path / ("bad.log.gz" if compress else "bad.jsonl")
    path.write_bytes(gzip.compress(text.encode()) if compress else text.encode())
    status, out, err = run(capsys, "replay", path, "--json")
    assert status == 2 and out == ""
    prefix = f"{path}:{line}: " if line else f"{path}: "
    assert prefix in err and what in err, err
    assert "Traceback" not in err


def test_unknown_heuristic_lists_valid_names(capsys, data_dir):
    with pytest.raises(SystemExit) as e:
        main(["replay", str(data_dir / "small.jsonl"), "--heuristic", "belady"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    for name in ("dtr", "eqclass", "local", "lru", "largest", "random"):
        assert name in err


@pytest.mark.parametrize("argv,what", [
    (["replay", "{data}/small.jsonl", "--budget", "lots"], "not a budget"),
    (["replay", "{data}/missing.jsonl"], "cannot read the log"),
    (["chain", "--n", "0", "--budget", "sqrt"], "at least 1"),
    (["chain", "--n", "8", "--budget", "cube"], "unknown chain budget"),
])
def test_bad_arguments_exit_2(capsys, data_dir, argv, what):
    status, out, err = run(capsys, *[a.format(data=data_dir) for a in argv])
    assert status == 2 and what in err and "Traceback" not in err


def test_bad_thrash_limit_exit_2(capsys, data_dir):
    with pytest.raises(SystemExit) as e:
        main(["replay", str(data_dir / "small.jsonl"), "--thrash-limit", "0.5"])
    assert e.value.code == 2
    assert "the thrash limit must be a number >= 1" in capsys.readouterr().err  # dtr.semantics' words


def test_console_script_and_module_without_torch(data_dir):
    # `python -m dtr.cli replay` works and imports neither torch nor matplotlib.
    code = ("import sys, runpy; sys.argv = ['dtr-sim', 'replay', %r, '--budget', '35', '--json'];"
            "from dtr.cli import main; rc = main(sys.argv[1:]);"
            "assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules, 'heavy import';"
            "sys.exit(rc)") % str(data_dir / "small.jsonl")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["remats"] == 1
    p = subprocess.run([sys.executable, "-m", "dtr.cli", "chain", "--n", "8", "--budget", "sqrt", "--json"],
                       capture_output=True, text=True)
    assert p.returncode == 0 and json.loads(p.stdout)["status"] == "ok"


def test_subcommands_and_the_budget_option():
    # The documented subcommands, in --help's order; replay, export and compare share one --budget.
    from dtr.cli import COMMANDS, build_parser
    assert [c.name for c in COMMANDS] == ["replay", "chain", "export", "compare", "sweep", "plot", "record"]
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name in ("replay", "export", "compare"):
        budget = next(a for a in sub[name]._actions if a.dest == "budget")
        assert (budget.option_strings, budget.metavar, budget.default) == (["--budget"], "B", None)


def test_dtr_sim_is_library_only():
    # The command line lives in dtr.cli: the simulator's modules never import it.
    code = ("import sys, dtr.sim, dtr.sim.sweep, dtr.sim.compare, dtr.sim.export, dtr.sim.trace;"
            "assert not [m for m in sys.modules if m.startswith('dtr.cli')], 'dtr.cli imported'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_import_dtr_is_light():
    code = ("import sys, dtr;"
            "heavy = [m for m in ('torch', 'matplotlib', 'numpy', 'scipy') if m in sys.modules];"
            "assert not heavy, heavy")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
