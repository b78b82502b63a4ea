"""Runtime benchmark: wall time and independently measured peak memory of training steps under dtr.budget.

Usage:
    python benchmarks/bench_runtime.py [--rounds 5] [--threads 1] [--models gpt,cnn,treelstm]
                                       [--device cpu|cuda] [--cfg JSON] [--smoke] [--out benchmarks/RUNTIME.md]

For each model (a GPT-style transformer in plain torch, a ResNet-ish CNN with
BatchNorm / in-place ReLU / residual ``+=``, a recursive TreeLSTM over a
data-dependent tree) and each variant (plain PyTorch; ``dtr.budget(None)``;
``dtr.budget(B)`` at several fractions of the plain step's peak;
``torch.utils.checkpoint`` per transformer block for the GPT), one training
step (zero grads, forward, loss, backward) is timed and its peak memory is
measured *independently of dtr* (DESIGN.md section 7):

* every (model, variant, round) runs in its own fresh subprocess
  (``--worker`` mode of this script) with ``MALLOC_MMAP_THRESHOLD_=65536``
  (``--allocator default`` keeps glibc's defaults, for the times a user sees:
  Note [Allocator settings]) and OMP / torch threads fixed;
* the worker runs warm-up steps of the same variant first (the first use of a
  dispatch mode imports ``torch._dynamo``), then writes ``5`` to
  ``/proc/self/clear_refs`` to reset ``VmHWM``, records ``VmRSS`` as the base,
  runs the measured steps and reports ``VmHWM - base``;
* variants are alternated in a shuffled order over several rounds; the report
  quotes the median over rounds of the per-round ratio to plain (time and peak).

With ``--device cuda`` the models run on the GPU and the peak is
``torch.cuda.max_memory_allocated()`` minus ``memory_allocated()`` after
warm-up (cuBLAS's workspaces are already there), each step timed between two
device synchronizations.

Budgets: ``B(f) = C + f * P`` where ``C`` is the bytes of the tensors that exist
before the step and that it uses (parameters, buffers, inputs and the
gradients, which persist across steps here) and ``P`` is the plain step's
measured peak increase over them (median of calibration runs).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]

from bench_models import SIZES, build, rss_status  # noqa: E402


# --------------------------------------------------------------------------- worker
def worker(spec: dict) -> dict:
    import torch
    torch.set_num_threads(spec["threads"])
    torch.set_num_interop_threads(1)
    import dtr

    cuda = spec.get("device", "cpu") == "cuda"
    model, inputs, loss_fn = build(spec["model"], spec["cfg"])
    if cuda:
        model = model.cuda()
        inputs = tuple(x.cuda() for x in inputs)
    model.train()
    params = list(model.parameters())
    for p in params:  # gradients persist across steps (zeroed in place): they are part of C
        p.grad = torch.zeros_like(p)
    const = sum(t.untyped_storage().nbytes() for t in [*params, *model.buffers(), *inputs])
    const += sum(p.grad.untyped_storage().nbytes() for p in params)
    variant, limit = spec["variant"], spec.get("limit")
    planned = None  # a planned variant: one budget for every step (Note [Planned steps] in dtr/runtime/step_plans.py)
    if variant.startswith("plan"):
        from dtr.runtime.step_plans import PlanPolicy
        planned = dtr.budget(limit, cost_model=spec.get("cost_model", "time"), heuristic=spec.get("heuristic", "eqclass"),
                             device="cuda" if cuda else None,
                             plan=PlanPolicy(background="inline", time_limit=spec.get("plan_time", 60.0)),
                             **({"entry": spec["entry"]} if spec.get("entry") else {}))

    def step(seed: int):
        model.zero_grad(set_to_none=False)
        torch.manual_seed(seed)
        stats = None
        if variant in ("plain", "ckpt"):
            loss = loss_fn(model, *inputs, checkpoint=(variant == "ckpt"))
            loss.backward()
        else:
            extra = {"entry": spec["entry"]} if spec.get("entry") else {}  # (older dtr versions have no entry)
            with planned if planned is not None else dtr.budget(
                    limit, cost_model=spec.get("cost_model", "time"), heuristic=spec.get("heuristic", "eqclass"),
                    device="cuda" if cuda else None, **extra) as b:
                loss = loss_fn(model, *inputs)
                loss.backward()
            stats = b.stats
        return loss.detach(), stats

    out = {"const_bytes": const, "times": [], "stats": [], "error": None}
    try:
        for _ in range(spec["warmup"]):
            step(100)
        # Clean reference point: reset the high-water mark and take the base RSS (or the GPU's allocation).
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            base = rss_status()["rss"]
        for _ in range(spec["steps"]):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            loss, stats = step(100)  # the same seed each step: every variant computes the same values
            if cuda:
                torch.cuda.synchronize()
            out["times"].append(time.perf_counter() - t)
            out["stats"].append(stats)
        hwm = torch.cuda.max_memory_allocated() if cuda else rss_status()["hwm"]
        out["base_rss"], out["hwm"], out["increase"] = base, hwm, hwm - base
        out["loss"] = float(loss)
        out["grad_sum"] = float(sum(p.grad.double().abs().sum() for p in params))
    except Exception as e:  # recorded in the report, never patched around
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        out["traceback"] = traceback.format_exc()[-2000:]
    return out


def run_worker(spec: dict, timeout: float) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), MKL_NUM_THREADS=str(spec["threads"]))
    if spec.get("allocator", "mmap") == "mmap":  # see Note [Allocator settings]
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    else:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    # A frozen copy of the dtr package first (the working tree may change during a long run), then this
    # checkout (where dtr is built in place but not installed).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (DTR_PATH, env.get("PYTHONPATH"), str(ROOT)) if p)
    t = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True,
                           text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s", "wall": time.perf_counter() - t}
    wall = time.perf_counter() - t
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": f"worker exit {p.returncode}: {p.stderr.strip().splitlines()[-1:] if p.stderr else ''}",
                "wall": wall}
    r = json.loads(lines[-1])
    r["wall"] = wall
    return r


# --------------------------------------------------------------------------- driver
MiB = 2 ** 20
DTR_PATH = None

# Note [Allocator settings]
# glibc serves a large allocation from its heap once the dynamic mmap threshold
# has grown past it (up to 32 MiB), and keeps freed heap memory mapped. The
# RSS high-water mark then counts memory the program already freed, so peaks
# are measured with MALLOC_MMAP_THRESHOLD_=65536 (every tensor buffer is its
# own mapping, unmapped when freed). That setting also makes every allocation
# fault in fresh pages, which slows every variant (plain PyTorch's step by
# about 1.6x on the 2-core machine) and so shrinks the time ratios. A user's
# process runs with the default allocator: --allocator default times that
# (its peaks are not independent measurements and are reported as such).
# Calibration (C and P, hence every budget) always runs with the threshold.


def fmt_mib(b) -> str:
    return "–" if b is None else f"{b / MiB:.1f}"


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def variants_for(model: str, fracs) -> list:
    fracs = fracs[model] if isinstance(fracs, dict) else fracs
    v = ["plain", "none"] + [f"dtr{f:g}" for f in fracs]
    if PLAN_FRACS.get(model):
        v += [f"plan{f:g}" for f in PLAN_FRACS[model]]
    if model == "gpt":
        v.append("ckpt")
    return v


PLAN_FRACS: dict = {}  # model -> the fractions that also get a planned variant (--plan)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--slow-rounds", type=int, default=None,
                    help="rounds for the budgeted dtr variants of a model whose plain step takes > 2 s (default: --rounds)")
    ap.add_argument("--steps", type=int, default=1, help="measured steps per worker (the median is the round's time)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", default="gpt,cnn,treelstm")
    ap.add_argument("--plan", default=None, metavar="FRACS",
                    help="also run these fractions (of every model) as planned steps: one dtr.budget(..., plan=True) "
                         "for all of a worker's steps, planned at the end of the first (give --warmup >= 3)")
    ap.add_argument("--fracs", default="0.5,0.35,0.25,0.215,0.2", help="budget fractions f of P for the GPT")
    ap.add_argument("--fracs-other", default="0.7,0.5,0.4", help="budget fractions f of P for the CNN and TreeLSTM")
    ap.add_argument("--calib", type=int, default=2, help="plain runs to calibrate P (the plain peak increase)")
    ap.add_argument("--timeout", type=float, default=240.0, help="per worker, seconds")
    ap.add_argument("--smoke", action="store_true", help="small sizes, 1 round: validates the harness")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heuristic", default="eqclass", help="the heuristic of every dtr.budget variant")
    ap.add_argument("--cost-model", default="time", choices=("time", "flops"),
                    help="the cost model of every dtr.budget variant")
    ap.add_argument("--entry", default=None, choices=("mode", "key"),
                    help="how every dtr.budget variant's ops reach dtr (dtr.budget's entry; default: dtr's default)")
    ap.add_argument("--dtr-path", default=None,
                    help="import dtr from this directory in the workers (a frozen copy containing dtr/)")
    ap.add_argument("--dtr-version", default=None, help="a label for the dtr version, quoted in the report")
    ap.add_argument("--allocator", default="mmap", choices=("mmap", "default"),
                    help="glibc settings of the workers: 'mmap' (MALLOC_MMAP_THRESHOLD_=65536, honest RSS peaks) or "
                         "'default' (as a user runs: realistic times, peaks inflated by the retained heap)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the models run (cuda: peaks from torch.cuda.max_memory_allocated)")
    ap.add_argument("--cfg", default=None,
                    help='JSON: per-model size overrides, e.g. \'{"gpt": {"layers": 12, "d": 1024}}\'')
    ap.add_argument("--out", default=None)
    ap.add_argument("--raw", default=None, help="also write every run's raw result (JSON) here")
    a = ap.parse_args()

    if a.worker:
        print(json.dumps(worker(json.loads(a.worker))))
        return

    if a.smoke:
        a.rounds, a.calib = 1, 1
    global DTR_PATH
    DTR_PATH = a.dtr_path
    models = a.models.split(",")
    for m, over in (json.loads(a.cfg) if a.cfg else {}).items():
        if m not in SIZES:
            raise SystemExit(f"--cfg: unknown model {m!r} (valid: {', '.join(SIZES)})")
        SIZES[m] = tuple({**size, **over} for size in SIZES[m])
    fracs = {m: [float(f) for f in (a.fracs if m == "gpt" else a.fracs_other).split(",")] for m in models}
    if a.plan:
        PLAN_FRACS.update({m: [float(f) for f in a.plan.split(",")] for m in models})
    shuffle = random.Random(a.seed)
    t_start = time.perf_counter()
    load_start = os.getloadavg()

    def spec(model, variant, limit=None, allocator=a.allocator):
        return {"model": model, "variant": variant, "limit": limit, "cfg": SIZES[model][1 if a.smoke else 0],
                "threads": a.threads, "steps": a.steps, "warmup": a.warmup, "heuristic": a.heuristic,
                "cost_model": a.cost_model, "allocator": allocator, "device": a.device, "entry": a.entry}

    # 1. Calibration: the plain step's peak increase P and the constants C.
    calib = {}
    for m in models:
        rs = [run_worker(spec(m, "plain", allocator="mmap"), a.timeout) for _ in range(a.calib)]
        ok = [r for r in rs if not r.get("error")]
        if not ok:
            raise SystemExit(f"plain {m} failed: {rs[0].get('error')}\n{rs[0].get('traceback', '')}")
        P, C = med([r["increase"] for r in ok]), ok[0]["const_bytes"]
        calib[m] = {"P": P, "C": C, "time": med([med(r["times"]) for r in ok])}
        print(f"[calib] {m}: C={fmt_mib(C)} MiB  P={fmt_mib(P)} MiB  plain step {calib[m]['time']:.3f} s",
              file=sys.stderr, flush=True)

    def limit_of(m, v):
        return limit_of_static(calib, m, v)

    # 2. Rounds: all (model, variant) pairs in a shuffled order per round.
    results = {(m, v): [] for m in models for v in variants_for(m, fracs)}
    for r in range(a.rounds):
        jobs = []
        for m in models:
            slow = a.slow_rounds is not None and calib[m]["time"] > 2.0 and r >= a.slow_rounds
            for v in variants_for(m, fracs):
                if slow and v.startswith("dtr"):
                    continue
                prev = results[(m, v)]
                if r >= 2 and len(prev) >= 2 and all(p.get("error") for p in prev):
                    continue  # failed in every earlier round: not repeated
                jobs.append((m, v))
        shuffle.shuffle(jobs)
        for m, v in jobs:
            if v == "none":
                res = run_worker(spec(m, "dtr", None), a.timeout)
            elif v.startswith("dtr"):
                res = run_worker(spec(m, "dtr", limit_of(m, v)), a.timeout)
            elif v.startswith("plan"):
                res = run_worker(spec(m, "plan", limit_of(m, v)), a.timeout)
            else:
                res = run_worker(spec(m, v), a.timeout)
            res["round"] = r
            results[(m, v)].append(res)
            t = f"{med(res['times']):.3f} s" if res.get("times") else "-"
            print(f"[round {r}] {m:8s} {v:8s} {t:>9s}  peak +{fmt_mib(res.get('increase'))} MiB"
                  f"{'  ERROR ' + res['error'] if res.get('error') else ''}  ({time.perf_counter() - t_start:.0f} s)",
                  file=sys.stderr, flush=True)

    report = render(a, models, fracs, calib, results, time.perf_counter() - t_start, load_start)
    print(report)
    if a.out:
        pathlib.Path(a.out).write_text(report)
    if a.raw:
        pathlib.Path(a.raw).write_text(json.dumps({"calib": calib, "elapsed": time.perf_counter() - t_start,
                                                   "load_start": load_start, "fracs": fracs,
                                                   "results": {f"{m}/{v}": rs for (m, v), rs in results.items()}},
                                                  indent=1, default=str))


def summarize(models, fracs, calib, results):
    S = {}
    for m in models:
        plain = {r["round"]: r for r in results[(m, "plain")] if not r.get("error")}
        for v in variants_for(m, fracs):
            rs = results[(m, v)]
            good = [r for r in rs if not r.get("error")]
            tr = [med(r["times"]) / med(plain[r["round"]]["times"]) for r in good if r["round"] in plain]
            pr = [r["increase"] / plain[r["round"]]["increase"] for r in good if r["round"] in plain
                  and plain[r["round"]]["increase"] > 0]
            stats = [s for r in good for s in r["stats"] if s]
            S[(m, v)] = {
                "n": len(rs), "ok": len(good), "errors": sorted({r["error"] for r in rs if r.get("error")}),
                "time": med([med(r["times"]) for r in good]), "time_ratio": med(tr),
                "increase": med([r["increase"] for r in good]), "peak_ratio": med(pr),
                "limit": limit_of_static(calib, m, v),
                "evictions": med([s["evictions"] for s in stats]), "remats": med([s["remats"] for s in stats]),
                "remat_seconds": med([s["remat_seconds"] for s in stats]),
                "dtr_peak": med([s["peak_bytes"] for s in stats]),
                "ops": med([s["ops"] for s in stats]),
                "loss": sorted({r["loss"] for r in good}), "grad_sum": sorted({r["grad_sum"] for r in good}),
                "plan_modes": sorted({s.get("plan") for s in stats if s.get("plan")}),
                "predicted_remat": med([s["predicted_remat"] for s in stats if s.get("predicted_remat") is not None]),
                # fidelity, per planned step: measured recomputation over the prediction, raw and at the step's
                # op speed (Note [A plan's prediction at the step's speed] in dtr/runtime/step_plans.py)
                "vs_predicted": [s["remat_seconds"] / s["predicted_remat_seconds"] for s in stats
                                 if s.get("plan") == "planned" and s.get("predicted_remat_seconds")],
                "vs_expected": [s["remat_seconds"] / s["expected_remat_seconds"] for s in stats
                                if s.get("plan") == "planned" and s.get("expected_remat_seconds")],
            }
    return S


def _frac(v):
    return float(v[4:]) if v.startswith("plan") else float(v[3:])


def limit_of_static(calib, m, v):
    if v.startswith("dtr") or v.startswith("plan"):
        return int(calib[m]["C"] + _frac(v) * calib[m]["P"])
    return None


def label(v):
    if v.startswith("plan"):
        return f"dtr.budget(C + {round(_frac(v) * 100, 3):g}% P, plan=True)"
    return {"plain": "plain PyTorch", "none": "dtr.budget(None)", "ckpt": "checkpoint per block"}.get(
        v, f"dtr.budget(C + {round(float(v[3:]) * 100, 3):g}% P)" if v.startswith("dtr") else v)


def render(a, models, fracs, calib, results, elapsed, load_start) -> str:
    import torch
    S = summarize(models, fracs, calib, results)
    L = ["# dtr runtime benchmark", "",
         f"Generated by `benchmarks/bench_runtime.py{' --smoke' if a.smoke else ''}` on "
         f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}: {platform.machine()}, {os.cpu_count()} CPUs "
         f"({_cpu_name()}), Linux {platform.release()}, Python {platform.python_version()}, torch {torch.__version__}; "
         f"{a.threads} torch/OMP thread(s), "
         f"{_gpu_name() + ', peaks from the CUDA allocator' if a.device == 'cuda' else '`MALLOC_MMAP_THRESHOLD_=65536`' if a.allocator == 'mmap' else 'the default glibc allocator (peaks are NOT independent: the heap keeps freed memory)'}; "
         f"{a.rounds} round(s)"
         f"{f' ({a.slow_rounds} for the budgeted variants of slow models)' if a.slow_rounds is not None else ''}, "
         f"{a.warmup} warm-up + {a.steps} measured step(s) per fresh worker process; heuristic {a.heuristic}, "
         f"cost model {a.cost_model}; " + (f"entry {a.entry}; " if a.entry else "") +
         f"dtr {a.dtr_version or _git_head()}{' (imported from a frozen copy)' if a.dtr_path else ''}; "
         f"a variant that failed in its first two rounds is not repeated; "
         f"load average {load_start[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; "
         f"total {elapsed / 60:.1f} min.", "",
         ("Peak = `torch.cuda.max_memory_allocated()` − `memory_allocated()` after warm-up, on the GPU; each step "
          "timed between two `torch.cuda.synchronize()`; a fresh process per variant and round. A step"
          if a.device == "cuda" else
          "Peak = the process's `VmHWM` − `VmRSS` after warm-up (reset via `/proc/self/clear_refs`), measured in a "
          "fresh process per variant and round, independently of dtr's accounting. A step")
         + " = zero grads in place, forward, loss, backward (no optimizer step); gradients persist across steps. "
         "Budgets are `C + f·P`: C = parameters + buffers + inputs + gradients (tensors existing before the step), "
         "P = the plain step's measured peak increase (median of calibration runs). "
         "Ratios are medians over rounds of the per-round ratio to plain in the same round.", ""]
    for m in models:
        cfg = SIZES[m][1 if a.smoke else 0]
        c = calib[m]
        L += [f"## {m}", "", f"Config: `{json.dumps(cfg)}`. C = {fmt_mib(c['C'])} MiB, "
              f"P = {fmt_mib(c['P'])} MiB, plain step ≈ {c['time']:.3f} s (calibration).", "",
              "| variant | budget MiB | ok/runs | step s | time × plain | peak +MiB | peak × plain | evictions | remats "
              "| remat s | dtr peak MiB (− C) | measured C + peak − budget, MiB | ops | loss, grads = plain |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        pl = S[(m, "plain")]
        for v in variants_for(m, fracs):
            s = S[(m, v)]
            same = "–"
            if s["ok"] and pl["ok"]:
                same = "yes" if (s["loss"] == pl["loss"] and s["grad_sum"] == pl["grad_sum"]) else \
                    f"NO (loss {s['loss']} vs {pl['loss']})"
            over = "–" if s["limit"] is None or s["increase"] is None else \
                f"{(c['C'] + s['increase'] - s['limit']) / MiB:+.1f}"
            dp = f"{fmt_mib(s['dtr_peak'])} ({fmt_mib(s['dtr_peak'] - c['C'])})" if s["dtr_peak"] is not None else "–"
            def f2(x, d=2):
                return "–" if x is None else f"{x:.{d}f}"
            L.append(f"| {label(v)} | {fmt_mib(s['limit'])} | {s['ok']}/{s['n']} | {f2(s['time'], 3)} | "
                     f"{f2(s['time_ratio'])} | {fmt_mib(s['increase'])} | {f2(s['peak_ratio'])} | "
                     f"{'–' if s['evictions'] is None else int(s['evictions'])} | "
                     f"{'–' if s['remats'] is None else int(s['remats'])} | {f2(s['remat_seconds'], 3)} | {dp} | "
                     f"{over} | "
                     f"{'–' if s['ops'] is None else int(s['ops'])} | {same} |")
        for v in variants_for(m, fracs):
            if v.startswith("plan") and S[(m, v)]["ok"]:
                s = S[(m, v)]
                L.append("")
                L.append(f"{label(v)}: timed steps ran {', '.join(s['plan_modes'])}; recomputation measured "
                         f"{s['remat_seconds']:.4f} s, predicted {s['predicted_remat'] or 0:.4g} cost units (median per step)."
                         if s["predicted_remat"] is not None else
                         f"{label(v)}: timed steps ran {', '.join(s['plan_modes'])} (no plan kept).")
                if s["vs_expected"]:
                    L.append(f"Measured over predicted recomputation, per planned timed step: "
                             f"{', '.join(f'{x:.2f}' for x in s['vs_predicted'])} (median {med(s['vs_predicted']):.2f}); "
                             f"over the prediction at the step's op speed: "
                             f"{', '.join(f'{x:.2f}' for x in s['vs_expected'])} (median {med(s['vs_expected']):.2f}).")
        errs = [(v, e) for v in variants_for(m, fracs) for e in S[(m, v)]["errors"]]
        if errs:
            L += ["", "Errors raised by the runtime (recorded, not patched):", ""]
            L += [f"- {label(v)}: `{e}`" for v, e in errs]
        L += [""]

    # Targets.
    L += ["## Targets", ""]

    def xr(x):
        return "–" if x is None else f"{x:.2f}×"

    def mark(ok):
        return "**MET**" if ok else "**NOT MET**"

    peaks = a.allocator == "mmap" or a.device == "cuda"  # see Note [Allocator settings]
    if not peaks:
        L.append("- Peaks are not judged: under the default allocator the RSS high-water mark counts memory the "
                 "heap kept after frees (measure them with `--allocator mmap`).")
    if "gpt" in models:
        g = {v: S[("gpt", v)] for v in variants_for("gpt", fracs)}
        n = g["none"]
        L.append(f"- GPT `budget(None)` time ≤ 1.15× plain: {xr(n['time_ratio'])} → "
                 f"{mark(n['time_ratio'] is not None and n['time_ratio'] <= 1.15)}")
        h = g.get("dtr0.5")
        if h:
            ok_t = h["time_ratio"] is not None and h["time_ratio"] <= 1.5
            ok_p = h["peak_ratio"] is not None and h["peak_ratio"] <= 0.55
            L.append(f"- GPT 50% budget time ≤ 1.5× plain: {xr(h['time_ratio'])} → "
                     f"{mark(ok_t)}; measured peak ≤ 0.55× plain: "
                     f"{(xr(h['peak_ratio']) + ' → ' + mark(ok_p)) if peaks else 'not judged'}"
                     f"{'  (errors: ' + '; '.join(h['errors']) + ')' if h['errors'] else ''}")
        ck = g["ckpt"]
        L.append(f"- Checkpointing per block, measured here: {xr(ck['time_ratio'])} time, "
                 f"{xr(ck['peak_ratio']) if peaks else 'unjudged'} peak (DESIGN.md reference: about 1.2×, 0.38×).")
        if not peaks:
            L.append("- dtr against checkpointing, time only: " + ", ".join(
                f"f={f:g}: {xr(g[f'dtr{f:g}']['time_ratio'])}" for f in fracs["gpt"]) +
                f" (checkpointing {xr(ck['time_ratio'])}).")
        best = None
        for f in fracs["gpt"]:
            s = g[f"dtr{f:g}"]
            if s["time_ratio"] is None or ck["time_ratio"] is None or not s["ok"]:
                continue
            ok = s["time_ratio"] <= ck["time_ratio"] and s["increase"] <= 1.05 * ck["increase"]
            if ok and (best is None or s["increase"] < best[1]["increase"]):
                best = (f, s)
        if not peaks:
            pass
        elif best:
            f, s = best
            L.append(f"- Some budget with dtr time ≤ checkpointing's at measured peak ≤ 1.05× checkpointing's: "
                     f"f = {f:g}: {s['time_ratio']:.2f}× vs {ck['time_ratio']:.2f}× time, "
                     f"peak {fmt_mib(s['increase'])} vs {fmt_mib(ck['increase'])} MiB "
                     f"({s['increase'] / ck['increase']:.2f}× checkpointing's) → {mark(True)}")
        else:
            cand = ", ".join(
                f"f={f:g}: {g[f'dtr{f:g}']['time_ratio']:.2f}× time, "
                f"{g[f'dtr{f:g}']['increase'] / ck['increase']:.2f}× ckpt peak"
                for f in fracs["gpt"] if g[f"dtr{f:g}"]["time_ratio"] is not None and ck["increase"])
            L.append(f"- Some budget with dtr time ≤ checkpointing's at measured peak ≤ 1.05× checkpointing's: "
                     f"none of the budgets tried ({cand or 'no successful runs'}) → {mark(False)}")
    ref = {"cnn": "1.25–1.42× (InceptionV4, ResNet-1202)", "treelstm": "2.09×"}
    for m in ("cnn", "treelstm"):
        if m not in models:
            continue
        rows = []
        for f in fracs[m]:
            s = S[(m, f"dtr{f:g}")]
            if s["ok"]:
                rows.append(f"f={f:g}: {s['time_ratio']:.2f}× time at {s['peak_ratio']:.2f}× peak")
            else:
                rows.append(f"f={f:g}: failed ({'; '.join(s['errors'])})")
        n = S[(m, "none")]
        L.append(f"- {m}: `budget(None)` {xr(n['time_ratio'])} time; "
                 + "; ".join(rows) + f". DTR prototype at ~0.4× memory: {ref[m]} (DESIGN.md section 8).")
    L += [""]
    return "\n".join(L)


def _git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip() or "?"
    except OSError:
        return "?"


def _gpu_name() -> str:
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


if __name__ == "__main__":
    main()
