"""Random quantized weights in mmserve's resident forms (int4.py, int8.py, fp8.py), for the
kernels' tests: what a loaded layer holds, without a checkpoint."""

from __future__ import annotations

import torch


def random_int4(N: int, K: int, group: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An int4 weight in the resident form (int4.py): random words, scales and zero codes."""
    qweight = torch.randint(-2**31, 2**31 - 1, (N, K // 8), dtype=torch.int32, generator=gen)
    scales = torch.rand(N, K // group, generator=gen) * 0.1
    zeros = torch.randint(0, 16, (N, K // group), dtype=torch.uint8, generator=gen)
    return qweight, scales, zeros


def random_int8(N: int, K: int, group: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An int8 weight in the resident form (int8.py): random codes, scales and zeros (GPTQ's 1..256)."""
    codes = torch.randint(0, 256, (N, K), dtype=torch.uint8, generator=gen)
    scales = torch.rand(N, K // group, generator=gen) * 0.01
    zeros = torch.randint(1, 257, (N, K // group), dtype=torch.int16, generator=gen)
    return codes, scales, zeros


def random_fp8(N: int, K: int, block: tuple[int, int] | None,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An FP8 weight in the resident form (fp8.py): every e4m3fn code but NaN, with scales per row
    (`block` None) or per block; and W, the float matrix it stands for (torch's decoding)."""
    codes = torch.randint(0, 256, (N, K), dtype=torch.uint8, generator=gen)
    codes[(codes & 0x7F) == 0x7F] = 0x3C
    weight = codes.view(torch.float8_e4m3fn)
    if block is None:
        scale = torch.rand(N, generator=gen)
        full = scale[:, None].expand(N, K)
    else:
        scale = torch.rand(-(-N // block[0]), -(-K // block[1]), generator=gen)
        full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:N, :K]
    return weight, scale, weight.float() * full
