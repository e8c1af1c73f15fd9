"""One streamed chat completion over HTTP, timed: `send_request` -> `RequestResult`.

Times are `time.perf_counter()` seconds. TTFT runs from sending the request to the first SSE
chunk that carries a choice (mmserve sends the first chunk once the first token exists); the
inter-token latencies are the gaps between later chunks that carry text. Token counts come from
the server's usage chunk (`stream_options.include_usage`); a server that sends none gets its
output tokens counted as text chunks and its prompt tokens as 0.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mmserve.bench.datasets import BenchRequest

if TYPE_CHECKING:
    import httpx

MAX_ERROR_CHARS = 300


@dataclass
class RequestResult:
    """What one request gave: success, token counts and times in seconds (None when no token came)."""

    success: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class RequestSettings:
    """What every request of a benchmark shares: the endpoint, model name and sampling."""

    url: str  # the full chat completions URL
    model: str
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True

    def headers(self) -> dict[str, str]:
        return {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}

    def body(self, request: BenchRequest) -> dict[str, Any]:
        return {"model": self.model, "messages": request.messages, "max_tokens": request.output_len,
                "temperature": self.temperature, "ignore_eos": self.ignore_eos, "stream": True,
                "stream_options": {"include_usage": True}}


async def send_request(client: httpx.AsyncClient, settings: RequestSettings, request: BenchRequest) -> RequestResult:
    """Send one request and time it; every failure (HTTP status, error event, network) is recorded, not raised."""
    result = RequestResult()
    start = time.perf_counter()
    try:
        async with client.stream("POST", settings.url, json=settings.body(request),
                                 headers=settings.headers()) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {_error_message(body)}"
            else:
                await _read_stream(response, result, start)
    except Exception as e:  # network errors, timeouts, a malformed stream
        result.error = f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]
    result.latency_s = time.perf_counter() - start
    result.success = result.error is None
    return result


async def _read_stream(response: httpx.Response, result: RequestResult, start: float) -> None:
    chunks_with_text = 0
    last: float | None = None
    done = False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            done = True
            break
        now = time.perf_counter()
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = "stream error: " + _error_message(data)
            return
        if chunk.get("usage"):
            result.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
            result.output_tokens = chunk["usage"].get("completion_tokens", 0)
        if not chunk.get("choices"):
            continue
        if result.ttft_s is None:
            result.ttft_s, last = now - start, now
        if chunk["choices"][0].get("delta", {}).get("content"):
            chunks_with_text += 1
            if last is not None and chunks_with_text > 1:
                result.itl_s.append(now - last)
            last = now
    if not done:
        result.error = "the stream ended without [DONE]"
    elif result.output_tokens == 0:
        result.output_tokens = chunks_with_text


def _error_message(body: str) -> str:
    """The `error.message` of an OpenAI error body, else the body itself (cut short)."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body
    return str(message)[:MAX_ERROR_CHARS]
