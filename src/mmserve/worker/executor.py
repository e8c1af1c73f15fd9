"""Executors run the model for the engine core: in its own process (tensor parallel size 1) or
in one worker process per rank (worker/multiproc_executor.py). Both offer the same calls:
`kv_cache_bytes_per_block`, `available_kv_cache_bytes`, `initialize_kv_cache`, `execute_model` (or,
for --async-scheduling, a step in four: `prepare`, `launch`, `collect` of the step before, `sample`),
`check_health`, `shutdown`."""

from __future__ import annotations

from typing import Any

from mmserve.config import EngineConfig
from mmserve.ipc.worker_messages import ModelRunnerOutput, SchedulerOutput


def make_executor(config: EngineConfig, model_dir: str, shm_store: bytes | None = None) -> Any:
    """The in-process executor for --tensor-parallel-size 1 (no extra process), else N workers
    (which read multimodal items from the shared-memory store `shm_store` when given)."""
    if config.parallel.tensor_parallel_size == 1:
        return InProcessExecutor(config, model_dir)
    from mmserve.worker.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(config, model_dir, shm_store)


class InProcessExecutor:
    """The model runner in the caller's process (tensor parallel size 1)."""

    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        from mmserve.worker.model_runner import ModelRunner  # torch stays out of P0

        self.runner = ModelRunner(config, model_dir)
        self.available_bytes = self.runner.available_kv_cache_bytes()  # profiled once, at start
        self.dtype = self.runner.dtype_name
        self.weight_bytes: int = self.runner.model.weight_bytes

    def kv_cache_bytes_per_block(self) -> int:
        return self.runner.kv_cache_bytes_per_block()

    def available_kv_cache_bytes(self) -> int | None:
        return self.available_bytes

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    # a step in four calls, for --async-scheduling (`engine/core.py: EngineCore._step_overlapped`)

    def prepare(self, scheduler_output: SchedulerOutput) -> Any:
        return self.runner.prepare(scheduler_output)

    def launch(self, prepared: Any, previous: Any) -> Any:
        return self.runner.launch(prepared, previous)

    def collect(self, launched: Any) -> ModelRunnerOutput:
        return self.runner.collect(launched)

    def sample(self, launched: Any) -> None:
        self.runner.sample(launched)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        """Free the runner's device memory (weights, KV cache, graphs); the executor is unusable after."""
        self.runner.shutdown()
