"""`--kv-events-config`: where an engine core publishes its prefix cache's changes (vLLM's names).

`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic":
"kv-events"}`, plus optionally `replay_endpoint`, `buffer_steps`, `hwm`, `max_queue_size`, and our
`buffer_bytes` (the replay buffer's bound in payload bytes) and `event_encoding` ("map", today's
vLLM, or "array", the positional events of vLLM before #42892). With
data parallelism each rank publishes on its own endpoint, as vLLM offsets it (a tcp port plus the
rank; `_dp<rank>` after an ipc or inproc address), under the topic `<topic>.dp<rank>` (a
subscriber to the bare topic gets every rank: ZMQ subscriptions match by prefix); every batch also
carries its `data_parallel_rank`. The events themselves are in `engine/kv_events.py`.
Every field is checked for its type and range when the server starts, before any model loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

PUBLISHERS = ("null", "zmq")
_MAX_COUNT = (1 << 31) - 1  # the largest count (ZMQ's hwm is a C int)
_BOOLS = ("enable_kv_cache_events",)
_COUNTS = ("buffer_steps", "hwm", "max_queue_size", "buffer_bytes")
_STRINGS = ("publisher", "endpoint", "topic", "event_encoding")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay (with a replay_endpoint; none without one)
    buffer_bytes: int = 64 << 20  # ours: and at most this many payload bytes
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""
    event_encoding: str = "map"  # ours: "array" for subscribers of vLLM before its PR #42892

    def __post_init__(self) -> None:
        _check_types(self)
        if self.event_encoding not in ("map", "array"):
            raise ValueError(f"kv_events_config.event_encoding must be map or array; got {self.event_encoding!r}")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)}; "
                             f"got {self.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            address = getattr(self, name)
            if address is not None and not address.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv_events_config.{name} must be a tcp://, ipc:// or inproc:// address; "
                                 f"got {address!r}")

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


def _check_types(config: KVEventsConfig) -> None:
    """Every field of its own type (booleans are booleans: the string "false" is refused), counts in range."""
    for name in _BOOLS:
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"kv_events_config.{name} must be true or false; got {getattr(config, name)!r}")
    for name in _STRINGS:
        if not isinstance(getattr(config, name), str):
            raise ValueError(f"kv_events_config.{name} must be a string; got {getattr(config, name)!r}")
    if config.replay_endpoint is not None and not isinstance(config.replay_endpoint, str):
        raise ValueError(f"kv_events_config.replay_endpoint must be a string or null; got {config.replay_endpoint!r}")
    for name in _COUNTS:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_COUNT:
            raise ValueError(f"kv_events_config.{name} must be an integer in [1, {_MAX_COUNT}]; got {value!r}")


def offset_endpoint(endpoint: str, rank: int) -> str:
    """Rank `rank`'s address: a tcp port plus the rank, or `_dp<rank>` after another address."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"
