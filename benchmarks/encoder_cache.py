"""The encoder cache: time to first token of a second request with the same image and a different
question, encoder cache on vs off (same run, built-in model, prefix caching off), and the encoder
time a hit saves.

TTFT is measured at the engine core (request already processed by P0, so no P0 cache plays a
part): from `add_request` to the step that samples the first token. Each run sends a request
about a new image (a fresh `mm_hash`), then — timed — a request with another question about the
same image. "Off" is `--encoder-cache-tokens 0`: an output lives only while requests use it, so
the second request encodes the image again. Prefix caching is off in both, so the second
request's prefill is computed whole either way: the difference is the vision encoder.

Encoder time per hit: the runner's `encode_items` calls are timed in the "off" engine (each
encodes the one image a hit would skip), beside the measured TTFT difference off - on.

Target: second-request TTFT with the cache on <= 0.6x off. A hit can save at most the encoder's
share of the "off" TTFT, so the run also prints that bound (1 - encoder time / off TTFT): on the
built-in model the decoder's prefill of the whole prompt, not the encoder, is most of the TTFT.
Run: `python benchmarks/encoder_cache.py [--runs 20]` (built-in model).
"""

from __future__ import annotations

import argparse
import statistics
import time

import msgspec
from _engine_timing import ttft

FIRST = "USER: <image>\nWhat is in this image? ASSISTANT:"
SECOND = "USER: <image>\nDescribe the colours of this image in one sentence. ASSISTANT:"


class Engine:
    """One engine core (encoder cache on or off, prefix caching off) and two processed requests
    about the same image, re-keyed to a new `mm_hash` for each run."""

    def __init__(self, model: str, encoder_cache_tokens: int | None) -> None:
        from mmserve import LLM, SamplingParams
        from mmserve.multimodal.sample_image import sample_image

        llm = LLM(model=model, enable_prefix_caching=False, encoder_cache_tokens=encoder_cache_tokens)
        self.core = llm.engine.core
        self.runner = self.core.executor.runner
        self.encode_seconds: list[float] = []
        encode = self.runner.model.encode_items

        def timed_encode(datas, dtype):  # one processed image per entry
            start = time.perf_counter()
            features = encode(datas, dtype)
            self.encode_seconds.append(time.perf_counter() - start)
            return features

        self.runner.model.encode_items = timed_encode
        params = SamplingParams(temperature=0.0, max_tokens=1)
        image = {"image": sample_image(336)}
        self.templates = [llm.engine.input_processor.process(f"t{i}", {"prompt": p, "multi_modal_data": image}, params)
                          for i, p in enumerate((FIRST, SECOND))]
        self.num_prompt_tokens = len(self.templates[1].prompt_token_ids)
        self.run("warm-up")

    def run(self, key: str) -> float:
        """TTFT of the second request about a new image `key` (the first one is untimed)."""
        first, second = (msgspec.structs.replace(t, request_id=f"{key}-{i}", mm_items=[
            msgspec.structs.replace(item, mm_hash=key) for item in t.mm_items]) for i, t in enumerate(self.templates))
        ttft(self.core, first)
        return ttft(self.core, second)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-llava")
    parser.add_argument("--runs", type=int, default=20, help="image pairs per setting")
    args = parser.parse_args()

    on_engine, off_engine = Engine(args.model, None), Engine(args.model, 0)
    on, off = [], []
    runs_before = (on_engine.runner.num_encoded_items, off_engine.runner.num_encoded_items)
    off_engine.encode_seconds.clear()
    for i in range(args.runs):  # interleaved, so that load from elsewhere hits both alike
        off.append(off_engine.run(f"img-{i}"))
        on.append(on_engine.run(f"img-{i}"))
    on_engine.core.check_integrity()
    encodes_on = on_engine.runner.num_encoded_items - runs_before[0]
    encodes_off = off_engine.runner.num_encoded_items - runs_before[1]
    stats = on_engine.core.stats().caches["encoder"]
    on_ms, off_ms = statistics.median(on) * 1e3, statistics.median(off) * 1e3
    n = on_engine.num_prompt_tokens
    print(f"TTFT of a second request about the same image ({n} prompt tokens), median of {args.runs} "
          f"(engine core, built-in model, prefix caching off):")
    print(f"  encoder cache off (--encoder-cache-tokens 0): {off_ms:8.2f} ms  ({encodes_off} encoder runs for "
          f"{2 * args.runs} requests)")
    print(f"  encoder cache on:                             {on_ms:8.2f} ms  ({encodes_on} encoder runs; "
          f"{stats.hits} hits of {stats.queries} lookups)")
    print(f"  ratio on/off: {on_ms / off_ms:.3f}  (target <= 0.6)")
    encode_ms = statistics.median(off_engine.encode_seconds) * 1e3
    saved = off_ms - on_ms
    print(f"encoder time saved per hit: {encode_ms:.2f} ms (median encoder call, one image, in the off engine); "
          f"TTFT off - on {saved:.2f} ms (ratio {saved / encode_ms:.2f})")
    print(f"  best ratio on/off a hit allows here: {1 - encode_ms / off_ms:.3f} (the encoder is "
          f"{encode_ms / off_ms:.0%} of the off TTFT)")


if __name__ == "__main__":
    main()
