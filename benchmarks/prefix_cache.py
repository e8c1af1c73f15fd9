"""The prefix cache: time to first token of a repeated 1-image request with prefix caching on vs
off (same run, built-in model), and the cost of hashing one KV block with each algorithm.

TTFT is measured at the engine core (request already processed by P0, so no P0 cache plays a
part): from `add_request` to the step that samples the first token. With the cache on, a repeat
hits every full block of the prompt (the image's included): only the last block is computed and
the image is not encoded. Block hashing is timed per 16-token block, against a plain sha256 over
the same block's raw token bytes (no framing, no chaining, no extra keys).

Targets: repeated-request TTFT with the cache on <= 0.5x off; a miss with the cache on <= 1.1x
off (hashing and registering blocks cost next to nothing); hashing a whole 4096-token prompt with
sha256 under 1 ms. Run: `python benchmarks/prefix_cache.py [--runs 20]` (built-in model).
"""

from __future__ import annotations

import argparse
import array
import hashlib
import statistics
import time

import msgspec
from _engine_timing import ttft

PROMPT = "USER: <image>\nWhat is in this image? Describe it in one sentence. ASSISTANT:"


def processed_request(llm, rid: str):
    """One 1-image request processed by P0, its item keyed by a fixed hash (so repeats hit)."""
    from mmserve import SamplingParams
    from mmserve.multimodal.sample_image import sample_image

    params = SamplingParams(temperature=0.0, max_tokens=1)
    req = llm.engine.input_processor.process(rid, {"prompt": PROMPT, "multi_modal_data": {"image": sample_image(336)}},
                                             params)
    req.mm_items = [msgspec.structs.replace(item, mm_hash="bench-image") for item in req.mm_items]
    return req


class Engine:
    """One engine core (prefix caching on or off) and a processed request to send it again and again."""

    def __init__(self, model: str, enable: bool) -> None:
        from mmserve import LLM

        llm = LLM(model=model, enable_prefix_caching=enable, num_kv_blocks=256)
        self.core = llm.engine.core
        self.template = processed_request(llm, "template")
        self.num_prompt_tokens = len(self.template.prompt_token_ids)
        self._ids = iter(range(1 << 30))
        text_only = [1] + self.template.prompt_token_ids[1:6]  # warm-up, sharing no block with the template
        ttft(self.core, msgspec.structs.replace(self.template, request_id="warm-up", prompt_token_ids=text_only,
                                                mm_items=[]))

    def send(self, cache_salt: str | None = None) -> tuple[float, int]:
        """TTFT of the template again; a new `cache_salt` makes it a miss (hashed and cached all the same)."""
        rid = f"r{next(self._ids)}"
        return ttft(self.core, msgspec.structs.replace(self.template, request_id=rid, cache_salt=cache_salt))


def hash_us_per_block(algo: str, num_blocks: int, block_size: int = 16) -> float:
    """Hash a 4096-token prompt with 4 images of 576 placeholders (as llava-1.5), over and over."""
    from mmserve.engine.block_hash import BlockHasher
    from mmserve.ipc.items import MultiModalItem, PlaceholderRange

    tokens = list(range(1000, 1000 + 4096))
    items = [MultiModalItem("image", f"{i:064x}", None, PlaceholderRange(100 + 1000 * i, 576)) for i in range(4)]
    hasher = BlockHasher(block_size, algo)
    reps = max(1, num_blocks // (len(tokens) // block_size))
    hasher.new_block_hashes(tokens, items, "salt", [])  # warm-up
    start = time.perf_counter()
    for _ in range(reps):
        hasher.new_block_hashes(tokens, items, "salt", [])
    return (time.perf_counter() - start) / (reps * len(tokens) // block_size) * 1e6


def plain_sha256_us_per_block(num_blocks: int, block_size: int = 16) -> float:
    blocks = [array.array("q", range(i * block_size, (i + 1) * block_size)) for i in range(num_blocks)]
    start = time.perf_counter()
    for block in blocks:
        hashlib.sha256(block.tobytes()).digest()
    return (time.perf_counter() - start) / num_blocks * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-llava")
    parser.add_argument("--runs", type=int, default=20, help="repeated requests per setting")
    parser.add_argument("--hash-blocks", type=int, default=20000, help="blocks hashed per algorithm")
    args = parser.parse_args()

    off_engine, on_engine = Engine(args.model, False), Engine(args.model, True)
    n = on_engine.num_prompt_tokens
    off, on, on_miss = [], [], []
    for i in range(args.runs):  # interleaved, so that load from elsewhere hits all alike
        off.append(off_engine.send()[0])
        t, cached = on_engine.send()
        on.append(t)
        on_miss.append(on_engine.send(cache_salt=f"miss-{i}")[0])
    on_engine.core.check_integrity()
    off_ms, on_ms = statistics.median(off) * 1e3, statistics.median(on) * 1e3
    print(f"TTFT, 1-image request of {n} prompt tokens, median of {args.runs} (engine core, built-in model):")
    print(f"  prefix caching off:          {off_ms:8.2f} ms")
    print(f"  prefix caching on, repeated: {on_ms:8.2f} ms  ({cached} of {n} prompt tokens cached)")
    print(f"  ratio on/off (repeat): {on_ms / off_ms:.3f}  (target <= 0.5)")
    miss_ms = statistics.median(on_miss) * 1e3
    print(f"  prefix caching on, a miss:   {miss_ms:8.2f} ms  (a new salt each time)")
    print(f"  ratio on/off (miss): {miss_ms / off_ms:.3f}  (target <= 1.1)")
    plain = plain_sha256_us_per_block(args.hash_blocks)
    print(f"block hashing, 16-token blocks of a 4096-token prompt with 4 images ({args.hash_blocks} blocks):")
    print(f"  plain sha256 over the raw token bytes (baseline): {plain:6.2f} us/block")
    for algo in ("sha256", "blake3", "xxh3_128"):
        us = hash_us_per_block(algo, args.hash_blocks)
        target = "  (target: 4096-token prompt < 1 ms)" if algo == "sha256" else ""
        print(f"  {algo:9s} {us:6.2f} us/block, ratio vs plain sha256 {us / plain:.2f}, "
              f"a 4096-token prompt {us * 256 / 1e3:.2f} ms{target}")


if __name__ == "__main__":
    main()
