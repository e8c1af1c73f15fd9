"""The engine core (P1): a scheduler, a KV cache manager and an executor, driven step by step.

`add_request` / `abort_requests` / `step` are the whole interface; it runs in P1
(`engine/core_proc.py: EngineCoreProc` drives it behind the sockets) or, for the offline
single-rank `LLM`, in the caller's process (`frontend/engine_client/llm_engine.py: LLMEngine`).
"""

from __future__ import annotations

import logging
from typing import Any

from mmserve.errors import CLIENT, ClientError, RequestFault
from mmserve.config import EngineConfig, compute_encoder_budget
from mmserve.engine.block_hash import BlockHasher
from mmserve.engine.cache_reset import reset_caches
from mmserve.engine.policies.first_tokens import FirstTokenCache
from mmserve.engine.kv_cache import KVCacheManager
from mmserve.engine.kv_event_publisher import KVEvents, make_kv_events
from mmserve.engine.poison import Poison
from mmserve.kv_events_config import KVEventsConfig
from mmserve.engine.request import Request, RequestStatus
from mmserve.engine.scheduler import Scheduler
from mmserve.engine.grammar_gate import GrammarGate
from mmserve.ipc.messages import (CachesReset, CacheStats, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
                                  FinishReason, ResetCaches, SchedulerStats)
from mmserve.ipc.worker_messages import SchedulerOutput
from mmserve.models.hf_config import ModelConfig, load_model_config
from mmserve.models.quantization.config import check_cpu_activation_quant, check_tensor_parallel, read_quant_spec
from mmserve.models.quantization.cpu_gemv import GEMV_MAX_ROWS
from mmserve.worker.device import kv_cache_dtype_of, rank_device, resolve_dtype
from mmserve.worker.executor import make_executor

logger = logging.getLogger(__name__)

_GIB = 1 << 30
_DEFAULT_KV_GB = 1.0  # the KV cache on CPU when --kv-cache-memory-gb is not given


class EngineCore:
    def __init__(self, config: EngineConfig, model_dir: str, shm_store: bytes | None = None) -> None:
        """`shm_store`: the msgpack `ShmStoreInfo` of the multimodal object store (--mm-cache-type
        shm), so that tensor-parallel workers read items by handle instead of receiving them."""
        self.config = config
        self._stopped = False
        self.model_config = load_model_config(model_dir)
        compute_encoder_budget(config.scheduler, self.model_config.max_item_tokens)  # refuse before loading
        check_quantization(config, model_dir)  # an unsupported quantization, in one line
        self.executor = make_executor(config, model_dir, shm_store)  # TP > 1: worker processes
        try:
            num_blocks, profiled = kv_cache_blocks(config, self.executor)
            self.max_model_len = resolve_max_model_len(config, self.model_config, num_blocks, profiled)
            self.executor.initialize_kv_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        cache = config.cache
        self.kv_cache = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching,
                                       cache.enable_last_block_caching, cache.enable_partial_block_caching)
        # requests hash their blocks only when the prefix cache can use the hashes
        self.block_hasher = (BlockHasher(cache.block_size, cache.prefix_caching_hash_algo)
                             if cache.enable_prefix_caching else None)
        self.kv_events = self._kv_events()
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len,
                                   self.model_config.max_item_tokens,
                                   FirstTokenCache(num_blocks, enabled=cache.enable_first_token_caching))
        runner = getattr(self.executor, "runner", None)  # in-process only: TP workers compile their own
        self.poison = Poison.from_env()  # a debugging hook: unset, None
        self.grammar_gate = GrammarGate(None if runner is None else runner.grammars,
                                        config.scheduler.max_grammar_compile_s)
        # --async-scheduling: the step on the device, launched by the last `step` and collected by the next
        self._in_flight: tuple[SchedulerOutput, Any] | None = None
        self.overlap = config.scheduler.async_scheduling  # a benchmark may switch it with no step in flight
        logger.info("engine core ready: %d KV blocks of %d tokens in %s (%.1f MiB per rank), max_model_len %d",
                    num_blocks, config.cache.block_size, str(kv_cache_dtype_of(config)).removeprefix("torch."),
                    num_blocks * self.executor.kv_cache_bytes_per_block() / 2**20, self.max_model_len)

    def _kv_events(self) -> KVEvents | None:
        """The rank's KV event publisher (`--kv-events-config`), fed by the KV cache manager."""
        cache, parallel = self.config.cache, self.config.parallel
        events_config = None if cache.kv_events_config is None else KVEventsConfig.from_dict(cache.kv_events_config)
        if events_config is not None and events_config.publishes and self.block_hasher is None:
            logger.warning("--kv-events-config: no events without prefix caching (--enable-prefix-caching)")
            return None
        events = make_kv_events(events_config, parallel.data_parallel_rank, parallel.data_parallel_size,
                                cache.block_size)
        if events is not None and self.block_hasher is not None:
            self.kv_cache.attach_events(events.log)
            self.block_hasher.keep_extra_keys = True
        return events

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; a ValueError (and no state change) when it can never run."""
        n = len(request.prompt_token_ids)
        if n == 0:
            raise ClientError("the prompt is empty")
        if n >= self.max_model_len:
            raise ClientError(f"the prompt has {n} tokens, but this model's context length (max_model_len) is "
                             f"{self.max_model_len}, which must also leave room for at least one output token")
        if self.scheduler.has_request(request.request_id) or self.grammar_gate.holds(request.request_id):
            raise ClientError(f"request id {request.request_id!r} is already in use")
        if not self.grammar_gate.hold(request):  # else queued once its grammar is compiled
            self.scheduler.add_request(Request.from_engine_core_request(request, self.block_hasher))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.grammar_gate.drop(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def reset_caches(self, ask: ResetCaches) -> CachesReset:
        """Drop what the prefix and encoder caches hold (`cache_reset.py`), between two steps."""
        done = reset_caches(self.scheduler, ask)
        if self.kv_events is not None:
            self.kv_events.end_step()  # the clear goes out now, not with the next step
        return done

    @property
    def step_in_flight(self) -> bool:
        """Whether a step launched by `step` awaits the next (--async-scheduling)."""
        return self._in_flight is not None

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.num_unfinished_requests > 0 or self.grammar_gate.num_held > 0
                or self._in_flight is not None)

    def step(self) -> EngineCoreOutputs:
        """Queue the requests whose grammar is now compiled, then schedule and run the model
        once; return every request's new tokens (and refusals of grammars that did not compile)."""
        refused = self._admit_compiled()
        if self.scheduler.num_unfinished_requests == 0 and self._in_flight is None:
            return EngineCoreOutputs(refused, stats=self.stats())
        outputs = self._step_overlapped() if self.overlap else self._step()
        outputs.outputs = refused + outputs.outputs
        return outputs

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Queue held requests whose grammar compiled; error outputs for those refused."""
        ready, refused = self.grammar_gate.take(wait_s=0.0 if self.scheduler.num_unfinished_requests else 0.05)
        for request in ready:
            self.scheduler.add_request(Request.from_engine_core_request(request, self.block_hasher))
        return [EngineCoreOutput(r.request_id, [], FinishReason.ABORT, error=why, error_kind=CLIENT)
                for r, why in refused]

    def _step(self) -> EngineCoreOutputs:
        """Schedule and run the model once. A failure that belongs to one request (a
        `RequestFault`, or any error in a step of one request) fails that request alone; any
        other failure propagates (the rank is restarted)."""
        assert self._in_flight is None, "async scheduling was switched off with a step in flight"
        scheduler_output = self._schedule()
        try:
            result = self.executor.execute_model(scheduler_output)
        except Exception as exc:
            outputs = self._fail_step(scheduler_output, exc)
            outputs.stats = self.stats()
            return outputs
        outputs = self.scheduler.update_from_output(scheduler_output, result)
        return self._end_step(outputs)

    def _step_overlapped(self) -> EngineCoreOutputs:
        """--async-scheduling: schedule, prepare and launch step N+1 while step N runs on the device
        (N+1's forward reads N's tokens there), then collect N, sample N+1, and update from N while
        N+1 runs. A failure of N+1 is handled as `_step` handles one (after N is collected, before
        its update: N+1's first-token answers are taken back); a failure to collect N is the rank's."""
        scheduled = self._schedule()
        previous, self._in_flight = self._in_flight, None
        failure: Exception | None = None
        try:
            launched = self.executor.launch(self.executor.prepare(scheduled), None if previous is None else previous[1])
        except Exception as exc:
            failure, launched = exc, None
        collected = None if previous is None else (previous[0], self.executor.collect(previous[1]))
        if launched is not None:  # None: a step of no token (requests only dropped), done once prepared
            try:
                self.executor.sample(launched)
                self._in_flight = (scheduled, launched)
            except Exception as exc:
                failure = exc
        outputs = EngineCoreOutputs([]) if failure is None else self._fail_step(scheduled, failure)
        outputs.outputs += (self.scheduler.drain_answered() if collected is None
                            else self.scheduler.update_from_output(*collected).outputs)
        return self._end_step(outputs)

    def _schedule(self) -> SchedulerOutput:
        scheduled = self.scheduler.schedule()
        if self.poison is not None:
            self.poison.check(self.scheduler.requests[rid] for rid in scheduled.num_scheduled_tokens
                              if rid in self.scheduler.requests)
        return scheduled

    def _fail_step(self, scheduled: SchedulerOutput, exc: Exception) -> EngineCoreOutputs:
        """A step that raised `exc`: its culprit's error output, the step's other requests requeued
        (`Scheduler.fail_step`); `exc` again when it belongs to no one request."""
        culprit = self._culprit(scheduled, exc)
        if culprit is None:
            raise exc
        logger.error("request %s failed in the engine step; the engine goes on", culprit, exc_info=exc)
        return self.scheduler.fail_step(scheduled, culprit, f"the engine failed on this request: {exc}")

    def _end_step(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        if self.kv_events is not None:
            self.kv_events.end_step()
        outputs.stats = self.stats()
        return outputs

    def _culprit(self, scheduled: SchedulerOutput, exc: Exception) -> str | None:
        """The one request a step failure belongs to, or None (then the rank cannot go on)."""
        try:
            self.executor.check_health()
        except Exception:
            return None  # a worker is gone: not one request's fault
        if isinstance(exc, RequestFault) and exc.request_id in scheduled.num_scheduled_tokens:
            return exc.request_id
        if len(scheduled.num_scheduled_tokens) == 1:
            return next(iter(scheduled.num_scheduled_tokens))
        return None

    def stats(self) -> SchedulerStats:
        """P1's state. Prefix layer: queries and hits in prompt tokens, entries in cached blocks.
        Encoder layer: queries and hits in items, `entries` resident outputs, and `bytes_used`
        their size in embedding tokens (not bytes: the runner's dtype and hidden size decide those).
        First-token layer: lookups and hits in requests, entries in kept tokens (`first_tokens.py`)."""
        s = self.scheduler
        pool, enc = self.kv_cache.pool, s.encoder_cache
        prefix = CacheStats(queries=s.admission.prefix_queries, hits=s.admission.prefix_hits,
                            evictions=pool.num_evictions, entries=pool.num_cached_blocks)
        encoder = CacheStats(queries=enc.num_queries, hits=enc.num_hits, evictions=enc.num_evictions,
                             entries=enc.num_resident_items, bytes_used=enc.num_resident_tokens)
        return SchedulerStats(len(s.running), len(s.waiting), self.kv_cache.num_free_blocks,
                              self.kv_cache.pool.num_blocks, s.num_preemptions,
                              caches={"prefix": prefix, "encoder": encoder, "first_token": s.first_tokens.stats()},
                              weight_bytes=getattr(self.executor, "weight_bytes", 0))

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def check_health(self) -> None:
        """Raise if the model can no longer run (a tensor-parallel worker died); cheap."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the grammar pool, the KV event publisher and the executor (which frees the model's
        memory); a second call does nothing (an offline LLM's finalizer may follow a direct call)."""
        if self._stopped:
            return
        self._stopped = True
        self._in_flight = None
        self.grammar_gate.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()
        self.executor.shutdown()


def check_quantization(config: EngineConfig, model_dir: str) -> None:
    """Refuse before loading, in one line, a quantization the engine does not read or cannot
    split over the tensor-parallel ranks, or a `--cpu-activation-quant` that cannot apply; say
    once when that mode is on."""
    spec = read_quant_spec(model_dir, config.model.quantization)
    check_tensor_parallel(spec, config.parallel.tensor_parallel_size)
    mode = config.model.cpu_activation_quant
    if mode != "none":
        device = rank_device(config, 0)
        check_cpu_activation_quant(mode, spec, device.type, str(resolve_dtype(config.model.dtype, device))
                                   .removeprefix("torch."))
        logger.info("--cpu-activation-quant %s: activations are rounded to %s per group of the int4 weights' "
                    "columns for integer dot products in steps of up to %d tokens (not exact; longer steps are)",
                    mode, mode, GEMV_MAX_ROWS)


def kv_cache_blocks(config: EngineConfig, executor) -> tuple[int, bool]:
    """KV blocks per rank, and whether they were sized by profiling: `--num-kv-blocks`, else
    `--kv-cache-memory-gb`, else on CUDA what `--gpu-memory-utilization` leaves, else 1 GiB."""
    cache = config.cache
    if cache.num_kv_blocks:
        return cache.num_kv_blocks, False
    available = None if cache.kv_cache_memory_gb is not None else executor.available_kv_cache_bytes()
    budget = available if available is not None else (cache.kv_cache_memory_gb or _DEFAULT_KV_GB) * _GIB
    num_blocks = int(max(budget, 0) // executor.kv_cache_bytes_per_block())  # KV memory and block bytes are per rank
    if num_blocks < 1:
        raise ValueError("no memory is left for one KV block after the weights and the largest step; raise "
                         "--gpu-memory-utilization or lower --max-num-batched-tokens"
                         if available is not None else "--kv-cache-memory-gb is too small for one KV block; raise it")
    return num_blocks, available is not None


def resolve_max_model_len(config: EngineConfig, model: ModelConfig, num_blocks: int, profiled: bool = False) -> int:
    """The model's context length, or the user's (never longer than the model's or the KV cache's).
    With a profiled KV cache (`profiled`), one request of the full length must fit."""
    model_max = model.text.max_position_embeddings
    capacity = num_blocks * config.cache.block_size
    wanted = config.model.max_model_len
    if profiled and (wanted or model_max) > capacity:
        raise ValueError(f"the KV cache left by --gpu-memory-utilization {config.device.gpu_memory_utilization} holds "
                         f"{capacity} tokens, less than one request of {wanted or model_max} tokens: raise "
                         "--gpu-memory-utilization, lower --max-model-len or --max-num-batched-tokens, or set "
                         "--kv-cache-memory-gb / --num-kv-blocks")
    if wanted is not None and wanted > model_max:
        raise ValueError(f"--max-model-len {wanted} exceeds the model's max_position_embeddings ({model_max})")
    if wanted is not None and wanted > capacity:
        raise ValueError(f"--max-model-len {wanted} does not fit in the KV cache ({capacity} tokens); "
                         f"raise --kv-cache-memory-gb / --num-kv-blocks or lower --max-model-len")
    if wanted is None and model_max > capacity:
        logger.warning("max_model_len capped at the KV cache's %d tokens (model allows %d)", capacity, model_max)
    return wanted or min(model_max, capacity)
