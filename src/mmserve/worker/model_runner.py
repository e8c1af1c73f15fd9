"""The model runner: turns a `SchedulerOutput` into one forward pass and sampled tokens.

It keeps what the scheduler sends only once: each request's tokens, items, block table and
sampling state (`RunnerRequest`), and encoder outputs by `mm_hash` — shared by every request
whose items have that hash — until the scheduler names the hash in `free_encoder_ids`. The KV
cache is one (K, V) pair of [num_blocks, block_size, Hkv, Dh] tensors per decoder layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmserve.config import EngineConfig
from mmserve.ipc.messages import ModelRunnerOutput, NewRequestData, SchedulerOutput
from mmserve.models.layers import AttentionMetadata
from mmserve.models.loader import load_model
from mmserve.models.parallel import SINGLE, TensorParallel
from mmserve.multimodal.inputs import MultiModalItem
from mmserve.sampling_params import SamplingParams
from mmserve.worker.sampler import sample


@dataclass
class RunnerRequest:
    """The runner's copy of one request: tokens so far (it appends what it samples)."""

    token_ids: list[int]
    mm_items: list[MultiModalItem]
    params: SamplingParams
    block_ids: list[int]
    generator: torch.Generator | None
    num_computed_tokens: int = 0


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str, tp: TensorParallel = SINGLE) -> None:
        """With `tp.size > 1` this is one rank's runner: every rank gets the same calls (the
        model's collectives pair them up) and samples the same tokens."""
        self.config = config
        self.block_size = config.cache.block_size
        self.model = load_model(model_dir, config.model.dtype, tp)
        self.dtype = next(self.model.parameters()).dtype
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.requests: dict[str, RunnerRequest] = {}
        self.encoder_outputs: dict[str, torch.Tensor] = {}  # mm_hash -> [F, D]
        self.num_encoded_items = 0  # items run through the vision encoder since start (tests, benchmarks)
        self.generator = torch.Generator().manual_seed(config.model.seed)

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
        if not so.num_scheduled_tokens:
            return ModelRunnerOutput({})
        self._run_encoders(so.scheduled_encoder_inputs)
        req_ids = list(so.num_scheduled_tokens)
        input_ids, positions, meta = self._prepare_inputs(req_ids, so.num_scheduled_tokens)
        embeds = self._embed(req_ids, so.num_scheduled_tokens, input_ids)
        hidden = self.model(embeds, positions, self.kv_caches, meta)  # [T, D]
        return self._sample(req_ids, so.num_scheduled_tokens, hidden)

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_request_ids:
            self.requests.pop(rid, None)
        for key in so.free_encoder_ids:
            self.encoder_outputs.pop(key, None)
        for new in so.new_requests:
            self.requests[new.request_id] = self._new_state(new)
        for cached in so.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
        for new in so.new_requests:
            self.requests[new.request_id].num_computed_tokens = new.num_computed_tokens

    @staticmethod
    def _new_state(new: NewRequestData) -> RunnerRequest:
        seed = new.sampling_params.seed
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        return RunnerRequest(list(new.token_ids), new.mm_items, new.sampling_params, list(new.block_ids), generator)

    def _run_encoders(self, scheduled: dict[str, list[int]]) -> None:
        """Encode the scheduled items, once per `mm_hash`, into `encoder_outputs`."""
        keyed = {item.mm_hash: item for rid, idxs in scheduled.items()
                 for item in (self.requests[rid].mm_items[idx] for idx in idxs)}
        if not keyed:
            return
        pixels = torch.stack([item.data["pixel_values"] for item in keyed.values()]).to(self.dtype)  # [N, C, H, W]
        features = self.model.encode_images(pixels)  # [N, F, D]
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
        positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])  # [T]
        return torch.tensor(input_ids, dtype=torch.int64), positions, meta

    def _embed(self, req_ids: list[str], num_sched: dict[str, int], input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, D], with image placeholders overwritten by encoder outputs."""
        embeds = self.model.embed_tokens(input_ids)
        offset = 0
        for rid in req_ids:
            state, n = self.requests[rid], num_sched[rid]
            start = state.num_computed_tokens
            for item in state.mm_items:
                ph = item.placeholder
                lo, hi = max(start, ph.offset), min(start + n, ph.end)
                if lo < hi:
                    feats = self.encoder_outputs[item.mm_hash]
                    embeds[offset + lo - start: offset + hi - start] = feats[lo - ph.offset: hi - ph.offset]
            offset += n
        return embeds

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
        tokens = sample(logits, [s.params for s in states], [s.generator for s in states], self.generator)
        result: dict[str, list[int]] = {rid: [] for rid in req_ids}
        for rid, state, token in zip(sampling, states, tokens):
            state.token_ids.append(token)
            result[rid] = [token]
        return ModelRunnerOutput(result)
