"""Offline throughput: mmserve's batched engine vs transformers' `generate`, one request at a time.

64 requests, one 336x336 image each (all different), 64 output tokens each (EOS ignored), greedy,
on the built-in model. Both sides get one warm-up request first; both count only output tokens.
Target: mmserve >= 5x transformers. Run: `python benchmarks/offline_throughput.py`.
"""

from __future__ import annotations

import argparse
import time

import torch


def build_requests(n: int, image_size: int):
    from mmserve.multimodal.sample_image import sample_image

    prompt = "USER: <image>\nDescribe the picture in detail. ASSISTANT:"
    return [{"prompt": prompt, "multi_modal_data": {"image": sample_image(image_size, variant=i)}} for i in range(n)]


def run_mmserve(model: str, requests, max_tokens: int) -> tuple[float, int]:
    from mmserve import LLM, SamplingParams

    llm = LLM(model=model)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(requests[:1], params)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(requests, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_transformers(model_dir: str, requests, max_tokens: int) -> tuple[float, int]:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)

    def one(req) -> int:
        inputs = processor(text=req["prompt"], images=[req["multi_modal_data"]["image"]], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        return out.shape[1] - inputs["input_ids"].shape[1]

    one(requests[0])  # warm-up
    start = time.perf_counter()
    tokens = sum(one(req) for req in requests)
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-llava")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=336)
    args = parser.parse_args()
    from mmserve.models.builtin import resolve_model

    model_dir = resolve_model(args.model)
    requests = build_requests(args.num_prompts, args.image_size)
    print(f"{args.num_prompts} requests, one {args.image_size}x{args.image_size} image each, "
          f"{args.max_tokens} output tokens, torch threads {torch.get_num_threads()}")
    m_time, m_tokens = run_mmserve(args.model, requests, args.max_tokens)
    print(f"mmserve:      {m_tokens} tokens in {m_time:.2f} s = {m_tokens / m_time:.1f} output tokens/s")
    h_time, h_tokens = run_transformers(model_dir, requests, args.max_tokens)
    print(f"transformers: {h_tokens} tokens in {h_time:.2f} s = {h_tokens / h_time:.1f} output tokens/s")
    ratio = (m_tokens / m_time) / (h_tokens / h_time)
    print(f"ratio mmserve / transformers: {ratio:.2f}x (target >= 5x): {'MET' if ratio >= 5 else 'NOT MET'}")


if __name__ == "__main__":
    main()
