# The two README commands: `make run` (the demo on the built-in model) and `make test`.
# Both create .venv on first use and are safe to run again.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run generate test bench clean

setup: $(STAMP)

# torch first, pinned: an unpinned torch (or one pulled in by a dependency) downloads several GB
# of CUDA packages; torch==2.13.0 resolves to the local CPU build.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

# the OpenAI-compatible server on the built-in model, http://127.0.0.1:8000 (Ctrl-C stops it)
run: $(STAMP)
	$(BIN)/mmserve serve builtin:tiny-llava --host 127.0.0.1 --port $(or $(PORT),8000)

# one offline completion about a built-in sample picture
generate: $(STAMP)
	$(BIN)/mmserve generate --prompt "What is in this image?" --max-tokens 32

test: $(STAMP)
	$(BIN)/python -m pytest -p no:cacheprovider

bench: $(STAMP)
	$(BIN)/python benchmarks/offline_throughput.py
	$(BIN)/python benchmarks/serving_overhead.py

clean:
	rm -rf $(VENV)
