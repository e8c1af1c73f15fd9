"""KV events: the prefix cache's changes, published over ZMQ in vLLM's wire format.

External cache-aware routers (llm-d's precise prefix scorer, NVIDIA Dynamo's KV router) read
what each replica holds from these. The format is vLLM's `KVEventBatch`, msgpack of msgspec
structs: the batch positional, each event a map tagged by its class name under "type" (vLLM
since its PR #42892; `"event_encoding": "array"` sends the earlier positional events instead,
`["BlockStored", block_hashes, ...]` in the field order below):

    KVEventBatch   = [ts, [event, ...], data_parallel_rank]
    BlockStored    = {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
                      "block_size", "lora_id", "medium", "lora_name", "extra_keys"}
    BlockRemoved   = {"type": "BlockRemoved", "block_hashes", "medium"}
    AllBlocksCleared = {"type": "AllBlocksCleared"}

sent as the multipart message (topic, 8-byte big-endian sequence number, payload); with a
`replay_endpoint`, a ROUTER socket answers a sequence number with every kept batch from it on,
then (-1, b"") (`kv_event_publisher.py`). Block hashes are our digests (bytes);
`parent_block_hash` is None for a prompt's first block; `extra_keys[i]` is block i's extra keys
exactly as `block_hash.py` hashed them
(`("mm", mm_hash, offset, ...)` per item overlapping the block, then `("salt", salt)`), None for
a block without any. `medium` is "GPU", vLLM's name for an engine's own KV cache.

One key, one story: a `BlockStored` when a hash first gets a block in the pool, a `BlockRemoved`
when the last block holding it is handed out again, and `AllBlocksCleared` when the publisher
starts (a new or restarted engine core holds nothing) and again in front of its first change, so
a subscriber that joined after the start still drops what the engine core's previous life held;
and an `AllBlocksCleared` in its step's place for a prefix-cache reset (`engine/cache_reset.py`).

Cost in the step: `KVEventLog` appends tuples (the block's hash, parent, token slice and extra
keys); at the end of a step the list goes to the publisher thread's queue, which builds the
structs, encodes and sends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from mmserve.engine.block_hash import BlockHash

if TYPE_CHECKING:
    from mmserve.engine.request import Request

MEDIUM = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A change of the prefix cache (a map tagged by class name under "type")."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# what KVEventLog records: (STORED, hash, parent, token ids, extra keys), (REMOVED, hash) or (CLEARED,)
STORED, REMOVED, CLEARED = 0, 1, 2
Record = tuple[Any, ...]


class KVEventLog:
    """The step's record of keys the pool gained and lost, in order; `take` hands it over."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._records: list[Record] = []

    def stored(self, req: Request, indices: list[int]) -> None:
        """Blocks `indices` of `req` are now cached under hashes new to the pool."""
        bs, hashes, keys = self.block_size, req.block_hashes, req.block_extra_keys
        for i in indices:
            self._records.append((STORED, hashes[i], hashes[i - 1] if i else None,
                                  req.all_token_ids[i * bs:(i + 1) * bs], keys[i] if i < len(keys) else ()))

    def removed(self, block_hash: BlockHash) -> None:
        self._records.append((REMOVED, block_hash))

    def cleared(self) -> None:
        """The pool dropped every key at once (a prefix-cache reset)."""
        self._records.append((CLEARED,))

    def take(self) -> list[Record]:
        records, self._records = self._records, []
        return records


def to_events(records: list[Record], block_size: int) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """Records as vLLM's events: a run of stored blocks that chain (each the parent of the next)
    is one `BlockStored`, a run of removals one `BlockRemoved`."""
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for record in records:
        last = events[-1] if events else None
        if record[0] == CLEARED:
            events.append(AllBlocksCleared())
            continue
        if record[0] == REMOVED:
            if isinstance(last, BlockRemoved):
                last.block_hashes.append(record[1])
            else:
                events.append(BlockRemoved([record[1]], MEDIUM))
            continue
        _, block_hash, parent, tokens, keys = record
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent:
            last.block_hashes.append(block_hash)
            last.token_ids.extend(tokens)
            assert last.extra_keys is not None
            last.extra_keys.append(keys or None)
        else:
            events.append(BlockStored([block_hash], parent, list(tokens), block_size, None, MEDIUM, None,
                                      [keys or None]))
    return events
