"""The messages between P0 (the frontend) and P1 (an engine core), in both directions.

P0 -> P1: `EngineCoreRequest`, aborts, cache resets (`EngineCoreInput`); P1 -> P0:
`EngineCoreOutputs` with their stats, readiness and failure (`EngineCoreEvent`). What the engine
core's scheduler sends its model runner and tensor-parallel workers, and what they answer, is in
`ipc/worker_messages.py`; what crosses to and from the launcher's services (`--api-server-count`
> 1) in `ipc/launcher_messages.py`. A message carries only what the receiver lacks.
"""

from __future__ import annotations

import msgspec

from mmserve.ipc.items import MultiModalItem
from mmserve.sampling_params import SamplingParams


class FinishReason:
    """Values of `EngineCoreOutput.finish_reason` (OpenAI's names)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # aborted by the client or the frontend


# ---- P0 -> P1 ---------------------------------------------------------------------------


class EngineCoreRequest(msgspec.Struct, tag="add"):
    """A tokenized, processed request, ready for the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    mm_items: list[MultiModalItem]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    cache_salt: str | None = None  # isolates a tenant in every cache (prefix blocks included)
    ipc_epoch: int = 0  # the IPC cache epoch the sender was in; a newer one empties the receiver
    client_index: int = 0  # the API server that sent it (--api-server-count): its outputs go back there
    return_first_logits: bool = False  # send back the first sampled step's raw logits row (`first_logits`)
    return_hidden: bool = False  # an embedding: send back the prompt's last hidden state (`hidden`)
    bypass_caches: bool = False  # a shadow run (`frontend/cache_verifier.py`): reads and writes no cache, runs last
    priority: int = 0  # --scheduling-policy priority: the lower, the sooner it runs (vLLM's)


class AbortRequests(msgspec.Struct, tag="abort"):
    """Stop these requests and free what they hold; unknown ids are ignored. An id is a request's
    (all its completions) or `sibling_request_id(id, index, n)` (one completion of an n > 1 request)."""

    request_ids: list[str]


class ResetCaches(msgspec.Struct, tag="reset"):
    """Drop what P1's caches hold (vLLM's `reset_prefix_cache` / `reset_encoder_cache` /
    `reset_mm_cache`, `engine/cache_reset.py`); answered by a `CachesReset` in the asking API
    server's next outputs. With `mm` the asking server's IPC receiver starts `ipc_epoch`, empty,
    and every other API server is told to reset its own item layers (`EngineCoreOutputs.reset_items`)."""

    call_id: int
    prefix: bool = False  # KV blocks' keys, partial blocks, first tokens
    encoder: bool = False  # encoder outputs
    mm: bool = False
    ipc_epoch: int = 0
    client_index: int = 0


class CachesReset(msgspec.Struct, array_like=True):
    """What a `ResetCaches` dropped: blocks that had keys, first tokens, encoder outputs."""

    call_id: int
    prefix_blocks: int = 0
    first_tokens: int = 0
    encoder_items: int = 0


EngineCoreInput = EngineCoreRequest | AbortRequests | ResetCaches  # everything P0 sends P1


def sibling_request_id(request_id: str, index: int, n: int) -> str:
    """The engine core's id of completion `index` of a request with `n` completions (the request's
    own id when n is 1)."""
    return request_id if n == 1 else f"{request_id}#{index}"


def client_request_id(engine_request_id: str) -> str:
    """The request's own id behind a completion's engine-core id (`sibling_request_id`'s inverse;
    an id without an index is returned as it is)."""
    return engine_request_id.rpartition("#")[0] or engine_request_id


# ---- P1 -> P0 ---------------------------------------------------------------------------


class EngineCoreReady(msgspec.Struct, tag="ready"):
    """P1 loaded the model and sized its KV cache; it takes requests from now on."""

    max_model_len: int
    num_kv_blocks: int
    pid: int = 0  # P1's process id (an API server that did not start P1 watches it by pid)
    dtype: str = "float32"  # the weights' and activations' dtype, "auto" resolved on the rank's device
    restarts: int = 0  # the rank's restarts so far, as its supervisor counted them (`restarts.py`)


class EngineCoreFailed(msgspec.Struct, tag="failed"):
    """P1 could not start (or hit a fatal error); `message` says why."""

    message: str


class TokenLogprobs(msgspec.Struct, array_like=True):
    """One sampled token's log probability, its rank (1 = most likely) and the K most likely
    tokens with theirs (K = `SamplingParams.logprobs`, most likely first)."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


class EngineCoreOutput(msgspec.Struct, omit_defaults=True):
    """New tokens of one completion this step; `finish_reason` set on its last output.

    `error` is set (with finish_reason "abort") when P1 refused or lost the request, and
    `error_kind` says whose fault: "client" (a refusal, a 4xx) or "internal" (the engine failed
    while serving it, a 500; see mmserve/errors.py). `index` is
    the completion's (0 ≤ index < n); `siblings_running` says, on a finished completion, that
    others of its request still run (P1 keeps the request's items until the last one ends).
    `new_logprobs` has one entry per new token when the request asked for log probabilities;
    `prompt_logprobs` (first output, when asked) one per prompt token after the first.
    On a completion's first output, `cache_counts` maps each P1 cache layer that was asked for the
    prompt ("prefix", "partial_block" in tokens; "encoder" in items; "last_block", "first_token" in lookups) to
    (hits, queries) for this request alone, and `first_logits` (when the request asked for them)
    is the raw logits row of its first sampled token, float32 bytes (absent when the first-token
    cache answered: no forward ran). Times are P1's monotonic clock (vLLM's engine-core timestamps,
    compared only with each other): `timestamp` when the output was made; on the first output also
    `queued_at` (the completion reached P1) and `scheduled_at` (its first admission).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id that ended it, if any
    error: str | None = None
    error_kind: str = "client"
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (set on the first output)
    index: int = 0
    siblings_running: bool = False
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    cache_counts: dict[str, tuple[int, int]] | None = None
    first_logits: bytes | None = None
    hidden: bytes | None = None  # the prompt's last final-normed hidden state, float32, when asked (an embedding)
    timestamp: float = 0.0
    queued_at: float | None = None
    scheduled_at: float | None = None


class CacheStats(msgspec.Struct):
    """One cache layer's counters since start (cumulative) and its current size."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0
    bytes_saved: int = 0  # bytes kept off the P0 -> P1 wire (ipc, shm)
    entries: int = 0
    bytes_used: int = 0  # the encoder layer counts embedding tokens here (see EngineCore.stats)
    fallbacks: int = 0  # items the layer could not take and that went inline instead (shm)
    keys_digest: int = 0  # XOR of the keys' 64-bit digests (ipc): equal on both sides when in step


def sum_stats(layers: list[CacheStats]) -> CacheStats:
    """One layer's stats over several caches (e.g. one per rank): counters and sizes added, key
    digests XORed."""
    names = CacheStats.__struct_fields__
    total = {name: sum(getattr(c, name) for c in layers) for name in names if name != "keys_digest"}
    digest = 0
    for c in layers:
        digest ^= c.keys_digest
    return CacheStats(**total, keys_digest=digest)


class SchedulerStats(msgspec.Struct):
    """P1's state after a step, for /metrics and tests. `caches` maps a cache layer
    ("processor", "ipc", "shm", "encoder", "prefix", "first_token") to its stats."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int  # since start
    caches: dict[str, CacheStats] = {}
    weight_bytes: int = 0  # resident model weights, all tensor-parallel ranks together


def sum_scheduler_stats(ranks: list[SchedulerStats]) -> SchedulerStats:
    """Several engine cores' stats as one: counts added, each cache layer summed (`sum_stats`)."""
    layers = sorted({layer for s in ranks for layer in s.caches})
    counts = {name: sum(getattr(s, name) for s in ranks) for name in SchedulerStats.__struct_fields__
              if name != "caches"}
    return SchedulerStats(**counts, caches={layer: sum_stats([s.caches[layer] for s in ranks if layer in s.caches])
                                            for layer in layers})


class EngineCoreOutputs(msgspec.Struct, tag="outputs"):
    """Outputs of a step. `resend` names requests P1 could not admit because their items came
    by hash alone and its IPC cache lacks them (request id -> the missing hashes): P0 resends."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None = None
    resend: dict[str, list[str]] = {}
    resets: list[CachesReset] = []  # the server's `ResetCaches` done since its last outputs
    reset_items: bool = False  # another API server reset the multimodal caches: reset this one's item layers


EngineCoreEvent = EngineCoreReady | EngineCoreFailed | EngineCoreOutputs  # everything P1 sends P0
