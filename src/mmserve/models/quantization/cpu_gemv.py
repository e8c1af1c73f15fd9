"""Decode GEMVs over quantized weights on the CPU, in C (`csrc/quant_gemv.c`)."""

from __future__ import annotations

import torch


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
              bias: torch.Tensor | None) -> torch.Tensor | None:
    return None


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
             bias: torch.Tensor | None) -> torch.Tensor | None:
    return None
