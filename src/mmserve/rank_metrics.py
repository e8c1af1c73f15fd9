"""Per-rank Prometheus figures with data parallelism (`engine="<rank>"`), read at scrape time.

The node totals stay where they were (`mmserve_cache_hits_total{layer=...}`,
`mmserve_num_requests_running`, ...: sums over ranks); these families split what belongs to one
rank: its state (up, restarts, running, waiting, KV blocks), its cache layers (the engine core's
encoder and prefix caches, and the IPC mirror P0 keeps for it), and the requests it finished
with their prompt and generated tokens. Routing decisions are counted by reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mmserve.ipc.messages import SchedulerStats

_RANK_LAYERS = ("ipc", "encoder", "prefix")


@dataclass
class RankFigures:
    """One rank as P0 sees it; `stats` None before its first step (or while it is down)."""

    rank: int
    up: bool
    restarts: int
    stats: SchedulerStats | None
    requests: int = 0  # finished there (any outcome)
    prompt_tokens: int = 0
    generation_tokens: int = 0


@dataclass
class DataParallelFigures:
    ranks: list[RankFigures]
    decisions: dict[str, int]  # routing decisions by reason


class RankCollector(Collector):
    def __init__(self, figures_fn: Callable[[], DataParallelFigures]) -> None:
        self.figures_fn = figures_fn

    def collect(self) -> Iterator[Metric]:
        figures = self.figures_fn()
        engine = ["engine"]
        up = GaugeMetricFamily("mmserve_engine_up", "1 while the rank serves.", labels=engine)
        restarts = CounterMetricFamily("mmserve_engine_restarts", "Restarts of the rank's engine core.",
                                       labels=engine)
        gauges = {name: GaugeMetricFamily(f"mmserve_engine_{name}", doc, labels=engine) for name, doc in (
            ("requests_running", "Requests in the rank's running batch."),
            ("requests_waiting", "Requests queued in the rank."),
            ("kv_cache_free_blocks", "Free KV cache blocks of the rank."),
            ("kv_cache_total_blocks", "KV cache blocks of the rank."))}
        counters = {name: CounterMetricFamily(f"mmserve_engine_{name}", doc, labels=engine) for name, doc in (
            ("requests", "Requests the rank finished (any outcome)."),
            ("prompt_tokens", "Prompt tokens of requests the rank finished."),
            ("generation_tokens", "Tokens the rank generated for requests it finished."))}
        queries = CounterMetricFamily("mmserve_engine_cache_queries", "Cache lookups by rank and layer.",
                                      labels=["engine", "layer"])
        hits = CounterMetricFamily("mmserve_engine_cache_hits", "Cache hits by rank and layer.",
                                   labels=["engine", "layer"])
        for r in figures.ranks:
            label = [str(r.rank)]
            up.add_metric(label, 1 if r.up else 0)
            restarts.add_metric(label, r.restarts)
            for name, value in (("requests", r.requests), ("prompt_tokens", r.prompt_tokens),
                                ("generation_tokens", r.generation_tokens)):
                counters[name].add_metric(label, value)
            if r.stats is None:
                continue
            for name, value in (("requests_running", r.stats.num_running), ("requests_waiting", r.stats.num_waiting),
                                ("kv_cache_free_blocks", r.stats.num_free_blocks),
                                ("kv_cache_total_blocks", r.stats.num_total_blocks)):
                gauges[name].add_metric(label, value)
            for layer in _RANK_LAYERS:
                if (c := r.stats.caches.get(layer)) is not None:
                    queries.add_metric(label + [layer], c.queries)
                    hits.add_metric(label + [layer], c.hits)
        decisions = CounterMetricFamily("mmserve_dp_routing_decisions", "Requests routed to a data-parallel "
                                        "rank, by reason (pinned, cache, load, imbalance).", labels=["reason"])
        for reason, count in sorted(figures.decisions.items()):
            decisions.add_metric([reason], count)
        yield from (up, restarts, *gauges.values(), *counters.values(), queries, hits, decisions)
