"""Prometheus metrics, one registry per server (so two servers or tests never share counts).

Request metrics are counted once per request when it ends, never per token. Engine state
(running and waiting requests, KV blocks, preemptions) and every cache layer's counters are read
from `engine.stats()` when /metrics is scraped: P1's layers travel in `SchedulerStats.caches`,
P0's are merged in by the frontend, so no cache counts anything on the request path twice.

With several API servers the launcher sets PROMETHEUS_MULTIPROC_DIR: the request counters and
histograms then live in prometheus-client's per-process files and every server's /metrics sums
them all (its multiprocess mode); the engine figures are every server's alike, and P0's cache
layers are summed by the frontend (`frontend/figures.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mmserve.ipc.messages import CacheStats, SchedulerStats
from mmserve.outputs import RequestTimes
from mmserve.rank_metrics import DataParallelFigures, RankCollector
from mmserve.vllm_metrics import Source, VllmNames

OUTCOMES = ("success", "error", "abort")  # success: finished by stop or length
CACHE_LAYERS = ("processor", "ipc", "shm", "encoder", "prefix", "first_token")
logger = logging.getLogger(__name__)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# seconds; from a few ms (a cached image, a short prompt) to minutes (a long generation)
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
# seconds between two outputs that brought tokens: a few ms on a GPU, more under load or on a CPU
_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)  # vLLM's 1-2-5
_N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's finished_reason values


@dataclass
class FinishedRequest:
    """What vLLM's per-request families read of an ended request, beside its outcome and times."""

    finish_reasons: list[str]  # one per completion: stop, length, abort or error
    max_completion_tokens: int  # the longest completion's tokens
    n: int  # completions asked for
    max_tokens: int | None  # asked for (None: up to the context's end)
    decode_s: float | None  # first token to last, in the API server (None: no token)
    times: RequestTimes | None = None  # the engine core's (vLLM's queue, prefill, decode and inference times)


class EngineStatsCollector(Collector):
    """Engine-core gauges read at scrape time from `stats_fn()` (None before the first step).

    Before the engine core's first step the request gauges read 0 and the block gauges are absent.
    """

    def __init__(self, stats_fn: Callable[[], SchedulerStats | None]) -> None:
        self.stats_fn = stats_fn

    def collect(self) -> Iterator[Metric]:
        stats = self.stats_fn()
        running, waiting, preempted = (0, 0, 0) if stats is None else (
            stats.num_running, stats.num_waiting, stats.num_preemptions)
        free, total = (None, None) if stats is None else (stats.num_free_blocks, stats.num_total_blocks)
        yield _gauge("mmserve_num_requests_running", "Requests in the engine core's running batch.", running)
        yield _gauge("mmserve_num_requests_waiting", "Requests queued in the engine core.", waiting)
        yield _gauge("mmserve_kv_cache_free_blocks", "Free KV cache blocks.", free)
        yield _gauge("mmserve_kv_cache_total_blocks", "KV cache blocks in all.", total)
        weights = None if stats is None else stats.weight_bytes
        yield _gauge("mmserve_model_weight_bytes", "Bytes of model weights held, quantized ones as they are "
                     "held (every engine and tensor-parallel rank together).", weights)
        preemptions = CounterMetricFamily("mmserve_num_preemptions_total",
                                          "Requests preempted (KV blocks taken back) since start.")
        preemptions.add_metric([], preempted)
        yield preemptions
        yield from _cache_metrics({} if stats is None else stats.caches)


_CACHE_FIELDS = (  # (CacheStats field, metric name, kind, help)
    ("queries", "mmserve_cache_queries", "counter", "Cache lookups by cache layer."),
    ("hits", "mmserve_cache_hits", "counter", "Cache lookups that hit, by cache layer."),
    ("evictions", "mmserve_cache_evictions", "counter", "Entries evicted, by cache layer."),
    ("bytes_saved", "mmserve_cache_bytes_saved", "counter", "Bytes kept off the P0 -> P1 wire, by cache layer."),
    ("fallbacks", "mmserve_cache_fallbacks", "counter", "Items sent inline because the layer could not "
     "take them (too big, store full), by cache layer."),
    ("entries", "mmserve_cache_entries", "gauge", "Entries held, by cache layer."),
    ("bytes_used", "mmserve_cache_bytes_used", "gauge", "Bytes held, by cache layer."),
)


def _cache_metrics(caches: dict[str, CacheStats]) -> Iterator[Metric]:
    """One family per CacheStats field, a sample per layer (every layer, 0 when absent)."""
    for field, name, kind, doc in _CACHE_FIELDS:
        family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=["layer"])
        for layer in CACHE_LAYERS:
            family.add_metric([layer], getattr(caches.get(layer, _EMPTY), field))
        yield family


_EMPTY = CacheStats()


def _gauge(name: str, documentation: str, value: int | None) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, documentation)
    if value is not None:
        gauge.add_metric([], value)
    return gauge


@dataclass
class VerifyFigures:
    """The shadow cache verifier's counts (`frontend/cache_verifier.py`), since start."""

    matches: int = 0
    mismatches: int = 0
    max_abs_diff: float = 0.0  # the largest first-token logit difference seen


class VerifyCollector(Collector):
    """`mmserve_cache_verify_total{outcome}` and `mmserve_cache_verify_max_abs_diff`, read at scrape."""

    def __init__(self, figures_fn: Callable[[], VerifyFigures]) -> None:
        self.figures_fn = figures_fn

    def collect(self) -> Iterator[Metric]:
        figures = self.figures_fn()
        total = CounterMetricFamily("mmserve_cache_verify", "Requests served by a cache that the shadow "
                                    "verifier re-ran with every cache bypassed, by outcome.", labels=["outcome"])
        total.add_metric(["match"], figures.matches)
        total.add_metric(["mismatch"], figures.mismatches)
        yield total
        diff = GaugeMetricFamily("mmserve_cache_verify_max_abs_diff", "The largest first-token logit "
                                 "difference the shadow verifier saw between a cached and an uncached run.")
        diff.add_metric([], figures.max_abs_diff)
        yield diff


class ServerMetrics:
    """The server's metrics; the HTTP layer calls `on_request_finished` once per request."""

    def __init__(self, stats_fn: Callable[[], SchedulerStats | None] | None = None,
                 dp_figures_fn: Callable[[], DataParallelFigures] | None = None, api_server: int | None = None,
                 verify_fn: Callable[[], VerifyFigures] | None = None, model_name: str | None = None) -> None:
        """`api_server`: this server's index when it is one of several (its requests are also
        counted under `api_server="<index>"`); `verify_fn`: the cache verifier's figures (this
        server's own: with several API servers each reports its shadows); `model_name`: the served
        name vLLM's metric names carry (`vllm_metrics.py`; none without it)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mmserve_requests", "Chat completion requests by outcome "
                                "(success: finished by stop or length).", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome=outcome)
        self.prompt_tokens = Counter("mmserve_prompt_tokens", "Prompt tokens of requests that reached "
                                     "the engine (image placeholders included).", registry=r)
        self.generation_tokens = Counter("mmserve_generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram("mmserve_time_to_first_token_seconds", "From the request's arrival to its "
                              "first generated token.", buckets=_TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("mmserve_e2e_request_latency_seconds", "From arrival to the last token, for "
                             "requests finished by stop or length.", buckets=_E2E_BUCKETS, registry=r)
        self._vllm_families(r)
        self.api_server = None if api_server is None else Counter(
            "mmserve_api_server_requests", "Requests each API server answered (any outcome).", ["api_server"],
            registry=r).labels(api_server=str(api_server))
        self.render_registry = r
        sources: list[Source] = [self.prompt_tokens, self.generation_tokens, self.ttft, self.e2e, self.finished,
                                 *self.per_request.values()]  # for vllm: names
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # one of several API servers: every process's counts
            self.render_registry = CollectorRegistry()
            sources = [multiprocess.MultiProcessCollector(self.render_registry)]
        if stats_fn is not None:
            sources.append(engine := EngineStatsCollector(stats_fn))
            self.render_registry.register(engine)
        if model_name is not None:
            self.render_registry.register(VllmNames(sources, model_name))
        if dp_figures_fn is not None:
            self.render_registry.register(RankCollector(dp_figures_fn))
        if verify_fn is not None:
            self.render_registry.register(VerifyCollector(verify_fn))

    def _vllm_families(self, r: CollectorRegistry) -> None:
        """The families only vLLM's names show (`vllm_metrics.py`), kept under mmserve's names."""
        self.finished = Counter("mmserve_request_finished", "Completions ended, by finish reason.",
                                ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.finished.labels(finished_reason=reason)
        per_request = [  # key, mmserve's name, what one observation is, buckets
            ("request_prompt", "mmserve_request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS),
            ("request_generation", "mmserve_request_generation_tokens", "Generated tokens per request (all its "
             "completions').", _TOKEN_BUCKETS),
            ("request_longest", "mmserve_request_max_num_generation_tokens", "The longest completion's tokens, per "
             "request.", _TOKEN_BUCKETS),
            ("params_n", "mmserve_request_params_n", "Completions asked for (n), per request.", _N_BUCKETS),
            ("params_max_tokens", "mmserve_request_params_max_tokens", "max_tokens asked for, per request that set "
             "one.", _TOKEN_BUCKETS),
            ("token_gap", "mmserve_inter_token_latency_seconds", "Between two outputs of a request that brought "
             "tokens.", _GAP_BUCKETS),
            ("per_token", "mmserve_request_time_per_output_token_seconds", "Per request: first token to last over "
             "the tokens after each completion's first.", _GAP_BUCKETS),
            ("decode", "mmserve_request_decode_time_seconds", "Per request: first token to last.", _E2E_BUCKETS),
            ("queue", "mmserve_request_queue_time_seconds", "Per request: reaching the engine core to its first "
             "admission.", _E2E_BUCKETS),
            ("prefill", "mmserve_request_prefill_time_seconds", "Per request: first admission to first token.",
             _E2E_BUCKETS),
            ("inference", "mmserve_request_inference_time_seconds", "Per request: first admission to last token.",
             _E2E_BUCKETS),
        ]
        self.per_request = {key: Histogram(name, documentation, buckets=buckets, registry=r)
                            for key, name, documentation, buckets in per_request}

    def on_token_gap(self, seconds: float) -> None:
        """A request's output brought tokens `seconds` after its previous one did."""
        self.per_request["token_gap"].observe(seconds)

    def on_request_finished(self, outcome: str, prompt_tokens: int, generation_tokens: int,
                            ttft_s: float | None, e2e_s: float | None, details: FinishedRequest | None = None) -> None:
        """Count one ended request; `ttft_s` None when no token came, `e2e_s` observed on success only;
        `details` for vLLM's per-request families (none without it)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {', '.join(OUTCOMES)}; got {outcome!r}")
        self.requests.labels(outcome=outcome).inc()
        if self.api_server is not None:
            self.api_server.inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if e2e_s is not None and outcome == "success":
            self.e2e.observe(e2e_s)
        if details is not None:
            self._count_details(prompt_tokens, generation_tokens, details)

    def _count_details(self, prompt_tokens: int, generation_tokens: int, d: FinishedRequest) -> None:
        for reason in d.finish_reasons:
            self.finished.labels(finished_reason=reason if reason in FINISH_REASONS else "abort").inc()
        self.per_request["request_prompt"].observe(prompt_tokens)
        self.per_request["request_generation"].observe(generation_tokens)
        self.per_request["request_longest"].observe(d.max_completion_tokens)
        self.per_request["params_n"].observe(d.n)
        if d.max_tokens is not None:
            self.per_request["params_max_tokens"].observe(d.max_tokens)
        decode_s = d.times.decode_s if d.times is not None else d.decode_s  # the engine core's clock, as vLLM's
        if decode_s is not None:
            self.per_request["decode"].observe(decode_s)
            if generation_tokens > d.n:  # a completion's tokens after its first
                self.per_request["per_token"].observe(decode_s / (generation_tokens - d.n))
        if d.times is not None and d.times.scheduled_ts is not None:
            self.per_request["queue"].observe(d.times.scheduled_ts - d.times.queued_ts)
            self.per_request["prefill"].observe(d.times.first_token_ts - d.times.scheduled_ts)
            self.per_request["inference"].observe(d.times.last_token_ts - d.times.scheduled_ts)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.render_registry)


async def log_stats_periodically(stats_fn: Callable[[], SchedulerStats | None], every_s: float = 10.0) -> None:
    """One INFO line every `every_s` seconds while anything happened: load and hit rates."""
    last = None
    while True:
        await asyncio.sleep(every_s)
        stats = stats_fn()
        if stats is None or stats == last:
            continue
        last = stats
        rates = ", ".join(f"{layer} {c.hits / c.queries:.0%}" for layer, c in sorted(stats.caches.items())
                          if c.queries)
        logger.info("running %d, waiting %d, KV blocks free %d/%d; cache hit rates: %s", stats.num_running,
                    stats.num_waiting, stats.num_free_blocks, stats.num_total_blocks, rates or "no lookups")
