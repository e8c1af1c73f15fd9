# The two README commands: `make run` (the demo on the built-in model) and `make test`;
# `make bench-serve` shows what the caches save (a cold run beside a warm run).
# Both create .venv on first use and are safe to run again.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run generate lint test test-gpu bench bench-serve bench-gpu gpu-wheels gpu-session gpu-session-more soak clean

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

# two pytest-xdist workers (tests/conftest.py schedules them: a file in one worker; every file whose
# checks see the whole machine, /dev/shm or Ray, in one worker); TEST_WORKERS=0 runs in this process.
# The 15 slowest tests are listed at the end: where the suite's time (aim: under 20 minutes) goes.
TEST_WORKERS ?= 2
test: lint
	$(BIN)/python -m pytest -p no:cacheprovider -n $(TEST_WORKERS) --durations=15

# The GPU kit, on a CUDA machine, from a clone: the python there (GPU_PY, with its own CUDA torch and
# mmserve's dependencies installed) runs the tree as it is; nothing is built or downloaded first.
GPU_PY ?= python3
GPU_RUN := PYTHONPATH=src:tests $(GPU_PY)

# in one process each: tests/gpu (parity with transformers on the same GPU, caches, CUDA graphs and
# async scheduling on vs off, the sampler's GPU paths against the CPU's, a 16-bit KV cache in graphs,
# every LLM's memory given back, the server), then the Triton kernels compiled for the GPU
test-gpu:
	$(GPU_RUN) -m pytest -p no:cacheprovider -m gpu -s tests/gpu
	$(GPU_RUN) -m pytest -p no:cacheprovider -q tests/kernels

# where the time goes on a random-weight Qwen2.5-VL-7B (under 8 minutes): the decode sweep against the
# bandwidth limit, tower and prefill against the matmul rate, TTFT against transformers, per-kernel
# tables (BENCH_GPU_ARGS="--device cpu --tiny" runs it on a CPU at a tiny size); BENCH_GPU_ARGS=--quantized:
# instead, AWQ and FP8 copies of the model, written on the GPU, against it (batch-1 decode step, TTFT)
bench-gpu:
	$(GPU_RUN) benchmarks/gpu_serving.py $(BENCH_GPU_ARGS)

# The next GPU session in two commands. Here (with a network): `make gpu-wheels` downloads into .whl/
# the wheels of what the GPU image lacks (its package list: the device notes' KINDS.md) or holds older
# than pyproject asks (its transformers is 5.17), each at the version this venv holds, for CPython 3.12
# on manylinux x86-64, without their dependencies (those the image lacks are named here too). There
# (no network): `make gpu-session` installs them into /tmp/site and runs, each under a timeout
# (together 9 min 30 s at most: one device call's 10 minutes), what issue 46 needs first: the
# benchmark, the kit, the attention sweep; `make gpu-session-more`, on the machine still warm, the
# benchmark's quantized rows and the attention kernels' table (under 4 minutes). Each logs to $$OUT
# (else /tmp/mmserve-gpu-logs) as it goes.
GPU_WHEELS := msgspec pyzmq blake3 fastapi starlette pydantic pydantic-core annotated-types typing-inspection \
	typing-extensions anyio sniffio uvicorn httptools openai httpx2 httpcore2 truststore jiter httpx httpcore av \
	setproctitle pybase64 zlib-ng xgrammar apache-tvm-ffi opentelemetry-api transformers
WHEEL_PLATFORMS := $(foreach n,17 24 27 28 31 34,--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64 \
	--platform manylinux1_x86_64
GPU_LOGS ?= $(or $(OUT),/tmp/mmserve-gpu-logs)
GPU_SITE := /tmp/site
GPU_SITE_RUN := env PYTHONPATH=src:tests:$(GPU_SITE) $(GPU_PY)
GPU_BENCH_S ?= 200
GPU_TEST_S ?= 230
GPU_SWEEP_S ?= 140
GPU_QUANT_S ?= 150
GPU_KERNELS_S ?= 50

gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	for name in $(GPU_WHEELS); do \
	  version=$$($(BIN)/python -c "import importlib.metadata as m; print(m.version('$$name'))") || exit 1; \
	  $(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    $(WHEEL_PLATFORMS) -d .whl "$$name==$$version" || exit 1; \
	done
	@du -sh .whl; ls .whl | wc -l

$(GPU_SITE)/.installed:
	$(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(GPU_SITE) .whl/*.whl
	touch $@

# each step goes on when the one before fails or runs out of time (test-gpu's two runs too: -i)
gpu-session: $(GPU_SITE)/.installed
	mkdir -p $(GPU_LOGS)
	-PYTHONUNBUFFERED=1 timeout $(GPU_BENCH_S) $(MAKE) --no-print-directory bench-gpu GPU_RUN="$(GPU_SITE_RUN)" 2>&1 \
	  | tee $(GPU_LOGS)/bench-gpu.log
	-PYTHONUNBUFFERED=1 timeout $(GPU_TEST_S) $(MAKE) -i --no-print-directory test-gpu GPU_RUN="$(GPU_SITE_RUN)" 2>&1 \
	  | tee $(GPU_LOGS)/test-gpu.log
	-PYTHONUNBUFFERED=1 timeout $(GPU_SWEEP_S) $(GPU_SITE_RUN) benchmarks/attention_sweep.py 2>&1 \
	  | tee $(GPU_LOGS)/attention-sweep.log

gpu-session-more: $(GPU_SITE)/.installed
	mkdir -p $(GPU_LOGS)
	-PYTHONUNBUFFERED=1 timeout $(GPU_QUANT_S) $(GPU_SITE_RUN) benchmarks/gpu_serving.py --quantized 2>&1 \
	  | tee $(GPU_LOGS)/bench-gpu-quant.log
	-PYTHONUNBUFFERED=1 timeout $(GPU_KERNELS_S) $(GPU_SITE_RUN) benchmarks/attention_kernels.py 2>&1 \
	  | tee $(GPU_LOGS)/attention-kernels.log

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
