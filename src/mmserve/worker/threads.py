"""From how many tokens a CPU step runs on every thread, measured once per model (`one_thread_below`).

A small step (a decode batch, a repeated image's uncached tail) is a handful of skinny matmuls.
On a small model, waking OpenMP's other threads for each costs more than they save, the more so
when other processes hold the other cores; on a larger one the other threads bring their share
of arithmetic and memory bandwidth from a few rows on. Where the crossover lies depends on the
model's size and the machine, so it is measured at start: the decoder's largest layer multiplied
by 1, 8, 32 and 128 rows, on one thread and on all, each timed several times in turns (best
of each); steps of fewer tokens than the first size where all threads win run on one thread.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch


logger = logging.getLogger(__name__)

ROWS = (1, 8, 32, 128)
# All threads must beat one by this factor to be used (a tie goes to one thread: fewer wake-ups).
_MARGIN = 0.8


def one_thread_below(model: torch.nn.Module, threads: int, device: torch.device, rounds: int = 3) -> int:
    """The step size (tokens) from which a step without encoder work runs on all `threads`; below
    it, on one. 0 (always all) off the CPU or with one thread; twice the largest size measured
    when one thread wins at every size. Leaves the process's setting at `threads`."""
    if device.type != "cpu" or threads <= 1:
        return 0
    layer = _largest_layer(model)
    if layer is None:
        return 2 * ROWS[-1]
    try:
        with torch.inference_mode():
            for rows in ROWS:
                best = _best_times(layer, rows, threads, rounds, _activation_dtype(model))
                if best[threads] < _MARGIN * best[1]:
                    logger.info("CPU steps of %d+ tokens on %d threads, fewer on one: a %dx%d matmul of %d rows "
                                "took %.3f ms on one, %.3f ms on %d", rows, threads, *_dims(layer), rows,
                                best[1] * 1e3, best[threads] * 1e3, threads)
                    return rows
    finally:
        torch.set_num_threads(threads)
    logger.info("CPU steps under %d tokens on one thread (it won at every size measured)", 2 * ROWS[-1])
    return 2 * ROWS[-1]


def _best_times(layer: Any, rows: int, threads: int, rounds: int, dtype: torch.dtype) -> dict[int, float]:
    """Best seconds of one product by the layer (its method's kernel: the weight may be packed or
    quantized) of `rows` rows of `dtype` on one thread and on `threads`, taking turns."""
    x = torch.randn(rows, _dims(layer)[1], dtype=dtype)
    best = {1: float("inf"), threads: float("inf")}
    for _ in range(rounds):
        for n in best:
            torch.set_num_threads(n)
            layer.method.apply(layer, x, None)  # a first call after the switch wakes (or parks) the pool
            start = time.perf_counter()
            for _ in range(3):
                layer.method.apply(layer, x, None)
            best[n] = min(best[n], (time.perf_counter() - start) / 3)
    return best


def _activation_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the decoder's activations have: its LM head's (never quantized)."""
    head = getattr(model, "lm_head", None)
    return torch.float32 if head is None else head.weight.dtype


def _dims(layer: Any) -> tuple[int, int]:
    """(out, in) of a linear layer's float matrix, whatever its weight's format."""
    shape = layer.shape
    return shape.out_features, shape.in_features


def _largest_layer(model: torch.nn.Module) -> Any:
    """The decoder's largest linear layer holding a float32 or quantized weight (a fused one
    included; embedding tables, vision towers and fused siblings' emptied layers aside)."""
    from mmserve.models.parallel import FusedLinear, ParallelLinear

    layers = [m for name, m in model.named_modules()
              if isinstance(m, (ParallelLinear, FusedLinear)) and "layers." in name and "visual" not in name
              and "vision" not in name and getattr(m, m.weight_names[0]).numel() > 0]
    return max(layers, key=lambda m: _dims(m)[0] * _dims(m)[1], default=None)
