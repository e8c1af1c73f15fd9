"""Responses kept for `previous_response_id`: each one's conversation, LRU by the bytes it really holds.

What is kept per response is the conversation a later turn continues: the earlier turns (from its
own `previous_response_id`, if any), its input as chat messages and its answer as an assistant
turn — never its `instructions`, which OpenAI does not carry over. It is kept as JSON bytes under
a key that joins the response's id to its scope (`scope_of`: the request's API key and
`cache_salt`), so a follow-up finds it only with the same key and salt.

An entry's size is what it costs in memory: the JSON's and the key's objects plus a fixed
per-entry overhead (the ordered dict's slot and link); adding an entry evicts the least recently
used ones until the total fits `capacity_bytes`; an entry larger than that is not kept.

One store per node: with `--api-server-count` 1 it lives in the API server (`ResponseStore`); with
more, in the launcher (`launcher/response_store_server.py`), which every API server reaches
through a `ResponseStoreClient` (one round trip over ipc:// per get or put), so a follow-up finds
its response whichever server the kernel hands its connection to. `KeptResponses` is what the
handler uses: JSON encoding, decoding and the store's call run in a worker thread, never on the
event loop (a conversation may hold images as data URLs).
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import threading
from collections import OrderedDict
from typing import Any, Protocol

import msgspec

Conversation = list[dict[str, Any]]

ENTRY_OVERHEAD = 160  # bytes per entry beyond its key and JSON objects (an OrderedDict slot and link; measured)


def scope_of(api_key: str | None, cache_salt: str | None) -> str:
    """The scope a response is kept under: its request's API key and salt, hashed (never stored as given)."""
    digest = hashlib.blake2b(digest_size=12)
    for part in (api_key, cache_salt):
        digest.update(b"\x00" if part is None else b"\x01" + len(part).to_bytes(4, "big") + part.encode())
    return digest.hexdigest()


class EncodedStore(Protocol):
    """What `KeptResponses` stores into: a key -> JSON bytes map (local or the launcher's)."""

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes | None: ...


class ResponseStore:
    """Key -> the conversation's JSON bytes, LRU within `capacity_bytes` of real memory; thread-safe.

    `put` keeps (evicting the least recently used as needed), `get` finds (and marks recently used)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def entry_bytes(key: str, data: bytes) -> int:
        """What one entry costs: its key and JSON objects and the per-entry overhead."""
        return sys.getsizeof(key) + sys.getsizeof(data) + ENTRY_OVERHEAD

    def put(self, key: str, data: bytes) -> None:
        size = self.entry_bytes(key, data)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.used_bytes -= self.entry_bytes(key, old)
            if size > self.capacity_bytes:
                return
            while self.used_bytes + size > self.capacity_bytes:
                evicted, value = self._entries.popitem(last=False)
                self.used_bytes -= self.entry_bytes(evicted, value)
            self._entries[key] = data
            self.used_bytes += size

    def get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._entries.get(key)
            if data is not None:
                self._entries.move_to_end(key)
            return data

    def check_integrity(self) -> None:
        with self._lock:
            assert self.used_bytes == sum(self.entry_bytes(k, v) for k, v in self._entries.items()), "used_bytes is off"
            assert self.used_bytes <= self.capacity_bytes, "over capacity"


class KeptResponses:
    """The handler's view of the store: conversations in and out, scoped, encoded off the event loop."""

    def __init__(self, store: EncodedStore) -> None:
        self.store = store

    async def put(self, scope: str, response_id: str, conversation: Conversation) -> None:
        await asyncio.to_thread(self._put, f"{scope}:{response_id}", conversation)

    async def get(self, scope: str, response_id: str) -> Conversation | None:
        """A copy of the conversation kept under `response_id` in `scope`, or None."""
        return await asyncio.to_thread(self._get, f"{scope}:{response_id}")

    def _put(self, key: str, conversation: Conversation) -> None:
        self.store.put(key, msgspec.json.encode(conversation))

    def _get(self, key: str) -> Conversation | None:
        data = self.store.get(key)
        return None if data is None else msgspec.json.decode(data)
