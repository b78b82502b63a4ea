"""Sweep benchmark: one ~20k-line log x 6 heuristics x 19 budget ratios (target: under a minute on 2 cores).

Usage: python benchmarks/bench_sweep.py [--shared ../shared] [--jobs N]

Uses SHARED/simrd-logs/transformer.log.gz (18.6k lines) when present, otherwise
a generated v1 log of about 20k lines (a 5,000-layer chain). Prints the wall
time of the whole sweep (worker start-up, parsing, CSV writing included) with
--jobs workers and with one, and the statuses reached.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import os
import pathlib
import tempfile
import time

from report import write_section  # (benchmarks/, this script's directory)

from dtr.heuristics import heuristic_names
from dtr.sim.chain import chain_log
from dtr.sim.sweep import parse_ratios, sweep

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET_S = 60.0


def count_lines(path: pathlib.Path) -> int:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return sum(1 for _ in f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=pathlib.Path, default=ROOT.parent / "shared")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=None, help="write the report as this Markdown file's section 'sweep'")
    args = ap.parse_args()
    report = []
    with tempfile.TemporaryDirectory() as tmp:
        log = args.shared / "simrd-logs" / "transformer.log.gz"
        if not log.exists():
            log = pathlib.Path(tmp) / "chain-5000.jsonl"
            log.write_text(chain_log(5_000))
        ratios = parse_ratios("0.1:1.0:0.05")
        heuristics = heuristic_names()
        report.append(f"Log: {log.name} ({count_lines(log)} lines); {len(heuristics)} heuristics x {len(ratios)} "
                      f"ratios = {len(heuristics) * len(ratios)} runs; thrash limit 3; load average "
                      f"{os.getloadavg()[0]:.2f} before the run (other processes share the CPUs).")
        print(report[-1])
        for jobs in dict.fromkeys((args.jobs, 1)):
            out = pathlib.Path(tmp) / f"sweep-{jobs}.csv"
            t = time.perf_counter()
            rows = sweep([str(log)], "all", ratios, thrash_limit=3.0, jobs=jobs, out=out)
            wall = time.perf_counter() - t
            statuses = collections.Counter(r.status for r in rows)
            verdict = "OK" if wall < TARGET_S else "OVER TARGET"
            report.append(f"- jobs={jobs}: {len(rows)} rows in {wall:.2f} s wall ({verdict}: target < {TARGET_S:.0f} s); "
                          f"statuses {dict(statuses)}")
            print(report[-1])
    if args.out:  # (Note [Marked sections] in benchmarks/report.py)
        write_section(args.out, "sweep", "Sweeps (dtr-sim sweep, every heuristic)", "\n\n".join(report[:1]) +
                      "\n\n" + "\n".join(report[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
