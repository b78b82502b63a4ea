# The two set-up-and-go commands (see README):
#   make demo   - create .venv, install dtr, run a training step under budgets, and the simulator
#   make test   - create .venv, install dtr with test extras, lint and type-check, run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
# The CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: venv demo lint test test-fast test-paths check-install bench experiments clean

$(VENV)/.installed: pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/native/*.cpp csrc/native/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q setuptools wheel "pybind11>=3.0"
	$(PIP) install -q --no-build-isolation -e ".[test]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) examples/demo_budget.py
	@echo
	$(VENV)/bin/dtr-sim chain --n 1024 --budget sqrt --heuristic dtr
	@echo
	$(VENV)/bin/dtr-sim replay logs/gpt.jsonl.gz --budget 50%

# ruff (style, imports, likely bugs), mypy over dtr/, and mypy's stubtest: dtr/_C.pyi against the built extension.
lint: venv
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m mypy.stubtest dtr._C --allowlist stubtest_allowlist.txt --mypy-config-file pyproject.toml

# The whole suite runs on the native per-op path (dtr._native must be built: DTR_REQUIRE_NATIVE), entering
# through the CPU's default entry, the dispatch key (Note [The default entry] in dtr/runtime/native.py); then the
# runtime's own tests run again on the Python reference path (DTR_NATIVE=0, a dispatch mode), and on the native
# path entered as a dispatch mode (DTR_ENTRY=mode: the default where torch sees an accelerator). Those two passes
# leave out the tests marked slow (whole models, long fuzz runs), to keep CI within its time: `make test-paths`
# runs them too.
RUNTIME_TESTS = tests/runtime
MODE_TESTS = $(RUNTIME_TESTS) tests/native
# Each pass ends with pytest's summary line (counts and the pass's wall time) and its 15 slowest tests. The tests
# run in JOBS processes (pytest-xdist; each test is independent of the others' order): CI's machine has two cores,
# and one process left one of them idle most of the time (pass 1: 13-16 min in one process, 9 in two).
JOBS ?= 2
PYTEST = $(PY) -m pytest -q -n $(JOBS) --durations=15
test: lint
	@echo "== pass 1/3: the whole suite (native path, default entry)"
	DTR_REQUIRE_NATIVE=1 $(PYTEST)
	@echo "== pass 2/3: the runtime's tests on the Python reference path (DTR_NATIVE=0), without the slow ones"
	DTR_NATIVE=0 $(PYTEST) -m "not slow" $(RUNTIME_TESTS)
	@echo "== pass 3/3: the runtime's and the native path's tests entered as a dispatch mode (DTR_ENTRY=mode), without the slow ones"
	DTR_ENTRY=mode $(PYTEST) -m "not slow" $(MODE_TESTS)

# Passes 2 and 3 of make test with the slow tests as well.
test-paths: venv
	DTR_NATIVE=0 $(PYTEST) $(RUNTIME_TESTS)
	DTR_ENTRY=mode $(PYTEST) $(MODE_TESTS)

# The first pass without the tests marked slow (each over about ten seconds; a few minutes in all), and no lint:
# for a quick check while working. make test runs everything.
test-fast: venv
	DTR_REQUIRE_NATIVE=1 $(PYTEST) -m "not slow"

# The install route a user takes, in a fresh virtual environment: the pinned torch, then `pip install .` with
# pip's build isolation (setup.py finds that torch: Note [Finding the user's torch]); `python -m dtr info` exits
# non-zero unless the native per-op path is active there. Run from / so that the checkout is not imported.
CHECK_VENV ?= build/check-install-venv
check-install:
	rm -rf $(CHECK_VENV)
	$(PYTHON) -m venv $(CHECK_VENV)
	$(CHECK_VENV)/bin/python -m pip install -q --upgrade pip
	$(CHECK_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(CHECK_VENV)/bin/python -m pip install -q .
	cd / && DTR_CACHE_DIR=$(abspath $(CHECK_VENV))/empty-cache $(abspath $(CHECK_VENV))/bin/python -m dtr info

# BENCHMARKS.md, generated end to end: each benchmark rewrites its own marked section (benchmarks/report.py,
# Note [Marked sections]) with its date, machine and command, and leaves any other section as it is.
bench: venv
	$(PY) benchmarks/bench_sim.py --out BENCHMARKS.md
	$(PY) benchmarks/bench_eqclass_scaling.py --out BENCHMARKS.md --figure benchmarks/eqclass_scaling.png
	$(PY) benchmarks/bench_sweep.py --out BENCHMARKS.md
	$(PY) benchmarks/bench_host_overhead.py --out BENCHMARKS.md --label "make's install"

experiments: venv
	$(PY) experiments/make_experiments.py

clean:
	rm -rf build $(VENV) *.egg-info dtr/*.so
