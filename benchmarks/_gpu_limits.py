"""The benchmarks' limits and work counts (`gpu_serving.py`, `attention_kernels.py`,
`attention_sweep.py`, `decode_step.py`; the leading underscore keeps `mmserve bench components`
from running it).

Limits are measured in the same run on the same device: the rate memory moves bytes (a large
device-to-device copy, bytes read + written per second) and the rate a large matmul in the
model's dtype does arithmetic. The work each figure stands for is counted from the model itself:
the bytes one decode step must read, and the floating-point operations of the vision tower and
of a prefill (2 per weight per row, plus attention's 4 * D per query-key pair).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from mmserve.models.qwen2_5_vision import window_order
from mmserve.models.qwen_vision import frame_boundaries


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], Any], device: torch.device, repeats: int = 5) -> float:
    """The fastest of `repeats` timed calls of `fn` (after one warm-up), in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second (read + written) of a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_time(lambda: dst.copy_(src), device)


def matmul_rate(device: torch.device, dtype: torch.dtype, size: int) -> float:
    """Floating-point operations per second of a [size, size] @ [size, size] matmul in `dtype`."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return 2 * size**3 / best_time(lambda: a @ b, device)


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def decode_step_bytes(model: Any, batch: int, context: int, kv_bytes_per_token: int) -> int:
    """Bytes one decode step of `batch` requests at `context` cached tokens must read: every
    decoder weight once (the LM head included; neither the vision tower nor the embedding table,
    of which a step reads one row per request), those rows, and each request's cached K/V."""
    params = dict(model.named_parameters())  # a tied head is listed once, under one of its names
    decoder = _bytes(p for name, p in params.items() if "visual" not in name)
    if any("lm_head" in name for name in params):  # an untied table: the step reads rows of it, not all
        decoder -= _bytes(p for name, p in params.items() if "embed_tokens" in name)
    text = model.config.text
    row = text.hidden_size * next(iter(params.values())).element_size()
    return decoder + batch * row + batch * context * kv_bytes_per_token


def _matrix_elements(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.dim() >= 2)


def _squares(cu: list[int]) -> int:
    return sum((hi - lo) ** 2 for lo, hi in zip(cu[:-1], cu[1:]))


def tower_flops(tower: Any, grids: list[tuple[int, int, int]]) -> float:
    """Floating-point operations of one Qwen2.5-VL / Qwen3-VL tower call over `grids`: the patch
    embedding and every block's matrices on each patch, the mergers' on each merge block, and
    attention (QK and PV: 4 * D per query-key pair) within frames or windows."""
    cfg = tower.cfg
    patches = sum(t * h * w for t, h, w in grids)
    per_patch = tower.patch_embed.proj.weight.numel() + _matrix_elements(tower.blocks)
    deepstack = getattr(tower, "deepstack_merger_list", [])
    mergers = _matrix_elements(tower.merger) + sum(_matrix_elements(m) for m in deepstack)
    frames = _squares(frame_boundaries(grids))
    windows = _squares(window_order(grids, cfg)[1]) if cfg.window_size else frames
    attention = sum(frames if i in cfg.fullatt_block_indexes or not cfg.window_size else windows
                    for i in range(cfg.depth))
    return 2 * patches * per_patch + 2 * patches // cfg.merge_unit * mergers + 4 * cfg.hidden_size * attention


def decoder_matrix_elements(model: Any) -> int:
    """Elements of the decoder's weight matrices a token passes through (its layers; neither the
    embedding table nor the LM head, nor the vision tower)."""
    return sum(p.numel() for name, p in model.named_parameters()
               if p.dim() >= 2 and "visual" not in name and "lm_head" not in name and "embed_tokens" not in name)


def prefill_flops(model: Any, lengths: list[int]) -> float:
    """Floating-point operations of prefilling prompts of `lengths` tokens: the decoder's matrices
    on every token, the LM head on each prompt's last, causal attention (4 * H * Dh per pair)."""
    text = model.config.text
    head = text.vocab_size * text.hidden_size
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    attention = 4 * text.num_attention_heads * text.head_dim * text.num_hidden_layers * pairs
    return 2 * decoder_matrix_elements(model) * sum(lengths) + 2 * head * len(lengths) + attention
