"""What each cache layer did for one request's prompt (`CacheReport`), as a user sees it in the
`x-mmserve-cache` response header.

Every count comes from the layer itself, per request: P0's layers count as the request's items
resolve and cross to P1 (`processor`: one lookup per image or video; `ipc` or `shm`: one per item
sent, a video's temporal groups each an item), P1's layers come back in the request's first output
(`EngineCoreOutput.cache_counts`: `encoder` in items, `prefix` in prompt tokens — an identical
prompt's last block and a copied partial block included —, `last_block` / `first_token` in lookups,
`partial_block` in tokens: those copied of the block after the full-block hits, of those looked
up). A layer that was not asked (turned off, a prompt without images) is absent. The header lists
`layer=hits/queries` in the request path's order, e.g. `processor=1/1 ipc=1/1 encoder=0/1 prefix=166/167`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HEADER = "x-mmserve-cache"
LAYER_ORDER = ("processor", "ipc", "shm", "encoder", "prefix", "last_block", "partial_block", "first_token")


@dataclass
class CacheReport:
    """(hits, queries) per layer for one request, and its items' hashes (for the verifier's log).

    `count` replaces a layer's figures (a resend sends every item again: its IPC lookups are new);
    `merge` takes P1's layers from the first output, once (`p1_done`)."""

    counts: dict[str, tuple[int, int]] = field(default_factory=dict)
    item_hashes: list[str] = field(default_factory=list)
    p1_done: bool = False

    def count(self, layer: str, hits: int, queries: int) -> None:
        self.counts[layer] = (hits, queries)

    def merge(self, p1_counts: dict[str, tuple[int, int]] | None) -> None:
        """P1's layers, from a completion's first output (only the first call counts)."""
        if self.p1_done or p1_counts is None:
            return
        self.p1_done = True
        for layer, (hits, queries) in p1_counts.items():
            self.counts[layer] = (hits, queries)

    @classmethod
    def combined(cls, reports: list[CacheReport]) -> CacheReport:
        """Several prompts' reports as one (a completions request with a list of prompts): each
        layer's hits and queries added."""
        total = cls(p1_done=all(r.p1_done for r in reports))
        for report in reports:
            for layer, (hits, queries) in report.counts.items():
                old_hits, old_queries = total.counts.get(layer, (0, 0))
                total.counts[layer] = (old_hits + hits, old_queries + queries)
            total.item_hashes += report.item_hashes
        return total

    def moved(self) -> None:
        """The request starts over on another engine rank: its P1 layers will come from there."""
        self.p1_done = False

    @property
    def hit_layers(self) -> list[str]:
        """The layers that served something of this request, in the request path's order."""
        return [layer for layer in self._ordered() if self.counts[layer][0] > 0]

    def header_value(self) -> str:
        return " ".join(f"{layer}={hits}/{queries}" for layer in self._ordered()
                        for hits, queries in [self.counts[layer]])

    def _ordered(self) -> list[str]:
        known = [layer for layer in LAYER_ORDER if layer in self.counts]
        return known + sorted(set(self.counts) - set(LAYER_ORDER))


def cache_headers(report: CacheReport | None) -> dict[str, str]:
    """The response headers that carry `report` (every OpenAI endpoint answers with them, whole or
    streamed; a stream sends them with its status line, after the first output: P1's layers are in)."""
    return {HEADER: report.header_value() if report is not None else ""}
