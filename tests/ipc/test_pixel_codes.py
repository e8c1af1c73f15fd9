"""Pixel codes and their table (ipc/pixel_codes.py): the table is exact or refused, the lookup is
the table's value of every code in its own channel, in both item layouts."""

from __future__ import annotations

import pytest
import torch

from mmserve.ipc.pixel_codes import codes_of, decode, lut_from, pixel_values


def every_code(channels: int = 3, repeats: int = 2) -> torch.Tensor:
    """[repeats, C, 256] uint8: each channel holds every code, shuffled."""
    g = torch.Generator().manual_seed(0)
    return torch.stack([torch.stack([torch.randperm(256, generator=g) for _ in range(channels)])
                        for _ in range(repeats)]).to(torch.uint8)


def arithmetic(codes: torch.Tensor) -> torch.Tensor:
    """A per-channel elementwise map, different in each channel (a processor's rescale + normalize)."""
    mean = torch.tensor([0.48, 0.45, 0.40]).view(1, 3, *([1] * (codes.dim() - 2)))
    std = torch.tensor([0.26, 0.26, 0.27]).view_as(mean)
    return (codes.to(torch.float64) / 255).to(torch.float32).sub(mean).div(std)


def test_the_table_gives_each_code_its_value_in_its_channel():
    codes = every_code()
    table = lut_from(codes, arithmetic(codes))
    assert table.shape == (3, 256) and table.dtype == torch.float32
    sample = torch.randint(0, 256, (5, 3, 7, 9), dtype=torch.uint8)
    assert torch.equal(decode(sample, table), arithmetic(sample))


def test_a_sample_missing_a_code_is_refused():
    codes = every_code()
    codes[codes == 17] = 18
    with pytest.raises(ValueError, match="misses some code"):
        lut_from(codes, arithmetic(codes))


def test_arithmetic_that_is_not_elementwise_is_refused():
    codes = every_code()
    values = arithmetic(codes)
    values[1] += 0.5  # the same code, another value where it appears again: the image's statistics leaked in
    with pytest.raises(ValueError, match="not elementwise"):
        lut_from(codes, values)


def test_both_item_layouts_look_up_by_channel():
    table = lut_from(every_code(), arithmetic(every_code()))
    image = torch.randint(0, 256, (3, 6, 4), dtype=torch.uint8)  # LLaVA: [C, H, W]
    assert torch.equal(pixel_values({"pixel_codes": image, "pixel_lut": table}), arithmetic(image[None])[0])
    rows = torch.randint(0, 256, (10, 3 * 2 * 4), dtype=torch.uint8)  # Qwen-VL: [P, C * Tp * p * p]
    want = arithmetic(rows.view(10, 3, 8)).view(10, 24)
    assert torch.equal(pixel_values({"pixel_codes": rows, "pixel_lut": table}), want)


def test_a_half_precision_lookup_rounds_each_value_once():
    table = lut_from(every_code(), arithmetic(every_code()))
    rows = torch.randint(0, 256, (7, 3 * 2), dtype=torch.uint8)  # [P, C * 2]
    data = {"pixel_codes": rows, "pixel_lut": table}
    want = arithmetic(rows.view(7, 3, 2)).view(7, 6)
    assert torch.equal(pixel_values(data), want)
    assert torch.equal(pixel_values(data, torch.bfloat16), want.to(torch.bfloat16))


def test_codes_must_match_the_table():
    table = torch.zeros(3, 256)
    with pytest.raises(ValueError, match="do not match"):
        decode(torch.zeros(2, 4, 5, dtype=torch.uint8), table)
    with pytest.raises(ValueError, match="do not match"):
        decode(torch.zeros(2, 3, 5), table)


def test_only_whole_values_become_codes():
    assert torch.equal(codes_of(torch.tensor([0.0, 17.0, 255.0])), torch.tensor([0, 17, 255], dtype=torch.uint8))
    for bad in ([0.5], [256.0], [-1.0]):
        with pytest.raises(ValueError, match="not whole"):
            codes_of(torch.tensor(bad))


def test_rows_of_one_frame_give_the_values_of_the_repeated_frames():
    """A still image as Qwen-VL lays it out: each row's C x (Tp x p x p) values hold Tp copies of
    one frame; carried as rows of one frame and `pixel_frames`, the values are the same."""
    table = lut_from(every_code(), arithmetic(every_code()))
    one = torch.randint(0, 256, (6, 3, 1, 16), dtype=torch.uint8)  # [P, C, 1 frame, p * p]
    repeated = one.expand(6, 3, 2, 16).reshape(6, 3 * 2 * 16)  # what the processor lays out, Tp = 2
    full = {"pixel_codes": repeated, "pixel_lut": table}
    carried = {"pixel_codes": one.reshape(6, 3 * 16), "pixel_frames": torch.tensor(2), "pixel_lut": table}
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(pixel_values(carried, dtype), pixel_values(full, dtype))
