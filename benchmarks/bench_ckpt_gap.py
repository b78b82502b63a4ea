"""Where dtr's time goes against per-block checkpointing, on the CPU GPT of benchmarks/RUNTIME.md.

Usage:
    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/bench_ckpt_gap.py [--rounds 7] [--frac 0.215] [--profile]

One process, one thread. Variants, in a shuffled order each round, one step
each, after one warm-up step each:

* ``plain``: plain PyTorch;
* ``nop``: a ``TorchDispatchMode`` that only calls each op (the cost of seeing
  every op through a mode, before dtr does anything);
* ``track``: ``dtr.budget(None)``;
* ``dtr``: ``dtr.budget(C + frac * P)``, with C and P as in bench_runtime.py
  (P from the plain step's RSS high-water mark, measured here once first);
* ``ckpt``: ``torch.utils.checkpoint`` (non-reentrant) per block.

Prints the median time of each and the median per-round ratios to plain and
of dtr to checkpointing. With ``--profile``, one more step of ``ckpt`` and of
``dtr`` runs under ``torch.profiler`` and the ATen ops' total self time is
printed for each: the op work each variant does, recomputation included,
apart from everything around the ops (Python, autograd, freeing memory).
Peaks are not measured here (bench_runtime.py does that, a fresh process per
variant); this only splits the time.
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import random
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_models  # noqa: E402

import dtr  # noqa: E402

VARIANTS = ["plain", "nop", "track", "dtr", "ckpt"]


class _Nop(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--frac", type=float, default=0.215, help="the dtr budget's f in C + f * P")
    ap.add_argument("--profile", action="store_true", help="also compare the ATen self time of ckpt and dtr")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)

    model, inputs, loss_fn, const = bench_models.training_setup("gpt", bench_models.SIZES["gpt"][0])

    def step(v: str, limit: Optional[int] = None) -> float:
        model.zero_grad(set_to_none=False)
        torch.manual_seed(100)
        t = time.perf_counter()
        if v in ("plain", "ckpt"):
            loss_fn(model, *inputs, checkpoint=(v == "ckpt")).backward()
        elif v == "nop":
            with _Nop():
                loss_fn(model, *inputs).backward()
        else:
            with dtr.budget(None if v == "track" else limit, cost_model="time"):
                loss_fn(model, *inputs).backward()
        return time.perf_counter() - t

    peak = bench_models.plain_peak(lambda: step("plain"))
    limit = int(const + a.frac * peak)
    print(f"C = {const / 2**20:.1f} MiB, P = {peak / 2**20:.1f} MiB (this process), "
          f"budget C + {a.frac} P = {limit / 2**20:.1f} MiB")

    for v in VARIANTS:
        step(v, limit)
    times: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    rng = random.Random(a.seed)
    for _ in range(a.rounds):
        order = VARIANTS[:]
        rng.shuffle(order)
        for v in order:
            times[v].append(step(v, limit))
    for v in VARIANTS:
        ratio = statistics.median(x / p for x, p in zip(times[v], times["plain"]))
        print(f"{v:6s} median {statistics.median(times[v]):.3f} s   x plain {ratio:.3f}")
    per_round = [d / c for d, c in zip(times["dtr"], times["ckpt"])]
    slower = sum(r > 1 for r in per_round)
    print("dtr / ckpt per round:", " ".join(f"{r:.3f}" for r in per_round),
          f"(median {statistics.median(per_round):.3f}; dtr slower in {slower} of {len(per_round)})")

    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        for v in ("ckpt", "dtr"):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                wall = step(v, limit)
            self_us = collections.Counter()
            for e in prof.key_averages():
                if e.key.startswith("aten::"):
                    self_us[e.key] += e.self_cpu_time_total
            total = sum(self_us.values()) / 1e6
            print(f"profiled {v}: wall {wall:.3f} s, ATen self time {total:.3f} s, the rest {wall - total:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
