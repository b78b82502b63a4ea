"""Fuzzing the log readers and ``dtr-sim``: bad input ends in exit status 0 or 2, never worse.

Seeded mutations of the committed logs (logs/*.jsonl.gz, prefixes of them to
stay fast) and of the hand-made logs in tests/data: truncations, byte flips,
huge, negative and fractional numbers, BOMs, swapped, missing and mistyped
fields, duplicated and unknown ids, binary garbage, gzip truncation. Each case
runs ``dtr-sim`` in-process through ``main(argv)`` and must end with status 0
(then the figures are checked against what the log says) or 2 with one line on
stderr that names the file, and the line when the content is at fault. A few
cases run as real processes, with a timeout, to rule out crashes and hangs at
the process level. Regression tests for each escape found in issue 15 (item 8)
follow the fuzzer.
"""
from __future__ import annotations

import faulthandler
import gzip
import json
import os
import pathlib
import random
import re
import subprocess
import sys

import pytest
from support.paths import DATA, LOGS, ROOT

from dtr.cli import main
from dtr.core import ReplayStatus
from dtr.errors import LogFormatError
from dtr.sim.logs import read_log

# A fixed, seeded set of cases in CI; DTR_FUZZ_CASES / DTR_FUZZ_SEED explore further.
CASES = int(os.environ.get("DTR_FUZZ_CASES", 1000))   # in-process replay cases (about 10 s)
OTHER_CASES = CASES // 8                               # sweep / export / compare on the same logs
PROCESS_CASES = 6                                      # also run as real processes
SEED = int(os.environ.get("DTR_FUZZ_SEED", 20261125))

NUMBERS = [b"-1", b"-0", b"0", b"1.5", b"1e400", b"-1e400", b"9223372036854775807", b"9223372036854775808",
           b"18446744073709551616", b"4503599627370497", b"4503599627370496", b"1e308", b"1e-320",
           b"123456789012345678901234567890", b"007", b"1.", b".5", b"1e", b"0x10", b"NaN", b"Infinity"]
VALUES = [b"null", b"true", b"[]", b"{}", b'""', b'"x"', b"[1]", b'["x", "x"]', b'[null]', b"-3", b'"\\ud800"',
          b'"\\u0000\\n"', b'"\xff"', b"[[[[[[[[[[]]]]]]]]]]"]
GARBAGE = [b"\xef\xbb\xbf", b"\x00", b"\xff\xfe", b"\x1f\x8b\x08", b"\xc3", b"\xe2\x82", b"\r", b"\t",
           b"}", b"{", b'"', b"\\", b"\n", b"\xed\xa0\x80"]
FIELD = re.compile(rb'"([A-Za-z_]+)"\s*:\s*')


@pytest.fixture(autouse=True)
def _no_hang():
    """A hang (a loop that never ends, in Python or C++) fails the run instead of stalling CI."""
    faulthandler.dump_traceback_later(240, exit=True, file=sys.__stderr__)
    yield
    faulthandler.cancel_dump_traceback_later()


def _source_logs():
    """(name, lines) of every log to mutate: the small hand-made ones whole, prefixes of the committed ones."""
    out = []
    for p in sorted(DATA.glob("*.jsonl")) + sorted(DATA.glob("*.simrd.log")):
        out.append((p.name, p.read_bytes().splitlines(keepends=True)))
    for p in sorted(LOGS.glob("*.jsonl.gz")):
        lines = gzip.decompress(p.read_bytes()).splitlines(keepends=True)
        out.append((p.name, lines[:400]))
    return out


def _value_span(line: bytes, rng: random.Random):
    """(start, end) of the value of a random field of a JSON line, or None."""
    fields = list(FIELD.finditer(line))
    if not fields:
        return None
    m = rng.choice(fields)
    start = m.end()
    depth, k, in_str = 0, start, False
    while k < len(line):
        c = line[k:k + 1]
        if in_str:
            if c == b"\\":
                k += 1
            elif c == b'"':
                in_str = False
                if depth == 0:
                    return start, k + 1
        elif c == b'"':
            in_str = True
        elif c in b"[{":
            depth += 1
        elif c in b"]}":
            if depth == 0:
                return start, k
            depth -= 1
            if depth == 0:
                return start, k + 1
        elif c == b"," and depth == 0:
            return start, k
        k += 1
    return start, len(line)


def _mutate(lines, rng: random.Random):
    """One random mutation of a log's lines: (bytes to write, whether to gzip, what was done)."""
    lines = list(lines)
    kind = rng.choice(["truncate", "flip", "number", "value", "bom", "swap_values", "drop_field", "dup_line",
                       "unknown_id", "drop_line", "swap_lines", "garbage", "gzip_truncate", "empty", "nesting",
                       "huge_sizes", "rename_field"])
    gz = rng.random() < 0.3
    i = rng.randrange(len(lines))
    line = lines[i]
    if kind == "truncate":
        data = b"".join(lines)
        return data[:rng.randrange(len(data) + 1)], gz, kind
    if kind == "flip":
        data = bytearray(b"".join(lines))
        for _ in range(rng.randint(1, 4)):
            k = rng.randrange(len(data))
            data[k] ^= 1 << rng.randrange(8)
        return bytes(data), gz, kind
    if kind in ("number", "value", "huge_sizes"):
        span = _value_span(line, rng)
        if span:
            new = rng.choice(NUMBERS if kind != "value" else VALUES)
            if kind == "huge_sizes":  # many sizes just under the per-tensor bound: totals must not overflow
                new = b"4503599627370496"
                lines = [re.sub(rb'("size"\s*:\s*)[0-9]+', rb"\g<1>" + new, ln) for ln in lines]
                lines = [re.sub(rb'("sizes"\s*:\s*\[)[0-9]+', rb"\g<1>" + new, ln) for ln in lines]
                lines = [re.sub(rb'("MEMORY"\s*:\s*")[0-9]+', rb"\g<1>" + new, ln) for ln in lines]
                lines *= rng.choice([1, 3])
            else:
                lines[i] = line[:span[0]] + new + line[span[1]:]
    elif kind == "bom":
        lines[0] = b"\xef\xbb\xbf" + lines[0]
    elif kind == "swap_values":
        a, b = _value_span(line, rng), _value_span(line, rng)
        if a and b and a != b:
            (a, b) = sorted((a, b))
            if a[1] <= b[0]:
                lines[i] = line[:a[0]] + line[b[0]:b[1]] + line[a[1]:b[0]] + line[a[0]:a[1]] + line[b[1]:]
    elif kind == "drop_field":
        fields = list(FIELD.finditer(line))
        span = _value_span(line, rng)
        if fields and span:
            m = [f for f in fields if f.end() == span[0]][0]
            lines[i] = line[:m.start()] + line[span[1]:].lstrip(b", ")
    elif kind == "rename_field":
        fields = list(FIELD.finditer(line))
        if fields:
            m = rng.choice(fields)
            lines[i] = line[:m.start(1)] + rng.choice([b"ID", b"x", b"op", b"id", b"size"]) + line[m.end(1):]
    elif kind == "dup_line":
        lines.insert(rng.randrange(len(lines) + 1), line)
    elif kind == "unknown_id":
        ids = re.findall(rb'"([a-zA-Z_][^"]{0,20})"', line)
        if ids:
            old = rng.choice(ids)
            lines[i] = line.replace(b'"' + old + b'"', rng.choice([b'"nope"', b'"' + old + b'x"']), 1)
    elif kind == "drop_line":
        del lines[i]
    elif kind == "swap_lines":
        j = rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    elif kind == "garbage":
        k = rng.randrange(len(line) + 1)
        lines[i] = line[:k] + b"".join(rng.choice(GARBAGE) for _ in range(rng.randint(1, 3))) + line[k:]
    elif kind == "gzip_truncate":
        data = gzip.compress(b"".join(lines))
        return data[:rng.randrange(2, len(data))], False, kind
    elif kind == "empty":
        return rng.choice([b"", b"\n\n", b"   \n\t\n", b"\xef\xbb\xbf"]), gz, kind
    elif kind == "nesting":
        lines[i] = b'{"op": "constant", "id": ' + b"[" * 200 + b"]" * 200 + b', "size": 1}\n'
    return b"".join(lines), gz, kind


def _run(capsys, argv):
    status = main([os.fspath(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def _check_error(err: str, path: pathlib.Path, at_line: bool):
    """An exit status 2 message: one line, names the file (and a line, when the content is at fault)."""
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    assert "Traceback" not in err
    assert err.startswith(f"dtr-sim: error: {path}"), err
    if at_line:
        assert re.match(rf"dtr-sim: error: {re.escape(str(path))}:[0-9]+: ", err), err


def _check_figures(d: dict, path: pathlib.Path):
    """The figures of a successful replay agree with what the log itself says (exact integers)."""
    log = read_log(path)
    constants = sum(r.sizes[0] for r in log.records() if r.kind == "constant")
    biggest = max([s for r in log.records() for s, a in zip(r.sizes, r.aliases or [None] * len(r.sizes))
                   if a is None] + [0])
    assert 0 <= d["constant_bytes"] <= constants
    assert biggest <= d["baseline_peak_bytes"] < 2**63
    if not log.meta.get("free_dead_constants"):  # then every constant stays resident to the end
        assert constants <= d["baseline_peak_bytes"]
        if d["status"] == ReplayStatus.OK:
            assert d["constant_bytes"] == constants
    assert 0 <= d["peak_bytes"] < 2**63
    for k in ("base_compute", "total_compute", "remat_compute", "overhead"):
        assert d[k] >= 0 and d[k] < float("inf"), (k, d[k])


def _cases():
    rng = random.Random(SEED)
    sources = _source_logs()
    for n in range(CASES):
        name, lines = sources[n % len(sources)]
        data, gz, kind = _mutate(lines, rng)
        yield n, name, (gzip.compress(data) if gz else data), kind, rng.random()


@pytest.mark.slow
def test_fuzz_replay_in_process(capsys, tmp_path):
    """Every mutated log replays (status 0, figures consistent) or fails cleanly (status 2, one line)."""
    kinds = {}
    for n, name, data, kind, r in _cases():
        path = tmp_path / f"case{n}-{name}"
        path.write_bytes(data)
        argv = ["replay", path, "--json"]
        if r < 0.4:
            argv += ["--budget", "50%", "--heuristic", ["eqclass", "dtr", "lru", "random"][n % 4]]
        status, out, err = _run(capsys, argv)
        assert status in (0, 2), (n, kind, status, err)
        kinds.setdefault(kind, [0, 0])[status // 2] += 1
        if status == 2:
            raw = gzip.decompress(data) if data[:2] == b"\x1f\x8b" and kind != "gzip_truncate" else data
            content = raw.replace(b"\xef\xbb\xbf", b"", 1).strip() != b"" and kind != "gzip_truncate"
            _check_error(err, path, at_line=content)
        else:
            assert err == ""
            _check_figures(json.loads(out), path)
    print({k: tuple(v) for k, v in sorted(kinds.items())})
    # the mutations do reach both outcomes (the fuzzer is not testing only its own noise)
    assert sum(v[0] for v in kinds.values()) > CASES // 10 and sum(v[1] for v in kinds.values()) > CASES // 3


def test_fuzz_other_commands_in_process(capsys, tmp_path):
    """sweep, export and compare read the same mutated logs: status 0 or 2, one line."""
    for n, name, data, kind, _ in list(_cases())[:OTHER_CASES]:
        path = tmp_path / f"case{n}-{name}"
        path.write_bytes(data)
        cmd = n % 3
        if cmd == 0:
            argv = ["sweep", path, "--heuristic", "lru", "--budgets", "0.5", "--jobs", "1",
                    "--out", tmp_path / f"sweep{n}.csv"]
        elif cmd == 1:
            argv = ["export", path, "--budget", "60%", "-o", tmp_path / f"sched{n}.json", "--json"]
        else:
            argv = ["compare", path, "--budget", "80%", "--planners", "chen", "--heuristics", "lru",
                    "--time-limit", "5", "--json"]
        status, out, err = _run(capsys, argv)
        assert status in (0, 2), (n, kind, argv[0], status, err)
        if status == 2:
            assert err.count("\n") == 1 and err.startswith("dtr-sim: error: ") and "Traceback" not in err, err


def test_fuzz_as_processes(tmp_path):
    """A few mutated logs replayed by real processes: no traceback, no crash (signal), no hang."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    rng = random.Random(SEED + 1)
    picked = rng.sample(list(_cases()), PROCESS_CASES)
    for n, name, data, kind, _ in picked:
        path = tmp_path / f"proc{n}-{name}"
        path.write_bytes(data)
        p = subprocess.run([sys.executable, "-m", "dtr.cli", "replay", str(path), "--budget", "40%"],
                           capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode in (0, 2), (n, kind, p.returncode, p.stderr)
        assert "Traceback" not in p.stderr
        if p.returncode == 2:
            assert p.stderr.count("\n") == 1 and p.stderr.startswith(f"dtr-sim: error: {path}"), p.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"op": "constant", "id": "a", "size": 9223372036854775808}\n')
    for argv in (["replay", str(bad)], ["replay", str(DATA / "small.jsonl"), "--budget", "1e400"],
                 ["replay", str(DATA / "small.jsonl"), "--seed", "-1"]):
        p = subprocess.run([sys.executable, "-m", "dtr.cli", *argv], capture_output=True, text=True, env=env,
                           timeout=120)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr


# ---------------------------------------------------------------------------
# Regressions: each escape listed in issue 15, item 8, and its class.

SMALL = DATA / "small.jsonl"


def _one_line_2(capsys, argv, *expect):
    status, out, err = _run(capsys, argv)
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err, (status, err)
    for e in expect:
        assert e in err, err
    return err


def test_a_leading_bom_is_skipped(capsys, tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + SMALL.read_bytes())
    status, out, err = _run(capsys, ["replay", path, "--json", "--budget", "35"])
    _, plain, _ = _run(capsys, ["replay", SMALL, "--json", "--budget", "35"])
    assert status == 0 and {**json.loads(out), "log": ""} == {**json.loads(plain), "log": ""}


@pytest.mark.parametrize("garbage,what", [
    (b"\xff\xfe\x00garbage", "not UTF-8"),
    (b'{"op": "constant", "id": "\xc3(", "size": 1}', "not UTF-8"),  # would reach Python as an id
    (b'{"op": "constant", "id": "\xed\xa0\x80", "size": 1}', "not UTF-8"),  # an encoded surrogate
    (b"\xef\xbb\xbf{}", "unexpected character"),  # a BOM is skipped only at the start of the file
])
def test_binary_bytes_name_file_and_line(capsys, tmp_path, garbage, what):
    lines = SMALL.read_bytes().splitlines(keepends=True)
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b"".join(lines[:3]) + garbage + b"\n" + b"".join(lines[3:]))
    _one_line_2(capsys, ["replay", path], f"{path}:4: ", what)


@pytest.mark.parametrize("size", ["9223372036854775808", "18446744073709551616", "1e400", "4503599627370497"])
def test_a_huge_size_names_its_line(capsys, tmp_path, size):
    path = tmp_path / "huge.jsonl"
    path.write_text('{"op": "meta", "version": 1}\n{"op": "constant", "id": "a", "size": %s}\n' % size)
    _one_line_2(capsys, ["replay", path], f"{path}:2: ", "too large")


def test_sizes_summing_past_2_63_are_an_error_not_a_wrong_peak(capsys, tmp_path):
    path = tmp_path / "sum.jsonl"
    size = 2**52  # the largest size one tensor may have; 2048 of them make 2^63
    path.write_text("".join('{"op": "constant", "id": "c%d", "size": %d}\n' % (i, size) for i in range(2100)))
    _one_line_2(capsys, ["replay", path], f"{path}:513: ", "2^61")


def test_one_operator_reading_a_huge_input_many_times(capsys, tmp_path):
    path = tmp_path / "ws.jsonl"
    path.write_text('{"op": "constant", "id": "a", "size": %d}\n' % 2**52 + json.dumps(
        {"op": "call", "name": "f", "inputs": ["a"] * 600, "outputs": ["b"], "sizes": [1], "aliases": [None],
         "cost": 1}) + "\n")
    _one_line_2(capsys, ["replay", path], f"{path}:2: ")


def test_costs_summing_to_infinity_name_the_line(capsys, tmp_path):
    call = {"op": "call", "name": "f", "inputs": [], "sizes": [1], "aliases": [None], "cost": 1e300}
    path = tmp_path / "cost.jsonl"
    path.write_text("".join(json.dumps({**call, "outputs": [f"t{i}"]}) + "\n" for i in range(3)))
    _one_line_2(capsys, ["replay", path], f"{path}:1: ")


@pytest.mark.parametrize("line,what", [
    ('{"op": "meta", "version": 1, "keep_needed": "no"}', "keep_needed"),
    ('{"op": "constant", "id": "a", "size": 1}\n{"op": "release", "id": "a\\tb\\nc\\u0000"}', "unknown id"),
    ('{"op": "constant", "id": "\\ud800", "size": 1}', "surrogate"),
    ('{"op": "constant", "id": "a", "size": 007}', "invalid number"),
    ('{"op": "constant", "id": "a", "size": 1.5}', "whole number"),
    ('{"op": "constant", "id": "a", "size": -1}', "negative"),
    ('{"op": "meta", "version": 1, "cost_unit": "n\\ns"}', "cost_unit"),
])
def test_bad_log_fields_are_one_line_with_file_and_line(capsys, tmp_path, line, what):
    path = tmp_path / "f.jsonl"
    path.write_text(line + "\n")
    _one_line_2(capsys, ["replay", path], f"{path}:", what)
    with pytest.raises(LogFormatError) as e:  # the library's message is one line too, not only the CLI's
        read_log(path)
    assert e.value.line >= 1 and str(e.value).isprintable(), str(e.value)


@pytest.mark.parametrize("argv,what", [
    (["--budget", "1e400"], "too large"),
    (["--budget", "1e19"], "too large"),
    (["--budget", "9223372036854775808"], "too large"),
    (["--budget", "99999999999999999999999%"], "more than the core can hold"),
    (["--budget", "1.5"], "whole number of bytes"),
    (["--budget", "0.4"], "40%"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**64)], "--seed"),
    (["--sample", "99999999999"], "--sample"),
    (["--sample", "-3"], "--sample"),
    (["--thrash-limit", "nan"], "--thrash-limit"),
])
def test_bad_replay_numbers_exit_2_with_one_line(capsys, argv, what):
    try:
        status = main(["replay", str(SMALL), *argv])
    except SystemExit as e:  # argparse's own errors: usage, then one error line
        status = e.code
        err = capsys.readouterr().err
        assert [ln for ln in err.splitlines() if "error:" in ln][0].count(what) == 1, err
    else:
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and what in err, err
    assert status == 2 and "Traceback" not in err


@pytest.mark.parametrize("argv,what", [
    (["compare", str(SMALL), "--budgets", "1:inf:1"], "finite"),
    (["compare", str(SMALL), "--budgets", "1e-300:1:1e-300"], "budgets"),
    (["compare", str(SMALL), "--budget", "50%", "--time-limit", "inf"], "--time-limit"),
    (["compare", str(SMALL), "--budget", "50%", "--seed", "-1"], "--seed"),
    (["sweep", str(SMALL), "--budgets", "1e300", "--out", "{tmp}/s.csv"], "more than the core can hold"),
    (["chain", "--n", "99999999999", "--budget", "sqrt"], "at most"),
    (["chain", "--n", "8", "--budget", "99999999999999999999999"], "out of range"),
    (["chain", "--n", "8", "--budget", "\u00b2"], "unknown chain budget"),
    (["export", str(SMALL), "-o", "{tmp}/missing/x.json"], "No such file"),
    (["replay", "{tmp}"], "Is a directory"),
])
def test_bad_arguments_of_other_commands_exit_2(capsys, tmp_path, argv, what):
    argv = [a.format(tmp=tmp_path) for a in argv]
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err and what in err, err
    assert len([ln for ln in err.splitlines() if "error:" in ln]) == 1, err


def test_a_nan_in_a_sweep_csv_names_its_line(capsys, tmp_path):
    out = tmp_path / "s.csv"
    assert _run(capsys, ["sweep", SMALL, "--heuristic", "lru", "--budgets", "0.5", "--jobs", "1", "--out", out])[0] == 0
    text = out.read_text().splitlines()
    head = text[0].split(",")
    row = text[1].split(",")
    row[head.index("overhead")] = "nan"
    out.write_text("\n".join([text[0], ",".join(row)]) + "\n")
    _one_line_2(capsys, ["plot", out, "-o", tmp_path / "f.png"], f"{out}:2: ", "overhead")
