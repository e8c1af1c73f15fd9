"""A fake engine that follows `AsyncLLM`'s interface, for tests of the HTTP layer alone."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from fastapi.testclient import TestClient

from mmserve.config import EngineConfig
from mmserve.errors import ClientError
from mmserve.frontend.engine_client.core_client import EngineDeadError
from mmserve.frontend.cache_resets import ResetReport
from mmserve.frontend.request.prompt import Prompt, PromptSettings
from mmserve.ipc.messages import SchedulerStats
from mmserve.models.generation_config import GenerationDefaults
from mmserve.multimodal.chat_templates import ChatTemplateOptions
from mmserve.multimodal.media import MediaError
from mmserve.outputs import CompletionOutput, RequestOutput, RequestTimes
from mmserve.sampling_params import SamplingParams

MODEL = "tiny"
PROMPT_IDS = [1, 2, 3, 4, 5]
CACHED = 2  # of PROMPT_IDS, "served from the prefix cache"
PIECES = ["Hel", "lo", " wor", "ld"]


class FakeEngine:
    """`AsyncLLM`'s interface: one text piece per step, scripted failures, records aborts."""

    model_dir = "/models/tiny"
    max_model_len = 64
    tokenizer = None
    config = EngineConfig()
    generation_defaults = GenerationDefaults()

    def __init__(self) -> None:
        self.healthy = True
        self.step_s = 0.0
        self.die_after: int | None = None  # raise EngineDeadError after this many outputs
        self.params: list[SamplingParams] = []
        self.prompts: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self.resets: list[dict[str, bool]] = []
        self.finished: list[str] = []
        self.pieces = PIECES  # the text each step adds
        self.piece_ids: list[int] | None = None  # the token id of each piece (default 100, 101, ...)
        self._stats: SchedulerStats | None = None

    @property
    def is_healthy(self) -> bool:
        return self.healthy

    def stats(self) -> SchedulerStats | None:
        return self._stats

    async def build_prompt(self, messages: list[dict], tools: list[dict] | None = None,
                           settings: PromptSettings | None = None,
                           template: ChatTemplateOptions | None = None) -> Prompt:
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise ClientError(f"bad role {m['role']!r}")
            for part in m["content"] if isinstance(m["content"], list) else []:
                if part["type"] == "image_url" and part["image_url"]["url"].startswith("bad:"):
                    raise MediaError("the data is not a supported image")
                if part["type"] == "image_url" and part["image_url"]["url"] == "crash":
                    raise RuntimeError("secret internal detail")
        parts = [p for m in messages for p in (m["content"] if isinstance(m["content"], list)
                                               else [{"type": "text", "text": m["content"]}])]
        text = " ".join(p["text"] for p in parts if p["type"] == "text")
        self.prompts.append({"messages": messages, "prompt": text, "template": template})
        return Prompt(text, settings=settings or PromptSettings())

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams,
                       **routing: object) -> AsyncIterator[RequestOutput]:
        if not self.healthy:
            raise EngineDeadError("engine core died")
        if "too long" in prompt.text:
            raise ClientError("the prompt has 999 tokens, but max_model_len is 64")
        self.params.append(params)
        pieces = self.pieces
        n = min(params.max_tokens, len(pieces))
        text, ids, done = "", [], False
        try:
            for i in range(n):
                await asyncio.sleep(self.step_s)
                if self.die_after is not None and i >= self.die_after:
                    raise EngineDeadError("engine core died")
                text += pieces[i]
                ids.append(100 + i if self.piece_ids is None else self.piece_ids[i])
                done = i == n - 1
                reason = ("length" if n == params.max_tokens else "stop") if done else None
                yield RequestOutput(request_id, prompt.text, PROMPT_IDS, [CompletionOutput(
                    0, text, list(ids), finish_reason=reason, delta_text=pieces[i])], finished=done,
                    num_cached_tokens=CACHED, metrics=RequestTimes(10.0, 10.25, 10.5, 10.5 + 0.25 * i))
        finally:
            (self.finished if done else self.aborted).append(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def reset_caches(self, **caches: bool) -> ResetReport:
        self.resets.append(caches)
        return ResetReport()

    def shutdown(self) -> None:
        pass


def messages(text: str = "hi", url: str | None = None) -> list[dict]:
    """One user message: an optional image part, then a text part."""
    parts: list[dict] = [{"type": "text", "text": text}]
    if url is not None:
        parts.insert(0, {"type": "image_url", "image_url": {"url": url}, "uuid": "img-1"})
    return [{"role": "user", "content": parts}]


GOOD = messages()

def post(client: TestClient, body: Any, **kw: Any):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post("/v1/chat/completions", content=content, headers={"Content-Type": "application/json"}, **kw)
