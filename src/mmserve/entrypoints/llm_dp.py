"""Offline data parallelism: `LLM(..., data_parallel_size=N)` drives the server's `AsyncLLM`
(N engine-core processes, the same routing) from a private event loop.

Contract: `generate` sends every prompt at once and returns the outputs in the prompts' order.
A bad prompt raises its ValueError and the others are aborted (some may have started running:
unlike the single-engine `LLM`, prompts are checked as they are admitted). `shutdown` stops
every engine core; it also runs at interpreter exit through the engine cores' own finalizers.
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

from mmserve.config import EngineConfig
from mmserve.frontend.async_llm import AsyncLLM
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import SamplingParams


class DataParallelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self._runner = asyncio.Runner()
        self.engine = AsyncLLM(config)

    def generate(self, ids: Sequence[str], prompts: Sequence[str | dict[str, Any]],
                 params: Sequence[SamplingParams]) -> list[RequestOutput]:
        return self._runner.run(self._all(ids, prompts, params))

    async def _all(self, ids: Sequence[str], prompts: Sequence[str | dict[str, Any]],
                   params: Sequence[SamplingParams]) -> list[RequestOutput]:
        tasks = [asyncio.ensure_future(self._one(*args)) for args in zip(ids, prompts, params)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _one(self, request_id: str, prompt: str | dict[str, Any], params: SamplingParams) -> RequestOutput:
        last = None
        async for out in self.engine.generate(request_id, prompt, params, stream=False):
            last = out
        assert last is not None
        return last

    def shutdown(self) -> None:
        self.engine.shutdown()
        self._runner.close()
