"""Prefix-cache keys: one chained hash per full KV block of a request.

    hash(block i) = H(encode(parent, token_ids, extra_keys))

The rule: a block's key covers every input its K/V values depend on, so two blocks with equal keys
hold equal K/V (tests/engine/test_cache_keys.py checks it on drawn prompts of every family). K/V
depend on the block's tokens, on the encoder outputs scattered into its placeholder tokens, on the
positions its tokens sit at, and on everything before it; hence:

- `parent` is block i-1's hash (covering everything before), or `BlockHasher.seed` for the first
  block (a constant of the algorithm, so hashes agree across processes and restarts);
- `token_ids` are the block's `block_size` token ids;
- `extra_keys` is a tuple of `("mm", mm_hash, offset, position_key)` for every multimodal item whose
  placeholder range overlaps the block — `mm_hash` is the item's content, `offset` the item's start
  relative to the block's start (negative when the item began in an earlier block), and
  `position_key` what the decoder's positions read of the item (`MultiModalItem.position_key`: its
  M-RoPE grid, a Qwen2.5-VL video group's temporal place), declared by the family's processor —
  then `("salt", cache_salt)` on the first block. Placeholder tokens are identical for every image,
  so without the item's hash two images would share blocks; with the offset, one image at two places
  gives two keys; with the position key, the same frames at another frame rate give two keys.
  Text after an item is positioned from it: the parent chain carries its position key on.

A prompt's *last block* (the one holding its last token, full or partial) has a key of the same
form over the tokens it holds so far (`BlockHasher.last_block_hash`): a block of r < block_size
tokens hashes those r tokens and the extra keys of the items overlapping them. For r = block_size
it equals the full block's hash.

A *leading part* of a cached block (`reusable_prefix_length`; the partial-block reuse of
`engine/partial_prefix.py`): under the same parent (and, for a first block, the same salt), the
K/V of the first k slots of a cached block equal those a request would compute for its next k
tokens when the k token ids are equal and so are the keys of every item overlapping those k
positions — the items whose offset is below k (an item listed in a block's keys overlaps the
block, so a negative offset covers slot 0). Items starting at or after k are read by no slot
below k (attention is causal, and positions before an item do not depend on it), so they may
differ. Hence the longest reusable k stops at the first token that differs and at the offset of
the first item key that differs; the salt keys must be equal or nothing is reused.

`encode` is msgpack (msgspec): every value is type-tagged and length-prefixed, and the same
values always give the same bytes — never Python's `hash()`, which is salted per process.
`H` is chosen by `--prefix-caching-hash-algo`: sha256 (default) and blake3 are collision
resistant; xxh3_128 is several times faster but NOT collision resistant — a crafted (or
unlucky) collision would let one prompt read another's KV blocks, so use it only where every
client is trusted.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Sequence

import msgspec

from mmserve.ipc.items import MultiModalItem

BlockHash = bytes  # a digest: 32 bytes (sha256, blake3) or 16 (xxh3_128)
HashFn = Callable[[bytes], BlockHash]
ExtraKeys = tuple[tuple[object, ...], ...]  # ("mm", mm_hash, offset, position_key) ... then ("salt", salt)

HASH_ALGOS = ("sha256", "blake3", "xxh3_128")
_SEED_TEXT = b"mmserve prefix cache v2"  # bump when the encoding of a block changes
_ENCODER = msgspec.msgpack.Encoder()


def _sha256(data: bytes) -> BlockHash:
    return hashlib.sha256(data).digest()


def _blake3(data: bytes) -> BlockHash:
    from blake3 import blake3

    return blake3(data).digest()


def _xxh3_128(data: bytes) -> BlockHash:
    import xxhash

    return xxhash.xxh3_128_digest(data)


_HASH_FNS: dict[str, HashFn] = {"sha256": _sha256, "blake3": _blake3, "xxh3_128": _xxh3_128}


def get_hash_fn(algo: str) -> HashFn:
    """The digest function of `algo` (one of `HASH_ALGOS`); ValueError for another name."""
    if algo not in _HASH_FNS:
        raise ValueError(f"unknown prefix caching hash algorithm {algo!r}; choose one of {', '.join(HASH_ALGOS)}")
    return _HASH_FNS[algo]


def hash_block(hash_fn: HashFn, parent: BlockHash, token_ids: Sequence[int], extra_keys: ExtraKeys) -> BlockHash:
    """One block's key: `hash_fn` over the canonical encoding of (parent, tokens, extra keys)."""
    return hash_fn(_ENCODER.encode((parent, token_ids, extra_keys)))


def block_extra_keys(mm_items: Sequence[MultiModalItem], cache_salt: str | None, start: int, end: int,
                     first: int = 0) -> ExtraKeys:
    """The extra keys of the block holding tokens [start, end) (see the module docstring).

    `mm_items` are in placeholder order (as in a prompt); the scan starts at `first` and stops at
    the first item that begins at or after `end`.
    """
    keys: list[tuple[object, ...]] = []
    for i in range(first, len(mm_items)):
        ph = mm_items[i].placeholder
        if ph.offset >= end:
            break
        if ph.end > start and ph.length:
            keys.append(("mm", mm_items[i].mm_hash, ph.offset - start, mm_items[i].position_key))
    if start == 0 and cache_salt is not None:
        keys.append(("salt", cache_salt))
    return tuple(keys)


def reusable_prefix_length(tokens: Sequence[int], keys: ExtraKeys, other_tokens: Sequence[int],
                           other_keys: ExtraKeys, limit: int) -> int:
    """How many leading tokens (at most `limit`) of two blocks under the same parent have equal K/V
    (see the module docstring): equal token ids, equal keys of the items overlapping them, equal
    salt keys. Each block's `keys` are as `block_extra_keys` makes them over the tokens it holds
    (items in offset order)."""
    if [key for key in keys if key[0] != "mm"] != [key for key in other_keys if key[0] != "mm"]:
        return 0
    n, k = min(limit, len(tokens), len(other_tokens)), 0
    while k < n and tokens[k] == other_tokens[k]:
        k += 1
    mm = [key for key in keys if key[0] == "mm"]
    other_mm = [key for key in other_keys if key[0] == "mm"]
    for i in range(max(len(mm), len(other_mm))):
        pair = mm[i:i + 1] + other_mm[i:i + 1]
        if len(pair) == 1 or pair[0] != pair[1]:  # the items before this one are equal in both
            first = min(mm_key_offset(key) for key in pair)  # this item's K/V differ from its offset on
            return max(0, min(k, first))
    return k


def mm_key_offset(mm_key: tuple[object, ...]) -> int:
    """An item key's offset from its block's start (`("mm", mm_hash, offset, position_key)`)."""
    offset = mm_key[2]
    assert isinstance(offset, int)
    return offset


class BlockHasher:
    """Computes a request's block hashes, given the hashes it already has.

    Stateless between calls: a request keeps its own list and passes it in, so each block is
    hashed once, when its last token becomes known (prompt tokens at arrival, generated tokens
    as they are sampled).
    """

    def __init__(self, block_size: int, algo: str = "sha256") -> None:
        self.block_size = block_size
        self.algo = algo
        self.hash_fn = get_hash_fn(algo)
        self.seed: BlockHash = self.hash_fn(_SEED_TEXT)  # the first block's parent
        self.keep_extra_keys = False  # requests keep each block's extra keys too (KV events publish them)

    def new_block_hashes(self, token_ids: Sequence[int], mm_items: Sequence[MultiModalItem],
                         cache_salt: str | None, known: Sequence[BlockHash],
                         extra_keys_out: list[ExtraKeys] | None = None) -> list[BlockHash]:
        """Hashes of the full blocks after the `len(known)` already hashed; [] when none is new.
        `extra_keys_out` gets each new block's extra keys, as hashed (for KV events)."""
        bs = self.block_size
        parent = known[-1] if known else self.seed
        new: list[BlockHash] = []
        if len(mm_items) > 1:
            mm_items = sorted(mm_items, key=lambda item: item.placeholder.offset)
        first = 0  # items before `first` end before the current block
        for start in range(len(known) * bs, len(token_ids) - bs + 1, bs):
            while first < len(mm_items) and mm_items[first].placeholder.end <= start:
                first += 1
            extra = block_extra_keys(mm_items, cache_salt, start, start + bs, first)
            if extra_keys_out is not None:
                extra_keys_out.append(extra)
            parent = hash_block(self.hash_fn, parent, token_ids[start:start + bs], extra)
            new.append(parent)
        return new

    def last_block_hash(self, token_ids: Sequence[int], num_tokens: int, mm_items: Sequence[MultiModalItem],
                        cache_salt: str | None, known: Sequence[BlockHash]) -> BlockHash | None:
        """The key of the block holding token `num_tokens - 1` of `token_ids`, over its tokens up
        to that one; None when `known` lacks the hash of a full block before it (its parent)."""
        start = (num_tokens - 1) // self.block_size * self.block_size
        if num_tokens < 1 or len(known) < start // self.block_size:
            return None
        parent = known[start // self.block_size - 1] if start else self.seed
        items = sorted(mm_items, key=lambda item: item.placeholder.offset)
        extra = block_extra_keys(items, cache_salt, start, num_tokens)
        return hash_block(self.hash_fn, parent, token_ids[start:num_tokens], extra)
