"""P0's engine: input processing -> engine core -> output processing.

The engine core runs in this process for now; it is reached only through `EngineCoreRequest`s,
`abort_requests` and `step()`'s `EngineCoreOutputs`, the messages that will cross to P1.
"""

from __future__ import annotations

from typing import Any

from mmserve.cache_report import CacheReport
from mmserve.config import EngineConfig
from mmserve.engine.core import EngineCore
from mmserve.frontend.input_processor import InputProcessor
from mmserve.frontend.output.output_processor import OutputProcessor
from mmserve.models.builtin import resolve_model
from mmserve.models.hf_config import eos_token_id
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = resolve_model(config.model.model)
        self.core = EngineCore(config, self.model_dir)
        eos = eos_token_id(self.model_dir)
        self.input_processor = InputProcessor(config, self.model_dir, self.core.max_model_len, eos)
        self.tokenizer = self.input_processor.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)

    def add_request(self, request_id: str, prompt: str | dict[str, Any], params: SamplingParams) -> None:
        """Process and queue a request; any fault in it is a ValueError and queues nothing.

        Its outputs carry a `CacheReport` (items pass by reference here: no IPC or shm layer).
        """
        report = CacheReport()
        request = self.input_processor.process(request_id, prompt, params, commit=False, report=report)
        try:
            self.core.add_request(request)
        except BaseException:
            self.input_processor.reject(request_id)
            raise
        self.input_processor.accept(request_id)
        self.output_processor.add_request(request, prompt if isinstance(prompt, str) else prompt.get("prompt"), report)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.output_processor.abort_requests(request_ids)
        self.core.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        batch = self.output_processor.process_outputs(self.core.step().outputs)
        if batch.to_abort:
            self.core.abort_requests(batch.to_abort)
        return batch.outputs
