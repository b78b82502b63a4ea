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
