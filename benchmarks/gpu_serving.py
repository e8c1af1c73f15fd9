"""The GPU benchmark (`make bench-gpu`): where a real-size Qwen2.5-VL-7B's time goes on one CUDA GPU.

No download: the model is built on the device from Qwen2.5-VL-7B's published config (random
bfloat16 weights, the built-in tokenizer) and saved once to a temporary directory that both
engines load. Every figure stands beside a limit measured in the same run on the same device
(`_gpu_limits.py`): a device-to-device copy's bandwidth (bytes read + written per second) and a
bfloat16 matmul's rate.

- decode sweep (batch 1, 8, 32, 64, 128 at 2,048 cached tokens, CUDA graphs; batch 1 eager too):
  step time against (bytes the step must read: the decoder's weights with the LM head, the
  embedding rows of its tokens, every request's K/V; not the vision tower) / bandwidth; and the
  share of a step the GPU was busy (torch.profiler, CUDA activity alone): the rest is the host's;
- the vision tower on one new 1024x768 image and on N at once, against its arithmetic / the matmul
  rate; the prefill of a ~1,000-token text prompt likewise;
- time to first token of one new 1024x768 image and of N new images at once, mmserve against
  transformers' `generate` (the N as one batch; run last, once mmserve has given the GPU back),
  each against (tower + prefill arithmetic) / rate;
  and P0's host work on one new image, the part of its TTFT no GPU speeds up;
- a repeated image, cold then warm (every cache hit);
- per-kernel tables (torch.profiler, top 15 by self device time) of one eager decode step and of
  one new image's first token (processing, tower and prefill).

`--quantized` measures instead AWQ int4 and FP8 block-wise copies of the checkpoint, written on
the device in the layouts Qwen publishes, against it: each one's batch-1 decode step (graphs) and
TTFT of a new image, as ratios to the unquantized model's, beside issue 50's targets (`_gpu_quant.py`).

Run: `python benchmarks/gpu_serving.py` (about 5 minutes on an H100); `--device cpu --tiny` runs
every piece on the CPU at a tiny size (proves the script without a GPU); without CUDA and without
`--device cpu` it says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from _gpu_baseline import transformers_ttft
from _gpu_decode import decode_read_bytes, decode_step_times, eager, eager_decode_table, kernel_table, overlapped
from _gpu_limits import best_time, copy_bandwidth, decoder_matrix_elements, matmul_rate, prefill_flops, tower_flops
from _gpu_quant import quantized_report
from _gpu_requests import PROMPT, first_token_s, host_s, images, with_image
from _model_sizes import QWEN25_VL_7B_TEXT, QWEN25_VL_7B_VISION

TINY_TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1280, max_position_embeddings=8192)
TINY_VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=14, spatial_merge_size=2,
                   temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1], hidden_act="silu")
TEXT_PROMPT = "<|im_start|>user\n" + "the quick brown fox jumps over the lazy dog " * 100 + "<|im_end|>\n"


@dataclass(frozen=True)
class Sizes:
    """How much the run does: the real sizes on a GPU, tiny ones with --tiny."""

    batches: tuple[int, ...]
    context: int
    images: int  # the "N new images at once"
    steps: int  # timed decode steps per batch
    copy_bytes: int
    matmul: int
    profile_batch: int
    quant_images: int  # --quantized: new images whose first token is timed per model (the median)


FULL = Sizes((1, 8, 32, 64, 128), 2048, 16, 20, 1 << 30, 8192, 8, 3)
TINY = Sizes((1, 4), 256, 2, 5, 1 << 26, 512, 2, 1)


def build_checkpoint(path: str, tiny: bool, device: torch.device, dtype: torch.dtype) -> None:
    """Qwen2.5-VL-7B's architecture (or a tiny one) with random weights, built on `device` and saved to `path`."""
    from transformers import AutoModelForImageTextToText

    from mmserve.models.builtin_qwen_vl import write_qwen_vl_files

    config = write_qwen_vl_files(path, family="qwen2_5_vl", text_config=TINY_TEXT if tiny else QWEN25_VL_7B_TEXT,
                                 vision_config=TINY_VISION if tiny else QWEN25_VL_7B_VISION, min_pixels=56 * 56,
                                 max_pixels=28 * 28 * 1280)  # Qwen2.5-VL's default pixel budget
    with torch.device(device):
        AutoModelForImageTextToText.from_config(config, dtype=dtype).save_pretrained(path)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def tower_s(llm: Any, path: str, pictures: list[Any], device: torch.device) -> tuple[float, float]:
    """Seconds of the vision tower on `pictures` in one call (P0's processing excluded; the
    lookup of the pixel codes' values included), and its arithmetic."""
    from mmserve.multimodal.qwen_processor import QwenVLProcessor
    from mmserve.worker.device import item_on

    runner, processor = llm.engine.core.executor.runner, QwenVLProcessor(path)
    datas = [item_on(processor.process_image(p), device) for p in pictures]
    grids = [tuple(int(x) for x in d["image_grid_thw"].reshape(3).tolist()) for d in datas]
    seconds = best_time(lambda: runner.model.encode_items(datas, runner.dtype), device, repeats=3)
    return seconds, tower_flops(runner.model.model.visual, grids)


def ratio_line(name: str, seconds: float, limit: float, extra: str = "") -> str:
    return f"  {name:<34} {seconds * 1e3:9.2f} ms   limit {limit * 1e3:8.2f} ms   {limit / seconds:6.1%} of it{extra}"


def decode_report(llm: Any, sizes: Sizes, bandwidth: float, rate: float) -> None:
    core = llm.engine.core
    runner = core.executor.runner
    # a step's arithmetic: 2 per weight per token (the LM head's too) — the larger limit only at large batches
    matrices = decoder_matrix_elements(runner.model) + runner.model.config.text.vocab_size * \
        runner.model.config.text.hidden_size
    print(f"decode steps at {sizes.context} cached tokens (limit: bytes read / copy bandwidth; "
          f"arithmetic / matmul rate when larger):", flush=True)
    graphs = "graphs" if runner.decode_graphs is not None else "eager"
    # each batch without, then with --async-scheduling (the host's work overlapping the device's)
    runs = [(b, mode, False, on) for b in sizes.batches for mode, on in ((graphs, False), (f"{graphs}, async", True))]
    for batch, mode, force_eager, on in runs + [(1, "eager", True, False)]:
        with eager(runner) if force_eager else contextlib.nullcontext(), overlapped(core, on):
            step, busy = decode_step_times(core, batch, sizes.context, sizes.steps)
        read = decode_read_bytes(core, batch, sizes.context, sizes.steps)
        limit = max(read / bandwidth, 2 * matrices * batch / rate)
        busy_text = "" if busy is None else f", device busy {busy:4.0%}"
        print(ratio_line(f"batch {batch:3d} ({mode})", step, limit,
                         f"   {read / 1e9:6.2f} GB read, {batch / step:8.0f} tok/s{busy_text}"), flush=True)


def first_token_report(llm: Any, path: str, sizes: Sizes, pictures: list[Any], device: torch.device,
                       rate: float) -> dict[str, float]:
    """TTFT (one new image, N at once), tower and text prefill against the compute limit, cold vs
    warm; the two TTFTs' seconds, for the comparison with transformers (`transformers_report`)."""
    n, model = sizes.images, llm.engine.core.executor.runner.model
    first_token_s(llm, [with_image(pictures[0])], device)  # warm-up
    one_s, (one_len,) = first_token_s(llm, [with_image(pictures[1])], device)
    many_s, many_lens = first_token_s(llm, [with_image(p) for p in pictures[2:2 + n]], device)
    text_s, (text_len,) = first_token_s(llm, [TEXT_PROMPT], device)
    tower_one_s, tower_one = tower_s(llm, path, pictures[1:2], device)
    tower_many_s, tower_many = tower_s(llm, path, pictures[2:2 + n], device)
    one_limit = (tower_one + prefill_flops(model, [one_len])) / rate
    many_limit = (tower_many + prefill_flops(model, many_lens)) / rate
    print(f"first tokens (limit: arithmetic / matmul rate; {one_len} prompt tokens per image):")
    print(ratio_line("vision tower, one image", tower_one_s, tower_one / rate, f"   {tower_one / 1e12:.2f} TFLOP"))
    print(ratio_line(f"vision tower, {n} images per image", tower_many_s / n, tower_many / rate / n))
    print(ratio_line(f"prefill, {text_len}-token text", text_s, prefill_flops(model, [text_len]) / rate))
    print(ratio_line("TTFT, one new image", one_s, one_limit))
    host = host_s(llm, images(1, seed=77)[0])
    print(f"  of which P0 on the host (hash, image processor, placeholders): {host * 1e3:.1f} ms "
          f"({host / one_s:.0%})")
    print(ratio_line(f"TTFT, {n} new images, per image", many_s / n, many_limit / n))
    repeat = with_image(pictures[2 + n])
    cold, _ = first_token_s(llm, [repeat], device)
    warm, _ = first_token_s(llm, [repeat], device)
    print(f"  repeated image: cold {cold * 1e3:.1f} ms, warm {warm * 1e3:.1f} ms ({cold / warm:.1f}x)", flush=True)
    return {"one_s": one_s, "batch_s": many_s}


def transformers_report(hf: dict[str, float], ours: dict[str, float], n: int) -> None:
    """transformers' `generate` on the same GPU (after mmserve has given it back) beside our TTFTs."""
    print("TTFT against transformers (generate, the same GPU, the same images):")
    for name, key, per in (("one new image", "one_s", 1), (f"{n} new images, per image", "batch_s", n)):
        print(f"  {name:<34} {ours[key] / per * 1e3:9.2f} ms   transformers {hf[key] / per * 1e3:8.1f} ms "
              f"({hf[key] / ours[key]:.2f}x ours)", flush=True)


def kernel_report(llm: Any, sizes: Sizes, device: torch.device) -> None:
    core = llm.engine.core
    print(f"\nper kernel, one eager decode step (batch {sizes.profile_batch}, {sizes.context} tokens):")
    print(eager_decode_table(core, sizes.profile_batch, sizes.context))
    new = with_image(images(1, seed=99)[0])
    print("per kernel, one new image's first token (processing, tower, prefill):")
    print(kernel_table(lambda: first_token_s(llm, [new], device), device))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a tiny model and tiny sizes (with --device cpu: "
                                                            "checks this script on a machine without a GPU)")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--quantized", action="store_true", help="instead of the rest: the batch-1 decode step and "
                        "TTFT of AWQ and FP8 copies of the checkpoint against it (_gpu_quant.py)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_serving: no CUDA device here; nothing measured (run it on a GPU: make bench-gpu, "
              "or --device cpu --tiny to check the script)")
        return
    sizes, dtype = (TINY if args.tiny else FULL), (torch.bfloat16 if device.type == "cuda" else torch.float32)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}", flush=True)
    bandwidth, rate = copy_bandwidth(device, sizes.copy_bytes), matmul_rate(device, dtype, sizes.matmul)
    print(f"limits: copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + written), {str(dtype).removeprefix('torch.')} "
          f"matmul {rate / 1e12:.2f} TFLOP/s", flush=True)
    with tempfile.TemporaryDirectory(prefix="mmserve-gpu-bench-") as path:
        start = time.perf_counter()
        build_checkpoint(path, args.tiny, device, dtype)
        print(f"built the {'tiny' if args.tiny else 'Qwen2.5-VL-7B-sized'} random checkpoint in "
              f"{time.perf_counter() - start:.0f} s", flush=True)
        if args.quantized:
            quantized_report(path, sizes.context, sizes.steps, images(1 + sizes.quant_images), device, dtype,
                             bandwidth)
            return
        pictures = images(sizes.images + 3)  # warm-up, one, N at once, the repeated one
        ours = run_mmserve(path, sizes, pictures, device, dtype, bandwidth, rate)
        if not args.no_transformers:  # last: the figures above come first when a session's timeout is short
            hf = transformers_ttft(path, PROMPT, pictures[0], pictures[1], pictures[2:2 + sizes.images], device, dtype)
            transformers_report(hf, ours, sizes.images)


def run_mmserve(path: str, sizes: Sizes, pictures: list[Any], device: torch.device, dtype: torch.dtype,
                bandwidth: float, rate: float) -> dict[str, float]:
    """Our figures, the engine shut down after (its GPU memory given back); the TTFTs' seconds."""
    from mmserve import LLM

    graph_sizes = sorted({*sizes.batches, sizes.profile_batch})
    with LLM(model=path, device=device.type, dtype=str(dtype).removeprefix("torch."), max_num_seqs=max(graph_sizes),
             max_model_len=sizes.context + 2048, max_num_batched_tokens=16384, cuda_graph_sizes=graph_sizes) as llm:
        # decode first: 46's principal gap, printed before anything a session's timeout may cut
        decode_report(llm, sizes, bandwidth, rate)
        ours = first_token_report(llm, path, sizes, pictures, device, rate)
        kernel_report(llm, sizes, device)
    return ours


if __name__ == "__main__":
    main()
