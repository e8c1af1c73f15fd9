"""The GPU benchmark (`make bench-gpu`): a real-size random-weight Qwen2.5-VL-7B on one CUDA GPU.

No download: the model is built on the GPU from Qwen2.5-VL-7B's published config (random weights,
bfloat16, the built-in tokenizer) and saved once to a temporary directory that both engines load.
Every figure has its baseline measured in the same run, on the same GPU:

- TTFT of one request (a 1024x768 image and a question), mmserve vs transformers' `generate`;
- output tokens/s of a batch (distinct images, fixed output length, EOS ignored), mmserve's
  batched engine vs transformers' `generate` one request at a time;
- a repeated 1024x768 image, cold (first sight) vs warm (processor, encoder and prefix caches hit);
- the vision encoder's time per image;
- a decode step's time against its bandwidth limit: (weight bytes + KV bytes read) divided by the
  bandwidth of a device-to-device copy measured here (bytes read + written per second).

Run: `python benchmarks/gpu_serving.py [--batch 16] [--max-tokens 64]` (on a CPU-only machine it
says so and exits 0).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch

QWEN25_VL_7B_TEXT = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters={"rope_theta": 1000000.0})
QWEN25_VL_7B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", tokens_per_second=2)
PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this picture.<|im_end|>\n" \
         "<|im_start|>assistant\n"
IMAGE_SIZE = (1024, 768)


DEVICE = "cuda"  # --smoke: "cpu", a tiny model (checks this script's own code on a machine without a GPU)
TINY_TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1280, max_position_embeddings=8192)
TINY_VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=14, spatial_merge_size=2,
                   temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1], hidden_act="silu")


def synced() -> float:
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def build_checkpoint(path: str, tiny: bool) -> None:
    """Qwen2.5-VL-7B's architecture with random bfloat16 weights, built on the GPU and saved to `path`."""
    from transformers import AutoModelForImageTextToText

    from mmserve.models.builtin_qwen_vl import write_qwen_vl_files

    config = write_qwen_vl_files(path, family="qwen2_5_vl", text_config=TINY_TEXT if tiny else QWEN25_VL_7B_TEXT,
                                 vision_config=TINY_VISION if tiny else QWEN25_VL_7B_VISION, min_pixels=56 * 56,
                                 max_pixels=28 * 28 * 1280)  # Qwen2.5-VL's default pixel budget
    with torch.device(DEVICE):
        AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second (read + written) of a device-to-device copy, best of 5."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = synced()
        dst.copy_(src)
        best = min(best, synced() - start)
    return 2 * nbytes / best


def images(n: int, seed: int = 0) -> list[Any]:
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    return [Image.fromarray(torch.randint(0, 256, (IMAGE_SIZE[1], IMAGE_SIZE[0], 3), generator=gen,
                                          dtype=torch.uint8).numpy()) for _ in range(n)]


# ---- transformers, the baseline ----------------------------------------------------------------

def hf_inputs(path: str, image: Any) -> dict[str, torch.Tensor]:
    """transformers' inputs for one prompt, built as its Qwen2.5-VL processor builds them."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer, processor = AutoTokenizer.from_pretrained(path), Qwen2VLImageProcessorPil.from_pretrained(path)
    pixels = processor(images=[image], return_tensors="pt")
    count = int(pixels["image_grid_thw"][0].prod()) // processor.merge_size ** 2
    ids = torch.tensor([tokenizer(PROMPT.replace("<|image_pad|>", "<|image_pad|>" * count))["input_ids"]])
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return {"input_ids": ids.to(DEVICE), "attention_mask": torch.ones_like(ids).to(DEVICE),
            "mm_token_type_ids": (ids == image_token).long().to(DEVICE),
            "pixel_values": pixels["pixel_values"].to(DEVICE, torch.bfloat16),
            "image_grid_thw": pixels["image_grid_thw"].to(DEVICE)}


def run_transformers(path: str, pictures: list[Any], max_tokens: int) -> dict[str, float]:
    """TTFT of one request and output tokens/s over the batch, one request at a time."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE).eval()
    try:
        return _time_transformers(model, path, pictures, max_tokens)
    finally:
        del model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def _time_transformers(model: Any, path: str, pictures: list[Any], max_tokens: int) -> dict[str, float]:
    def generate(image: Any, n: int) -> int:
        inputs = hf_inputs(path, image)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return out.shape[1] - inputs["input_ids"].shape[1]

    generate(pictures[0], 2)  # warm-up
    start = synced()
    generate(pictures[1], 1)
    ttft = synced() - start
    start = synced()
    tokens = sum(generate(image, max_tokens) for image in pictures)
    elapsed = synced() - start
    return {"ttft_s": ttft, "tokens_per_s": tokens / elapsed}


# ---- mmserve --------------------------------------------------------------------------------------

def run_mmserve(path: str, pictures: list[Any], max_tokens: int) -> tuple[dict[str, float], Any]:
    """TTFT, batch output tokens/s, and a repeated image cold vs warm."""
    from mmserve import LLM, SamplingParams

    llm = LLM(model=path, device=DEVICE, dtype="bfloat16", max_model_len=8192, max_num_seqs=max(len(pictures), 8))
    one = SamplingParams(temperature=0.0, max_tokens=1)
    batch = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    fresh = images(3, seed=1)
    llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": fresh[0]}}], one)  # warm-up
    start = synced()
    llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": fresh[1]}}], one)
    ttft = synced() - start
    start = synced()
    outs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": p}} for p in pictures], batch)
    elapsed = synced() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    repeat = {"prompt": PROMPT, "multi_modal_data": {"image": fresh[2]}}
    start = synced()
    llm.generate([repeat], one)
    cold = synced() - start
    start = synced()
    llm.generate([repeat], one)
    warm = synced() - start
    return {"ttft_s": ttft, "tokens_per_s": tokens / elapsed, "cold_s": cold, "warm_s": warm}, llm


def encoder_time(llm: Any, path: str, image: Any) -> float:
    """Seconds of the vision tower for one 1024x768 image (median of 5; processing excluded)."""
    from mmserve.multimodal.qwen_processor import QwenVLProcessor

    runner = llm.engine.core.executor.runner
    data = QwenVLProcessor(path).process_image(image)
    data = {k: v.to(DEVICE) if v.is_floating_point() else v for k, v in data.items()}
    times = []
    for _ in range(5):
        start = synced()
        runner.model.encode_items([data], runner.dtype)
        times.append(synced() - start)
    return statistics.median(times)


def decode_step(llm: Any, batch: int, context: int, bandwidth: float) -> dict[str, float]:
    """Median decode step time with `batch` text requests of about `context` tokens, and its bandwidth
    limit: each step reads every weight once and each request's whole KV, at the copy's rate (bytes
    read + written per second: the rate memory moves bytes)."""
    from mmserve import SamplingParams

    runner = llm.engine.core.executor.runner
    steps: list[float] = []
    execute = runner.execute_model

    def timed(so: Any) -> Any:
        start = synced()
        out = execute(so)
        if so.num_scheduled_tokens and all(n == 1 for n in so.num_scheduled_tokens.values()):
            steps.append(synced() - start)
        return out

    runner.execute_model = timed
    prompts = [f"{i} " + "the quick brown fox jumps over the lazy dog " * (context // 10) for i in range(batch)]
    context = max(len(llm.get_tokenizer()(p)["input_ids"]) for p in prompts)
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    finally:
        runner.execute_model = execute
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_per_token = runner.kv_cache_bytes_per_block() // runner.block_size
    read = weights + batch * (context + 16) * kv_per_token
    step = statistics.median(steps)
    return {"step_s": step, "limit_s": read / bandwidth, "bytes_read": read, "context": context}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=1024)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the script only")
    args = parser.parse_args()
    global DEVICE
    DEVICE = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_serving: no CUDA device here; nothing measured (run it on a GPU: make bench-gpu)")
        return
    print(f"device: {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="mmserve-gpu-bench-") as path:
        start = time.perf_counter()
        build_checkpoint(path, tiny=args.smoke)
        print(f"built Qwen2.5-VL-7B-sized random checkpoint on the GPU in {time.perf_counter() - start:.0f} s")
        bandwidth = copy_bandwidth()
        pictures = images(args.batch)
        hf = run_transformers(path, pictures, args.max_tokens)
        ours, llm = run_mmserve(path, pictures, args.max_tokens)
        encoder = encoder_time(llm, path, pictures[0])
        decode = decode_step(llm, args.batch, args.decode_context, bandwidth)
    print(f"device copy bandwidth (read + written): {bandwidth / 1e12:.2f} TB/s")
    print(f"TTFT, one 1024x768 image:   mmserve {ours['ttft_s'] * 1e3:8.1f} ms   transformers "
          f"{hf['ttft_s'] * 1e3:8.1f} ms   ratio {hf['ttft_s'] / ours['ttft_s']:.2f}x")
    print(f"output tokens/s, batch {args.batch}:  mmserve {ours['tokens_per_s']:8.1f}      transformers "
          f"{hf['tokens_per_s']:8.1f}      ratio {ours['tokens_per_s'] / hf['tokens_per_s']:.2f}x")
    print(f"repeated 1024x768 image:    cold {ours['cold_s'] * 1e3:8.1f} ms   warm {ours['warm_s'] * 1e3:8.1f} ms   "
          f"ratio {ours['cold_s'] / ours['warm_s']:.2f}x")
    print(f"vision encoder per image:   {encoder * 1e3:8.1f} ms")
    print(f"decode step, batch {args.batch} at ~{decode['context']} tokens: {decode['step_s'] * 1e3:.2f} ms; "
          f"bandwidth limit {decode['limit_s'] * 1e3:.2f} ms ({decode['bytes_read'] / 1e9:.1f} GB read); "
          f"{decode['limit_s'] / decode['step_s']:.0%} of the limit")


if __name__ == "__main__":
    main()
