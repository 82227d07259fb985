# The two commands: `make demo` and `make test`. Both install what they need into ./.venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test clean

setup:
	@bash scripts/setup.sh

demo: setup
	@bash scripts/demo.sh

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf .mmrag demo-data .pytest_cache
