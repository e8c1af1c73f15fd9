"""One request as /metrics counts it: its token counts, times and finish reasons, counted once
when it ends (`RequestRecord.finish`), however it ends; the gap between two of its outputs that
brought tokens is counted as it happens (vLLM's inter-token latency)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from mmserve.cache_report import CacheReport
from mmserve.metrics import FinishedRequest, ServerMetrics
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import SamplingParams


def outcome_of(out: RequestOutput) -> str:
    """`success` for a request finished by stop or length (every choice), else `abort`."""
    return "success" if out.finished and all(c.finish_reason in ("stop", "length") for c in out.outputs) else "abort"


def completion_tokens(out: RequestOutput) -> int:
    return sum(len(c.token_ids) for c in out.outputs)


@dataclass
class RequestRecord:
    """One request's token counts and times (perf_counter seconds)."""

    metrics: ServerMetrics
    arrival: float
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    report: CacheReport | None = None  # what each cache layer did for the prompt (`x-mmserve-cache`)
    first_token_time: float | None = None
    last_token_time: float | None = None
    params: SamplingParams | None = None  # set once the request's parameters are made
    last: RequestOutput | None = None  # the latest output (its completions, finish reasons, engine times)
    finished: bool = False

    def observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        tokens = completion_tokens(out)
        if tokens > self.generation_tokens:
            if self.last_token_time is None:
                self.first_token_time = now
            else:
                self.metrics.on_token_gap(now - self.last_token_time)
            self.last_token_time = now
        self.prompt_tokens = len(out.prompt_token_ids)
        self.generation_tokens = tokens
        self.cached_tokens = out.num_cached_tokens or 0
        self.report = out.cache_report or self.report
        self.last = out

    def finish(self, outcome: str) -> None:
        """Count the request under `outcome`; later calls do nothing."""
        if self.finished:
            return
        self.finished = True
        now = time.perf_counter()
        first, last = self.first_token_time, self.last_token_time
        choices = self.last.outputs if self.last is not None else []
        n = self.params.n if self.params is not None else max(len(choices), 1)
        reasons = [c.finish_reason or outcome for c in choices] if outcome == "success" else [outcome] * n
        self.metrics.on_request_finished(outcome, self.prompt_tokens, self.generation_tokens,
                                         None if first is None else first - self.arrival, now - self.arrival,
                                         FinishedRequest(reasons, max((len(c.token_ids) for c in choices), default=0),
                                                         n, self.params.max_tokens if self.params else None,
                                                         None if first is None or last is None else last - first,
                                                         self.last.metrics if self.last is not None else None))
