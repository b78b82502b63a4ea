"""Benchmark of the static planners against DTR; prints a Markdown report (--out FILE writes it).

    .venv/bin/python benchmarks/bench_planners.py [--out benchmarks/PLANNERS.md] [--quick] [--no-published]
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from dtr.core import ReplayStatus
from dtr.sim import parse_text, read_log
from dtr.sim.chain import chain_log
from dtr.sim.compare import compare
from dtr.sim.graph import graph_from_log, plan_graph
from dtr.sim.planners import PlanOptions, run_planner
from dtr.sim.replay import baseline
from dtr.sim.schedule import evaluate, plan_schedule

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("DTR_SHARED", ROOT.parent / "shared")) / "simrd-logs"


def random_dag_log(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    d = json.dumps
    lines = [d({"op": "meta", "version": 1})]
    for i in range(n):
        ins = [f"x{j}" for j in rng.sample(range(max(0, i - 8), i), k=min(i, rng.randint(1, 2)))] if i else []
        lines.append(d({"op": "call", "name": "f", "inputs": ins, "outputs": [f"x{i}"],
                        "sizes": [rng.randint(1, 8)], "aliases": [None], "cost": rng.randint(1, 9)}))
    for i in range(n - 1):
        lines.append(d({"op": "release", "id": f"x{i}"}))
    return "\n".join(lines) + "\n"


def timed(fn, reps):
    out, ts = None, []
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t)
    return out, statistics.median(ts)


def speed(quick: bool) -> list:
    lines = ["## Speed (medians)", "", "| case | result | median s | target |", "|---|---|---|---|"]
    g = graph_from_log(parse_text(chain_log(1000)))
    pg = plan_graph(g)
    b = math.ceil(2 * math.sqrt(1000))
    r, t = timed(lambda: run_planner("rotor", pg, b), 1 if quick else 3)
    ev = evaluate(g, plan_schedule(pg, r.sequence).steps, b)
    lines.append(f"| rotor, toy chain n=1000 (2001 nodes), budget {b} | {r.status}, cost {ev.total_compute:g} "
                 f"(base {g.base_compute:g}), valid {ev.valid} | {t:.2f} | < 2 s |")
    g = graph_from_log(parse_text(chain_log(1500)))
    pg = plan_graph(g)
    b = math.ceil(2 * math.sqrt(1500)) * 2
    r, t = timed(lambda: run_planner("fastsa", pg, b, PlanOptions(time_limit=20 if quick else 55)), 1)
    ev = evaluate(g, plan_schedule(pg, r.sequence).steps, b) if r.sequence else None
    lines.append(f"| fastsa, toy chain n=1500 ({pg.n} nodes), budget {b} | {r.status} {r.message}"
                 f"{'' if ev is None else f', overhead {ev.overhead:.3f}, valid {ev.valid}'} | {t:.1f} | < 60 s |")
    for name, text in (("toy chain n=49", chain_log(49)), ("random DAG", random_dag_log(100))):
        g = graph_from_log(parse_text(text))
        pg = plan_graph(g)
        peak = baseline(parse_text(text))["peak_memory"]
        b = int(peak * 0.5)
        r = run_planner("checkmate", pg, b, PlanOptions(time_limit=30 if quick else 120))
        ev = evaluate(g, plan_schedule(pg, r.sequence).steps, b) if r.sequence else None
        lines.append(f"| checkmate ILP, {name} ({pg.n} nodes), 50% | {r.status}, gap "
                     f"{'-' if r.gap is None else f'{r.gap:.3g}'}"
                     f"{'' if ev is None else f', overhead {ev.overhead:.3f}'} | {r.solve_seconds:.1f} | "
                     f"limit 120 s |")
    return lines + [""]


def table(title: str, log, planners, limit: float, ratios=(0.5, 0.3)) -> list:
    peak = baseline(log)["peak_memory"]
    budgets = [int(peak * x) for x in ratios]
    rows = compare(log, budgets, planners, heuristics=("eqclass", "dtr"), thrash_limit=2.0, baseline_peak=peak,
                   options=PlanOptions(time_limit=limit))
    lines = [f"### {title}", "", "| budget | planner | status | valid | overhead | peak / budget | s | gap |",
             "|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for b, x in zip(budgets, ratios):
        sub = [r for r in rows if r.budget_bytes == b]
        for r in sub:
            ov = "-" if r.overhead is None else f"{r.overhead:.4f}"
            pk = "-" if r.peak_bytes is None else f"{r.peak_bytes / b:.3f}"
            gap = "-" if r.gap is None else f"{r.gap:.3g}"
            lines.append(f"| {x:.0%} | {r.planner} | {r.status} | {'-' if r.valid is None else r.valid} | {ov} | "
                         f"{pk} | {r.solve_seconds:.2f} | {gap} |")
        static = [r.overhead for r in sub if r.kind == "static" and r.valid]
        for h in ("eqclass", "dtr"):
            d = next(r for r in sub if r.planner == h)
            if static and d.status == ReplayStatus.OK:
                best = min(static)
                ok = (d.overhead - 1) <= 1.2 * (best - 1) + 1e-12
                verdicts.append(f"{x:.0%} {h}: overhead {d.overhead:.4f} vs best static {best:.4f} "
                                f"(extra {d.overhead - 1:.4f} vs {best - 1:.4f}: "
                                f"{'within' if ok else 'NOT within'} 1.2x)")
            elif not static:
                verdicts.append(f"{x:.0%} {h}: {d.status}; no static plan within the budget to compare")
            else:
                verdicts.append(f"{x:.0%} {h}: {d.status} (DTR failed; best static {min(static):.4f})")
    return lines + ["", "Goal (online DTR's extra compute within 1.2x of the best static plan's):", ""] + \
        [f"- {v}" for v in verdicts] + [""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", help="write the report here too")
    ap.add_argument("--quick", action="store_true", help="shorter time limits")
    ap.add_argument("--no-published", action="store_true", help="skip the published simrd logs")
    args = ap.parse_args()
    t0 = time.time()
    lim = 20.0 if args.quick else 60.0
    out = ["# Static planners vs DTR", "",
           f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
           f"{platform.platform()}; date {datetime.date.today().isoformat()}. "
           f"Generated by `benchmarks/bench_planners.py{' --quick' if args.quick else ''}`.", ""]
    out += speed(args.quick)
    out += ["## Per-log comparisons (50% and 30% of each log's peak without eviction)", "",
            "overhead = total compute / base compute through the one evaluator; DTR rows are the simulator's "
            "run exported as a schedule (thrash limit 2). `n/a`: the planner does not apply (Rotor on a "
            "non-chain). The ILP is run only where it is small enough (its node-level model is O(n^2) "
            "variables).", ""]
    all_p = ["chen", "rotor", "checkmate", "checkmate-lp", "fastsa"]
    cases = [("tests/data/small.jsonl", read_log(ROOT / "tests/data/small.jsonl"), all_p),
             ("tests/data/views.jsonl", read_log(ROOT / "tests/data/views.jsonl"), all_p),
             ("toy chain n=32", parse_text(chain_log(32), "<chain 32>"), all_p),
             ("toy chain n=64", parse_text(chain_log(64), "<chain 64>"), ["chen", "rotor", "checkmate-lp", "fastsa"])]
    if not args.no_published and (SHARED / "resnet32.log.gz").exists():
        cases.append(("resnet32 (published)", read_log(SHARED / "resnet32.log.gz"), ["chen", "rotor", "fastsa"]))
        cases.append(("transformer (published)", read_log(SHARED / "transformer.log.gz"), ["chen", "fastsa"]))
    for title, log, planners in cases:
        out += table(title, log, planners, lim)
        print(f"[{time.time() - t0:.0f}s] {title}", file=sys.stderr)
    out.append(f"Total benchmark time {time.time() - t0:.0f} s.")
    text = "\n".join(out) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
