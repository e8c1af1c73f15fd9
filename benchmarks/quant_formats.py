"""The weight formats `decode_step.py` compares: quantized copies of its model in the published
layouts, written once beside it by the tests' packer (tests/helpers/quant_checkpoints.py).

Run alone (`python benchmarks/quant_formats.py [--model-dir DIR] [--formats dense,awq]`), it
times the kernels without the engine: one decode token through every linear layer of the decoder,
one thread, in CPU time (what a shared machine's other processes do not change), per format."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

FORMATS = ("dense", "awq", "w4a16", "w4a16-asym", "fp8-block", "fp8-channel", "fp8-online")


def format_checkpoint(model_dir: str, fmt: str) -> tuple[str, str | None]:
    """(checkpoint, --quantization) of the model in `fmt`: quantized copies are written beside
    it once: int4 in groups of 128, FP8 in 128 x 128 blocks or per row."""
    if fmt in ("dense", "fp8-online"):
        return model_dir, "fp8" if fmt == "fp8-online" else None
    from helpers.quant_checkpoints import quantize_copy

    folder = Path(model_dir).with_name(Path(model_dir).name + "-formats")
    if not (folder / f"{fmt}-q" / "config.json").exists():
        shutil.rmtree(folder / f"{fmt}-q", ignore_errors=True)
        shutil.rmtree(folder / f"{fmt}-deq", ignore_errors=True)
        folder.mkdir(exist_ok=True)
        quantize_copy(model_dir, folder, fmt, group=128, block=128)
        shutil.rmtree(folder / f"{fmt}-deq")
    return str(folder / f"{fmt}-q"), None


def layer_times(model_dir: str, formats: list[str], repeats: int = 5) -> dict[str, float]:
    """Per format, CPU seconds (this process, one thread) of one decode token through every linear
    layer of the decoder (fused ones once), best of `repeats`: the kernels alone, and CPU time, so
    other processes on a shared machine do not count."""
    import time

    import torch

    from mmserve.models.loader import load_model
    from mmserve.models.parallel import FusedLinear, ParallelLinear, pack_linears

    torch.set_num_threads(1)
    took = {}
    for fmt in formats:
        path, quantization = format_checkpoint(model_dir, fmt)
        model = load_model(path, quantization=quantization)
        pack_linears(model)
        layers = [m for name, m in model.named_modules() if isinstance(m, (ParallelLinear, FusedLinear))
                  and "visual" not in name and getattr(m, m.weight_names[0]).numel() > 0]
        inputs = [torch.randn(1, layer.shape.in_features) for layer in layers]
        best = float("inf")
        for _ in range(repeats + 1):  # the first builds the kernels and warms the caches
            start = time.process_time()
            for layer, x in zip(layers, inputs):
                layer.method.apply(layer, x, None)
            best = min(best, time.process_time() - start)
        took[fmt] = best
    return took


if __name__ == "__main__":
    import argparse

    from decode_step import TEXT, write_model

    parser = argparse.ArgumentParser(description="one decode token through the decoder's linear layers, per format")
    parser.add_argument("--model-dir", help="decode_step.py's checkpoint (written there when missing)")
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args()
    times = layer_times(write_model(dict(TEXT), args.model_dir), args.formats.split(","))
    for fmt, seconds in times.items():
        ratio = times.get("dense", seconds) / seconds
        print(f"{fmt:>11}: {seconds * 1e3:6.2f} ms CPU per token, dense / {fmt} {ratio:.2f}x")
