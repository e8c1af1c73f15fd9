"""From how many tokens a CPU step runs on every thread, measured once per model (`one_thread_below`).

A small step (a decode batch, a repeated image's uncached tail) is a handful of skinny matmuls.
On a small model, waking OpenMP's other threads for each costs more than they save, the more so
when other processes hold the other cores; on a larger one the other threads bring their share
of arithmetic and memory bandwidth from a few rows on. Where the crossover lies depends on the
model's size and the machine, so it is measured at start: the decoder's largest weight multiplied
by 1, 8, 32 and 128 rows, on one thread and on all, each timed several times in turns (best
of each); steps of fewer tokens than the first size where all threads win run on one thread.
"""

from __future__ import annotations

import logging
import time

import torch

from mmserve.models.parallel import linear

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
    weight = _largest_matrix(model)
    if weight is None:
        return 2 * ROWS[-1]
    try:
        with torch.inference_mode():
            for rows in ROWS:
                best = _best_times(weight, rows, threads, rounds)
                if best[threads] < _MARGIN * best[1]:
                    logger.info("CPU steps of %d+ tokens on %d threads, fewer on one: a %dx%d matmul of %d rows "
                                "took %.3f ms on one, %.3f ms on %d", rows, threads, *weight.shape, rows,
                                best[1] * 1e3, best[threads] * 1e3, threads)
                    return rows
    finally:
        torch.set_num_threads(threads)
    logger.info("CPU steps under %d tokens on one thread (it won at every size measured)", 2 * ROWS[-1])
    return 2 * ROWS[-1]


def _best_times(weight: torch.Tensor, rows: int, threads: int, rounds: int) -> dict[int, float]:
    """Best seconds of one `linear` of `rows` rows on one thread and on `threads`, taking turns."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)  # the weight may be packed (`pack_linears`)
    best = {1: float("inf"), threads: float("inf")}
    for _ in range(rounds):
        for n in best:
            torch.set_num_threads(n)
            linear(x, weight)  # a first call after the switch wakes (or parks) the pool
            start = time.perf_counter()
            for _ in range(3):
                linear(x, weight)
            best[n] = min(best[n], (time.perf_counter() - start) / 3)
    return best


def _largest_matrix(model: torch.nn.Module) -> torch.Tensor | None:
    """The largest 2-D float weight of the decoder's layers (embedding tables, vision towers and
    quantized weights aside)."""
    matrices = [p for name, p in model.named_parameters()
                if p.dim() == 2 and p.dtype.itemsize >= 2 and p.dtype.is_floating_point
                and "layers." in name and "visual" not in name and "vision" not in name]
    return max(matrices, key=lambda p: p.numel(), default=None)
