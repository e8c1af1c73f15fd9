"""What the endpoints share about choices: the `n` completions of one `RequestOutput` as streamed
deltas (`ChoiceStream`, the SSE loop chat, completions and responses streams run), and log
probabilities in OpenAI's two shapes.

Log probabilities come from the engine as one `{token id: Logprob}` per token (the sampled token
and its top K, see `SamplingParams`); a masked alternative (-inf, e.g. a token a JSON schema forbids)
is reported as -9999.0, as vLLM does, since JSON has no infinity.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Callable, Sequence

from mmserve.entrypoints.openai.errors import to_openai_error
from mmserve.entrypoints.openai.protocol import StreamOptions, UsageInfo
from mmserve.entrypoints.openai.request_record import RequestRecord, outcome_of
from mmserve.outputs import Logprob, RequestOutput

FLOOR = -9999.0


@dataclass(frozen=True)
class StreamUsage:
    """What a stream says of its usage: a last chunk with it (`include`), and the counts so far in
    every chunk too (`continuous`, vLLM's `continuous_usage_stats`)."""

    include: bool = False
    continuous: bool = False

    @classmethod
    def of(cls, options: StreamOptions | None, force: bool = False) -> StreamUsage:
        """A request's `stream_options`, under the server's `--enable-force-include-usage` (`force`)."""
        include = force or (options is not None and bool(options.include_usage))
        return cls(include, include and options is not None and bool(options.continuous_usage_stats))


@dataclass
class ChoiceDelta:
    """What is new in completion `index` since the last delta: text, the log probabilities of its
    new tokens (None when not asked for), and its finish reason once, when it ends."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None


@dataclass
class ChoiceTracker:
    """Turns a request's successive outputs into per-choice deltas (each token and each finish
    reason given out exactly once)."""

    sent_tokens: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)

    def deltas(self, out: RequestOutput) -> list[ChoiceDelta]:
        result = []
        for c in out.outputs:
            if c.index in self.finished:
                continue
            start = self.sent_tokens.get(c.index, 0)
            self.sent_tokens[c.index] = len(c.token_ids)
            logprobs = None if c.logprobs is None else c.logprobs[start:]
            delta = ChoiceDelta(c.index, c.delta_text, c.token_ids[start:], logprobs)
            if c.finish_reason is not None:
                self.finished.add(c.index)
                delta.finish_reason = c.finish_reason
            if delta.text or delta.token_ids or delta.finish_reason:
                result.append(delta)
        return result


def _value(lp: Logprob) -> float:
    return FLOOR if math.isinf(lp.logprob) or math.isnan(lp.logprob) else max(lp.logprob, FLOOR)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _name(token_id: int, lp: Logprob, as_ids: bool) -> str:
    """How a log-probability entry names its token: its text, or vLLM's "token_id:N" (a name that
    stays apart where two tokens have one text, and survives tokens that are not whole characters)."""
    return f"token_id:{token_id}" if as_ids else lp.decoded_token


def _ranked(entry: dict[int, Logprob], top: int) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: kv[1].rank)[:top]


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], top: int,
                  as_ids: bool = False) -> dict[str, Any]:
    """OpenAI chat's `choice.logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}]}`;
    `as_ids`: tokens named "token_id:N" (`bytes` are the name's)."""
    def item(token: int, lp: Logprob) -> dict[str, Any]:
        name = _name(token, lp, as_ids)
        return {"token": name, "logprob": _value(lp), "bytes": _bytes(name)}

    content = [item(token, entry[token]) | {"top_logprobs": [item(t, lp) for t, lp in _ranked(entry, top)]}
               for token, entry in zip(token_ids, entries)]
    return {"content": content, "refusal": None}


def completion_logprobs(token_ids: list[int], entries: Sequence[dict[int, Logprob] | None], top: int,
                        text_offset: int = 0, text_of: Callable[[int], str] | None = None,
                        as_ids: bool = False) -> dict[str, Any]:
    """The legacy completions shape: `tokens`, `token_logprobs`, `top_logprobs` (token text ->
    log probability, K entries) and `text_offset` (each token's start in the choice's text). An
    entry None (an echoed prompt's first token) has null log probabilities, its text `text_of`'s.
    `as_ids`: tokens named "token_id:N" (`text_offset` still counts the text)."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token, entry in zip(token_ids, entries):
        if entry is None:
            text = text_of(token) if text_of is not None else ""
            tokens.append(f"token_id:{token}" if as_ids else text)
            values.append(None)
            tops.append(None)
        else:
            chosen = entry[token]
            text = chosen.decoded_token
            tokens.append(_name(token, chosen, as_ids))
            values.append(_value(chosen))
            tops.append({_name(t, lp, as_ids): _value(lp) for t, lp in _ranked(entry, top)})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


VLLM_ONLY = ("prompt_logprobs", "prompt_token_ids", "token_ids")  # in an answer only when asked for


def drop_unasked(body: dict[str, Any]) -> dict[str, Any]:
    """A response or chunk body without vLLM's fields nobody asked for (`VLLM_ONLY` left null), at
    its top level and in each choice; OpenAI's own null fields stay."""
    for part in (body, *body.get("choices", ())):
        for key in VLLM_ONLY:
            if key in part and part[key] is None:
                del part[key]
    return body


def prompt_logprobs_json(entries: Sequence[dict[int, Logprob] | None]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) token id -> `{logprob, rank,
    decoded_token}` of the prompt's token and the top K there."""
    return [None if entry is None else {str(tid): {"logprob": _value(lp), "rank": lp.rank,
                                                   "decoded_token": lp.decoded_token} for tid, lp in entry.items()}
            for entry in entries]


class ChoiceStream:
    """The SSE events of one streamed request, starting from its first engine output: `_open`'s
    events, then per step each choice's new text as `_delta`'s events, a usage chunk (no choices)
    when asked for, then `data: [DONE]`. Chat and completions differ only in their chunks.

    `events()` yields one string per engine output, holding all of that step's events: the first
    output's (the role chunks and the first text) leave in one write, and an answer finished in its
    first step (`max_tokens` 1, a cached reply) is one string ending in `[DONE]`."""

    def __init__(self, request_id: str, model: str, outputs: AsyncGenerator[RequestOutput, None], first: RequestOutput,
                 record: RequestRecord, usage: StreamUsage, top_logprobs: int = 0, as_ids: bool = False) -> None:
        self.request_id = request_id
        self.model = model
        self.outputs = outputs
        self.first = first
        self.record = record
        self.usage = usage
        self.top_logprobs = top_logprobs
        self.as_ids = as_ids  # log probabilities name tokens "token_id:N"
        self.created = int(time.time())

    async def events(self) -> AsyncGenerator[str, None]:
        step: list[str] = []  # this output's events, not yielded yet
        try:
            step, out, tracker = self._open(), self.first, ChoiceTracker()
            while True:
                step += [event for d in tracker.deltas(out) for event in self._delta(d)]
                if out.finished:
                    break
                if step:
                    yield "".join(step)
                step = []
                out = await anext(self.outputs)
                self.record.observe(out)
            if self.usage.include:
                step.append(self._usage(self._counts()))
            self.record.finish(outcome_of(out))
            await self._finished()
        except Exception as exc:  # the status line is sent: report it in the stream
            self.record.finish("error")
            step.append(self._failed(exc))
        finally:
            await self.close()
        yield "".join(step) + "data: [DONE]\n\n"

    async def close(self) -> None:
        """End the request: closing its engine generator aborts it if it is still running."""
        await self.outputs.aclose()
        self.record.finish("abort")

    def _counts(self) -> UsageInfo:
        """The usage so far: the last chunk's, and every chunk's with `usage.continuous`."""
        return UsageInfo.of(self.record.prompt_tokens, self.record.generation_tokens, self.record.cached_tokens)

    def _with_usage(self, body: dict[str, Any]) -> dict[str, Any]:
        """A chunk's body with its `usage`: null while a usage chunk is to come, the counts so far
        with `usage.continuous`, left out otherwise."""
        if self.usage.continuous and body["usage"] is None:
            body["usage"] = self._counts().model_dump()
        elif not self.usage.include:
            del body["usage"]
        return body

    def _open(self) -> list[str]:
        return []

    async def _finished(self) -> None:
        """Called once the request finished well, before the last events are written."""

    def _failed(self, exc: Exception) -> str:
        """The event that reports a failure after the status line was sent."""
        return f"data: {to_openai_error(exc).body().model_dump_json()}\n\n"

    def _delta(self, d: ChoiceDelta) -> list[str]:
        raise NotImplementedError

    def _usage(self, usage: UsageInfo) -> str:
        raise NotImplementedError
