"""What intercepting ops costs, by mechanism: a Python dispatch mode against a C++ dispatcher fallback.

Usage:
    python benchmarks/bench_dispatch_floor.py [--rounds 15] [--build-dir DIR]

dtr intercepts ops with a TorchDispatchMode. This measures the floor that
choice sets, on the TreeLSTM of bench_runtime.py (one thread, its default
size), in one process over shuffled rounds: the median over rounds of each
variant's step time over plain PyTorch's in the same round.

* ``python-nop``: a do-nothing TorchDispatchMode (every op into Python and
  back);
* ``cpp-nop``: a C++ boxed fallback on a dispatch key below autograd that only
  passes each op on (benchmarks/dispatch_floor/floor_ext.cpp, built here with
  torch.utils.cpp_extension);
* ``cpp-read``: that fallback also reading each tensor argument's storage;
* ``cpp-to-python``: that, and converting every argument to a Python object;
* ``dtr-mode`` and ``dtr-key``: ``dtr.budget(None)`` with its ops entering
  through a TorchDispatchMode (the default) and through dtr's own dispatch
  key (``entry="key"``, Note [The dispatch-key entry]).

The C++ fallback and dtr's entry take the same dispatch key, so they run in
two processes, each over its own shuffled rounds: part ``floor`` (everything
but ``dtr-key``) and part ``dtr`` (plain, python-nop, dtr-mode, dtr-key).

Every variant's gradients are checked equal to plain PyTorch's. It also
reports which ops each mechanism sees in one step, where they differ: the
op stream a C++ fallback sees is not the one a Python mode sees.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import dtr

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models  # noqa: E402
from dispatch_modes import Nop, OpNames  # noqa: E402


def _build(build_dir: str):
    from torch.utils.cpp_extension import load
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dispatch_floor", "floor_ext.cpp")
    os.makedirs(build_dir, exist_ok=True)
    return load("dtr_dispatch_floor", [src], build_directory=build_dir, extra_cflags=["-O2"], verbose=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--build-dir", default=os.path.join(tempfile.gettempdir(), "dtr_dispatch_floor"))
    ap.add_argument("--part", choices=("floor", "dtr"), default=None,
                    help="one process's part (default: both, each in its own process)")
    a = ap.parse_args(argv)
    if a.part is None:  # (the floor's fallback and dtr's entry take the same dispatch key: one per process)
        for part in ("floor", "dtr"):
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--rounds", str(a.rounds), "--build-dir",
                                a.build_dir, "--part", part])
            if r.returncode:
                return r.returncode
        return 0
    ext = _build(a.build_dir) if a.part == "floor" else None
    torch.set_num_threads(1)
    cfg = bench_models.SIZES["treelstm"][0]
    model, inputs, loss_fn = bench_models.build("treelstm", cfg)

    def step():
        model.zero_grad(set_to_none=True)
        loss_fn(model, *inputs).backward()

    @contextlib.contextmanager
    def cpp(level: int, count_names: bool = False):
        ext.enable(True, level, count_names)
        try:
            yield
        finally:
            ext.enable(False, 0, False)

    variants = {"plain": contextlib.nullcontext, "python-nop": Nop}
    if ext is not None:
        variants.update({"cpp-nop": lambda: cpp(0), "cpp-read": lambda: cpp(1), "cpp-to-python": lambda: cpp(2)})
    variants["dtr-mode"] = lambda: dtr.budget(None, entry="mode")
    if ext is None:
        variants["dtr-key"] = lambda: dtr.budget(None, entry="key")
    ref = None
    for name, ctx in variants.items():
        with ctx():
            step()
        grads = [p.grad.clone() for p in model.parameters()]
        ref = ref or grads
        if not all(torch.equal(x, y) for x, y in zip(ref, grads)):
            raise SystemExit(f"{name}: gradients differ from plain PyTorch's")
    py = OpNames()
    with py:
        step()
    seen_cpp: collections.Counter = collections.Counter()
    if ext is not None:
        ext.names()
        with cpp(0, count_names=True):
            step()
        seen_cpp.update(ext.names())
    times = {k: [] for k in variants}
    for _ in range(a.rounds):
        order = list(variants)
        random.shuffle(order)
        for k in order:
            t0 = time.perf_counter()
            with variants[k]():
                step()
            times[k].append(time.perf_counter() - t0)
    ratio = {k: statistics.median(t / p for t, p in zip(times[k], times["plain"])) for k in variants}
    print(f"Generated by `benchmarks/bench_dispatch_floor.py --rounds {a.rounds}` (part {a.part}) on "
          f"{datetime.datetime.now():%Y-%m-%d %H:%M}: {platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, 1 thread; TreeLSTM {cfg}; load average {os.getloadavg()[0]:.2f}.\n")
    print(f"plain step: {statistics.median(times['plain']):.3f} s (median)\n")
    print("| variant | time × plain |\n|---|---|")
    for k in variants:
        print(f"| {k} | {ratio[k]:.3f}× |")
    if ext is None:
        return 0
    n_py, n_cpp = sum(py.names.values()), sum(seen_cpp.values())
    print(f"\nOps seen in one step: Python mode {n_py}, C++ fallback {n_cpp}. Where they differ:\n")
    print("| op | Python mode | C++ fallback |\n|---|---|---|")
    for name in sorted(set(py.names) | set(seen_cpp), key=lambda n: -abs(py.names[n] - seen_cpp[n])):
        if py.names[name] != seen_cpp[name]:
            print(f"| {name} | {py.names[name]} | {seen_cpp[name]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
