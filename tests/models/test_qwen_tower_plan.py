"""The Qwen vision towers' device work: the patch embedding is the Conv3d it stands for (one matmul
over flattened patches), and everything a call derives from its grids is planned on the host
before the tower runs (`plan`), so the tower's compute (`run`) touches no host tensor and reads
no device value back: checked on the meta device, where either is an error or visible."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mmserve.models.attention.torch_sdpa import TORCH
from mmserve.models.qwen_vision import VisionPatchEmbed
from helpers.qwen_towers import TOWERS, tower_configs, tower_shape

SHAPE = tower_shape(32, 64, 48)
CONFIGS = tower_configs(SHAPE, window_size=56)
GRIDS = [(1, 4, 6), (2, 4, 4), (1, 10, 14)]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_patch_embedding_is_its_conv3d(family):
    cfg = CONFIGS[family]
    embed = VisionPatchEmbed(cfg, bias=family == "qwen3")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in embed.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    rows = torch.randn(300, cfg.patch_dim, generator=g)  # [P, C * Tp * p * p], each row one patch
    patches = rows.view(-1, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
    weight, bias, stride = embed.proj.weight, embed.proj.bias, embed.proj.stride
    with torch.no_grad():
        conv = F.conv3d(patches, weight, bias, stride=stride).flatten(1)  # [P, D] float32
        exact = F.conv3d(patches.double(), weight.double(), None if bias is None else bias.double(),
                         stride=stride).flatten(1)  # [P, D] float64: the reference both round from
        ours = embed(rows)
    assert ours.dtype == torch.float32 and ours.shape == conv.shape
    # a float32 sum of 1,176 products either way: ours is as close to the exact result as the conv is
    assert (ours.double() - exact).abs().max() <= 2 * (conv.double() - exact).abs().max()
    torch.testing.assert_close(ours, conv, rtol=1e-5, atol=3e-4)


class DeviceWork(TorchDispatchMode):
    """Records every op that takes a host tensor, and every read of a tensor's value."""

    def __init__(self) -> None:
        super().__init__()
        self.host_ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [*args, *(kwargs or {}).values()]
        if any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in flat) \
                or func.overloadpacket.__name__ in ("_local_scalar_dense", "item"):
            self.host_ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_tower_runs_on_the_device_alone_after_its_plan(family):
    cfg = CONFIGS[family]
    tower = TOWERS[family](cfg).to("meta").eval()
    meta = torch.device("meta")
    pixels = torch.empty(sum(t * h * w for t, h, w in GRIDS), cfg.patch_dim, device=meta)
    plan = tower.plan(GRIDS, TORCH, meta)
    work = DeviceWork()
    with torch.no_grad(), work:
        embeds, deepstack = tower.run(pixels, plan)
    assert work.host_ops == []
    assert embeds.shape == (pixels.shape[0] // 4, 48) and len(deepstack) == len(cfg.deepstack_visual_indexes)


class Transfers(TorchDispatchMode):
    """Records every host -> device copy (with whether it blocks the host) and every op that
    reads a device value back, the ops that would make the host wait on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, bool]] = []  # (op, non_blocking)
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in ("_local_scalar_dense", "item", "nonzero", "equal", "is_nonzero"):
            self.reads.append(name)
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        if any(t.device.type == "cpu" for t in inputs) and any(
                isinstance(t, torch.Tensor) and t.device.type == "meta" for t in outputs):
            self.copies.append((name, bool(kwargs.get("non_blocking", False))))
        return out


@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_whole_tower_call_copies_to_the_device_without_blocking_and_reads_nothing_back(family):
    """`forward` (the plan, then the run) with the torch backend: every host -> device copy is one
    that need not wait for the device's queue, and no device value is read. The segments of the
    torch backend were copied blocking, one copy per segment length, before."""
    cfg = CONFIGS[family]
    tower = TOWERS[family](cfg).to("meta").eval()
    pixels = torch.empty(sum(t * h * w for t, h, w in GRIDS), cfg.patch_dim, device="meta")
    transfers = Transfers()
    with torch.no_grad(), transfers:
        tower(pixels, GRIDS, TORCH)
    assert transfers.copies and all(non_blocking for _, non_blocking in transfers.copies), transfers.copies
    assert transfers.reads == []


def _random(module: torch.nn.Module) -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return module.eval()


def test_the_qwen2_5_plan_equals_what_transformers_computes_from_the_grid_tensor():
    """The rotary cos/sin in window order and both segment boundaries, made on the host from the
    grid list, equal transformers' computation from `grid_thw` (a tensor, on the tower's device
    there: its `.tolist()` and `repeat_interleave` are what would wait on a GPU)."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

    cfg = CONFIGS["qwen2_5"]
    hf_cfg = Qwen2_5_VLVisionConfig(**{k: v for k, v in SHAPE.items() if k != "hidden_act"}, hidden_act="silu",
                                    patch_size=cfg.patch_size, window_size=cfg.window_size,
                                    fullatt_block_indexes=list(cfg.fullatt_block_indexes))
    hf = Qwen2_5_VisionTransformerPretrainedModel._from_config(hf_cfg, dtype=torch.float32).eval()
    grid_thw = torch.tensor(GRIDS)
    window_index, window_cu = get_vision_window_index(grid_thw, 2, cfg.window_size, cfg.patch_size)
    P = int(grid_thw.prod(-1).sum())
    x = torch.zeros(P, cfg.hidden_size)
    with torch.no_grad():
        cos, sin = (hf.permute_input_for_window_attn(e, window_index, seq_len=P)
                    for e in hf.rotary_pos_emb(x, get_vision_position_ids(grid_thw, 2)))
    tower = TOWERS["qwen2_5"](cfg)
    plan = tower.plan(GRIDS, TORCH, torch.device("cpu"))
    our_cos, our_sin = tower.rotary_pos_emb(plan.angles)  # each [P, 1, Dh]
    torch.testing.assert_close(our_cos[:, 0], cos.reshape(P, -1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(our_sin[:, 0], sin.reshape(P, -1), atol=1e-6, rtol=1e-6)
    assert torch.equal(plan.order, window_index) and torch.equal(plan.restore, torch.argsort(window_index))
    assert _boundaries(plan.frames) == get_vision_cu_seqlens(grid_thw).tolist()
    assert _boundaries(plan.windows) == window_cu.tolist()


def test_the_qwen3_plan_equals_what_transformers_computes_from_the_grid_tensor():
    """The learned grid's bilinear taps (as the sum they weigh) and the rotary positions, made on
    the host, equal transformers' vectorised computation from `grid_thw`."""
    from transformers.vision_utils import (get_vision_cu_seqlens, get_vision_interpolation_indices_and_weights,
                                          get_vision_position_ids)

    cfg = CONFIGS["qwen3"]
    tower = _random(TOWERS["qwen3"](cfg))
    grid_thw = torch.tensor(GRIDS)
    index, weight = get_vision_interpolation_indices_and_weights(grid_thw, tower.side, "bilinear", True, 2)
    table = tower.pos_embed.weight.detach()
    plan = tower.plan(GRIDS, TORCH, torch.device("cpu"))
    ours = (table[plan.taps] * plan.weights).sum(1)
    torch.testing.assert_close(ours, (table[index] * weight[..., None]).sum(1), atol=1e-6, rtol=1e-6)
    want = tower.rotary_pos_emb.angles(get_vision_position_ids(grid_thw, 2))
    assert torch.equal(plan.angles, want)
    assert _boundaries(plan.frames) == get_vision_cu_seqlens(grid_thw).tolist()


def _boundaries(segments) -> list[int]:
    """`cu` back from the torch backend's segments (each group: a length and its segments' rows)."""
    spans = sorted((int(start), length) for length, rows in segments.groups for start in rows[:, 0])
    return [0] + [start + length for start, length in spans]
