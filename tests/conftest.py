"""Shared fixtures: paths to the hand-made logs and to the published simrd logs; no runtime state shared
between tests. They apply to every folder below:

  core/        the C++ core (dtr._C): differential against a reference, hand-made cases, compaction, stress
  sim/         the simulator: logs, replays, sweeps, plots, schedules and export, log fuzzing, published logs
  planners/    the static planners (Chen, Rotor, Checkmate, FastSA, hierarchical)
  cli/         dtr-sim's command line
  runtime/     dtr.budget against plain PyTorch; make test runs this folder on every path and entry
  native/      the native per-op path against the Python reference path (make test: also as a dispatch mode)
  runtime_units/  the runtime's parts on their own: liveness, storage table, prediction, timing
  devices/     the runtime on a CUDA device and under DistributedDataParallel
  zoo/         the model zoo, dtr-sim record and the committed logs
  install/     the native path's build on the install routes
  support/     helpers the test files share (a package, on the path through pyproject.toml); data/: hand-made logs
"""
from __future__ import annotations

import os
import pathlib
import sys

import pytest

# Note [One intra-op thread in tests]
# The tests compare dtr's results with plain PyTorch's bit for bit. With two
# intra-op threads, plain PyTorch itself is not always bit-reproducible on this
# machine: the process's first tanh over a 512x256 tensor differed in the last
# bits from later ones in about a third of processes (never with one thread),
# and a test comparing a chain of sin over 2^16 floats with a recomputation of
# it failed once in CI the same way. dtr's exactness is relative to PyTorch's
# own determinism, so the suite runs with one intra-op thread (as the
# benchmarks do); subprocesses inherit it through the environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    try:
        import torch
    except ImportError:  # (the simulator's tests run without torch)
        return
    torch.set_num_threads(1)


DATA = pathlib.Path(__file__).parent / "data"
SHARED = pathlib.Path(os.environ.get("DTR_SHARED", pathlib.Path(__file__).resolve().parents[2] / "shared"))
SIMRD_LOGS = SHARED / "simrd-logs"


@pytest.fixture(autouse=True)
def _nothing_carried_over_from_an_earlier_test():
    """Each test's first block starts without the storages an earlier test's blocks left resident.

    A block remembers what the program still holds for the next block (Note
    [Constants from earlier blocks] in dtr/runtime/driver.py). Between tests that
    is only ever garbage, but not always dead garbage: pytest keeps a failed
    test's traceback, and with it that test's model, so the next test's budget
    would count it and one real failure would make unrelated ones.
    """
    driver = sys.modules.get("dtr.runtime.driver")  # never imported (no torch): nothing to clear
    if driver is not None:
        driver._CARRIED.clear()


@pytest.fixture(autouse=True)
def _compact_every_table(request):
    """Blocks compact their tables whenever more than half is garbage, however small (unless marked).

    Outside tests a block compacts only tables of limits.COMPACT_MIN_OPS ops or more
    (Note [Compaction] in dtr/runtime/driver.py), which the tests' small programs
    never reach: without this, none of them would renumber a recipe. Tests of
    the floor itself are marked ``compact_floor`` and run with the real value.
    """
    if request.node.get_closest_marker("compact_floor") is not None:
        yield
        return
    limits = sys.modules.get("dtr.runtime.limits")
    if limits is None:
        try:
            import dtr.runtime.limits as limits  # (the runtime's package needs torch: without it, nothing to set)
        except ImportError:
            yield
            return
    floor = limits.COMPACT_MIN_OPS
    limits.COMPACT_MIN_OPS = 0
    try:
        yield
    finally:
        limits.COMPACT_MIN_OPS = floor


@pytest.fixture
def data_dir() -> pathlib.Path:
    return DATA


@pytest.fixture
def simrd_logs() -> pathlib.Path:
    if not (SIMRD_LOGS / "REFERENCE.md").exists():
        pytest.skip("the published simrd logs (../shared/simrd-logs) are not present")
    return SIMRD_LOGS
