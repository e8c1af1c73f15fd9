"""The model runner: turns a `SchedulerOutput` into one forward pass and sampled tokens.

It keeps what the scheduler sends only once: each request's tokens, items, block table and
sampling state (`RunnerRequest`), and encoder outputs by `mm_hash` — shared by every request
whose items have that hash — until the scheduler names the hash in `free_encoder_ids`. The KV
cache is one (K, V) pair of [num_blocks, block_size, Hkv, Dh] tensors per decoder layer.

Positions: 1-D token indices, or for M-RoPE models (Qwen-VL) the [3, L] positions the model
computes once per request from its tokens and items (`mrope_positions`), continued past them by
`index + delta` for generated tokens; a chunk, a prefix-cache hit or a preemption therefore
resumes at exactly the positions of a whole-prompt forward. Encoder outputs of deepstack models
(Qwen3-VL) carry the deepstack features beside the embedding: rows [F, D * (1 + layers)].
"""

from __future__ import annotations

import torch

from mmserve.config import EngineConfig
from mmserve.ipc.messages import ModelRunnerOutput, NewRequestData, SchedulerOutput
from mmserve.models.layers import AttentionMetadata
from mmserve.models.loader import load_model
from mmserve.models.parallel import SINGLE, TensorParallel
from mmserve.ipc.items import MultiModalItem
from mmserve.worker.cache_fault import CacheFault
from mmserve.worker.grammar import GrammarCache
from mmserve.worker.runner_state import RunnerRequest
from mmserve.worker.sampler import sample_requests


# A CPU step of fewer tokens than this (and no encoder work) runs on one thread: waking OpenMP's
# second thread costs more than it saves on a small matmul (a repeated image's uncached tail, a
# small decode batch), the more so while P0 holds the other core.
SMALL_STEP_TOKENS = 32


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str, tp: TensorParallel = SINGLE) -> None:
        """With `tp.size > 1` this is one rank's runner: every rank gets the same calls (the
        model's collectives pair them up) and samples the same tokens."""
        self.config = config
        self.block_size = config.cache.block_size
        self.model = load_model(model_dir, config.model.dtype, tp)
        self.dtype = next(self.model.parameters()).dtype
        on_cpu = next(self.model.parameters()).device.type == "cpu"
        self.threads = torch.get_num_threads()  # as P1 / the worker set it
        self.small_step_threads = 1 if on_cpu else self.threads
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.requests: dict[str, RunnerRequest] = {}
        self.encoder_outputs: dict[str, torch.Tensor] = {}  # mm_hash -> [F, D]
        self.num_encoded_items = 0  # items run through the vision encoder since start (tests, benchmarks)
        self._encoded: set[str] = set()  # the hashes encoded this step (the rest are cache reads)
        self.generator = torch.Generator().manual_seed(config.model.seed)
        self.grammars = GrammarCache(model_dir, self.model.config.text.vocab_size)
        self.fault = CacheFault.from_env()  # a debugging hook that alters cache hits (tests of the verifier)

    # ---- KV cache ---------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        t = self.model.config.text
        return 2 * t.num_hidden_layers * self.block_size * self.model.num_kv_heads * t.head_dim * self.dtype.itemsize

    def initialize_kv_cache(self, num_blocks: int) -> None:
        t = self.model.config.text
        shape = (num_blocks, self.block_size, self.model.num_kv_heads, t.head_dim)  # this rank's KV heads
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
                          for _ in range(t.num_hidden_layers)]

    # ---- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        self._copy_blocks(so.kv_copies)
        if not so.num_scheduled_tokens:
            return ModelRunnerOutput({})
        small = sum(so.num_scheduled_tokens.values()) < SMALL_STEP_TOKENS and not so.scheduled_encoder_inputs
        torch.set_num_threads(self.small_step_threads if small else self.threads)
        try:
            self._run_encoders(so.scheduled_encoder_inputs)
            req_ids = list(so.num_scheduled_tokens)
            input_ids, positions, meta = self._prepare_inputs(req_ids, so.num_scheduled_tokens)
            embeds, deepstack = self._embed(req_ids, so.num_scheduled_tokens, input_ids)
            hidden = self.model(embeds, positions, self.kv_caches, meta, deepstack)  # [T, D]
            return self._sample(req_ids, so.num_scheduled_tokens, hidden)
        finally:  # the process's setting outside a step is the caller's (an offline LLM runs in theirs)
            torch.set_num_threads(self.threads)

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_request_ids:
            self.requests.pop(rid, None)
        for key in so.free_encoder_ids:
            self.encoder_outputs.pop(key, None)
        for new in so.new_requests:
            state = self.requests[new.request_id] = self._new_state(new)
            if self.model.uses_mrope:
                state.mrope = self.model.mrope_positions(state.token_ids, state.mm_items)
        for cached in so.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
        for new in so.new_requests:
            self.requests[new.request_id].num_computed_tokens = new.num_computed_tokens

    def _new_state(self, new: NewRequestData) -> RunnerRequest:
        params = new.sampling_params
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        num_prompt = len(new.token_ids) if new.num_prompt_tokens is None else new.num_prompt_tokens
        state = RunnerRequest(list(new.token_ids), new.mm_items, params, list(new.block_ids), generator,
                              num_prompt_tokens=num_prompt, eos_token_id=new.eos_token_id,
                              return_first_logits=new.return_first_logits)
        if self.fault is not None and new.num_computed_tokens and len(new.token_ids) == num_prompt:
            self.fault.on_prefix_hit(self.kv_caches, new.block_ids[0])
        if params.structured_outputs is not None:
            state.grammar = self.grammars.matcher(params.structured_outputs, new.eos_token_id)
            for token in state.output_token_ids:  # resumed after preemption: replay its outputs
                state.grammar.accept_token(token)
        return state

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV blocks (source, destination) in every layer, before the step writes any K/V."""
        if not copies:
            return
        device = self.kv_caches[0][0].device
        src = torch.tensor([s for s, _ in copies], device=device)
        dst = torch.tensor([d for _, d in copies], device=device)
        for k, v in self.kv_caches:  # each [num_blocks, block_size, Hkv, Dh]
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    def _run_encoders(self, scheduled: dict[str, list[int]]) -> None:
        """Encode the scheduled items, once per `mm_hash`, into `encoder_outputs`."""
        keyed = {item.mm_hash: item for rid, idxs in scheduled.items()
                 for item in (self.requests[rid].mm_items[idx] for idx in idxs)}
        self._encoded = set(keyed)
        if not keyed:
            return
        features = self.model.encode_items([_data(item) for item in keyed.values()], self.dtype)  # each [F, D']
        for (key, item), feats in zip(keyed.items(), features):
            if feats.shape[0] != item.placeholder.length:
                raise ValueError(f"image gives {feats.shape[0]} embeddings for {item.placeholder.length} placeholders")
            self.encoder_outputs[key] = feats
        self.num_encoded_items += len(keyed)

    def _prepare_inputs(self, req_ids: list[str], num_sched: dict[str, int]):
        input_ids: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        for rid in req_ids:
            state, n = self.requests[rid], num_sched[rid]
            start = state.num_computed_tokens
            input_ids.extend(state.token_ids[start:start + n])
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(state.block_ids)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size)
        positions = torch.cat([self.requests[rid].positions(s - q, s)
                               for rid, q, s in zip(req_ids, query_lens, seq_lens)], dim=-1)  # [T] or [3, T]
        return torch.tensor(input_ids, dtype=torch.int64), positions, meta

    def _embed(self, req_ids: list[str], num_sched: dict[str, int],
               input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token embeddings [T, D], with image placeholders overwritten by encoder outputs, and
        for deepstack models the features added after the first decoder layers [layers, T, D]
        (zero on text tokens; None when the step has no image token)."""
        embeds = self.model.embed_tokens(input_ids)
        D, layers = embeds.shape[-1], self.model.num_deepstack
        deepstack = None
        offset = 0
        for rid in req_ids:
            state, n = self.requests[rid], num_sched[rid]
            start = state.num_computed_tokens
            for item in state.mm_items:
                ph = item.placeholder
                lo, hi = max(start, ph.offset), min(start + n, ph.end)
                if lo < hi:
                    feats = self.encoder_outputs[item.mm_hash][lo - ph.offset: hi - ph.offset]  # [n, D']
                    if self.fault is not None and item.mm_hash not in self._encoded:
                        feats = self.fault.on_encoder_hit(feats)
                    rows = slice(offset + lo - start, offset + hi - start)
                    embeds[rows] = feats[:, :D]
                    if layers:
                        if deepstack is None:
                            deepstack = embeds.new_zeros(layers, embeds.shape[0], D)
                        deepstack[:, rows] = feats[:, D:].view(-1, layers, D).transpose(0, 1)
            offset += n
        return embeds, deepstack

    def _sample(self, req_ids: list[str], num_sched: dict[str, int], hidden: torch.Tensor) -> ModelRunnerOutput:
        rows, sampling = [], []
        offset = 0
        for rid in req_ids:
            state, n = self.requests[rid], num_sched[rid]
            offset += n
            if state.num_computed_tokens + n == len(state.token_ids):  # reached the end: sample
                rows.append(offset - 1)
                sampling.append(rid)
        if not rows:
            return ModelRunnerOutput({rid: [] for rid in req_ids})
        logits = self.model.compute_logits(hidden[rows])  # [R, V]
        states = [self.requests[rid] for rid in sampling]
        first_logits = {rid: logits[i].float().cpu().numpy().tobytes()  # raw: before any logits processing
                        for i, (rid, state) in enumerate(zip(sampling, states))
                        if state.return_first_logits and len(state.token_ids) == state.num_prompt_tokens}
        for state in states:  # seeded: each draw depends on (seed, position) alone, preemption or not
            if state.generator is not None:
                state.generator.manual_seed(_step_seed(state.params.seed, len(state.token_ids)))
        tokens, logprobs = sample_requests(logits, states, self.generator, self.grammars.control_tokens)
        result: dict[str, list[int]] = {rid: [] for rid in req_ids}
        for rid, state, token in zip(sampling, states, tokens):
            state.token_ids.append(token)
            result[rid] = [token]
        return ModelRunnerOutput(result, {rid: [lp] for rid, lp in zip(sampling, logprobs) if lp is not None},
                                 first_logits)


def _step_seed(seed: int | None, position: int) -> int:
    """The generator seed for a seeded request's token at `position`: a request resumed after
    preemption (its runner state rebuilt) draws the same numbers it would have drawn."""
    return ((seed or 0) ^ (position * 0x9E3779B97F4A7C15)) & ((1 << 63) - 1)


def _data(item: MultiModalItem) -> dict[str, torch.Tensor]:
    """An item's processed tensors: P1 holds every scheduled item's data (IPC cache or shm)."""
    assert item.data is not None, f"item {item.mm_hash} reached the runner without its data"
    return item.data
