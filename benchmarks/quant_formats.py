"""The weight formats `decode_step.py` compares (and its summary of them, `summarize`): quantized
copies of its model in the published layouts, written once beside it by the tests' packer
(tests/helpers/quant_checkpoints.py).

Run alone (`python benchmarks/quant_formats.py [--model-dir DIR] [--formats dense,awq] [--rows 1,8]
[--threads N]`), it times the kernels without the engine: `--rows` tokens (rows of x, a decode
step's batch) through every linear layer of the decoder, on one thread by default, in CPU time
(what a shared machine's other processes change least), per format; beside each, the time the
layers' resident bytes take at the bandwidth of a large copy measured in the same run, in CPU
time too (the kernels' memory bound), and for quantized formats above one row the same rows through dequantized
tiles and the matmul (the prefill path, `GEMV_MAX_ROWS` being where the two cross)."""

from __future__ import annotations

import functools
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

FORMATS = ("dense", "awq", "w4a16", "w4a16-asym", "fp8-block", "fp8-channel", "fp8-online", "awq-f16", "awq-int8",
           "w4a16-int8", "w8a16", "w8a8")
INT8_ACTIVATIONS = "-int8"  # an int4 format's name + this: the same checkpoint, --cpu-activation-quant int8


def activation_quant(fmt: str) -> str:
    """`--cpu-activation-quant` of a format name: "int8" for e.g. "awq-int8", else "none"."""
    return "int8" if fmt.endswith(INT8_ACTIVATIONS) else "none"


def format_checkpoint(model_dir: str, fmt: str) -> tuple[str, str | None]:
    """(checkpoint, --quantization) of the model in `fmt`: quantized copies are written beside
    it once: int4 in groups of 128, FP8 in 128 x 128 blocks or per row; a name ending in "-f16"
    (e.g. "awq-f16") stores the tensors left unquantized in float16, as published releases do
    (the others keep the model's float32); one ending in "-int8" is the int4 format's checkpoint
    run with int8 activations (`activation_quant`)."""
    fmt = fmt.removesuffix(INT8_ACTIVATIONS)
    if fmt in ("dense", "fp8-online"):
        return model_dir, "fp8" if fmt == "fp8-online" else None
    import torch
    from helpers.quant_checkpoints import Recipe, quantize_checkpoint

    folder = Path(model_dir).with_name(Path(model_dir).name + "-formats")
    if not (folder / f"{fmt}-q" / "config.json").exists():
        work = folder / f"{fmt}-writing"
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(folder / f"{fmt}-q", ignore_errors=True)
        unquantized = torch.float16 if fmt.endswith("-f16") else None
        quantize_checkpoint(model_dir, work, Recipe(fmt.removesuffix("-f16"), 128, 128, unquantized=unquantized))
        work.rename(folder / f"{fmt}-q")
    return str(folder / f"{fmt}-q"), None


Runs = dict[tuple[str, str, int, int], list[float]]


def summarize(steps: Runs, cpu: Runs, read: dict[tuple[str, int, int], int]) -> None:
    """Each format's speed-up over dense float32 per configuration, in wall and in CPU time (on a
    shared machine with one thread, CPU time leaves out the time others held the core), beside
    the ratio of the bytes the two steps read (what a memory-bound step could gain at most)."""
    for key, took in steps.items():
        fmt, attention, batch, context = key
        dense_key = ("dense", attention, batch, context)
        if fmt == "dense" or dense_key not in steps:
            continue
        wall = statistics.mean(steps[dense_key]) / statistics.mean(took)  # runs before and after, if named so
        work = statistics.mean(cpu[dense_key]) / statistics.mean(cpu[key])
        target = " (target >= 4)" if fmt.startswith(("awq", "w4a16")) else ""
        bytes_ratio = read["dense", batch, context] / read[fmt, batch, context]
        print(f"{fmt}: batch {batch}, context {context}: dense step / {fmt} step {wall:.2f}x, in CPU time "
              f"{work:.2f}x{target}; bytes read, dense / {fmt}: {bytes_ratio:.2f}x")


def decoder_linears(model_dir: str, fmt: str) -> list[Any]:
    """The decoder's linear layers (fused ones once) of the model in `fmt`, packed as the engine packs them."""
    from mmserve.models.loader import load_model
    from mmserve.models.parallel import FusedLinear, ParallelLinear, pack_linears

    path, quantization = format_checkpoint(model_dir, fmt)
    model = load_model(path, quantization=quantization, activation_quant=activation_quant(fmt))
    pack_linears(model)
    return [m for name, m in model.named_modules() if isinstance(m, (ParallelLinear, FusedLinear))
            and "visual" not in name and getattr(m, m.weight_names[0]).numel() > 0]


def resident_bytes(layers: list[Any]) -> int:
    """The bytes the layers' weights hold (a packed dense weight: its float32 values)."""
    tensors = [getattr(layer, name) for layer in layers for name in layer.weight_names]
    return sum(t.numel() * t.element_size() if not t.is_mkldnn else t.to_dense().nbytes for t in tensors)


def cpu_seconds(run: Callable[[], object], repeats: int) -> float:
    """Best of `repeats` CPU seconds of `run` (after one warm-up: kernels built, caches warm)."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
    return best


def apply_all(layers: list[Any], inputs: list[Any]) -> None:
    """Each layer's input through it (its method's kernel for that many rows)."""
    for layer, x in zip(layers, inputs):
        layer.method.apply(layer, x, None)


def layer_times(model_dir: str, formats: list[str], rows: int = 1, repeats: int = 5,
                tiles: bool = False) -> dict[str, float]:
    """Per format, CPU seconds of `rows` tokens through every linear layer of the decoder (by its
    GEMV, or with `tiles` by dequantized tiles through the matmul), best of `repeats`."""
    import torch

    from mmserve.models.quantization import cpu_gemv

    took = {}
    for fmt in formats:
        layers = decoder_linears(model_dir, fmt)
        inputs = [torch.randn(rows, layer.shape.in_features) for layer in layers]
        limit = cpu_gemv.GEMV_MAX_ROWS
        cpu_gemv.GEMV_MAX_ROWS = 0 if tiles else max(limit, rows)
        try:
            took[fmt] = cpu_seconds(functools.partial(apply_all, layers, inputs), repeats)
        finally:
            cpu_gemv.GEMV_MAX_ROWS = limit
    return took


def main() -> None:
    import argparse

    import torch
    from decode_step import TEXT, model_checkpoint

    parser = argparse.ArgumentParser(description="tokens through the decoder's linear layers, per format")
    parser.add_argument("--model-dir", help="decode_step.py's checkpoint (written there when missing)")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--rows", default="1", help="rows of x (a decode step's batch), comma-separated")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--avx2", action="store_true", help="the AVX2 kernels only (with ONEDNN_MAX_CPU_ISA=AVX2 "
                        "in the environment, dense too: a machine without AVX-512)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from mmserve.models.quantization import cpu_gemv

    cpu_gemv.WIDE = not args.avx2
    with model_checkpoint(dict(TEXT), args.model_dir) as model_dir:
        formats = args.formats.split(",")
        held = {fmt: resident_bytes(decoder_linears(model_dir, fmt)) for fmt in formats}
        src = torch.rand(512 << 18)
        dst = torch.empty_like(src)
        bandwidth = 2 * src.nbytes / cpu_seconds(lambda: dst.copy_(src), 7)
        print(f"{args.threads} thread(s); copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + written)")
        for rows in (int(r) for r in args.rows.split(",")):
            times = layer_times(model_dir, formats, rows)
            tiled = layer_times(model_dir, [f for f in formats if f != "dense"], rows, tiles=True) if rows > 1 else {}
            for fmt, seconds in times.items():
                bound = held[fmt] / bandwidth
                tiles = f", tiles {tiled[fmt] * 1e3:7.2f} ms" if fmt in tiled else ""
                print(f"{rows:3d} rows {fmt:>11}: {seconds * 1e3:7.2f} ms CPU, {held[fmt] / 1e6:5.0f} MB "
                      f"(bound {bound * 1e3:5.2f} ms, x{seconds / bound:4.2f}), dense / {fmt} "
                      f"{times.get('dense', seconds) / seconds:.2f}x{tiles}", flush=True)


if __name__ == "__main__":
    main()
