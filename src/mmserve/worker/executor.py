"""Executors run the model for the engine core; this one runs it in the engine core's process."""

from __future__ import annotations

from mmserve.config import EngineConfig
from mmserve.ipc.messages import ModelRunnerOutput, SchedulerOutput


class InProcessExecutor:
    """The model runner in the caller's process (tensor parallel size 1)."""

    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        from mmserve.worker.model_runner import ModelRunner  # torch stays out of P0

        self.runner = ModelRunner(config, model_dir)

    def kv_cache_bytes_per_block(self) -> int:
        return self.runner.kv_cache_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass
