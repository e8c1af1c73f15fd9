"""How many threads a small CPU step runs on, measured once per model (`small_step_threads`).

A step of fewer than `SMALL_STEP_TOKENS` tokens (a small decode batch, a repeated image's uncached
tail) is a handful of skinny matmuls. On a small model, waking OpenMP's other threads for each
costs more than they save, the more so when another process holds the other cores; on a larger
one (a decoder layer of tens of MB) the other threads bring their share of memory bandwidth and
arithmetic. Which holds depends on the model's size and the machine, so it is measured at start:
the decoder's largest weight multiplied by a small step's activations on one thread and on all,
each timed several times in turns (best of each).
"""

from __future__ import annotations

import logging
import time

import torch

from mmserve.models.parallel import linear

logger = logging.getLogger(__name__)

# Below this many tokens (and without encoder work) a CPU step runs on `small_step_threads`.
SMALL_STEP_TOKENS = 32
# All threads must beat one by this factor to be used (a tie goes to one thread: fewer wake-ups).
_MARGIN = 0.8


def small_step_threads(model: torch.nn.Module, threads: int, device: torch.device, tokens: int = 8,
                       rounds: int = 5) -> int:
    """`threads` when the model's largest decoder matmul at `tokens` rows runs faster on them than
    on one thread, else 1; `threads` off the CPU. Leaves the process's setting at `threads`."""
    if device.type != "cpu" or threads <= 1:
        return threads
    weight = _largest_matrix(model)
    if weight is None:
        return 1
    x = torch.randn(tokens, weight.shape[1], dtype=weight.dtype)  # the weight may be packed (`pack_linears`)
    best = {1: float("inf"), threads: float("inf")}
    try:
        with torch.inference_mode():
            for _ in range(rounds):
                for n in best:
                    torch.set_num_threads(n)
                    linear(x, weight)  # a first call after the switch wakes (or parks) the pool
                    start = time.perf_counter()
                    for _ in range(3):
                        linear(x, weight)
                    best[n] = min(best[n], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    chosen = threads if best[threads] < _MARGIN * best[1] else 1
    logger.info("small steps (< %d tokens) on %d thread(s): a %dx%d matmul of %d rows took %.3f ms on 1, "
                "%.3f ms on %d", SMALL_STEP_TOKENS, chosen, *weight.shape, tokens, best[1] / 3 * 1e3,
                best[threads] / 3 * 1e3, threads)
    return chosen


def _largest_matrix(model: torch.nn.Module) -> torch.Tensor | None:
    """The largest 2-D weight of the decoder's layers (embedding tables and vision towers aside)."""
    matrices = [p for name, p in model.named_parameters()
                if p.dim() == 2 and "layers." in name and "visual" not in name and "vision" not in name]
    return max(matrices, key=lambda p: p.numel(), default=None)
