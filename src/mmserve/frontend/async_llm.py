"""P0's asyncio engine: requests go to the engine cores (P1) over ZMQ, outputs back to each request's queue.

Outputs come back on one background task per rank and are routed to each request's queue.
Everything P0 holds for a request is its `OpenRequest` (`request/open_request.py`), made by
admission and let go of in one place (`OpenRequests.release`) whatever ends it; `generate` reads
as the request's life: wait for a serving rank, admit, read outputs, release.

Input processing (the chat template, media decoding, the HF image processor, tokenizing) always
runs in a worker thread, so the event loop only routes (`admission.py`, which also owns the
request path's undo rule). The IPC sender cache is updated on the event loop,
right before each send, so its updates happen in send order — the order P1 applies them in.
Until P1 produces a request's first output, P0 keeps the request's processed items: if P1 lacked
an item it was sent by hash (drift), P0 starts a new IPC epoch and resends.

With `--data-parallel-size N` there are N engine cores (`EngineRanks`); `DPRouter` picks each
request's rank, and one output task per rank feeds the same queues. When a rank dies, requests
that showed their caller nothing yet start again on a live rank, streams that showed output
resume there from the tokens already sent (the caller sees a pause; `failover.py`), and the rank
is restarted (`--engine-restart-limit`); P0 is dead only once no rank serves or can come back.
With `--api-server-count` > 1 this is one of several API servers (`attachment`): the launcher
owns the engine cores and the coordinator routes for every server (`RemoteRouter`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncGenerator

from mmserve.errors import ClientError, engine_error
from mmserve.config import EngineConfig
from mmserve.frontend.request.admission import Admission
from mmserve.frontend.engine_client.attached_engine import Attachment
from mmserve.frontend.cache_verifier import Case, CacheVerifier
from mmserve.frontend.cache_resets import CacheResets, ResetReport
from mmserve.frontend.request.chat import check_tools, parse_chat_messages
from mmserve.frontend.dp.remote_router import RemoteRouter
from mmserve.frontend.engine_client.core_client import EngineCoreClient, EngineDeadError
from mmserve.frontend.dp.dp_router import DPRouter, Router
from mmserve.frontend.engine_client.engine_ranks import EngineRanks
from mmserve.frontend.engine_client.failover import RANK_POLL_S, RANK_WAIT_S, RankFailover
from mmserve.frontend.engine_client.sender import RankSender
from mmserve.frontend.figures import EngineFigures, SharedFigures
from mmserve.frontend.input_processor import InputProcessor
from mmserve.transport.item_transport import ItemTransport
from mmserve.frontend.request.open_request import OpenRequest
from mmserve.frontend.request.open_requests import OpenRequests
from mmserve.frontend.request.prompt import Prompt, PromptSettings
from mmserve.models.hf_config import eos_token_id
from mmserve.frontend.output.output_processor import OutputProcessor
from mmserve.ipc.messages import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from mmserve.metrics import VerifyFigures, log_stats_periodically
from mmserve.rank_metrics import DataParallelFigures
from mmserve.multimodal.chat_templates import ChatTemplateOptions
from mmserve.multimodal.processing import create_processor
from mmserve.models.hub import resolve_engine_model
from mmserve.frontend.output.embedding import embedding_output
from mmserve.outputs import EmbeddingRequestOutput, RequestOutput
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    """P0's engine: admission, failover and figures composed over the ranks and the open requests.

    Starts the engine cores on construction (blocking until they are ready; RuntimeError if one
    cannot start)."""

    def __init__(self, config: EngineConfig, attachment: Attachment | None = None) -> None:
        self.config = config = resolve_engine_model(config)  # resolved already when a launcher started it
        self.model_dir = config.model.checkpoint_dir
        self.transport = ItemTransport(config, attachment)
        # the processor (2-4 s, mostly transformers' imports) is made while the engine cores start
        with ThreadPoolExecutor(1, thread_name_prefix="mmserve-processor") as pool:
            processor = pool.submit(create_processor, self.model_dir)
            try:
                self.ranks = EngineRanks(config, self.model_dir, self.transport.shm_info, attachment)
            except BaseException:
                self.transport.close()
                raise
        try:
            self._finish_init(config, attachment, processor.result())
        except BaseException:
            self.ranks.shutdown()
            self.transport.close()
            raise

    def _finish_init(self, config: EngineConfig, attachment: Attachment | None, processor: Any) -> None:
        for rank in range(len(self.ranks)):  # a rank on another node cannot map this node's store
            self.transport.restarted(rank, remote=not self.ranks.client(rank).is_local)
        self.max_model_len = self.ranks.client(0).max_model_len
        router: Router | None = None
        if len(self.ranks) > 1:
            router = RemoteRouter(attachment.coordinator) if attachment is not None and attachment.coordinator \
                else DPRouter(config, [self.ranks.client(r).num_kv_blocks for r in range(len(self.ranks))])
        self.input_processor = InputProcessor(config, self.model_dir, self.max_model_len, eos_token_id(self.model_dir),
                                              known_tokens=self.transport.known_tokens, fetch=self.transport.fetch,
                                              processor=processor)
        self.sender = RankSender(self.ranks, router, self.transport)
        self.tokenizer = self.input_processor.tokenizer
        self.generation_defaults = self.input_processor.generation  # the OpenAI layer's sampling defaults
        self.requests = OpenRequests(self.sender, self.transport, config.scheduler.stalled_stream_abort_s)
        self.output_processor = OutputProcessor(self.tokenizer, self.requests.output_states)
        self._tasks: dict[str, asyncio.Task[None]] = {}  # per rank "out<r>" / "restart<r>", and "log"
        self.log_stats = True  # the periodic stats line (`--disable-log-stats` turns it off)
        shared = SharedFigures(attachment.metrics_dir, config.parallel.api_server_index) \
            if attachment is not None else None
        self.figures = EngineFigures(self.input_processor.processor_cache, self.transport, self.sender, shared)
        self.failover = RankFailover(self.ranks, self.sender, self.transport, self.output_processor, self.requests,
                                     self.figures)
        self.admission = Admission(self.input_processor, self.output_processor, self.sender, self.requests,
                                   self.failover)
        self.verifier = CacheVerifier(config.cache.cache_verify_rate, self.ranks.client(0).dtype)
        self.resets = CacheResets(self.ranks, self.input_processor, self.transport)

    @property
    def client(self) -> EngineCoreClient:
        """Rank 0's engine core (the only one without data parallelism)."""
        return self.ranks.client(0)

    @property
    def num_requests(self) -> int:
        """Requests in flight: admitted (being resolved) or running, not yet ended."""
        return len(self.requests)

    @property
    def is_healthy(self) -> bool:
        """False once no rank serves and none can come back (`RankFailover.is_healthy`)."""
        return self.failover.is_healthy

    @property
    def dead_error(self) -> str | None:
        """Why P0 is dead (None while some rank serves or can come back)."""
        return self.requests.dead_error

    def stats(self) -> SchedulerStats | None:
        """The ranks' latest stats summed, P0's cache layers merged in (`EngineFigures.stats`)."""
        return self.figures.stats()

    def dp_figures(self) -> DataParallelFigures:
        """Per rank: up, restarts, stats, what it served; the routing decisions (for /metrics)."""
        return self.figures.dp_figures()

    async def build_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                           settings: PromptSettings | None = None,
                           template: ChatTemplateOptions | None = None) -> Prompt:
        """OpenAI messages (and function `tools`) rendered by the chat template as `template` says
        -> the request's prompt naming its media, with `settings` (ValueError for bad input); the
        template renders in a worker thread and the media are read, hashed and processed by
        `generate`, also off the event loop."""
        return await asyncio.to_thread(self._render_prompt, messages, tools, settings, template)

    def _render_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       settings: PromptSettings | None, template: ChatTemplateOptions | None) -> Prompt:
        inputs = parse_chat_messages(messages)
        checked = check_tools(tools) if tools is not None else None
        text = self.input_processor.processor.apply_chat_template(inputs.conversation, checked, template)
        return inputs.prompt(text, settings)

    async def generate(self, request_id: str, prompt: str | dict[str, Any] | Prompt, params: SamplingParams,
                       stream: bool = True, data_parallel_rank: int | None = None, priority: int = 0,
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's output after every engine step until it finishes.

        Bad input raises ValueError before anything is sent to P1. Leaving the loop early
        (client gone, task cancelled) aborts the request in P1, which frees its blocks.
        `stream=False` says the caller shows nothing before the last output, so the request may
        start over on another rank until then; `data_parallel_rank` forces one rank; `priority`
        orders it under `--scheduling-policy priority` (the lower, the sooner). While no
        rank serves and one restarts, the request waits for it (`wait_for_live_rank`). A cache-served
        request the verifier sampled is re-run past every cache once it ends (`_shadow`).
        """
        candidate = self.verifier.wants(params)
        request = await self._admit(request_id, prompt, params, stream, data_parallel_rank, candidate, priority)
        try:
            while not request.finished:
                yield await request.next_output()
        finally:
            self._release(request)

    async def embed(self, request_id: str, prompt: str | dict[str, Any] | Prompt, normalize: bool = True,
                    truncate_prompt_tokens: int | None = None, priority: int = 0) -> EmbeddingRequestOutput:
        """The prompt's embedding: the final-normed hidden state of its last token (vLLM's LAST
        pooling; L2-normalized with `normalize`), computed by a one-token greedy request that asks
        P1 for it. Its images go through every cache as a generation request's do, and an
        identical prompt embedded before is answered from the first-token cache with the same
        vector, no forward run. Bad input: ValueError, as `generate`."""
        params = SamplingParams(max_tokens=1, temperature=0.0, truncate_prompt_tokens=truncate_prompt_tokens)
        request = await self._admit(request_id, prompt, params, False, None, False, priority, embed=True)
        try:
            while not request.finished:
                await request.next_output()
        finally:
            self._release(request)
        return embedding_output(request.last, normalize)

    async def _shadow(self, case: Case) -> tuple[RequestOutput | None, bytes | None]:
        """The cache verifier's re-run of `case` past every cache, on its rank: its last output and
        first logits row."""
        await self._until_serving(case.rank)
        request = await self.admission.admit(case.shadow_id, case.prompt, case.shadow_params, False, case.rank,
                                             shadow=True)
        try:
            while not request.finished:
                await request.next_output()
        finally:
            self._release(request)
        return request.last, request.first_logits

    async def _admit(self, request_id: str, prompt: str | dict[str, Any] | Prompt, params: SamplingParams,
                     stream: bool, rank: int | None, candidate: bool, priority: int = 0,
                     embed: bool = False) -> OpenRequest:
        """Admit the request once a rank serves. A rank whose process ends between admission's check
        and its send (before its output loop retires it) fails the send; the request, undone whole,
        is then admitted again once a rank serves, unless a rank was forced or none can come back."""
        deadline = time.monotonic() + RANK_WAIT_S
        while True:
            await self._until_serving(rank)
            try:
                return await self.admission.admit(request_id, prompt, params, stream, rank, candidate=candidate,
                                                  priority=priority, embed=embed)
            except EngineDeadError:
                if rank is not None or not self.is_healthy or time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(RANK_POLL_S)

    async def _until_serving(self, data_parallel_rank: int | None) -> None:
        """Return once a request can be admitted (EngineDeadError, or ClientError for a forced rank down)."""
        self._ensure_output_task()
        if not self.is_healthy:
            raise EngineDeadError(self.requests.dead_error or "the engine core process is not running")
        if data_parallel_rank is None and not self.ranks.live():
            await self.failover.wait_for_live_rank()  # one is restarting
        if data_parallel_rank is not None and data_parallel_rank not in self.ranks.live():
            raise ClientError(f"data parallel rank {data_parallel_rank} is not serving (ranks: "
                             f"{', '.join(str(h['rank']) + ' ' + str(h['status']) for h in self.ranks.health())})")

    def _release(self, request: OpenRequest) -> None:
        """The request ended, whatever ended it: P0 lets go of it (`OpenRequests.release`); a
        cache-served candidate gets its shadow re-run."""
        try:
            self.requests.release(request)
            if request.candidate:
                case = self.verifier.finished(request.request_id, request.prompt, request.params,
                                              request.last if request.finished else None, request.rank,
                                              request.first_logits)
                if case is not None:
                    self.verifier.verify(case, self._shadow(case))
        finally:
            self.figures.changed = True  # several API servers: shared with the others within SHARE_EVERY_S

    def verify_figures(self) -> VerifyFigures:
        """The shadow cache verifier's counts (for /metrics)."""
        return self.verifier.figures

    async def abort(self, request_id: str) -> None:
        self.requests.abort([request_id])

    async def reset_caches(self, prefix: bool = False, encoder: bool = False, mm: bool = False) -> ResetReport:
        """Drop what the named caches hold, on every rank (`frontend/cache_resets.py`); what was dropped."""
        self._ensure_output_task()  # the answers come through the output loops
        return await self.resets.reset(prefix, encoder, mm)

    # ---- the output loops -------------------------------------------------------------------

    def start(self) -> None:
        """Start the output loops now (else the first request does): a death before it is handled too."""
        self._ensure_output_task()

    def _ensure_output_task(self) -> None:
        for rank, client in enumerate(self.ranks.clients):
            if client is not None:  # a dead one's loop retires it at once
                self._ensure_task(f"out{rank}", lambda r=rank: self._output_loop(r))
        if self.log_stats:
            self._ensure_task("log", lambda: log_stats_periodically(self.stats))
        if self.figures.shared is not None:
            self._ensure_task("share", self.figures.share_periodically)

    def _ensure_task(self, name: str, make: Any) -> None:
        task = self._tasks.get(name)
        if task is None or task.done():
            self._tasks[name] = asyncio.get_running_loop().create_task(make())

    async def _restart(self, rank: int) -> None:
        """Restart a dead rank; once it serves, its output loop runs and the parked requests move."""
        if await self.failover.restart(rank):
            self._ensure_output_task()
            self.failover.move_parked()

    async def _output_loop(self, rank: int) -> None:
        client = self.ranks.client(rank)
        try:
            while True:
                self._dispatch(rank, await client.get_output_async())
                await asyncio.sleep(0)  # the requests' generators run first, then the receive is re-armed
        except EngineDeadError as e:
            self.resets.rank_gone(rank)
            if self.failover.rank_died(rank, str(e)):
                self._ensure_task(f"restart{rank}", lambda: self._restart(rank))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not leave requests hanging
            logger.exception("output loop failed")
            self.requests.fail_all(f"the frontend's output loop failed: {e}")

    def _dispatch(self, rank: int, batch: EngineCoreOutputs) -> None:
        if batch.stats is not None:
            self.figures.record(rank, stats := batch.stats)
            if (router := self.sender.router) is not None:
                used = 1 - stats.num_free_blocks / stats.num_total_blocks if stats.num_total_blocks else 0.0
                router.set_load(rank, stats.num_running + stats.num_waiting, used)
        for request_id, missing in batch.resend.items():
            self.admission.resend(request_id, missing)
        self.resets.answered(rank, batch.resets)
        if batch.reset_items:
            self.resets.reset_by_another_server()
        ok: list[EngineCoreOutput] = []
        for out in batch.outputs:
            if out.first_logits is not None and (open_request := self.requests.get(out.request_id)) is not None:
                open_request.first_logits = out.first_logits
            if out.error is None:
                ok.append(out)
            else:
                self.requests.fail(out.request_id, engine_error(out.error, out.error_kind))
        processed = self.output_processor.process_outputs(ok)
        if processed.to_abort:
            self.requests.abort(processed.to_abort)
        for result in processed.outputs:
            self.requests.put(result)

    def shutdown(self) -> None:
        self.verifier.close()
        for task in self._tasks.values():
            task.cancel()
        self.ranks.shutdown()
        self.transport.close()
        if isinstance(self.sender.router, RemoteRouter):
            self.sender.router.close()

