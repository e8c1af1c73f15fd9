"""The offline engine: input processing -> an engine client -> output processing, for any number of ranks.

One driver for every deployment shape: one rank steps its `EngineCore` in this process
(`InProcessClient`; `core` is that engine core), N data-parallel ranks run in their own
processes (`RankProcesses`). Either way a request is validated by the same `InputProcessor`,
aborted by the same rule and its outputs made by the same `OutputProcessor`:
- `add_requests` processes every prompt (several at once, on the input threads) before it sends
  any: one bad prompt raises its ValueError (a `ClientError`) and nothing of any of them stays;
- a request the engine fails alone (an error output) finishes with finish_reason "abort" and the
  others go on; a failure of a whole engine core raises from `step`, and the caller aborts.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from mmserve.cache_report import CacheReport
from mmserve.config import EngineConfig
from mmserve.engine.core import EngineCore
from mmserve.frontend.cache_resets import ResetReport, reset_frontend_items
from mmserve.frontend.engine_client.offline_client import InProcessClient, OfflineClient
from mmserve.frontend.engine_client.rank_processes import RankProcesses
from mmserve.frontend.input_processor import InputProcessor
from mmserve.frontend.output.output_processor import OutputProcessor
from mmserve.frontend.request.prompt import Prompt as TypedPrompt
from mmserve.ipc.messages import EngineCoreRequest
from mmserve.models.hub import resolve_engine_model
from mmserve.models.hf_config import eos_token_id
from mmserve.multimodal.items import PROCESSING_THREADS, ResolvedItem, settled
from mmserve.outputs import RequestOutput
from mmserve.rank_metrics import DataParallelFigures
from mmserve.sampling_params import SamplingParams

Prompt = str | dict[str, Any] | TypedPrompt  # what `LLM.generate` takes
Processed = tuple[EngineCoreRequest, Prompt, CacheReport, list[ResolvedItem]]  # a request, what P0 holds for it


class LLMEngine:
    """The offline engine over an `OfflineClient` (`client`), chosen by `--data-parallel-size`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config = resolve_engine_model(config)
        self.model_dir = config.model.checkpoint_dir
        self.client: OfflineClient = InProcessClient(EngineCore(config, self.model_dir)) \
            if config.parallel.data_parallel_size == 1 else RankProcesses(config, self.model_dir)
        try:
            self.input_processor = InputProcessor(config, self.model_dir, self.client.max_model_len,
                                                  eos_token_id(self.model_dir), known_tokens=self.client.known_tokens,
                                                  fetch=self.client.fetch)
        except BaseException:
            self.client.shutdown()  # the engine cores' memory and processes go back now, not at collection
            raise
        self.tokenizer = self.input_processor.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)
        self._inputs = ThreadPoolExecutor(PROCESSING_THREADS, thread_name_prefix="mmserve-inputs")

    @property
    def core(self) -> EngineCore:
        """The in-process engine core (one rank only)."""
        if not isinstance(self.client, InProcessClient):
            raise AttributeError("with data parallelism the engine cores run in their own processes")
        return self.client.core

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0) -> None:
        """Process and queue one request; any fault in it is a ValueError and queues nothing."""
        self.add_requests([request_id], [prompt], [params], [priority])

    def add_requests(self, request_ids: Sequence[str], prompts: Sequence[Prompt],
                     params: Sequence[SamplingParams], priorities: Sequence[int] | None = None,
                     embed: bool = False) -> None:
        """Process every request, then queue them all; a fault in any raises and none stays.

        `priorities` (one per request, default 0) order them under `--scheduling-policy priority`.
        Their outputs carry a `CacheReport` (the IPC or shm layer counted only across processes);
        with `embed` they ask for their prompt's last hidden state (`RequestOutput.hidden`)."""
        processed = self._process_all(request_ids, prompts, params, priorities or [0] * len(request_ids))
        sent: list[str] = []
        try:
            for request, prompt, report, _ in processed:
                request.return_hidden = embed
                self.output_processor.add_request(request, TypedPrompt.parse(prompt).shown_text, report)
                self.client.add_request(request, report)
                sent.append(request.request_id)
        except BaseException:
            for *_, pending in processed[len(sent):]:
                self.input_processor.reject(pending)
            self.abort_requests(list(request_ids))
            raise
        for *_, pending in processed:
            self.input_processor.accept(pending)

    def _process_all(self, request_ids: Sequence[str], prompts: Sequence[Prompt],
                     params: Sequence[SamplingParams], priorities: Sequence[int]) -> list[Processed]:
        """Every request processed, in order; several at once on the input threads (the image
        processor, hashing and tokenizing release the GIL), as the server processes concurrent
        requests. If any fails, what the others hold is rejected and the first fault (in order)
        raises."""
        def one(rid: str, prompt: Prompt, p: SamplingParams, priority: int) -> Processed:
            pending: list[ResolvedItem] = []
            report = CacheReport()
            processed = self.input_processor.process(rid, prompt, p, pending, report=report, priority=priority)
            return processed, prompt, report, pending

        if len(prompts) == 1:  # a lone prompt on the caller's thread: no hand-off
            return [one(request_ids[0], prompts[0], params[0], priorities[0])]
        done, fault = settled([self._inputs.submit(one, *args)
                               for args in zip(request_ids, prompts, params, priorities)])
        if fault is not None:
            for *_, pending in done:
                self.input_processor.reject(pending)
            raise fault
        return done

    def abort_requests(self, request_ids: list[str]) -> None:
        self.output_processor.abort_requests(request_ids)
        self.client.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One round of engine outputs, processed; raises if an engine core failed as a whole."""
        batch = self.output_processor.process_outputs(self.client.get_outputs())
        if batch.to_abort:
            self.client.abort_requests(batch.to_abort)
        self.client.finished([out for out in batch.outputs if out.finished])
        return batch.outputs

    def reset_caches(self, prefix: bool = False, encoder: bool = False, mm: bool = False) -> ResetReport:
        """Drop what the named caches hold, on every rank (`frontend/cache_resets.py`); what was dropped."""
        report = ResetReport()
        if mm:
            reset_frontend_items(self.input_processor, None, report)  # the client resets its transport
        self.client.reset_caches(prefix, encoder, mm, report)
        return report

    def dp_figures(self) -> DataParallelFigures:
        """Per rank: up, restarts, stats, what it served; the routing decisions (data parallelism only)."""
        if not isinstance(self.client, RankProcesses):
            raise AttributeError("one rank: no data-parallel figures")
        return self.client.dp_figures()

    def shutdown(self) -> None:
        """Stop the engine cores and free what they hold: in process, the runner's weights, KV cache
        and graphs; with data or tensor parallelism, their processes."""
        self._inputs.shutdown(wait=True, cancel_futures=True)
        self.client.shutdown()
