# The two set-up-and-go commands (see README):
#   make demo   - create .venv, install dtr, run a training step under budgets, and the simulator
#   make test   - create .venv, install dtr with test extras, lint and type-check, run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
# The CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: venv demo lint test check-install bench experiments clean

$(VENV)/.installed: pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/native/*.cpp)
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
	$(PY) -m mypy.stubtest dtr._C --allowlist stubtest_allowlist.txt

# The whole suite runs on the native per-op path (dtr._native must be built: DTR_REQUIRE_NATIVE), entering
# through the CPU's default entry, the dispatch key (Note [The default entry] in dtr/runtime/native.py); then the
# runtime's own tests run again on the Python reference path (DTR_NATIVE=0, a dispatch mode), and on the native
# path entered as a dispatch mode (DTR_ENTRY=mode: the default where torch sees an accelerator).
RUNTIME_TESTS = tests/test_runtime.py tests/test_runtime_fuzz.py tests/test_exactness.py tests/test_runtime_models.py \
                tests/test_runtime_compat.py tests/test_training_loops.py tests/test_nesting.py \
                tests/test_budget_errors.py tests/test_generation.py
MODE_TESTS = $(RUNTIME_TESTS) tests/test_native.py
test: lint
	DTR_REQUIRE_NATIVE=1 $(PY) -m pytest -q
	DTR_NATIVE=0 $(PY) -m pytest -q $(RUNTIME_TESTS)
	DTR_ENTRY=mode $(PY) -m pytest -q $(MODE_TESTS)

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

bench: venv
	$(PY) benchmarks/bench_sim.py --out BENCHMARKS.md
	$(PY) benchmarks/bench_eqclass_scaling.py --out BENCHMARKS.md --figure benchmarks/eqclass_scaling.png
	$(PY) benchmarks/bench_sweep.py
	$(PY) benchmarks/bench_host_overhead.py --out BENCHMARKS.md

experiments: venv
	$(PY) experiments/make_experiments.py

clean:
	rm -rf build $(VENV) *.egg-info dtr/*.so
