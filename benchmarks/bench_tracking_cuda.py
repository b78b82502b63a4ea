"""Host overhead of tracking only (``dtr.budget(None)``) on a GPU, with parts of the per-op work switched off.

Usage:
    python benchmarks/bench_tracking_cuda.py [--rounds 3] [--steps 3]

One process, the 12-layer GPT of benchmarks/RUNTIME-CUDA.md (d 1024, T 1024,
batch 8). Variants, alternated round by round, each step timed between two
``torch.cuda.synchronize()``; the median step time over all rounds is quoted,
relative to plain PyTorch:

* ``nop``: a dispatch mode that only calls the op (Python dispatch alone);
* ``none-time`` / ``none-flops``: ``dtr.budget(None)`` with each cost model;
* ``-every``: the event timer times every op (no sampling: Note [Sampled
  timing on CUDA] in dtr/runtime/timing.py);
* ``-old``: full polls on schedule even when no new peak is possible (Note
  [Liveness] in dtr/runtime/mode.py).
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_runtime  # noqa: E402

import dtr  # noqa: E402

CFG = {"layers": 12, "d": 1024, "heads": 16, "seq": 1024, "batch": 8, "vocab": 8192, "p": 0.1}
VARIANTS = ["plain", "nop", "none-time", "none-time-every", "none-time-old", "none-time-old-every",
            "none-flops", "none-flops-old"]


class _Nop(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="steps per variant and round")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    model, inputs, loss_fn = bench_runtime.build("gpt", CFG)
    model = model.cuda()
    inputs = tuple(x.cuda() for x in inputs)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def step(v: str) -> float:
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        if v == "plain":
            loss_fn(model, *inputs).backward()
        elif v == "nop":
            with _Nop():
                loss_fn(model, *inputs).backward()
        else:
            parts = v.split("-")
            with dtr.budget(None, cost_model=parts[1], device="cuda") as b:
                if "old" in parts:
                    b._mode._poll_on_schedule = True
                if "every" in parts:
                    b._mode.timer.samples = False
                loss_fn(model, *inputs).backward()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    for v in VARIANTS:  # warm-up
        step(v)
        step(v)
    times = {v: [] for v in VARIANTS}
    for _ in range(a.rounds):
        for v in VARIANTS:
            times[v] += [step(v) for _ in range(a.steps)]
    plain = statistics.median(times["plain"])
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {a.rounds} rounds x {a.steps} steps")
    for v in VARIANTS:
        m = statistics.median(times[v])
        print(f"{v:22s} {m:.4f} s  x{m / plain:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
