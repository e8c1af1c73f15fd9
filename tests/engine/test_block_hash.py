"""Block hashes: images and salts change them, offsets matter, and every algorithm gives the same
hashes in every process (no Python `hash()`, no per-process seed)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from mmserve.engine.block_hash import HASH_ALGOS, BlockHasher, block_extra_keys, get_hash_fn
from mmserve.engine.request import Request
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from mmserve.sampling_params import SamplingParams

IMG = 32000  # every image's placeholder token: identical for all images


def image(mm_hash: str, offset: int, length: int, place: tuple = ()) -> MultiModalItem:
    return MultiModalItem("image", mm_hash, None, PlaceholderRange(offset, length), position_key=place)


def hashes(tokens, items=(), salt=None, algo="sha256", block_size=4) -> list[bytes]:
    return BlockHasher(block_size, algo).new_block_hashes(tokens, list(items), salt, [])


def test_same_tokens_with_different_images_differ_from_the_first_image_block_on():
    tokens = [1, 2, 3, 4, 5] + [IMG] * 6 + [6, 7, 8, 9, 10]  # image in [5, 11): blocks 1 and 2
    a = hashes(tokens, [image("cat", 5, 6)])
    b = hashes(tokens, [image("dog", 5, 6)])
    assert len(a) == 4
    assert a[0] == b[0]  # before the image
    assert all(x != y for x, y in zip(a[1:], b[1:]))  # the image's blocks, and (chained) every later one
    assert hashes(tokens)[0] == a[0] and hashes(tokens)[1] != a[1]  # no item at all is a third key


def test_the_same_image_at_another_offset_differs():
    tokens = [IMG] * 12  # identical tokens: only the offset tells the two layouts apart
    at1, at2 = hashes(tokens, [image("cat", 1, 8)]), hashes(tokens, [image("cat", 2, 8)])
    assert all(x != y for x, y in zip(at1, at2))


def test_extra_keys_carry_each_overlapping_item_with_its_offset_and_the_salt_on_the_first_block():
    items = [image("a", 2, 5), image("b", 7, 2, (1, 2, 4))]  # a: [2, 7), b: [7, 9)
    assert block_extra_keys(items, "s", 0, 4) == (("mm", "a", 2, ()), ("salt", "s"))
    assert block_extra_keys(items, "s", 4, 8) == (("mm", "a", -2, ()), ("mm", "b", 3, (1, 2, 4)))
    assert block_extra_keys(items, "s", 8, 12) == (("mm", "b", -1, (1, 2, 4)),)
    assert block_extra_keys(items, None, 12, 16) == ()


def test_the_same_item_at_another_temporal_place_differs():
    """A Qwen2.5-VL video group: same pixels (same hash), same tokens, other seconds per group."""
    tokens = [1, 2] + [IMG] * 8 + [3, 4]
    slow, fast = (hashes(tokens, [image("g", 2, 4, (1, 4, 4, 0, s)), image("h", 6, 4, (1, 4, 4, 1, s))])
                  for s in (1.0, 0.5))
    assert slow[0] != fast[0] and all(x != y for x, y in zip(slow, fast))


def test_salt_isolates_every_block():
    tokens = list(range(12))
    none, s1, s2 = hashes(tokens), hashes(tokens, salt="tenant-1"), hashes(tokens, salt="tenant-2")
    assert len({none[0], s1[0], s2[0]}) == 3
    assert all(len({x, y, z}) == 3 for x, y, z in zip(none, s1, s2))  # through the chain
    assert hashes(tokens, salt="tenant-1") == s1


def test_incremental_hashing_equals_hashing_at_once():
    hasher = BlockHasher(4)
    tokens, items = list(range(30)), [image("x", 3, 10)]
    known: list[bytes] = []
    for end in (3, 4, 9, 17, 30):
        known += hasher.new_block_hashes(tokens[:end], items, "s", known)
    assert known == hasher.new_block_hashes(tokens, items, "s", [])
    assert len(known) == 7


def test_a_request_hashes_generated_tokens_as_they_arrive():
    hasher = BlockHasher(4)
    req = Request("r", [1, 2, 3, 4, 5, 6], [], SamplingParams(), None, 0.0, cache_salt="s", block_hasher=hasher)
    assert len(req.block_hashes) == 1
    req.append_output_token_ids([7])
    assert len(req.block_hashes) == 1
    req.append_output_token_ids([8])
    assert req.block_hashes == hasher.new_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], [], "s", [])
    assert Request("plain", [1, 2, 3, 4], [], SamplingParams(), None, 0.0).block_hashes == []


def test_algorithms_digest_sizes_and_unknown_name():
    tokens = list(range(8))
    sizes = {algo: len(hashes(tokens, algo=algo)[0]) for algo in HASH_ALGOS}
    assert sizes == {"sha256": 32, "blake3": 32, "xxh3_128": 16}
    assert len({hashes(tokens, algo=algo)[0] for algo in HASH_ALGOS}) == 3
    with pytest.raises(ValueError, match="unknown prefix caching hash algorithm"):
        get_hash_fn("md5")


def test_the_first_block_seed_is_a_constant_of_the_algorithm():
    assert BlockHasher(4, "sha256").seed == hashlib.sha256(b"mmserve prefix cache v2").digest()
    # pinned: changing how a block is encoded must be deliberate (bump the seed text)
    got = hashes([1, 2, 3, 4, 5, 6, 7, 8], [image("img", 2, 4)], "s")[1].hex()
    assert got == "5dc14f95c95ef54c849a969d58302ab125caa4c6b4d6fe82f946be7a0bcee6cd"


_CHILD = """
import json
from mmserve.engine.block_hash import HASH_ALGOS, BlockHasher
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
items = [MultiModalItem("image", "cat", None, PlaceholderRange(3, 6))]
print(json.dumps({a: [h.hex() for h in BlockHasher(4, a).new_block_hashes(list(range(20)), items, "s", [])]
                  for a in HASH_ALGOS}))
"""


def test_every_algorithm_is_reproducible_across_processes():
    items = [image("cat", 3, 6)]
    here = {a: [h.hex() for h in hashes(list(range(20)), items, "s", algo=a)] for a in HASH_ALGOS}
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # Python's own hash() would differ under it
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == here
