"""The model runner: turns a `SchedulerOutput` into one forward pass and sampled tokens.

It keeps what the scheduler sends only once: each request's tokens, items, block table and
sampling state (`RunnerRequest`), and encoder outputs by `mm_hash` — shared by every request
whose items have that hash — until the scheduler names the hash in `free_encoder_ids`. The KV
cache is one (K, V) pair of [num_blocks, block_size, Hkv, Dh] tensors per decoder layer, in
`--kv-cache-dtype` (`kv_cache_dtype.py`; the model's dtype by default).

Positions: 1-D token indices, or for M-RoPE models (Qwen-VL) the [3, L] positions the model
computes once per request from its tokens and items (`mrope_positions`), continued past them by
`index + delta` for generated tokens; a chunk, a prefix-cache hit or a preemption therefore
resumes at exactly the positions of a whole-prompt forward. Encoder outputs of deepstack models
(Qwen3-VL) carry the deepstack features beside the embedding: rows [F, D * (1 + layers)].

Device: the weights, KV cache, encoder outputs, sampler state and generators live on the rank's
device (`worker/device.py`). A step's inputs are built on the host and cross in one pinned buffer
(`to_device`); pixel values cross once, from pinned staging; the sampled tokens (and log
probabilities) come back in the step's one device-to-host transfer.

A step is `prepare` (host: states, block copies, encoders, inputs), `launch` (the forward and the
logits), `sample` (the sampling, the tokens' copy started) and `collect` (the tokens read, each state
appended). The engine core runs them in that order (`execute_model`), or with --async-scheduling
prepares and launches step N+1 while step N runs on the device, then collects N and samples N+1
(`engine/core.py`): a decoding token still in flight when its step is prepared (`StepInputs.late`)
is read on the device from N's sampled tokens, so the device never waits for the host.
"""

from __future__ import annotations

import gc
import logging

import torch

from mmserve.errors import RequestFault
from mmserve.config import EngineConfig
from mmserve.ipc.worker_messages import ModelRunnerOutput, NewRequestData, SchedulerOutput
from mmserve.models.loader import load_model
from mmserve.malloc_tuning import release_freed_memory, zeros_on_huge_pages
from mmserve.models.parallel import SINGLE, TensorParallel, pack_linears
from mmserve.models.quantization.select import describe_quantization
from mmserve.worker.device import rank_device, resolve_dtype, resolve_kv_cache_dtype, to_device
from mmserve.models.cpu_decoder import CpuDecoder
from mmserve.worker.cuda_graphs import DecodeGraphs, GraphMetadata, graph_metadata_for
from mmserve.worker.cache_fault import CacheFault
from mmserve.worker.encoder_outputs import EncoderOutputs
from mmserve.worker.grammar import GrammarCache, RequestGrammar
from mmserve.worker.prompt_logprobs import score_prompts
from mmserve.worker.memory import available_kv_cache_bytes
from mmserve.worker.runner_state import RunnerRequest
from mmserve.worker.sampler import collect_sampled, launch_sampling
from mmserve.worker.step_inputs import LaunchedStep, PreparedStep, late_indices, prepare_inputs
from mmserve.worker.threads import one_thread_below


logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str, tp: TensorParallel = SINGLE) -> None:
        """With `tp.size > 1` this is one rank's runner: every rank gets the same calls (the
        model's collectives pair them up) and samples the same tokens."""
        self.config = config
        self.block_size = config.cache.block_size
        self.device = rank_device(config, tp.rank)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)  # --kv-cache-dtype
        self.model = load_model(model_dir, self.dtype, tp, self.device, config.model.attention_backend,
                                config.model.quantization, config.model.cpu_activation_quant)
        if self.device.type == "cpu":
            pack_linears(self.model)  # oneDNN's packed weights: the decoder's matmuls, several times faster
            release_freed_memory()  # the dense copies packing freed (glibc keeps freed memory otherwise)
        logger.info("rank %d: model on %s in %s, %s attention, %s weights: %.1f MiB resident", tp.rank, self.device,
                    str(self.dtype).removeprefix("torch."), self.model.attention.name,
                    describe_quantization(self.model), self.model.weight_bytes / 2**20)
        self.threads = torch.get_num_threads()  # as P1 / the worker set it
        # a step of fewer tokens (and no encoder work) runs on one thread: measured for this model
        self.one_thread_below = one_thread_below(self.model, self.threads, self.device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_scratch_block: int | None = None
        self.decode_graphs: DecodeGraphs | None = None
        self.requests: dict[str, RunnerRequest] = {}
        self.embedding_ids: set[str] = set()  # requests returning their hidden state (none: a step skips the check)
        self.generator = new_generator(self.device, config.model.seed)
        self.grammars = GrammarCache(model_dir, self.model.config.text.vocab_size)
        self.fault = CacheFault.from_env()  # a debugging hook that alters cache hits (tests of the verifier)
        self.encoders = EncoderOutputs(self.device, self.dtype, self.fault)

    @property
    def encoder_outputs(self) -> dict[str, torch.Tensor]:
        """The resident encoder outputs by `mm_hash` ([F, D'] each)."""
        return self.encoders.outputs

    @property
    def num_encoded_items(self) -> int:
        """Items run through the vision encoder since start (tests, benchmarks)."""
        return self.encoders.num_encoded_items

    @property
    def dtype_name(self) -> str:
        """The resolved dtype's name ("float32", "bfloat16", "float16")."""
        return str(self.dtype).removeprefix("torch.")

    # ---- KV cache ---------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        t, itemsize = self.model.config.text, self.kv_cache_dtype.itemsize
        return 2 * t.num_hidden_layers * self.block_size * self.model.num_kv_heads * t.head_dim * itemsize

    def available_kv_cache_bytes(self) -> int | None:
        """On CUDA, the KV cache's share of `--gpu-memory-utilization` after profiling the largest
        step (`worker/memory.py`); None on CPU."""
        return available_kv_cache_bytes(self)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """The KV cache of `num_blocks` blocks; on CUDA, unless --enforce-eager, with the decode
        graphs captured when the attention backend supports them."""
        build = graph_metadata_for(self.model.attention)
        self.allocate_kv_cache(num_blocks, scratch=build is not None and self._graphs_allowed())
        if build is not None and self._graphs_allowed():
            self.enable_decode_graphs(build, capture=True)

    def _graphs_allowed(self) -> bool:
        return self.device.type == "cuda" and not self.config.device.enforce_eager

    def enable_decode_graphs(self, build_metadata: GraphMetadata, capture: bool) -> None:
        """Run plain decode steps through `DecodeGraphs` (captured when `capture`; eagerly over
        the same padded static buffers otherwise: how CPU tests check them). Needs the KV cache
        allocated with its scratch block (the last one)."""
        assert self.kv_scratch_block is not None, "the KV cache has no scratch block"
        t = self.model.config.text
        longest = self.config.model.max_model_len or t.max_position_embeddings
        max_blocks = min(self.kv_scratch_block, -(-longest // self.block_size))
        sizes = self.config.device.graph_sizes(self.config.scheduler.max_num_seqs)
        self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, sizes, max_blocks, self.block_size,
                                          self.kv_scratch_block, build_metadata)
        if capture:
            self.decode_graphs.capture()

    def allocate_kv_cache(self, num_blocks: int, scratch: bool) -> None:
        """`num_blocks` blocks for the scheduler, and with `scratch` one more that only decode
        graphs' padding rows write (block id `num_blocks`)."""
        self.kv_scratch_block = num_blocks if scratch else None
        num_blocks += int(scratch)
        t = self.model.config.text
        shape = (num_blocks, self.block_size, self.model.num_kv_heads, t.head_dim)  # this rank's KV heads

        def zeros() -> torch.Tensor:  # on the CPU on 2 MiB pages: decode attention reads blocks wherever they lie
            if self.device.type == "cpu":
                return zeros_on_huge_pages(shape, self.kv_cache_dtype)
            return torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)

        self.kv_caches = [(zeros(), zeros()) for _ in range(t.num_hidden_layers)]
        compiled = self.device.type == "cpu" and not self.config.device.enforce_eager
        text_model = self.model.text_model
        text_model.cpu_decoder = CpuDecoder.build(text_model, self.kv_caches) if compiled else None

    def shutdown(self) -> None:
        """Drop what this runner holds on its device — decode graphs, KV cache, encoder outputs,
        request states, weights — and give the freed memory back (torch's cache on CUDA); the
        runner is unusable after. Idempotent."""
        self.decode_graphs = None
        self.kv_caches = []
        self.encoders.outputs.clear()
        self.requests.clear()
        self.embedding_ids.clear()
        self.__dict__.pop("model", None)
        gc.collect()  # modules and graphs may sit in reference cycles
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # ---- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step, whole: `prepare`, `launch`, `sample`, `collect`."""
        launched = self.launch(self.prepare(so))
        self.sample(launched)
        return self.collect(launched)

    @torch.inference_mode()
    def prepare(self, so: SchedulerOutput) -> PreparedStep | None:
        """A step's host work: request states, block copies and encoders (queued on the device after
        any step in flight), then its inputs; None when it schedules no token."""
        self._update_states(so)
        self._copy_blocks(so.kv_copies)
        if not so.num_scheduled_tokens:
            return None
        small = sum(so.num_scheduled_tokens.values()) < self.one_thread_below and not so.scheduled_encoder_inputs
        threads = 1 if small else self.threads
        torch.set_num_threads(threads)
        try:
            self.encoders.run(self.model, self.requests, so.scheduled_encoder_inputs)
            req_ids = list(so.num_scheduled_tokens)
            host = prepare_inputs(self.requests, req_ids, so.num_scheduled_tokens, self.block_size,
                                  self.model.attention.build_metadata, self.decode_graphs)
        finally:  # the process's setting outside a step is the caller's (an offline LLM runs in theirs)
            torch.set_num_threads(self.threads)
        return PreparedStep(req_ids, so.num_scheduled_tokens, host, threads)

    @torch.inference_mode()
    def launch(self, prepared: PreparedStep | None, previous: LaunchedStep | None = None) -> LaunchedStep | None:
        """Queue a prepared step's forward and logits on the device. Its decoding tokens still in
        flight (`StepInputs.late`) are read there from `previous`, the step that sampled them, so
        the forward follows that step's sampling without waiting for the host."""
        if prepared is None:
            return None
        torch.set_num_threads(prepared.threads)
        try:
            step, late = to_device((prepared.inputs, late_indices(prepared.inputs, previous)), self.device)
            if late is not None:
                assert previous is not None and previous.sampled is not None
                step.input_ids[late[0]] = previous.sampled.tokens[late[1]]
            req_ids = prepared.req_ids
            if step.graph_inputs is not None and self.decode_graphs is not None:
                hidden = self.decode_graphs.run(step.input_ids, step.positions, step.graph_inputs)  # [T, D]
            else:
                embeds, deepstack = self.encoders.embed(self.model, self.requests, req_ids, prepared.num_scheduled,
                                                        step.input_ids)
                hidden = self.model(embeds, step.positions, self.kv_caches, step.meta, deepstack)  # [T, D]
            last = hidden[step.logits_rows] if step.sampling else None  # [R, D]: the rows that sample
            logits = self.model.compute_logits(last) if last is not None else None  # [R, V]
            launched = LaunchedStep(req_ids, step.sampling, logits)
            if last is not None:
                launched.hidden_rows = self._asked_hidden(step.sampling, last)
            if step.prompt_rows:
                launched.prompt_logprobs = score_prompts(self.model.compute_logits, hidden, step.prompt_rows,
                                                         self.requests)
            return launched
        finally:
            torch.set_num_threads(self.threads)

    @torch.inference_mode()
    def sample(self, launched: LaunchedStep | None) -> None:
        """Queue a launched step's sampling, its tokens' copy to the host started. Every step before
        it must be collected first: grammars, penalties and seeds read each request's tokens."""
        if launched is None or launched.logits is None:
            return
        logits, launched.logits = launched.logits, None
        states = [self.requests[rid] for rid in launched.sampling]
        launched.first_logits = {rid: logits[i].float().cpu().numpy().tobytes()  # raw: before any processing
                                 for i, (rid, state) in enumerate(zip(launched.sampling, states))
                                 if state.return_first_logits and len(state.token_ids) == state.num_prompt_tokens}
        launched.hidden = {rid: row.float().cpu().numpy().tobytes() for rid, row in launched.hidden_rows.items()}
        launched.hidden_rows = {}
        for state in states:  # seeded: each draw depends on (seed, position) alone, preemption or not
            if state.generator is not None:
                state.generator.manual_seed(_step_seed(state.params.seed, len(state.token_ids)))
        launched.sampled = launch_sampling(logits, states, self.generator, self.grammars.control_tokens)

    @torch.inference_mode()
    def collect(self, launched: LaunchedStep | None) -> ModelRunnerOutput:
        """Wait for a sampled step's tokens; each request's state takes its token."""
        if launched is None:
            return ModelRunnerOutput({})
        result: dict[str, list[int]] = {rid: [] for rid in launched.req_ids}
        if launched.sampled is None:
            return ModelRunnerOutput(result, prompt_logprobs=launched.prompt_logprobs)
        tokens, logprobs = collect_sampled(launched.sampled)
        for rid, token in zip(launched.sampling, tokens):
            result[rid] = [token]
        return ModelRunnerOutput(result, {rid: [lp] for rid, lp in zip(launched.sampling, logprobs) if lp is not None},
                                 launched.first_logits, launched.prompt_logprobs, launched.hidden)

    def _asked_hidden(self, sampling: list[str], last: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows of `last` [R, D] that embedding requests sample their first token from: their
        prompts' last final-normed hidden states (copied to the host by `sample`)."""
        if not self.embedding_ids:
            return {}
        return {rid: last[i] for i, rid in enumerate(sampling) if rid in self.embedding_ids
                and len(self.requests[rid].token_ids) == self.requests[rid].num_prompt_tokens}

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_request_ids:
            self.requests.pop(rid, None)
            self.embedding_ids.discard(rid)
        for key in so.free_encoder_ids:
            self.encoders.outputs.pop(key, None)
        for new in so.new_requests:
            state = self.requests[new.request_id] = self._new_state(new)
            if new.return_hidden:
                self.embedding_ids.add(new.request_id)
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
        generator = None if params.seed is None else new_generator(self.device, params.seed)
        num_prompt = len(new.token_ids) if new.num_prompt_tokens is None else new.num_prompt_tokens
        state = RunnerRequest(list(new.token_ids), new.mm_items, params, list(new.block_ids), generator,
                              num_prompt_tokens=num_prompt, eos_token_id=new.eos_token_id,
                              return_first_logits=new.return_first_logits)
        if self.fault is not None and new.num_computed_tokens and len(new.token_ids) == num_prompt:
            self.fault.on_prefix_hit(self.kv_caches, new.block_ids[0])
        if params.structured_outputs is not None:
            try:  # the request's own work: a failure here is the request's, not the engine's
                spec = params.structured_outputs
                state.grammar = RequestGrammar(self.grammars.matcher(spec, new.eos_token_id), spec.after_thinking,
                                               state.token_ids[:num_prompt])
            except Exception as exc:
                raise RequestFault(new.request_id, exc) from exc
            for token in state.output_token_ids:  # resumed after preemption: replay its outputs
                state.grammar.accept(token)
        return state

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV blocks (source, destination) in every layer, before the step writes any K/V."""
        if not copies:
            return
        src, dst = to_device(torch.tensor(copies, dtype=torch.int64).T, self.device)  # [2, n]: sources, destinations
        for k, v in self.kv_caches:  # each [num_blocks, block_size, Hkv, Dh]
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

def _step_seed(seed: int | None, position: int) -> int:
    """The generator seed for a seeded request's token at `position`: a request resumed after
    preemption (its runner state rebuilt) draws the same numbers it would have drawn."""
    return ((seed or 0) ^ (position * 0x9E3779B97F4A7C15)) & ((1 << 63) - 1)


def new_generator(device: torch.device, seed: int) -> torch.Generator:
    """A seeded generator on `device` (the host's for a device without generators: meta)."""
    return torch.Generator(device if device.type == "cuda" else "cpu").manual_seed(seed)
