"""Partial-block reuse: a cached block's leading tokens, copied into a block of the request's own.

The prefix cache hits whole blocks (`block_pool.py`), so a request whose next k < block_size
tokens after its F hit blocks equal a cached block's first k tokens (the same image, then another
question) would compute them again. This index finds that block: every computed block the cache
keeps — a full block under its hash, a prompt's last block under its last-block key — is filed
under its *root* (its parent hash, and for a first block its salt) with its token ids and extra
keys. `find` answers, for the request's tokens after its hits, the filed block under the same root
whose leading part is reusable longest, judged by `block_hash.reusable_prefix_length` (the
exactness rule: equal tokens, equal keys of the items overlapping them). The scheduler has the
runner copy that block into the request's block F before the step's forward
(`SchedulerOutput.kv_copies`; the whole block: the request's own K/V overwrite the slots past k
before any attention reads them) and the request's prefill starts k tokens into it. The cached
block is neither written nor taken, and stays cached.

Search: under a root, entries are sorted by a byte key holding, per slot, the token id and an 8-byte
tag of the item keys started by then (offset <= slot). The entry sharing the longest leading run of
(token, tag) with a request's key is one of its two neighbours in that order (a binary search).
Tags only narrow the search: the answer is judged by the exactness rule on the kept tokens and
keys, so a tag collision can cost a reuse but never make a wrong one.

Life of an entry: a block is filed once the step that computed its tokens has run (`file_computed`),
so its K/V are in place before any copy reads them, and dropped when the pool drops its keys
(`BlockPool.on_block_dropped`: the block is handed out again, or a failed step unregisters it). A
prompt's last block filed with fewer tokens is filed again, with all of them, once full.
"""

from __future__ import annotations

import hashlib
import struct
from bisect import bisect_left, insort
from typing import NamedTuple, Sequence

import msgspec

from mmserve.engine.block_hash import BlockHash, ExtraKeys, block_extra_keys, mm_key_offset, reusable_prefix_length
from mmserve.engine.block_pool import KVBlock
from mmserve.engine.request import Request

Root = tuple[BlockHash, str | None]  # (parent hash, cache salt of a first block)

_TOKEN = struct.Struct(">I")  # big-endian: the key's byte order is the token ids' order
_TAG_BYTES = 8
_SLOT_BYTES = _TOKEN.size + _TAG_BYTES
_ENCODER = msgspec.msgpack.Encoder()


class _Entry(NamedTuple):
    block: KVBlock
    root: Root
    key: bytes  # `sort_key(tokens, keys)`
    tokens: tuple[int, ...]  # the block's leading tokens whose K/V are computed
    keys: ExtraKeys  # their extra keys (`block_extra_keys` over those tokens)


class PartialPrefixIndex:
    """Computed blocks by root, searched by their leading tokens: `add` files a block, `drop`
    unfiles it (both mutate only the index), `find` answers a reusable leading part (changes nothing).

    Invariants (`check_integrity`): every entry is in its root's list once, each list is sorted
    and not empty, and every filed block holds a pool key (a hash or a last-block key)."""

    def __init__(self) -> None:
        self._sorted: dict[Root, list[tuple[bytes, int]]] = {}  # root -> (key, block id), ascending
        self._entries: dict[int, _Entry] = {}  # block id -> its entry

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, block: KVBlock, root: Root, tokens: Sequence[int], keys: ExtraKeys) -> None:
        """File `block`, whose first `len(tokens)` slots hold the computed K/V of `tokens`; a block
        filed already keeps the longer of its two entries."""
        old = self._entries.get(block.block_id)
        if old is not None:
            if len(old.tokens) >= len(tokens):
                return
            self.drop(block)
        entry = _Entry(block, root, sort_key(tokens, keys), tuple(tokens), keys)
        self._entries[block.block_id] = entry
        insort(self._sorted.setdefault(root, []), (entry.key, block.block_id))

    def drop(self, block: KVBlock) -> None:
        """Unfile `block` (its contents may change); nothing when it is not filed."""
        entry = self._entries.pop(block.block_id, None)
        if entry is None:
            return
        same = self._sorted[entry.root]
        i = bisect_left(same, (entry.key, block.block_id))
        assert same[i] == (entry.key, block.block_id), f"{block} is not where its key sorts"
        del same[i]
        if not same:
            del self._sorted[entry.root]

    def clear(self) -> None:
        """Unfile every block (the pool dropped every key)."""
        self._sorted.clear()
        self._entries.clear()

    def find(self, root: Root, tokens: Sequence[int], keys: ExtraKeys) -> tuple[KVBlock | None, int] | None:
        """The filed block under `root` whose first k tokens have the K/V that `tokens` (with
        `keys`, their extra keys) would get, k the longest; (None, 0) when none has any; None when
        no block is filed under `root` (nothing was compared)."""
        same = self._sorted.get(root)
        if not same or not tokens:
            return None
        key = sort_key(tokens, keys)
        i = bisect_left(same, (key,))
        best: KVBlock | None = None
        best_k = 0
        for near_key, block_id in same[max(0, i - 1):i + 1]:
            entry = self._entries[block_id]
            k = reusable_prefix_length(entry.tokens, entry.keys, tokens, keys, _common_slots(near_key, key))
            if k > best_k:
                best, best_k = entry.block, k
        return best, best_k

    def check_integrity(self) -> None:
        filed = 0
        for root, same in self._sorted.items():
            assert same and same == sorted(same), f"root {root[0][:4].hex()}: empty or unsorted"
            for key, block_id in same:
                entry = self._entries[block_id]
                assert entry.root == root and entry.key == key and entry.block.block_id == block_id
            filed += len(same)
        assert filed == len(self._entries), "an entry is filed under no root, or twice"
        for entry in self._entries.values():
            block = entry.block
            assert block.block_hash is not None or block.last_hash is not None, f"{block} is filed without a key"


def sort_key(tokens: Sequence[int], keys: ExtraKeys) -> bytes:
    """Per slot, the token id (4 bytes) and a tag of the item keys that start at or before it."""
    mm = [key for key in keys if key[0] == "mm"]
    if not mm:
        return b"".join(_TOKEN.pack(token) + _NO_ITEMS for token in tokens)
    out = bytearray()
    started, tag = 0, _NO_ITEMS
    for slot, token in enumerate(tokens):
        n = started
        while n < len(mm) and mm_key_offset(mm[n]) <= slot:
            n += 1
        if n != started:
            started, tag = n, _tag(mm[:n])
        out += _TOKEN.pack(token)
        out += tag
    return bytes(out)


def _tag(mm_keys: Sequence[tuple[object, ...]]) -> bytes:
    return hashlib.blake2b(_ENCODER.encode(mm_keys), digest_size=_TAG_BYTES).digest()


_NO_ITEMS = _tag(())


def _common_slots(a: bytes, b: bytes) -> int:
    """How many leading slots two sort keys share."""
    n = 0
    for start in range(0, min(len(a), len(b)), _SLOT_BYTES):
        if a[start:start + _SLOT_BYTES] != b[start:start + _SLOT_BYTES]:
            break
        n += 1
    return n


# ---- a request's blocks ------------------------------------------------------------------


def block_root(req: Request, index: int) -> Root | None:
    """The root of `req`'s block `index`; None without block hashes up to it."""
    parent = req.block_parent(index)
    if parent is None:
        return None
    return parent, req.cache_salt if index == 0 else None


def block_keys(req: Request, start: int, end: int) -> ExtraKeys:
    """The extra keys of `req`'s tokens [start, end), within one block."""
    items = req.mm_items
    if len(items) > 1:
        items = sorted(items, key=lambda item: item.placeholder.offset)
    return block_extra_keys(items, req.cache_salt, start, end)


def file_block(index: PartialPrefixIndex, req: Request, block: KVBlock, block_index: int, start: int,
               end: int) -> None:
    """File `req`'s block `block_index` (`block`, from token `start`), its K/V computed up to `end`."""
    root = block_root(req, block_index)
    if root is not None:
        index.add(block, root, req.all_token_ids[start:end], block_keys(req, start, end))


def find_reusable(index: PartialPrefixIndex, req: Request, block_index: int, start: int,
                  end: int) -> tuple[KVBlock | None, int] | None:
    """A filed block whose leading part `req`'s tokens [start, end) of block `block_index` can
    reuse, and that part's length, as `PartialPrefixIndex.find` answers."""
    root = block_root(req, block_index)
    if root is None:
        return None
    return index.find(root, req.all_token_ids[start:end], block_keys(req, start, end))
