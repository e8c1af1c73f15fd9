"""What the offline API returns (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmserve.cache_report import CacheReport


@dataclass
class Logprob:
    """One token's log probability, its rank among all tokens (1 = most likely), and its text."""

    logprob: float
    rank: int
    decoded_token: str


# per output token: token id -> Logprob, holding the sampled token and the top K alternatives
SampleLogprobs = list[dict[int, Logprob]]
# per prompt token: token id -> Logprob, the prompt's token and the top K there; None for the first token
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestTimes:
    """A request's times in the engine core (vLLM's `RequestOutput.metrics` fields): P1's monotonic
    clock, so only their differences mean anything. `last_token_ts` moves with each output."""

    queued_ts: float  # it reached the engine core
    scheduled_ts: float | None  # first admitted (None: answered before any admission, never)
    first_token_ts: float
    last_token_ts: float

    @property
    def queue_s(self) -> float | None:
        return None if self.scheduled_ts is None else self.scheduled_ts - self.queued_ts

    @property
    def prefill_s(self) -> float | None:
        return None if self.scheduled_ts is None else self.first_token_ts - self.scheduled_ts

    @property
    def decode_s(self) -> float:
        return self.last_token_ts - self.first_token_ts

    @property
    def inference_s(self) -> float | None:
        return None if self.scheduled_ts is None else self.last_token_ts - self.scheduled_ts


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    delta_text: str = ""  # text new since the previous output of this request (for streaming)
    logprobs: SampleLogprobs | None = None  # with SamplingParams.logprobs: one entry per token
    num_cached_tokens: int | None = None  # this completion's prefix-cache hit (n > 1: siblings hit the prompt)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EmbeddingOutput:
    """An embedding (vLLM's `EmbeddingOutput`): the prompt's pooled hidden state."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (vLLM's `EmbeddingRequestOutput`): `outputs.embedding`, pooled from
    the hidden state of the prompt's last token (vLLM's LAST pooling), L2-normalized unless asked
    not to be; `num_cached_tokens` as a generation request reports it."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache; None before the first token
    cache_report: CacheReport | None = None  # what each cache layer did for the prompt (server requests)
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams.prompt_logprobs, from the first output
    metrics: RequestTimes | None = None  # the engine core's times (vLLM's name); None before the first token
    hidden: bytes | None = None  # an embedding request's prompt's last hidden state (float32 bytes): `embedding.py`
