# The commands: `make demo`, `make test` (the whole suite) and `make check` (its fast lane: README "Tests").
# Each installs what it needs into ./.venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test check test-avx2 check-avx2 clean

setup:
	@bash scripts/setup.sh

demo: setup
	@bash scripts/demo.sh

# The whole suite on TEST_WORKERS pytest-xdist workers (0: one process). Each heavy resource is started on one
# worker only (tests/lanes.py: a group per module, one for the session's engines, one for the vision service),
# each worker's engines bind a core of their own, and torch runs one thread a process (tests/conftest.py).
TEST_WORKERS ?= 2
TEST_DIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)
test: setup
	$(PY) -m pytest -q $(TEST_DIST) --durations=25 $(PYTEST_ARGS)

# The tests that start no vLLM engine, server process, Ray or browser; one that does fails (tests/conftest.py).
# On CHECK_WORKERS pytest-xdist workers: the lane is single-threaded Python, so two cores run two tests at once
# (60-77 s against 81-93 s in one process here); 0 runs it in one process.
CHECK_WORKERS ?= 2
check: setup
	$(PY) -m pytest -q --lane=fast -n $(CHECK_WORKERS) --durations=10 $(PYTEST_ARGS)

# Either lane as an AVX2-only CPU (AMD EPYC) runs it, on a host with AVX-512: every kernel capped to AVX2
# (mmrag/adapters/hardware.py, MMRAG_EMULATE_ISA). To time `make test` and `make check` against their budgets there.
AS_AVX2 := $(PY) -c 'import sys; from mmrag.adapters.hardware import exec_emulating; exec_emulating("avx2", sys.argv[1:])'

test-avx2: setup
	$(AS_AVX2) $(PY) -m pytest -q $(TEST_DIST) --durations=25 $(PYTEST_ARGS)

check-avx2: setup
	$(AS_AVX2) $(PY) -m pytest -q --lane=fast -n $(CHECK_WORKERS) --durations=10 $(PYTEST_ARGS)

clean:
	rm -rf .mmrag demo-data .pytest_cache
