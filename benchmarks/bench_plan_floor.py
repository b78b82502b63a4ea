"""How fast could a planned step of the CPU GPT be? Every planner's schedule of one recorded step, against
plain PyTorch and per-block checkpointing.

Usage:
    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/bench_plan_floor.py [--fracs 0.215,0.5] [--rounds 5]
        [--time-limit 120] [--out BENCHMARKS.md]

One process, one thread, the GPT of bench_runtime.py. Plain and checkpointed
steps are timed in alternation (``--rounds`` each, after a warm-up step);
C and P are bench_runtime.py's (P from the plain step's RSS high-water mark,
measured here once). For each budget ``C + f * P`` one step runs under
``dtr.budget`` with measured op times, and the next is recorded as a log.
Every planner (``dtr-sim compare``'s, the Checkmate ILP included) schedules
that log at the budget in the program's order of first computations (FastSA
told so: Note [Schedules a step can follow] in dtr.sim.schedule; a schedule
out of that order is no floor, as a step cannot follow it), the one
evaluator checks each schedule, and the
default plan (``plan=True``: ``auto``) is made and replayed as the runtime
would follow it. The report gives each schedule's recomputation (the log's
op times) and what a step would take if it cost plain PyTorch's time plus
that recomputation and nothing else: no step that follows the schedule can be
faster, as the runtime adds its own work. The ILP runs on grouped stages
(its message says how many), so its schedule bounds nothing: the best one
found is only the best one found.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_models  # noqa: E402
from report import write_section  # noqa: E402

import dtr  # noqa: E402
from dtr.sim.compare import compare  # noqa: E402
from dtr.sim.planners import PlanOptions  # noqa: E402
from dtr.sim.step_plan import make_step_plan  # noqa: E402

PLANNERS = ["lookahead", "hierarchical", "fastsa", "checkmate-lp", "checkmate"]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fracs", default="0.215,0.5", help="budgets C + f * P")
    ap.add_argument("--rounds", type=int, default=5, help="timed plain and checkpointed steps, each")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds for each planner per budget")
    ap.add_argument("--out", default=None, help="write the report as a section of this Markdown file")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)

    model, inputs, loss_fn, const = bench_models.training_setup("gpt", bench_models.SIZES["gpt"][0])

    def step(v: str, limit: Optional[int] = None, log: Optional[str] = None) -> float:
        model.zero_grad(set_to_none=False)
        torch.manual_seed(100)
        t = time.perf_counter()
        if v in ("plain", "ckpt"):
            loss_fn(model, *inputs, checkpoint=(v == "ckpt")).backward()
        else:
            with dtr.budget(limit, cost_model="time", log=log):
                loss_fn(model, *inputs).backward()
        return time.perf_counter() - t

    peak = bench_models.plain_peak(lambda: step("plain"))
    step("ckpt")
    times: Dict[str, List[float]] = {"plain": [], "ckpt": []}
    for r in range(a.rounds):
        for v in (("plain", "ckpt") if r % 2 == 0 else ("ckpt", "plain")):
            times[v].append(step(v))
    plain, ckpt = statistics.median(times["plain"]), statistics.median(times["ckpt"])
    lines = [f"One process, one thread, the GPT of bench_runtime.py; C = {const / 2**20:.1f} MiB, P = "
             f"{peak / 2**20:.1f} MiB (the plain step's RSS high-water mark). Plain step {plain:.3f} s, per-block "
             f"checkpointing {ckpt:.3f} s ({ckpt / plain:.2f}× plain), medians of {a.rounds} alternating steps. "
             f"Recomputation in the recorded step's measured op times; *floor*: plain + that recomputation, the "
             f"fastest a step following the schedule could be. Every schedule computes each op first in the "
             f"program's order (FastSA anneals under it). Planner time limit {a.time_limit:g} s.", ""]
    with tempfile.TemporaryDirectory() as tmp:
        for f in [float(x) for x in a.fracs.split(",")]:
            limit = int(const + f * peak)
            step("dtr", limit)
            log = str(pathlib.Path(tmp) / f"gpt-{f}.jsonl")
            step("dtr", limit, log=log)
            rows = compare(log, [limit], PLANNERS, heuristics=["eqclass"],
                           options=PlanOptions(time_limit=a.time_limit, in_order=True))
            plan = make_step_plan(log, limit, "auto", time_limit=30.0)
            lines += [f"**C + {f:g} P = {limit / 2**20:.1f} MiB** (the recorded step's own compute "
                      f"{rows[0].base_compute * 1e-9:.3f} s):", "",
                      "| schedule | status | recomputes s | floor s | floor × plain | floor × checkpointing |",
                      "|---|---|---|---|---|---|"]
            entries = [(r.planner if r.kind == "static" else f"online DTR ({r.planner}, the simulator)", r.status,
                        None if r.total_compute is None or not r.valid and r.kind == "static"
                        else (r.total_compute - r.base_compute) * 1e-9) for r in rows]
            entries.append((f"the default plan followed ({plan.planner})", plan.status,
                            plan.predicted_remat * 1e-9 if plan.ok else None))
            for name, status, remat in entries:
                if remat is None:
                    lines.append(f"| {name} | {status} | – | – | – | – |")
                else:
                    floor = plain + remat
                    lines.append(f"| {name} | {status} | {remat:.3f} | {floor:.3f} | {floor / plain:.2f} | "
                                 f"{floor / ckpt:.2f} |")
            ilp = next((r for r in rows if r.planner == "checkmate"), None)
            if ilp is not None:
                lines += ["", f"Checkmate: {ilp.message[:200]}"]
            lines.append("")
            print("\n".join(lines), flush=True)
    text = "\n".join(lines)
    if a.out:
        write_section(a.out, "plan-floor", "How fast a planned step of the CPU GPT could be", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
