"""Beam search over the caches: what a step computes, and its time against greedy decoding.

vLLM's beam search runs in the frontend (`mmserve/beam_search.py`): every step is one engine
request per live beam, the whole prompt and the beam's tokens so far. The caches are what makes
that cheap: the prompt's blocks (its image's placeholders included) and each beam's tokens are
prefix-cache hits, full blocks and a block's reusable leading part. So a step should compute
about one token per beam. This prints, for one image prompt on the built-in model, the tokens a
search computed (the engine's prefix counters before and after) per beam-step, and its time
against a greedy answer of the same length: one engine request of max_tokens steps.

Target: <= 2 computed tokens per beam-step (the caches hold; without them every step would compute
the whole prompt again, hundreds of tokens).
Run: `python benchmarks/beam_search.py [--width 4] [--tokens 16] [--runs 3]`.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-llava")
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    from mmserve import LLM, BeamSearchParams, SamplingParams
    from mmserve.multimodal.sample_image import sample_image

    llm = LLM(model=args.model, max_model_len=1024)
    core = llm.engine.core
    params = BeamSearchParams(beam_width=args.width, max_tokens=args.tokens)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    beams, plain, computed, queried = [], [], 0, 0
    for run in range(args.runs):  # a new salt each run: the first step of each search misses, as a new image would
        item = {"prompt": "USER: <image>\nWhat is in this image? ASSISTANT:", "multi_modal_data":
                {"image": sample_image()}, "cache_salt": f"run-{run}"}
        llm.generate(item, SamplingParams(max_tokens=1))  # the prompt once, as a first request would
        before = core.stats().caches["prefix"]
        start = time.perf_counter()
        llm.beam_search(item, params)
        beams.append(time.perf_counter() - start)
        after = core.stats().caches["prefix"]
        queried += after.queries - before.queries
        computed += (after.queries - before.queries) - (after.hits - before.hits)
        start = time.perf_counter()
        llm.generate(item, greedy)
        plain.append(time.perf_counter() - start)
    steps = args.runs * args.width * args.tokens
    beam_s, plain_s = statistics.median(beams), statistics.median(plain)
    print(f"beam search, width {args.width}, {args.tokens} tokens, one image prompt (built-in model, "
          f"median of {args.runs}):")
    print(f"  prompt tokens queried {queried}, computed {computed}: {computed / steps:.2f} per beam-step "
          f"(target <= 2), {1 - computed / queried:.1%} from the prefix cache")
    print(f"  {beam_s * 1e3:.1f} ms, greedy answer of the same length {plain_s * 1e3:.1f} ms: ratio "
          f"{beam_s / plain_s:.1f} (width x tokens = {args.width * args.tokens} engine requests)")


if __name__ == "__main__":
    main()
