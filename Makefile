# The two README commands: `make run` (the demo on the built-in model) and `make test`;
# `make bench-serve` shows what the caches save (a cold run beside a warm run).
# Both create .venv on first use and are safe to run again.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run generate lint test test-gpu bench bench-serve bench-gpu soak clean

setup: $(STAMP)

# torch first, pinned: an unpinned torch (or one pulled in by a dependency) downloads several GB
# of CUDA packages; torch==2.13.0 resolves to the local CPU build.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,ray]'
	touch $(STAMP)

# the OpenAI-compatible server on the built-in model, http://127.0.0.1:8000 (Ctrl-C stops it)
run: $(STAMP)
	$(BIN)/mmserve serve builtin:tiny-llava --host 127.0.0.1 --port $(or $(PORT),8000)

# one offline completion about a built-in sample picture
generate: $(STAMP)
	$(BIN)/mmserve generate --prompt "What is in this image?" --max-tokens 32

# ruff and mypy, configured in pyproject.toml; `make test` runs them first
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -p no:cacheprovider

# The GPU kit, on a CUDA machine, from a clone: the python there (GPU_PY, with its own CUDA torch and
# mmserve's dependencies installed) runs the tree as it is; nothing is built or downloaded first.
GPU_PY ?= python3
GPU_RUN := PYTHONPATH=src:tests $(GPU_PY)

# in one process each: tests/gpu (parity with transformers on the same GPU, caches and CUDA graphs on
# vs off, every LLM's memory given back, the server), then the Triton kernels compiled for the GPU
test-gpu:
	$(GPU_RUN) -m pytest -p no:cacheprovider -m gpu -s tests/gpu
	$(GPU_RUN) -m pytest -p no:cacheprovider -q tests/kernels

# where the time goes on a random-weight Qwen2.5-VL-7B (under 8 minutes): the decode sweep against the
# bandwidth limit, tower and prefill against the matmul rate, TTFT against transformers, per-kernel
# tables (BENCH_GPU_ARGS="--device cpu --tiny" runs it on a CPU at a tiny size)
bench-gpu:
	$(GPU_RUN) benchmarks/gpu_serving.py $(BENCH_GPU_ARGS)

# every component benchmark in benchmarks/ (one at a time: make bench ONLY=serving_overhead)
bench: $(STAMP)
	$(BIN)/python -m benchmarks $(if $(ONLY),--only $(ONLY))

# the serving benchmark on the built-in model: launches a server, sends the same requests twice
# (cold, then warm), prints both runs side by side with each cache layer's hit rate, stops the server
bench-serve: $(STAMP)
	$(BIN)/mmserve bench serve --launch --repeat 2

# the soak: a real server on loopback under mixed good, hostile, cancelled and uuid-only requests
# with tiny caches, lru then shm, bounded in requests and seconds; fails if anything leaks or an
# answer differs from a fresh server's (tests/soak.py; e.g. SOAK_ARGS="--requests 1000 --seconds 300")
soak: $(STAMP)
	$(BIN)/python tests/soak.py $(SOAK_ARGS)

clean:
	rm -rf $(VENV)
