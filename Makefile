# The two commands: `make demo` and `make test`. Both install what they need into ./.venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-avx2 clean

setup:
	@bash scripts/setup.sh

demo: setup
	@bash scripts/demo.sh

test: setup
	$(PY) -m pytest -q --durations=30 $(PYTEST_ARGS)

# The suite as an AVX2-only CPU (AMD EPYC) runs it, on a host with AVX-512: every kernel capped to AVX2
# (adapters/hardware.py, MMRAG_EMULATE_ISA). To time `make test` against its 30-minute budget there.
test-avx2: setup
	$(PY) -c 'import sys; from adapters.hardware import exec_emulating; exec_emulating("avx2", sys.argv[1:])' \
		$(PY) -m pytest -q --durations=30 $(PYTEST_ARGS)

clean:
	rm -rf .mmrag demo-data .pytest_cache
