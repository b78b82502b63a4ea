"""One-process A/B of the 12-layer GPT's training step on a GPU: time, peak and exactness per variant.

Usage:
    python benchmarks/bench_tracking_cuda.py [--rounds 5] [--steps 3] [--variants plain,nop,ckpt,track,...]

One process, the 12-layer GPT of benchmarks/RUNTIME-CUDA.md (d 1024, T 1024,
batch 8). Variants are alternated round by round; each step is timed between
two ``torch.cuda.synchronize()``; the median step time over all rounds is
quoted, relative to plain PyTorch. A variant's name is dash-separated:

* ``plain``; ``nop`` (a dispatch mode that only calls the op: Python dispatch
  alone); ``ckpt`` (``torch.utils.checkpoint`` per block, non-reentrant);
* ``track``: ``dtr.budget(None)``; ``bF`` (``b0.5``): ``dtr.budget(C + F*P)``,
  where C is the bytes of the parameters, gradients and inputs and P the
  plain step's peak increase over them; ``bckpt``: ``dtr.budget(C + ckpt's
  peak increase)``, the budget at per-block checkpointing's memory;
* modifiers of the dtr variants: ``ref`` (the Python reference per-op path,
  ``native=False``), ``flops`` (flop costs instead of measured times),
  ``every`` (the event timer times every op: Note [Sampled timing on CUDA] in
  dtr/runtime/timing.py), ``old`` (full polls on schedule even when no new
  peak is possible: Note [Liveness] in dtr/runtime/mode.py), ``hNAME`` (the
  heuristic NAME instead of eqclass: ``hdtr``, ``hlocal``, ``hlargest``...).

Independently of dtr, each variant's peak is ``torch.cuda.max_memory_allocated()``
over its measured steps minus the allocation before them; a budgeted variant
reports C + peak - budget (<= 0 when the budget held by the allocator's count).
Every step runs from the same seed, so each dtr variant's loss and gradients
are compared with plain PyTorch's (max abs difference; cuBLAS and the
embedding's backward are not bitwise deterministic here, so small
differences are expected for every variant, plain against itself included).
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
import bench_models  # noqa: E402

import dtr  # noqa: E402

CFG = {"layers": 12, "d": 1024, "heads": 16, "seq": 1024, "batch": 8, "vocab": 8192, "p": 0.1}
VARIANTS = "plain,nop,ckpt,track,track-ref,b0.5,b0.5-ref,bckpt"
MiB = 2 ** 20


class _Nop(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps per variant and round")
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--smoke", action="store_true", help="a tiny GPT on the CPU (checks this script; no peaks)")
    a = ap.parse_args(argv)
    if not a.smoke and not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    dev = "cpu" if a.smoke else "cuda"
    cuda = dev == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    variants = a.variants.split(",")
    cfg = dict(CFG, layers=6, d=64, heads=2, seq=32, batch=4, vocab=64) if a.smoke else CFG
    model, inputs, loss_fn = bench_models.build("gpt", cfg)
    model = model.to(dev)
    inputs = tuple(x.to(dev) for x in inputs)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    const = sum(t.untyped_storage().nbytes() for t in [*params, *inputs]) \
        + sum(p.grad.untyped_storage().nbytes() for p in params)
    limits: dict = {}
    stats: dict = {}

    def reset() -> int:
        sync()
        if not cuda:
            return 0
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak(base: int) -> int:
        return torch.cuda.max_memory_allocated() - base if cuda else 0

    def step(v: str):
        model.zero_grad(set_to_none=False)
        torch.manual_seed(100)
        sync()
        t = time.perf_counter()
        parts = v.split("-")
        if v in ("plain", "ckpt"):
            loss = loss_fn(model, *inputs, checkpoint=(v == "ckpt"))
            loss.backward()
        elif v == "nop":
            with _Nop():
                loss = loss_fn(model, *inputs)
                loss.backward()
        else:
            with dtr.budget(limits.get(parts[0]), cost_model="flops" if "flops" in parts else "time",
                            device=dev, native="ref" not in parts,
                            heuristic=next((t[1:] for t in parts[1:] if t.startswith("h")), "eqclass")) as b:
                if "old" in parts:
                    b._driver._poll_on_schedule = True
                if "every" in parts:
                    b._driver.timer.samples = False
                loss = loss_fn(model, *inputs)
                loss.backward()
            stats[v] = b.stats
        sync()
        return time.perf_counter() - t, loss.detach()

    def peak_of(v: str) -> int:
        base = reset()
        step(v)
        return peak(base)

    step("plain")  # warm-up, then the plain and checkpointed peaks fix the budgets
    P = peak_of("plain")
    step("ckpt")
    P_ckpt = peak_of("ckpt")
    if not cuda:  # no allocator count on the CPU: the smoke run takes dtr's own, and a guess for ckpt
        step("track")
        P = stats["track"]["peak_bytes"] - const
        P_ckpt = P // 2
    for v in variants:
        head = v.split("-")[0]
        if head == "bckpt":
            limits[head] = const + P_ckpt
        elif head.startswith("b") and head != "bckpt":
            limits[head] = const + int(float(head[1:]) * P)
    _, ref_loss = step("plain")
    ref_grads = [p.grad.clone() for p in params]
    diffs = {}
    errors = {}
    for v in variants:  # warm-up, and each variant's exactness against plain
        try:
            step(v)
            _, loss = step(v)
        except Exception as e:  # reported, and the variant left out of the rounds
            errors[v] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            continue
        diffs[v] = (abs(float(loss) - float(ref_loss)),
                    max(float((p.grad - g).abs().max()) for p, g in zip(params, ref_grads)))
    variants = [v for v in variants if v not in errors]
    times: dict = {v: [] for v in variants}
    peaks: dict = {v: 0 for v in variants}
    for _ in range(a.rounds):
        for v in variants:
            base = reset()
            times[v] += [step(v)[0] for _ in range(a.steps)]
            peaks[v] = max(peaks[v], peak(base))
    plain = statistics.median(times["plain"]) if "plain" in times else float("nan")
    print(f"{torch.cuda.get_device_name() if cuda else 'CPU (smoke)'}, torch {torch.__version__}, dtr native path "
          f"{'available' if dtr.runtime.native.available() else 'UNAVAILABLE'}; "
          f"{a.rounds} rounds x {a.steps} steps; C {const / MiB:.1f} MiB, P {P / MiB:.1f} MiB, "
          f"ckpt peak {P_ckpt / MiB:.1f} MiB")
    print("| variant | step s | x plain | peak +MiB | budget MiB | C + peak - budget, MiB | evictions | remats "
          "| remat s | max abs diff loss / grads vs plain |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for v in variants:
        m = statistics.median(times[v])
        lim = limits.get(v.split("-")[0])
        s = stats.get(v)
        over = "–" if lim is None else f"{(const + peaks[v] - lim) / MiB:+.1f}"
        print(f"| {v} | {m:.4f} | {m / plain:.3f} | {peaks[v] / MiB:.1f} | "
              f"{'–' if lim is None else f'{lim / MiB:.1f}'} | {over} | "
              f"{'–' if s is None else s['evictions']} | {'–' if s is None else s['remats']} | "
              f"{'–' if s is None else format(s['remat_seconds'], '.4f')} | "
              f"{diffs[v][0]:.3g} / {diffs[v][1]:.3g} |")
    for v, e in errors.items():
        print(f"{v}: failed, {e}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
