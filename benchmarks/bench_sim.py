"""Simulator benchmark: toy chain, published-log quality, replay speed, eviction choice cost.

Usage: python benchmarks/bench_sim.py [--shared ../shared] [--rounds 7] [--out BENCHMARKS-sim.md]

Prints a Markdown report (and writes it with --out). Ratios are measured in one
run, alternating the variants, and medians are quoted.
"""
from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import subprocess
import sys
import time

from report import write_section  # (benchmarks/, this script's directory)

from dtr.core import Core, ReplayStatus
from dtr.sim import chain_log, parse_text, read_log, replay
from dtr.sim.chain import chain_budget
from dtr.sim.replay import baseline

ROOT = pathlib.Path(__file__).resolve().parents[1]


def chain_section() -> list:
    rows = ["## Toy chain (simrd Algorithm 3, unit sizes and costs)", "",
            "| n | heuristic | extra at ceil(2 sqrt n) | limit 1.1 n | reference simrd | status at ceil(log2 n), thrash limit 50 | extra at log |",
            "|---|---|---|---|---|---|---|"]
    ref = {1024: 988, 4096: 4217}
    for n in (1024, 4096):
        log = parse_text(chain_log(n))
        for h in ("dtr", "eqclass"):
            s = replay(log, h, chain_budget(n, "sqrt"), thrash_limit=50, banish=True)
            lg = replay(log, h, chain_budget(n, "log"), thrash_limit=50, banish=True)
            rows.append(f"| {n} | {h} | {s.total_compute - s.base_compute:.0f} | {1.1 * n:.0f} | {ref[n]} | "
                        f"{lg.status} | {lg.total_compute - lg.base_compute:.0f} |")
    return rows + [""]


def quality_section(shared: pathlib.Path) -> list:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_published_logs import reference_table
    refpath = shared / "simrd-logs" / "REFERENCE.md"
    if not refpath.exists():
        return ["## Published logs", "", "(../shared/simrd-logs not present: skipped)", ""]
    table = reference_table(refpath)
    rows = ["## Published logs: eqclass, thrash limit 2, against the reference simulator", "",
            "| log | ratio | reference | dtr-sim eqclass | dtr-sim dtr |", "|---|---|---|---|---|"]
    worst = 0.0
    for name in ("resnet32", "transformer", "lstm"):
        log = read_log(shared / "simrd-logs" / f"{name}.log.gz")
        peak = baseline(log)["peak_memory"]
        for ratio in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8):
            ref = table.get((name, "eqclass", ratio))
            e = replay(log, "eqclass", int(peak * ratio), thrash_limit=2, baseline_peak=peak)
            d = replay(log, "dtr", int(peak * ratio), thrash_limit=2, baseline_peak=peak)
            if ref and ref[1] == ReplayStatus.OK and e.status == ReplayStatus.OK:
                worst = max(worst, e.overhead / ref[0] - 1)
            refs = f"{ref[0]:.3f} {ref[1]}" if ref else "–"
            rows.append(f"| {name} | {ratio} | {refs} | {e.overhead:.3f} {e.status} | {d.overhead:.3f} {d.status} |")
    rows += ["", f"Largest relative excess over the reference where it succeeded: {100 * worst:.2f}%", ""]
    return rows


def time_process(argv: list) -> float:
    t = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def speed_section(shared: pathlib.Path, rounds: int) -> list:
    lstm = shared / "simrd-logs" / "lstm.log.gz"
    if not lstm.exists():
        return ["## Replay speed", "", "(../shared/simrd-logs not present: skipped)", ""]
    py = sys.executable
    loads = [py, "-c", "import gzip, json, sys\nfor line in gzip.open(sys.argv[1], 'rt'):\n    json.loads(line)\n",
             str(lstm)]
    sim = [py, "-m", "dtr.cli", "replay", str(lstm), "--budget", "50%", "--json"]
    ratios, t_loads, t_sim = [], [], []
    for _ in range(rounds):
        pair = [("loads", loads), ("sim", sim)]
        random.shuffle(pair)
        got = {k: time_process(a) for k, a in pair}
        t_loads.append(got["loads"])
        t_sim.append(got["sim"])
        ratios.append(got["sim"] / got["loads"])
    log = read_log(lstm)
    peak = baseline(log)["peak_memory"]
    in_proc = {"eqclass": [], "dtr": []}
    dtr_ratio = []
    for _ in range(rounds):
        got = {}
        for h in random.sample(["eqclass", "dtr"], 2):
            t = time.perf_counter()
            replay(log, h, int(peak * 0.5), baseline_peak=peak)
            got[h] = time.perf_counter() - t
            in_proc[h].append(got[h])
        dtr_ratio.append(got["dtr"] / got["eqclass"])
    low = {"eqclass": [], "dtr": []}
    for _ in range(3):
        for h in ("eqclass", "dtr"):
            t = time.perf_counter()
            replay(log, h, int(peak * 0.2), baseline_peak=peak)
            low[h].append(time.perf_counter() - t)
    med = statistics.median
    return ["## Replay speed (LSTM log, 48.6k lines, gzip)", "",
            f"Whole process `python -m dtr.cli replay lstm.log.gz --budget 50% --json`: median {med(t_sim):.3f} s; "
            f"a Python process that only `json.loads` every line: median {med(t_loads):.3f} s.",
            f"Median per-round ratio: **{med(ratios):.2f}x** (target <= 3x; {rounds} rounds, shuffled order).", "",
            f"In-process replay at 50%: eqclass median {1000 * med(in_proc['eqclass']):.1f} ms, dtr (exact e*) "
            f"median {1000 * med(in_proc['dtr']):.1f} ms: dtr/eqclass **{med(dtr_ratio):.1f}x** (target <= 10x).",
            f"At 20% (more evictions): eqclass {1000 * med(low['eqclass']):.1f} ms, dtr {1000 * med(low['dtr']):.1f} ms "
            f"({med(low['dtr']) / med(low['eqclass']):.1f}x).", ""]


def pool_section() -> list:
    """Cost of one eviction choice as the pool grows: full scan vs sampling."""
    rows = ["## Eviction choice on large pools (synthetic: a chain of N resident 1-byte storages, then 2000 more links, each evicting one)", "",
            "| pool size | heuristic | full scan, us/eviction | sample=64, us/eviction |", "|---|---|---|---|"]
    for n in (1_000, 10_000, 100_000):
        for h in ("eqclass", "dtr"):
            cols = []
            for sample in (0, 64):
                c = Core(h, budget=None, sample=sample)
                w = c.constant(0)
                last = w
                for i in range(n):  # a chain, so that evicted components form
                    last = c.call([last], [1], [-1], 1.0 + (i % 7))[0]
                c.set_budget(n)  # now full: each new 1-byte output evicts one storage
                k = 2000
                t = time.perf_counter()
                for _ in range(k):
                    last = c.call([last], [1], [-1], 1.0)[0]
                dt = time.perf_counter() - t
                cols.append(f"{1e6 * dt / k:.1f}")
            rows.append(f"| {n} | {h} | {cols[0]} | {cols[1]} |")
    return rows + [""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shared", default=str(ROOT.parent / "shared"))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None, help="write the report as this Markdown file's section 'sim'")
    args = ap.parse_args(argv)
    shared = pathlib.Path(args.shared)
    body = chain_section() + quality_section(shared) + speed_section(shared, args.rounds) + pool_section()
    text = "\n".join(line.replace("## ", "### ", 1) if line.startswith("## ") else line for line in body)
    print(text)
    if args.out:  # (Note [Marked sections] in benchmarks/report.py)
        write_section(args.out, "sim", "The simulator (dtr-sim)", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
