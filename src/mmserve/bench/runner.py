"""One run of a workload against a server: `run_workload` -> `RunOutcome`.

Arrivals: with `request_rate` inf every request is sent at once; otherwise the gaps between
sends are exponential with mean 1 / rate (a Poisson process), drawn from `seed`, so every run
of one invocation sees the same schedule. At most `max_concurrency` requests are in flight
(None: no cap). /metrics is scraped right before the first send and after the last answer.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import numpy as np

from mmserve.bench.client import RequestResult, RequestSettings, send_request
from mmserve.bench.datasets import BenchRequest
from mmserve.bench.progress import ProgressBar
from mmserve.bench.prometheus import MetricsSnapshot, scrape


@dataclass(frozen=True)
class LoadShape:
    """How requests are sent: arrival rate in requests/s (inf: all at once), in-flight cap, seed."""

    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be positive (inf: all at once); got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be at least 1; got {self.max_concurrency}")

    def send_times(self, n: int) -> list[float]:
        """Seconds after the run's start at which each of `n` requests is sent."""
        if math.isinf(self.request_rate):
            return [0.0] * n
        gaps = np.random.default_rng(self.seed).exponential(1.0 / self.request_rate, n)
        return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist() if n else []


@dataclass
class RunOutcome:
    """A run's per-request results (in request order), its wall time and the scrapes around it."""

    results: list[RequestResult]
    duration_s: float
    before: MetricsSnapshot
    after: MetricsSnapshot


async def run_workload(base_url: str, settings: RequestSettings, requests: list[BenchRequest], shape: LoadShape,
                       label: str, progress: bool = True) -> RunOutcome:
    """Send `requests` as `shape` says and wait for every answer."""
    import httpx

    limit = shape.max_concurrency or max(len(requests), 1)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=httpx.Timeout(shape.timeout_s), limits=limits) as client:
        before = await scrape(client, base_url)
        bar = ProgressBar(len(requests), label, enabled=progress)
        semaphore = asyncio.Semaphore(limit)
        start = time.perf_counter()

        async def one(request: BenchRequest, send_at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + send_at - time.perf_counter()))
            async with semaphore:
                result = await send_request(client, settings, request)
            bar.update(result.success)
            return result

        results = await asyncio.gather(*(one(r, t) for r, t in zip(requests, shape.send_times(len(requests)))))
        duration = time.perf_counter() - start
        bar.close()
        after = await scrape(client, base_url)
    return RunOutcome(list(results), duration, before, after)
