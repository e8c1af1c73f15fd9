"""The messages between an engine core's scheduler (P1) and its model runner and workers.

P1 scheduler -> workers: `SchedulerOutput` (wrapped in `ExecuteModel` when it crosses to
tensor-parallel worker processes); workers -> P1: `ModelRunnerOutput`; the executor's life-cycle
messages with its tensor-parallel ranks (`WorkerInput`, `WorkerEvent`). A message carries only what
the receiver lacks: a request already known to the workers ships its new block ids, not its
history; its multimodal items travel once, in its `NewRequestData`.
"""

from __future__ import annotations

import msgspec

from mmserve.ipc.items import MultiModalItem
from mmserve.ipc.messages import TokenLogprobs
from mmserve.sampling_params import SamplingParams


# ---- P1 scheduler -> workers -------------------------------------------------------------


class NewRequestData(msgspec.Struct):
    """A request the workers have not seen (or lost to preemption): everything they need.

    Sent once per request (and again after a preemption), so it is the only message that
    carries the request's items to the workers; every later step ships `CachedRequestData`.
    Items come with `data` (--mm-cache-type lru), or as `shm_handle` alone when the executor
    strips them for workers that read the shared-memory store themselves."""

    request_id: str
    token_ids: list[int]  # prompt, plus outputs so far when resumed after preemption
    mm_items: list[MultiModalItem]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int | None = None  # None: all of token_ids is prompt
    eos_token_id: int | None = None  # what `min_tokens` holds back, with the stop token ids
    return_first_logits: bool = False  # the runner returns the first sampled step's raw logits row
    return_hidden: bool = False  # ... and the prompt's last hidden state (an embedding request)


class CachedRequestData(msgspec.Struct):
    """A request the workers already hold: only what changed."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


class SchedulerOutput(msgspec.Struct):
    """One step's work.

    `num_scheduled_tokens[id]` tokens of request `id` run from its `num_computed_tokens`.
    `scheduled_encoder_inputs[id]` lists the indices of its items to encode this step, before
    the decoder runs; each `mm_hash` appears at most once per step (a request whose items are
    resident, or encoded this step for another request, reads the runner's output by hash).
    `free_encoder_ids` are the `mm_hash`es of encoder outputs the runner deletes before encoding.
    `finished_request_ids` (finished, aborted or preempted since the last step) drop their state.
    `kv_copies` are (source, destination) KV block ids, copied in every layer before the step
    writes any K/V (a prompt's cached last block, into the block of a request that repeats it; a
    block whose leading tokens a request shares, into that request's block). Whole blocks are
    copied: the destination's owner writes its own K/V past the copied tokens before reading them.
    """

    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    scheduled_encoder_inputs: dict[str, list[int]]
    free_encoder_ids: list[str]
    finished_request_ids: list[str]
    kv_copies: list[tuple[int, int]] = []


# ---- workers -> P1 -----------------------------------------------------------------------


class ModelRunnerOutput(msgspec.Struct):
    """Sampled tokens per scheduled request; an empty list where a prefill chunk ended early.
    `logprobs[id]` (requests that asked only) has one entry per sampled token; `first_logits[id]`
    the raw logits row (float32 bytes) of the first token sampled after the prompt, for requests
    that asked (`NewRequestData.return_first_logits`); `hidden[id]` the final-normed hidden state
    (float32 bytes) that first token was sampled from, for `return_hidden`; `prompt_logprobs[id]` (requests with
    `prompt_logprobs`) is (i, entries): the log probabilities of prompt tokens i, i + 1, ... that
    this step's chunk scored."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = {}
    first_logits: dict[str, bytes] = {}
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = {}
    hidden: dict[str, bytes] = {}


# ---- P1 executor <-> tensor-parallel workers ---------------------------------------------
# P1 broadcasts `WorkerInput`s to every rank through the shared-memory ring (ipc/shm_broadcast.py);
# ranks answer with `WorkerEvent`s on one ZMQ PUSH/PULL queue.


class ShmBroadcastInfo(msgspec.Struct, frozen=True):
    """What a reader needs to attach to a broadcast ring (given to each worker at spawn)."""

    name: str  # the shared-memory segment
    num_slots: int
    slot_bytes: int  # payload bytes per slot; bigger messages go over ZMQ
    num_readers: int
    overflow_addresses: list[str]  # reader i receives oversized messages on address i


class InitializeKVCache(msgspec.Struct, tag="init_kv_cache"):
    """Allocate `num_blocks` KV blocks (of this rank's KV heads); every rank answers `WorkerDone`."""

    num_blocks: int


class ExecuteModel(msgspec.Struct, tag="execute_model"):
    """Run one step; rank 0 answers `WorkerStepOutput`, the others only on failure. With `overlap`
    (--async-scheduling) each rank prepares and launches the step, collects the step before (rank 0
    answering with that one's output) and samples this one."""

    scheduler_output: SchedulerOutput
    overlap: bool = False


class ShutdownWorker(msgspec.Struct, tag="shutdown"):
    """Leave the loop and exit 0."""


WorkerInput = InitializeKVCache | ExecuteModel | ShutdownWorker  # P1 -> every rank


class WorkerReady(msgspec.Struct, tag="worker_ready"):
    """The rank loaded its shard of the model (and on CUDA profiled its largest step)."""

    rank: int
    kv_cache_bytes_per_block: int
    available_kv_cache_bytes: int | None = None  # on CUDA: what --gpu-memory-utilization leaves the KV cache
    dtype: str = "float32"  # the rank's resolved dtype
    weight_bytes: int = 0  # the rank's resident weights (quantized ones as they are held)


class WorkerDone(msgspec.Struct, tag="worker_done"):
    """The rank finished an `InitializeKVCache`."""

    rank: int


class WorkerStepOutput(msgspec.Struct, tag="worker_step_output"):
    """The sampled tokens of one `ExecuteModel`, sent by rank 0 alone (every rank sampled the same)."""

    rank: int
    output: ModelRunnerOutput


class WorkerFailed(msgspec.Struct, tag="worker_failed"):
    """The rank hit an error (it exits 1 after sending this)."""

    rank: int
    message: str


WorkerEvent = WorkerReady | WorkerDone | WorkerStepOutput | WorkerFailed  # ranks -> P1
