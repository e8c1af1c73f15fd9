"""Responses kept in memory for `previous_response_id`: each one's conversation, LRU by bytes.

What is kept per response is the conversation a later turn continues: the earlier turns (from its
own `previous_response_id`, if any), its input as chat messages and its answer as an assistant
turn — never its `instructions`, which OpenAI does not carry over. A size is the length of the
conversation's JSON (images included as their data URLs). Adding an entry evicts the least
recently used ones until the total fits `capacity_bytes`; an entry larger than that is not kept.
Each API server keeps its own store.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec

Conversation = list[dict[str, Any]]


class ResponseStore:
    """`put` keeps a response's conversation, `get` finds it (and marks it recently used)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[str, tuple[bytes, int]] = OrderedDict()  # id -> (JSON, its size)

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, conversation: Conversation) -> None:
        """Keep `conversation` under `response_id` (evicting the least recently used as needed)."""
        data = msgspec.json.encode(conversation)
        if len(data) > self.capacity_bytes:
            return
        while self.used_bytes + len(data) > self.capacity_bytes:
            _, (_, size) = self._entries.popitem(last=False)
            self.used_bytes -= size
        self._entries[response_id] = (data, len(data))
        self.used_bytes += len(data)

    def get(self, response_id: str) -> Conversation | None:
        """A copy of the conversation kept under `response_id`, or None."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return msgspec.json.decode(entry[0])

    def check_integrity(self) -> None:
        assert self.used_bytes == sum(size for _, size in self._entries.values()), "used_bytes is off"
        assert self.used_bytes <= self.capacity_bytes, "over capacity"
