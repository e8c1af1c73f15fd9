"""Our variable-length (segment) attention kernel against the torch backend (interpreted on CPU):
random segments, Qwen2.5-VL's windows and frames as its tower makes them, and CLIP's equal
segments, for head sizes 24, 64, 80 and 128."""

from __future__ import annotations

import pytest
import torch

from helpers.triton_device import DEVICE
from mmserve.models.attention.torch_sdpa import TORCH
from mmserve.models.qwen2_5_vision import window_order
from mmserve.models.qwen_config import QwenVisionConfig
from mmserve.models.qwen_vision import frame_boundaries

pytest.importorskip("triton")

from mmserve.models.attention.triton_backend import TritonBackend  # noqa: E402


def compare(cu: list[int], heads: int, head_dim: int, seed: int, dtype: torch.dtype = torch.float32) -> None:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(cu[-1], heads, head_dim, generator=g).to(dtype) for _ in range(3))
    scale = head_dim**-0.5
    want = TORCH.segments(cu, torch.device("cpu")).attend(q, k, v, scale)
    got = TritonBackend(DEVICE).segments(cu, DEVICE).attend(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), scale)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("heads,head_dim", [(2, 80), (3, 64), (1, 24), (2, 128)])
def test_random_segments_equal_the_torch_backend(heads, head_dim):
    lengths = torch.randint(1, 90, (6,), generator=torch.Generator().manual_seed(head_dim)).tolist()
    cu = [0]
    for n in lengths + [1, 64]:  # a one-row segment and one of exactly a tile
        cu.append(cu[-1] + n)
    compare(cu, heads, head_dim, seed=heads)


def test_qwen2_5_vl_windows_and_frames_equal_the_torch_backend(loops):
    """A video of two frames and an image whose grid is not whole windows (edge windows cut short),
    with both loop headers (`loops`)."""
    cfg = QwenVisionConfig(depth=1, hidden_size=160, intermediate_size=32, num_heads=2, in_channels=3, patch_size=14,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=32, hidden_act="silu",
                           window_size=112)
    grids = [(2, 8, 12), (1, 10, 6)]
    _, windows = window_order(grids, cfg)
    compare(windows, 2, cfg.head_dim, seed=1)
    compare(frame_boundaries(grids), 2, cfg.head_dim, seed=2)


def test_clip_images_as_equal_segments_equal_the_torch_backend():
    """Fixed-size images, each its patches plus CLS (17 rows), as CLIP's tower attends them."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(3 * 17, 4, 64, generator=g) for _ in range(3))
    want = TORCH.equal_segments(3, 17, torch.device("cpu")).attend(q, k, v, 0.125)
    got = TritonBackend(DEVICE).equal_segments(3, 17, DEVICE).attend(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), 0.125)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else []))
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_half_precision_equals_the_torch_backend_within_rounding(dtype, head_dim):
    """The half-precision tiles of each head size (`tuning.py`: 128 query rows, several key tiles
    per segment). bfloat16 on a GPU only: Triton's interpreter computes a bfloat16 `tl.dot` wrongly."""
    compare([0, 30, 31, 300], 1, head_dim, seed=5, dtype=dtype)


def test_tiles_follow_the_head_size_the_dtype_and_the_segments():
    from mmserve.models.attention.tuning import HALF_LARGE_HEAD, HALF_SMALL_HEAD, SINGLE, TileConfig, prefill_tiles

    assert prefill_tiles(80, 2, 4070, 4070) == HALF_LARGE_HEAD  # Qwen2.5-VL's tower: a frame's full attention
    assert prefill_tiles(128, 2, 5000, 5000) == HALF_LARGE_HEAD
    assert prefill_tiles(64, 2, 577, 577) == HALF_SMALL_HEAD  # CLIP-L/14 at 336 pixels
    window = prefill_tiles(80, 2, 64, 64)  # a 64-patch window: no query rows past it
    assert (window.block_m, window.block_n, window.num_stages) == (64, 64, HALF_LARGE_HEAD.num_stages)
    clip = TileConfig(32, min(32, SINGLE.block_n), SINGLE.num_warps, SINGLE.num_stages)  # CLIP in float32
    assert prefill_tiles(64, 4, 17, 17) == clip


def test_ampere_and_ada_take_their_own_half_precision_tiles():
    """Tiles that spill no register on sm_80 (`benchmarks/kernel_resources.py --arch 80`); Hopper's
    elsewhere, and off CUDA the nominal H100's."""
    from mmserve.models.attention.tuning import (AMPERE_LARGE_HEAD, AMPERE_SMALL_HEAD, HALF_LARGE_HEAD, SINGLE,
                                                 device_arch, prefill_tiles)

    assert prefill_tiles(128, 2, 5000, 5000, arch=80) == AMPERE_LARGE_HEAD
    assert prefill_tiles(64, 2, 577, 577, arch=89) == AMPERE_SMALL_HEAD
    assert prefill_tiles(128, 2, 5000, 5000, arch=90) == HALF_LARGE_HEAD
    assert prefill_tiles(128, 4, 5000, 5000, arch=80) == SINGLE  # float32: no tensor cores either way
    assert device_arch(torch.device("cpu")) == device_arch(torch.device("meta")) == 90


def exact_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: float) -> torch.Tensor:
    """The float64 attention inside each segment (the reference both the kernel and torch round from)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for lo, hi in zip(cu[:-1], cu[1:]):
        qs, ks, vs = (x[lo:hi].double().transpose(0, 1) for x in (q, k, v))  # [H, n, Dh]
        out[lo:hi] = (torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1) @ vs).transpose(0, 1)
    return out


@pytest.mark.parametrize("head_dim", [64, 80, 128, 96, 40, 24])
def test_every_head_size_equals_float64_attention(head_dim, loops):
    """Heads held in one part (64, 128, 24 padded to 32) and in two (80 = 64 + 16, 96 = 64 + 32,
    40 = 32 + 16 with the second part padded): float32 within float32's rounding of the exact
    result, over segments longer than a key tile, a one-row one, and both loop headers."""
    cu = [0, 70, 71, 135, 200]
    g = torch.Generator().manual_seed(head_dim)
    q, k, v = (torch.randn(cu[-1], 2, head_dim, generator=g) for _ in range(3))
    scale = head_dim**-0.5
    exact = exact_segments(q, k, v, cu, scale)
    got = TritonBackend(DEVICE).segments(cu, DEVICE).attend(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), scale).cpu()
    torch_f32 = TORCH.segments(cu, torch.device("cpu")).attend(q, k, v, scale)
    assert (got.double() - exact).abs().max() <= max(4 * (torch_f32.double() - exact).abs().max(), 1e-6)


def test_a_head_is_held_in_the_fewest_power_of_two_lanes():
    """Qwen2.5-VL's tower heads (1280 / 16 = 80) take 64 + 16 lanes, not 128; a power of two is one
    part; a split that saves nothing (112: 64 + 64) is not made."""
    from mmserve.models.attention.tuning import head_parts

    assert head_parts(80) == (64, 16)
    assert head_parts(96) == (64, 32)
    assert head_parts(72) == (64, 16)
    assert head_parts(64) == (64, 0) and head_parts(128) == (128, 0) and head_parts(16) == (16, 0)
    assert head_parts(112) == (128, 0) and head_parts(24) == (32, 0) and head_parts(8) == (16, 0)


def test_head_alignment_is_what_every_head_stride_allows():
    from mmserve.models.attention.varlen_kernel import head_alignment

    assert head_alignment([72, 72 * 3, 72], 2) == 8  # Qwen3-VL's tower, bfloat16: 16 bytes
    assert head_alignment([80, 240], 2) == 8
    assert head_alignment([72], 4) == 4  # float32: 16 bytes
    assert head_alignment([72, 36], 2) == 4
    assert head_alignment([72, 9], 2) == 1


@pytest.mark.parametrize("block_m,block_n,warps,stages", [(64, 64, 8, 3), (128, 32, 8, 3), (128, 128, 4, 2),
                                                          (32, 16, 4, 4)])
def test_every_tile_the_sweep_tries_computes_the_same_attention(monkeypatch, block_m, block_n, warps, stages):
    """`benchmarks/attention_sweep.py` times the tiles' neighbours on a GPU (`tuning.base_tiles`
    replaced): each one gives the tower's attention, windows and a frame alike."""
    from mmserve.models.attention import tuning

    tiles = tuning.TileConfig(block_m, block_n, warps, stages)
    monkeypatch.setattr(tuning, "base_tiles", lambda head_dim, itemsize, arch=tuning.NOMINAL_ARCH: tiles)
    compare([0, 64, 128, 150, 300], 2, 80, seed=block_m + block_n)
