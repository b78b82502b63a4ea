"""Host cost per op: dtr's own work per dispatched op, above a do-nothing TorchDispatchMode.

Usage:
    python benchmarks/bench_host_overhead.py [--rounds 11] [--steps 5] [--blocks 40] [--width 32]
                                            [--out BENCHMARKS.md]

A tiny-op MLP (``--blocks`` Linear+ReLU pairs of ``--width`` features, batch 4,
one thread): its ATen ops take microseconds, so a training step (zero grads,
forward, loss, backward) is nearly all host overhead. Variants:

* ``plain``: no mode; ``nop``: a do-nothing TorchDispatchMode (the floor any
  dispatch-mode tool pays);
* ``track/ref`` and ``track/native``: ``dtr.budget(None)`` on the Python
  reference path and on the native path (dtr._native), both entered as a
  dispatch mode (``entry="mode"``; the CPU's default entry is the key);
* ``track/key`` and ``budget/key``: the same through the dispatch-key entry
  (``entry="key"``: no Python dispatch mode at all, so the third column, above
  plain PyTorch, is its whole cost);
* ``budget/ref`` and ``budget/native``: a budget of the parameters and gradients
  plus half the rest of a tracking run's peak, raised to what the step needs
  at once where that is more (dtr's own accounting: this benchmark is about
  time, not memory; the report gives the budget as a fraction of the peak,
  and the evictions and recomputations of a step), with no thrash limit
  (timed costs of microsecond ops are noisy). At the default batch of 4 the
  MLP's memory is nearly all parameters and gradients: the budget then is
  what the step needs at once and evicts nothing (``--batch 64`` evicts).

Each round runs every variant (``--steps`` steps, one ``with`` per step, as a
training loop would) in a shuffled order; a variant's cost per op is its
median step time divided by the ops per step. The report quotes, per variant,
the median over rounds of (variant - nop) per op, and the median over rounds
of the per-round ratio ref / native.
"""
from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time

import torch
from dispatch_modes import Nop, OpNames  # (benchmarks/, this script's directory)
from report import write_section

import dtr
from dtr.runtime import native as native_path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--steps", type=int, default=5, help="steps per variant per round (the median is kept)")
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the report as a section of this Markdown file")
    ap.add_argument("--section", default="host-cost", help="the section's name in --out (one per install route)")
    ap.add_argument("--label", default="the current install", help="what the section's title calls this run")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    model = torch.nn.Sequential(*[m for _ in range(a.blocks)
                                  for m in (torch.nn.Linear(a.width, a.width), torch.nn.ReLU())])
    x = torch.randn(a.batch, a.width)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()

    counter = OpNames()
    with counter:
        step()
    ops = sum(counter.names.values())
    for _ in range(2):  # (the second block counts the first one's gradients from its start, as a loop does)
        with dtr.budget(None, native=False) as b:
            step()
    peak = b.stats["peak_bytes"]
    held = 2 * sum(p.nbytes for p in model.parameters())  # parameters and their gradients
    limit = [int(held + 0.5 * (peak - held))]
    if not native_path.available():
        print("dtr._native is not available: only the reference is measured", file=sys.stderr)
    variants = {
        "plain": contextlib.nullcontext,
        "nop": Nop,
        "track/ref": lambda: dtr.budget(None, native=False),
        "budget/ref": lambda: dtr.budget(limit[0], native=False, thrash_limit=None),
    }
    if native_path.available():
        variants["track/native"] = lambda: dtr.budget(None, native=True, entry="mode")
        variants["budget/native"] = lambda: dtr.budget(limit[0], native=True, entry="mode", thrash_limit=None)
        variants["track/key"] = lambda: dtr.budget(None, entry="key")
        variants["budget/key"] = lambda: dtr.budget(limit[0], entry="key", thrash_limit=None)
    # Results must equal plain PyTorch's on every path (a benchmark of a wrong answer means nothing).
    torch.manual_seed(a.seed)
    step()
    want = [p.grad.clone() for p in model.parameters()]
    evicted = {}  # budgeted variant -> (evictions, remats) of a step
    for _ in range(20):  # the budget is raised to what the step needs at once (and 5% more) where that is more
        try:
            for name, ctx in variants.items():
                for _ in range(2):
                    with ctx() as b:
                        step()
                    if not all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want)):
                        raise SystemExit(f"{name}: gradients differ from plain PyTorch's")
                    if name.startswith("budget/"):
                        evicted[name] = (b.stats["evictions"], b.stats["remats"])
            break
        except dtr.OutOfBudgetError as e:
            limit[0] = int(max(limit[0], e.needed) * 1.05)
    rng = random.Random(a.seed)
    per_op = {k: [] for k in variants}
    for _ in range(a.rounds):
        order = list(variants)
        rng.shuffle(order)
        for name in order:
            ctx = variants[name]
            with ctx():  # warm-up (prediction caches, allocator)
                step()
            ts = []
            for _ in range(a.steps):
                t0 = time.perf_counter_ns()
                with ctx():
                    step()
                ts.append(time.perf_counter_ns() - t0)
            per_op[name].append(statistics.median(ts) / 1e3 / ops)
    above = {k: statistics.median([v - n for v, n in zip(per_op[k], per_op["nop"])]) for k in variants}
    over_plain = {k: statistics.median([v - n for v, n in zip(per_op[k], per_op["plain"])]) for k in variants}
    lines = [f"Tiny-op MLP: {a.blocks} x (Linear({a.width}, {a.width}) + ReLU), batch {a.batch}, 1 thread: "
             f"{ops} ops per training step; {a.rounds} shuffled rounds of {a.steps} steps per variant; "
             f"the budgeted variants' budget is {limit[0]} bytes, {limit[0] / peak:.0%} of the tracking peak "
             f"(evictions, recomputations a step: "
             f"{', '.join(f'{k} {e}/{r}' for k, (e, r) in evicted.items())}).",
             "", "| variant | µs per op (median) | above a do-nothing mode | above plain PyTorch |",
             "|---|---|---|---|"]
    for k in variants:  # (the differences are medians of per-round differences)
        lines.append(f"| {k} | {statistics.median(per_op[k]):.1f} | "
                     f"{'—' if k in ('plain', 'nop') else f'{above[k]:.1f}'} | "
                     f"{'—' if k == 'plain' else f'{over_plain[k]:.1f}'} |")
    if native_path.available():
        for budgeted in ("track", "budget"):
            r = statistics.median([p / q for p, q in zip(per_op[f"{budgeted}/ref"], per_op[f"{budgeted}/native"])])
            lines.append(f"\n{budgeted}: reference / native step time, median of per-round ratios: {r:.2f}×")
    text = "\n".join(lines)
    print(text)
    if a.out:  # (Note [Marked sections] in benchmarks/report.py)
        st = native_path.status()
        where = f"dtr._native {st.origin}" if st.active else "the Python reference only"
        write_section(a.out, a.section, f"Host cost per op ({a.label}; torch {torch.__version__}, {where})", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
