"""Pixels as items carry them: uint8 codes and the processor's value of each code, per channel.

Every image and video processor we serve does its geometry (resize, crop, patchify, temporal
padding) on uint8 pixels and then maps each value through the same arithmetic per channel
(rescale, normalize). So a processed item holds, instead of float32 `pixel_values`:

- `pixel_codes`: uint8, laid out exactly as the processor lays out `pixel_values` (the pixel
  before the arithmetic);
- `pixel_lut`: [C, 256] float32, the processor's own value of code v in channel c, computed by
  running the processor's arithmetic on every code (`lut_from`), never re-derived here.

The worker looks the values up on its device (`decode`, `pixel_values`): bit for bit the
processor's `pixel_values`, at a quarter of the bytes in the processor cache, the IPC caches, the
shared-memory store and the host-to-device copy, and P0 skips the float pass.

Layouts: `decode` and `lut_from` read the channel at dim 1; `pixel_values` views an item's codes
that way: Qwen-VL rows [P, C * Tp * p * p] (channel-major columns) as [P, C, Tp * p * p], a LLaVA
image [C, H, W] as [1, C, H * W].

Repeated frames: a still image that the processor lays out as `Tp` identical frames (Qwen-VL's
temporal patch) is carried as rows of one frame [P, C * p * p] and `pixel_frames` (an int64 scalar,
Tp); `pixel_values` repeats each row's values over the frames, so the values are the processor's
and the bytes half again.
"""

from __future__ import annotations

import torch

CODES = 256  # uint8 values


def lut_from(codes: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The [C, 256] table with `table[c, codes[a, c, b]] == values[a, c, b]` for every element.

    codes: [A, C, B] uint8, values: [A, C, B] float32, the same pixels before and after the
    processor's arithmetic. ValueError unless every code appears in every channel and each
    (code, channel) has one value: the arithmetic is then elementwise, and the table exact."""
    if codes.shape != values.shape or codes.dim() != 3 or codes.dtype != torch.uint8:
        raise ValueError(f"codes {tuple(codes.shape)} {codes.dtype} and values {tuple(values.shape)} "
                         "must be matching [A, C, B] uint8 and float tensors")
    channels = codes.shape[1]
    table = torch.full((channels, CODES), float("nan"), dtype=torch.float32)
    flat_codes = codes.transpose(0, 1).reshape(channels, -1).long()  # [C, A * B]
    flat_values = values.transpose(0, 1).reshape(channels, -1).to(torch.float32)
    table.scatter_(1, flat_codes, flat_values)
    if bool(table.isnan().any()):
        raise ValueError("the sample misses some code in some channel: every value 0..255 must appear")
    if not torch.equal(table.gather(1, flat_codes), flat_values):
        raise ValueError("the processor's arithmetic is not elementwise per channel: one code maps to two values")
    return table


def decode(codes: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """codes: [A, C, ...] uint8, lut: [C, 256] -> the values [A, C, ...] in lut's dtype, on
    codes' device: per channel, one `index_select` from its 256 values by an int32 index (the
    fastest lookup on the CPU; a few small kernels on a GPU), so the index is a third of the
    codes at 4 bytes each."""
    channels = lut.shape[0]
    if codes.dtype != torch.uint8 or codes.dim() < 2 or codes.shape[1] != channels:
        raise ValueError(f"pixel codes {tuple(codes.shape)} {codes.dtype} do not match a table of "
                         f"{channels} channels")
    acb = codes.reshape(codes.shape[0], channels, -1)  # [A, C, B]
    table = lut.to(codes.device)
    out = torch.empty(acb.shape, dtype=lut.dtype, device=codes.device)
    for c in range(channels):
        index = acb[:, c].to(torch.int32)  # [A, B]
        out[:, c] = table[c].index_select(0, index.view(-1)).view(index.shape)
    return out.view(codes.shape)


def pixel_values(data: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An item's pixel values in `dtype` (each value rounded once, from the processor's float32),
    in the processor's layout, on its codes' device: rows [P, C * B] from rows of codes, rows
    [P, C * F * B] from rows of one frame and `pixel_frames` F, an image [C, H, W] from an image
    of codes."""
    codes, lut = data["pixel_codes"], data["pixel_lut"]
    channels = lut.shape[0]
    acb = codes.view(codes.shape[0], channels, -1) if codes.dim() == 2 else codes.view(1, channels, -1)
    values = decode(acb, lut.to(dtype))  # [A, C, B]
    if "pixel_frames" not in data:
        return values.view(codes.shape)
    frames = int(data["pixel_frames"])  # a host int64 (worker/device.py: item_on leaves int64 on the host)
    rows = codes.shape[0]
    return values.view(rows, channels, 1, -1).expand(rows, channels, frames, acb.shape[2]).reshape(rows, -1)


def codes_of(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 codes of float pixels that hold whole values 0..255 (a processor's output with its
    arithmetic turned off); ValueError otherwise."""
    codes = pixels.to(torch.uint8)
    if not torch.equal(codes.to(pixels.dtype), pixels):
        raise ValueError("the processor's geometry gave values that are not whole 0..255 codes")
    return codes
