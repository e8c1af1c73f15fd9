"""`--kv-events-config`: where an engine core publishes its prefix cache's changes (vLLM's names).

`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic":
"kv-events"}`, plus optionally `replay_endpoint`, `buffer_steps`, `hwm`, `max_queue_size`, and our
`event_encoding` ("map", today's vLLM, or "array", the positional events of vLLM before #42892). With
data parallelism each rank publishes on its own endpoint, as vLLM offsets it (a tcp port plus the
rank; `_dp<rank>` after an ipc or inproc address), under the topic `<topic>.dp<rank>` (a
subscriber to the bare topic gets every rank: ZMQ subscriptions match by prefix); every batch also
carries its `data_parallel_rank`. The events themselves are in `engine/kv_events.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""
    event_encoding: str = "map"  # ours: "array" for subscribers of vLLM before its PR #42892

    def __post_init__(self) -> None:
        if self.event_encoding not in ("map", "array"):
            raise ValueError(f"kv_events_config.event_encoding must be map or array; got {self.event_encoding!r}")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)}; "
                             f"got {self.publisher!r}")
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"kv_events_config.endpoint must be a tcp://, ipc:// or inproc:// address; "
                             f"got {self.endpoint!r}")
        if min(self.buffer_steps, self.hwm, self.max_queue_size) < 1:
            raise ValueError("kv_events_config: buffer_steps, hwm and max_queue_size must be positive")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVEventsConfig:
        """From the flag's JSON object; a ValueError names an unknown key or a bad value."""
        if not isinstance(values, dict):
            raise ValueError("kv_events_config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**values)

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def for_rank(self, rank: int, data_parallel_size: int) -> tuple[str, str | None, str]:
        """(endpoint, replay endpoint, topic) of data-parallel `rank`."""
        if data_parallel_size == 1:
            return self.endpoint, self.replay_endpoint, self.topic
        topic = f"{self.topic}.dp{rank}" if self.topic else f"dp{rank}"
        replay = None if self.replay_endpoint is None else offset_endpoint(self.replay_endpoint, rank)
        return offset_endpoint(self.endpoint, rank), replay, topic


def offset_endpoint(endpoint: str, rank: int) -> str:
    """Rank `rank`'s address: a tcp port plus the rank, or `_dp<rank>` after another address."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"
