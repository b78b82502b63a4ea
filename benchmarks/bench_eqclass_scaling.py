"""Replay time against log length on a chain that keeps every other output alive (issue 15, item 7).

The log: ``t_i = f(t_{i-1})``, unit sizes and costs; every odd output is
released once the next call has read it, every even one stays alive to the end
of the log (so the pool grows with the log, and at 50% of the peak about a
quarter of the outputs are evicted while the rest wait in the pool). The
output condition then brings the evicted outputs back until memory runs out
(status ``oom`` at the end: the kept outputs alone are the whole peak).

For each length the script times, in one run, a Python process that only
``json.loads`` every line and ``dtr-sim replay LOG --budget 50% --json`` with
``eqclass`` and ``lru`` (whole processes: parse, baseline replay, replay).

Usage: python benchmarks/bench_eqclass_scaling.py [--lines 10000,100000,300000,1000000]
       [--rounds 3] [--timeout 600] [--out BENCHMARKS.md] [--figure benchmarks/eqclass_scaling.png]

With --out, the section ``eqclass-scaling`` of that file is replaced
(or appended if missing); the rest of the file is kept.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from report import write_section  # (benchmarks/, this script's directory)

ROOT = pathlib.Path(__file__).resolve().parents[1]
TITLE = "Replay scaling: a chain keeping every other output (eqclass, lru; budget 50%)"
HEURISTICS = ("eqclass", "lru")


def write_log(path: pathlib.Path, lines: int) -> None:
    """The chain log of exactly `lines` lines (meta line included), format v1."""
    dump = json.dumps
    with open(path, "w") as f:
        f.write(dump({"op": "meta", "version": 1, "cost_unit": "unit", "model": "alternating-chain"}) + "\n")
        n, i = 1, 0
        while n < lines:
            f.write(dump({"op": "call", "name": "f", "inputs": [f"t{i - 1}"] if i else [], "outputs": [f"t{i}"],
                          "sizes": [1], "aliases": [None], "cost": 1}) + "\n")
            n += 1
            if i >= 2 and i % 2 == 0 and n < lines:  # t_{i-1} (odd) was just read: release it
                f.write(dump({"op": "release", "id": f"t{i - 1}"}) + "\n")
                n += 1
            i += 1


def timed(argv: list, timeout: float):
    """(seconds, stdout) of a process, or (None, None) past the timeout."""
    t = time.perf_counter()
    try:
        out = subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True, timeout=timeout).stdout
    except subprocess.TimeoutExpired:
        return None, None
    return time.perf_counter() - t, out


def measure(path: pathlib.Path, rounds: int, timeout: float) -> dict:
    py = sys.executable
    loads = [py, "-c", "import json, sys\nfor line in open(sys.argv[1]):\n    json.loads(line)\n", str(path)]
    row = {"loads": [], **{h: [] for h in HEURISTICS}, "json": {}}
    for _ in range(rounds):
        row["loads"].append(timed(loads, timeout)[0])
        for h in HEURISTICS:
            if row[h] and row[h][-1] is None:
                continue  # it timed out once: do not wait again
            dt, out = timed([py, "-m", "dtr.cli", "replay", str(path), "--heuristic", h, "--budget", "50%",
                             "--json"], timeout)
            row[h].append(dt)
            if out:
                row["json"][h] = json.loads(out)
    return row


def med(xs: list):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(t, timeout: float) -> str:
    return f"> {timeout:.0f}" if t is None else f"{t:.2f}"


def section(rows: dict, rounds: int, timeout: float) -> list:
    out = [f"Whole processes, median of {rounds}. Target: a replay takes at most 3x the `json.loads` pass.", "",
           "| lines | json.loads s | eqclass s | eqclass / loads | lru s | lru / loads | eqclass evictions | "
           "eqclass storage accesses / eviction |",
           "|---|---|---|---|---|---|---|---|"]
    for lines, r in rows.items():
        lo, eq, lr = med(r["loads"]), med(r["eqclass"]), med(r["lru"])
        j = r["json"].get("eqclass")
        ev = j["evictions"] if j else None
        acc = f"{j['storage_accesses'] / max(1, j['evictions']):.0f}" if j else "–"
        out.append(f"| {lines} | {fmt(lo, timeout)} | {fmt(eq, timeout)} | "
                   f"{'–' if eq is None else f'{eq / lo:.2f}x'} | {fmt(lr, timeout)} | "
                   f"{'–' if lr is None else f'{lr / lo:.2f}x'} | {ev if ev is not None else '–'} | {acc} |")
    return out + [""]


def figure(rows: dict, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    xs = list(rows)
    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=120)
    loads = [med(rows[x]["loads"]) for x in xs]
    ax.plot(xs, loads, "k--", marker="o", label="json.loads pass")
    ax.plot(xs, [3 * t for t in loads], color="0.6", linestyle=":", label="3x json.loads (target)")
    for h, mark in zip(HEURISTICS, "sd"):
        pts = [(x, med(rows[x][h])) for x in xs if med(rows[x][h]) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=mark, label=f"replay {h}, 50%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("log lines")
    ax.set_ylabel("seconds (whole process)")
    ax.set_title("Replay time vs log length (chain keeping every other output)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", default="10000,100000,300000,1000000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600, help="seconds before a replay is given up")
    ap.add_argument("--out", default=None, help="a Markdown file whose section this replaces (e.g. BENCHMARKS.md)")
    ap.add_argument("--figure", default=None, help="write a log-log figure here (PNG)")
    args = ap.parse_args(argv)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for lines in (int(x) for x in args.lines.split(",")):
            path = pathlib.Path(tmp) / f"chain{lines}.jsonl"
            write_log(path, lines)
            rows[lines] = measure(path, args.rounds, args.timeout)
            print(f"{lines} lines: " + ", ".join(f"{k} {fmt(med(v), args.timeout)} s" for k, v in rows[lines].items()
                                                  if k != "json"), file=sys.stderr)
    text = section(rows, args.rounds, args.timeout)
    print("\n".join(text))
    if args.out:  # (Note [Marked sections] in benchmarks/report.py)
        write_section(args.out, "eqclass-scaling", TITLE, "\n".join(text))
    if args.figure:
        figure(rows, pathlib.Path(args.figure))
    return 0


if __name__ == "__main__":
    sys.exit(main())
