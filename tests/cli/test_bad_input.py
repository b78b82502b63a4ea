"""dtr-sim on bad input: each error says what was wrong and how to fix it, exits 2, and shows no traceback.

One test (or table) per kind of input: time limits, option pairs that do not
go together, thrash-limit stops, unreadable log paths (devices, logs too
large for memory), outputs that cannot be written, impossible budgets,
budget ratios and the model options of ``dtr-sim record``.
"""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading

import pytest

from dtr.cli import main
from dtr.sim.chain import chain_log


def run(capsys, *argv):
    """``main(argv)``'s status, stdout and stderr; argparse's own errors (SystemExit) give their code."""
    try:
        status = main([str(a) for a in argv])
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def error_line(err: str) -> str:
    """The one ``error:`` line of stderr (argparse prints its usage first)."""
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# --- time limits -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0", "soon"])
@pytest.mark.parametrize("argv", [
    ["replay", "{small}", "--budget", "35", "--plan", "checkmate", "--plan-time-limit"],
    ["compare", "{small}", "--budget", "35", "--time-limit"],
])
def test_every_time_limit_is_a_finite_number_of_seconds(capsys, data_dir, argv, value):
    argv = [a.format(small=data_dir / "small.jsonl") for a in argv]
    status, out, err = run(capsys, *argv, value)
    line = error_line(err)
    assert status == 2 and out == "" and argv[-1] in line, err
    assert ("finite number of seconds > 0" if value != "soon" else "not a number") in line, err


def test_the_planning_library_refuses_an_infinite_time_limit(data_dir):
    from dtr.sim.step_plan import make_step_plan
    with pytest.raises(ValueError, match="finite number of seconds > 0"):
        make_step_plan(data_dir / "small.jsonl", 35, "checkmate", time_limit=float("inf"))


# --- options that need another ------------------------------------------------------------------------------


def test_save_plan_needs_a_planner(capsys, data_dir, tmp_path):
    small, saved = data_dir / "small.jsonl", tmp_path / "plan.json"
    status, out, err = run(capsys, "replay", small, "--budget", "35", "--save-plan", saved)
    assert status == 2 and out == "" and "--save-plan needs --plan PLANNER" in error_line(err)
    assert not saved.exists()
    # With a plan file, nothing is planned either, so nothing could be saved.
    assert run(capsys, "replay", small, "--budget", "35", "--plan", "lookahead", "--save-plan", saved)[0] == 0
    status, _, err = run(capsys, "replay", small, "--budget", "35", "--plan", saved, "--save-plan", tmp_path / "b")
    assert status == 2 and "is a plan file" in error_line(err)


@pytest.mark.parametrize("figure,what", [("overhead.pdf", "unknown figure format 'pdf'"),
                                         ("missing/overhead.png", "does not exist")])
def test_compare_checks_its_figure_before_running_the_planners(capsys, monkeypatch, data_dir, tmp_path, figure,
                                                               what):
    import dtr.sim.compare

    def planners_ran(*args, **kwargs):
        raise AssertionError("the planners ran before --plot was checked")

    monkeypatch.setattr(dtr.sim.compare, "compare", planners_ran)
    status, out, err = run(capsys, "compare", data_dir / "small.jsonl", "--budgets", "0.8:1:0.1",
                           "--plot", tmp_path / figure)
    assert status == 2 and out == "" and what in error_line(err)


# --- which thrash limit stopped a replay -------------------------------------------------------------------


def test_a_thrash_stop_by_count_says_so(capsys, tmp_path):
    # Ops that cost nothing: the compute allowance never runs out, the count one does.
    path = tmp_path / "free.jsonl"
    path.write_text(chain_log(64, cost=0))
    status, out, _ = run(capsys, "replay", path, "--budget", "16", "--heuristic", "lru", "--thrash-limit", "1.5")
    stopped = next(ln for ln in out.splitlines() if ln.startswith("stopped"))
    assert status == 0 and "status         thrash" in out
    assert "65 recomputations, more than (1.5 - 1) x the log's 129 ops" in stopped, stopped
    assert "recomputed" not in stopped and "total compute" not in stopped, stopped


def test_a_thrash_stop_by_compute_says_so(capsys, data_dir, tmp_path):
    # One dear op (10 of 24 ns) recomputed once: past 0.3 x the compute, within 0.3 x the 5 ops (1).
    path = tmp_path / "dear.jsonl"
    path.write_text((data_dir / "small.jsonl").read_text().replace('"cost": 1}', '"cost": 10}'))
    status, out, _ = run(capsys, "replay", path, "--budget", "35", "--heuristic", "lru", "--thrash-limit", "1.3")
    stopped = next(ln for ln in out.splitlines() if ln.startswith("stopped"))
    assert status == 0 and "recomputed 10 ns, more than (1.3 - 1) x the log's 24 ns" in stopped, stopped
    assert "recomputations, more than" not in stopped, stopped


# --- log paths that are not logs ---------------------------------------------------------------------------


def test_a_device_is_not_a_log(capsys):
    if not os.path.exists("/dev/null"):
        pytest.skip("no /dev/null")
    status, out, err = run(capsys, "replay", "/dev/null")
    assert status == 2 and out == ""
    assert "/dev/null: not a log file: this is a character device" in error_line(err)


def test_an_endless_device_is_refused_before_it_is_read():
    # Read whole, /dev/zero fills memory: under a 2 GiB address-space cap that was a MemoryError traceback.
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30));"
            "from dtr.cli import main; sys.exit(main(['replay', '/dev/zero', '--budget', '10']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "/dev/zero: not a log file" in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/full"])
@pytest.mark.parametrize("argv,what", [
    (["sweep", "{small}", "--out", "{dev}", "--budgets", "0.5", "--jobs", "1"], "not a sweep CSV"),
    (["plot", "{dev}", "-o", "{tmp}/x.png"], "not a sweep CSV"),
    (["replay", "{small}", "--budget", "35", "--plan", "{dev}"], "not a plan file"),
])
def test_a_csv_or_plan_that_is_an_endless_device_is_refused(data_dir, tmp_path, argv, what, device):
    # Read whole as a log is: sweep's --out, plot's CSV and a plan file on /dev/zero grew memory without end.
    if not os.path.exists(device):
        pytest.skip(f"no {device}")
    argv = [a.format(small=data_dir / "small.jsonl", dev=device, tmp=tmp_path) for a in argv]
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30));"
            f"from dtr.cli import main; sys.exit(main({argv!r}))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert f"{device}: {what}: this is a character device" in error_line(p.stderr)


def test_a_pipe_is_still_a_log(capsys, data_dir, tmp_path):
    fifo = tmp_path / "log.pipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes((data_dir / "small.jsonl").read_bytes()))
    writer.start()
    status, out, _ = run(capsys, "replay", fifo, "--budget", "35", "--json")
    writer.join()
    assert status == 0 and json.loads(out)["remats"] == 1


@pytest.mark.parametrize("where", ["read", "decompress"])
def test_a_log_too_large_for_memory_names_the_file(capsys, monkeypatch, tmp_path, data_dir, where):
    import dtr.sim.logs

    def out_of_memory(*args, **kwargs):
        raise MemoryError()

    path = tmp_path / "big.jsonl.gz"
    path.write_bytes(gzip.compress((data_dir / "small.jsonl").read_bytes()))
    if where == "decompress":  # (a gzip bomb)
        monkeypatch.setattr(dtr.sim.logs.gzip, "decompress", out_of_memory)
    else:
        monkeypatch.setattr(dtr.sim.logs, "open", _Unreadable, raising=False)
    status, out, err = run(capsys, "replay", path)
    line = error_line(err)
    assert status == 2 and out == "" and f"{path}: the log does not fit in memory" in line, err


class _Unreadable:
    """A log file whose read runs out of memory (a log larger than memory)."""

    def __init__(self, path, mode="rb"):
        self._f = open(path, mode)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()
        return False

    def fileno(self):
        return self._f.fileno()

    def read(self):
        raise MemoryError()


# --- outputs that cannot be written, budgets that cannot be met, ratios that are not numbers ----------------


def test_a_failed_write_names_the_file(capsys, data_dir):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    status, out, err = run(capsys, "export", data_dir / "small.jsonl", "-o", "/dev/full")
    assert status == 2 and out == "" and "/dev/full: No space left on device" in error_line(err)


def test_export_at_an_impossible_budget_says_what_is_needed(capsys, data_dir, tmp_path):
    status, out, err = run(capsys, "export", data_dir / "small.jsonl", "--budget", "30", "-o", tmp_path / "s.json")
    line = error_line(err)
    assert status == 2 and out == "" and "at least 35 bytes" in line and "--budget to at least 35" in line, err
    assert "log line 9" in line, err
    status, _, err = run(capsys, "export", data_dir / "small.jsonl", "--budget", "35", "--thrash-limit", "1",
                         "-o", tmp_path / "s.json")
    assert status == 2 and "--thrash-limit 1" in error_line(err)


@pytest.mark.parametrize("ratios,what", [("0.2,1e400", "'1e400' is not finite (too large for a float)"),
                                         ("0.2,nan", "'nan' is not finite (not a number)"),
                                         ("0.2,-1", "'-1' is not > 0")])
def test_sweep_ratios_say_what_is_wrong(capsys, data_dir, tmp_path, ratios, what):
    status, _, err = run(capsys, "sweep", data_dir / "small.jsonl", "--budgets", ratios, "--out", tmp_path / "s.csv")
    assert status == 2 and what in error_line(err)


# --- dtr-sim record's model options ------------------------------------------------------------------------


@pytest.mark.parametrize("option,what", [
    ("seq_len=-5", "bad option for gpt: seq_len must be a whole number >= 1 (got -5)"),
    ("d_model=0", "bad option for gpt: d_model must be a whole number >= 1 (got 0)"),
    ("n_layers=-1", "bad option for gpt: n_layers must be a whole number >= 1 (got -1)"),
    ("n_layers=2.5", "bad option for gpt: n_layers must be a whole number >= 1 (got 2.5)"),
    ("dropout=1.5", "bad option for gpt: dropout is a probability: from 0 to 1 (got 1.5)"),
    ("depth=40", "bad option for gpt: no option 'depth' (its options: vocab_size, d_model, n_layers, n_heads, "
                 "seq_len, dropout)"),
    ("seed=3", "--seed"),
    ("d_model=130", "bad option for gpt (d_model=130): d_model (130) must be a multiple of n_heads (4)"),
])
def test_record_options_name_the_option_and_what_it_takes(capsys, tmp_path, option, what):
    pytest.importorskip("torch")
    out_log = tmp_path / "gpt.jsonl"
    status, out, err = run(capsys, "record", "gpt", "-o", out_log, "--batch", "1", "--set", option)
    assert status == 2 and out == "" and what in error_line(err), err
    assert not out_log.exists()
