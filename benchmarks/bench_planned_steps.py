"""Planned steps against online DTR: the same budget, steps planned with the future known or decided online.

Usage:
    python benchmarks/bench_planned_steps.py [--rounds 7] [--models gpt,cnn,treelstm,treelstm-new,mlp]
                                             [--fracs 0.5,0.3]
                                             [--out BENCHMARKS.md]

For each model (bench_runtime.py's GPT, CNN and TreeLSTM at their small
sizes; ``treelstm-new``, the TreeLSTM over a new random tree every step, so
that no step matches a plan; and an MLP of Linear-ReLU-Dropout layers) and
each budget
``C + f * P`` (C: what exists before the step, P: dtr's own peak above it
with no limit), two budgets run in one process, one thread:

* ``online``: ``dtr.budget(B)`` entered once per step, as today;
* ``planned``: one ``dtr.budget(B, plan=PlanPolicy(background="inline"))``
  entered once per step; warm-up steps until a plan is followed or three
  steps ran (planning happens at the end of a recorded step, outside the
  timed steps).

With ``--baselines``, each round also runs a plain PyTorch step and one
checkpointed per block (``torch.utils.checkpoint``, the GPT only), and the
report adds the planned steps' median per-round ratios to both. ``--full``
uses bench_runtime.py's full sizes (the CPU GPT of the issue's targets)
rather than its small ones. In one process the variants share the machine's
state round by round, which separate processes (bench_runtime.py) do not.

Then ``--rounds`` rounds, each one step of each variant in a shuffled
order. Reported: median step times, the median of the per-round ratios
planned / online, the recomputation each did (the core's figure, in the cost
model's unit), what the planned steps ran as (planned, diverged, online),
and whether both produced plain PyTorch's gradients bit for bit.
"""
from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_models  # noqa: E402
from report import write_section  # noqa: E402

import dtr  # noqa: E402
from dtr.runtime.step_plans import PlanPolicy  # noqa: E402


def _mlp():
    torch.manual_seed(0)
    layers: List[torch.nn.Module] = []
    for _ in range(6):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1)]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(256, 10))
    x, y = torch.randn(256, 256), torch.randint(0, 10, (256,))
    return model, (x, y), lambda m, x, y, checkpoint=False: torch.nn.functional.cross_entropy(m(x), y)


def _build(name: str, full: bool = False):
    """``(model, inputs, loss_fn, new_step)``: ``new_step(i)`` sets what step ``i`` runs on (the tree)."""
    if name == "mlp":
        return (*_mlp(), lambda i: None)
    torch.manual_seed(0)
    if name != "treelstm-new":
        return (*bench_models.build(name, bench_models.SIZES[name][0 if full else 1]), lambda i: None)
    cfg = bench_models.SIZES["treelstm"][1]
    model, inputs, _ = bench_models.build("treelstm", cfg)
    rng = random.Random(2)
    trees = [bench_models.random_tree(0, cfg["leaves"], rng) for _ in range(64)]
    now = [trees[0]]

    def new_step(i: int) -> None:
        now[0] = trees[i % len(trees)]

    def loss_fn(m, tokens, y, checkpoint=False):
        return torch.nn.functional.cross_entropy(m(now[0], tokens), y)
    return model, inputs, loss_fn, new_step


def run(name: str, frac: float, rounds: int, seed: int, baselines: bool = False,
        full: bool = False) -> Dict[str, object]:
    """One model at one budget: the report's row."""
    model, inputs, loss_fn, new_step = _build(name, full)
    params = list(model.parameters())
    steps = [0]

    def step(ctx=None, checkpoint=False):
        new_step(steps[0])
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100)
        if ctx is None:
            loss = loss_fn(model, *inputs, checkpoint=checkpoint) if checkpoint else loss_fn(model, *inputs)
            loss.backward()
            return None
        with ctx:
            loss = loss_fn(model, *inputs)
            loss.backward()
        return ctx.stats

    wants: Dict[int, List[torch.Tensor]] = {}

    def want() -> List[torch.Tensor]:  # plain PyTorch's gradients for the step about to run (outside the timing)
        if steps[0] not in wants:
            step()
            wants[steps[0]] = [p.grad.clone() for p in params]
        return wants[steps[0]]

    want()
    with dtr.budget(None) as b0:
        step_body = loss_fn(model, *inputs)
        step_body.backward()
    const, peak = b0.stats["memory_bytes"], b0.stats["peak_bytes"]
    limit = int(const + frac * (peak - const))
    planned = dtr.budget(limit, plan=PlanPolicy(background="inline", time_limit=60))
    warm = 0
    while warm < 6:
        warm += 1
        steps[0] += 1
        s = step(planned)
        if s["plan"] == "planned" or (warm >= 3 and not planned.plans):
            break
    variants = ["online", "planned"] + (["plain"] + (["ckpt"] if name == "gpt" else []) if baselines else [])
    times: Dict[str, List[float]] = {v: [] for v in variants}
    stats: Dict[str, List[dict]] = {"online": [], "planned": []}
    exact = {"online": True, "planned": True}
    rng = random.Random(seed)
    for _ in range(rounds):
        steps[0] += 1  # (every variant runs the same step: one tree per round for treelstm-new)
        order = list(variants)
        rng.shuffle(order)
        for v in order:
            w = want()
            ctx = planned if v == "planned" else dtr.budget(limit) if v == "online" else None
            t = time.perf_counter()
            st = step(ctx, checkpoint=v == "ckpt")
            times[v].append(time.perf_counter() - t)
            if v in stats:
                stats[v].append(st)
                exact[v] = exact[v] and all(torch.equal(p.grad, g) for p, g in zip(params, w))
    ratios = [p / o for p, o in zip(times["planned"], times["online"])]
    med = statistics.median
    against = {v: med([p / o for p, o in zip(times["planned"], times[v])]) for v in variants[2:]}
    planned.close()
    return {
        "model": name, "frac": frac, "budget": limit, "online_s": med(times["online"]),
        "planned_s": med(times["planned"]), "ratio": med(ratios), "against": against,
        "baseline_s": {v: med(times[v]) for v in variants[2:]},
        "online_remat": med([s["remat_compute"] for s in stats["online"]]),
        "planned_remat": med([s["remat_compute"] for s in stats["planned"]]),
        "predicted": med([s["predicted_remat"] for s in stats["planned"] if s["predicted_remat"] is not None]
                         or [float("nan")]),
        # measured recomputation time over the plan's prediction at the step's own op speed, planned steps only
        "fidelity": med([s["remat_seconds"] / s["expected_remat_seconds"] for s in stats["planned"]
                         if s.get("expected_remat_seconds")] or [float("nan")]),
        "modes": sorted({s["plan"] for s in stats["planned"]}),
        "planner": next((s["planner"] for s in stats["planned"] if s["planner"]), None),
        "unit": stats["online"][0]["cost_unit"], "exact": exact,
        "why": planned.plan_errors[-1][:160] if planned.plan_errors and not planned.plans else "",
    }


def render(rows: List[dict], rounds: int) -> str:
    lines = [f"One process, one thread, {rounds} shuffled rounds of one step each, after warm-up steps in "
             f"which the planned budget recorded and planned. Recomputation is the core's figure (measured "
             f"op times). Measured / expected: a planned step's recomputation time over the plan's prediction at "
             f"the step's own op speed, with the runtime's own time per recomputation (`expected_remat_seconds`; median of planned steps). Exact: gradients equal plain PyTorch's bit "
             f"for bit, every step.", "",
             "| model | budget | online s | planned s | planned / online (median of rounds) | online remat | "
             "planned remat (predicted) | measured / expected remat s | planned steps ran | planner | exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pred = "–" if r["predicted"] != r["predicted"] else f"{r['predicted']:.3g}"
        lines.append(
            f"| {r['model']} | C + {r['frac']:g} P | {r['online_s']:.4f} | {r['planned_s']:.4f} | "
            f"{r['ratio']:.3f}× | {r['online_remat']:.3g} {r['unit']} | {r['planned_remat']:.3g} ({pred}) | "
            f"{'–' if r['fidelity'] != r['fidelity'] else format(r['fidelity'], '.2f')} | "
            f"{', '.join(r['modes'])} | {r['planner'] or 'none: ' + r['why']} | "
            f"{'yes' if all(r['exact'].values()) else 'NO: ' + str(r['exact'])} |")
    if any(r["against"] for r in rows):
        lines += ["", "Planned steps against plain PyTorch and checkpointing per block, in the same rounds "
                      "(median of per-round ratios):", "",
                  "| model | budget | plain s | checkpointed s | planned / plain | planned / checkpointed |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            a, b = r["against"], r["baseline_s"]
            lines.append(f"| {r['model']} | C + {r['frac']:g} P | {b.get('plain', float('nan')):.4f} | "
                         f"{b.get('ckpt', float('nan')):.4f} | {a.get('plain', float('nan')):.3f}× | "
                         f"{a.get('ckpt', float('nan')):.3f}× |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--models", default="gpt,cnn,treelstm,treelstm-new,mlp")
    ap.add_argument("--fracs", default="0.5,0.3")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baselines", action="store_true", help="also time plain and checkpointed steps")
    ap.add_argument("--full", action="store_true", help="bench_runtime.py's full sizes, not its small ones")
    ap.add_argument("--out", default=None, help="write the report as a section of this Markdown file")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for m in a.models.split(","):
        for f in (float(x) for x in a.fracs.split(",")):
            try:
                rows.append(run(m, f, a.rounds, a.seed, a.baselines, a.full))
            except dtr.DtrError as e:
                print(f"{m} at {f:g}: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr)
                continue
            print(render(rows[-1:], a.rounds).splitlines()[-1], flush=True)
    text = render(rows, a.rounds)
    print(text)
    if a.out:
        section = ("planned-steps-full", "Planned steps of the full-size CPU GPT, in one process") if a.full \
            else ("planned-steps", "Planned steps against online DTR")
        write_section(a.out, section[0], f"{section[1]} (torch {torch.__version__})", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
