"""The server's /metrics, scraped before and after a run: per cache layer hit rates over the run.

A layer's hit rate during a run is (hits after - hits before) / (queries after - queries before),
from `mmserve_cache_hits_total{layer=...}` and `mmserve_cache_queries_total{layer=...}`; it is
None when the layer answered no query during the run (turned off, not built yet, or unused by
the workload) or when /metrics could not be read. With data parallelism each rank's encoder and
prefix layers follow as `<layer> dp<rank>` (from `mmserve_engine_cache_*_total{engine=...}`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mmserve.metrics import CACHE_LAYERS  # the layers mmserve reports, in the order tables show them

if TYPE_CHECKING:
    import httpx

QUERIES = "mmserve_cache_queries_total"
HITS = "mmserve_cache_hits_total"
RANK_QUERIES = "mmserve_engine_cache_queries_total"
RANK_HITS = "mmserve_engine_cache_hits_total"
RANK_LAYERS = ("encoder", "prefix")

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Labels = tuple[tuple[str, str], ...]


@dataclass
class MetricsSnapshot:
    """Every sample of one /metrics scrape: (name, sorted labels) -> value. Empty if unreadable."""

    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)
    error: str | None = None

    @classmethod
    def parse(cls, text: str) -> MetricsSnapshot:
        """Parse the Prometheus text exposition format (comments and bad lines are skipped)."""
        samples: dict[tuple[str, Labels], float] = {}
        for line in text.splitlines():
            match = _SAMPLE.match(line)
            if match is None:
                continue
            name, labels, value = match.groups()
            try:
                samples[(name, tuple(sorted(_LABEL.findall(labels or ""))))] = float(value)
            except ValueError:
                continue
        return cls(samples)

    def value(self, name: str, **labels: str) -> float | None:
        return self.samples.get((name, tuple(sorted(labels.items()))))

    def layers(self) -> list[str]:
        """Cache layers present in the scrape, mmserve's known order first."""
        found = {dict(labels).get("layer") for name, labels in self.samples if name == QUERIES}
        return [layer for layer in CACHE_LAYERS if layer in found] + sorted(
            layer for layer in found if layer is not None and layer not in CACHE_LAYERS)


async def scrape(client: httpx.AsyncClient, base_url: str) -> MetricsSnapshot:
    """GET {base_url}/metrics; a failure gives an empty snapshot holding the error."""
    try:
        response = await client.get(base_url.rstrip("/") + "/metrics", timeout=10.0)
        response.raise_for_status()
    except Exception as e:
        return MetricsSnapshot(error=f"{type(e).__name__}: {e}")
    return MetricsSnapshot.parse(response.text)


@dataclass(frozen=True)
class CacheDelta:
    """One layer's queries and hits during a run (None when /metrics had no such sample)."""

    queries: int | None
    hits: int | None

    @property
    def hit_rate(self) -> float | None:
        if not self.queries or self.hits is None:
            return None
        return self.hits / self.queries


def cache_deltas(before: MetricsSnapshot, after: MetricsSnapshot) -> dict[str, CacheDelta]:
    """Per layer (every known layer, then any other the server reports): the run's queries and hits."""
    layers = list(CACHE_LAYERS) + [layer for layer in after.layers() if layer not in CACHE_LAYERS]
    deltas = {layer: CacheDelta(_delta(before, after, QUERIES, layer=layer), _delta(before, after, HITS, layer=layer))
              for layer in layers}
    ranks = sorted({dict(labels)["engine"] for name, labels in after.samples
                    if name == RANK_QUERIES and "engine" in dict(labels)}, key=int)
    for rank in ranks if len(ranks) > 1 else ():  # one rank's figures are the totals
        for layer in RANK_LAYERS:
            deltas[f"{layer} dp{rank}"] = CacheDelta(_delta(before, after, RANK_QUERIES, engine=rank, layer=layer),
                                                     _delta(before, after, RANK_HITS, engine=rank, layer=layer))
    return deltas


def _delta(before: MetricsSnapshot, after: MetricsSnapshot, name: str, **labels: str) -> int | None:
    start, end = before.value(name, **labels), after.value(name, **labels)
    if start is None or end is None:
        return None
    return round(end - start)


def counter_delta(before: MetricsSnapshot, after: MetricsSnapshot, name: str, **labels: str) -> float | None:
    """`after - before` of one sample, None if either scrape lacks it."""
    start, end = before.value(name, **labels), after.value(name, **labels)
    return None if start is None or end is None else end - start
