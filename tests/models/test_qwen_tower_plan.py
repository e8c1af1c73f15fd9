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
from mmserve.models.qwen2_5_vision import Qwen2_5VisionTower
from mmserve.models.qwen3_vision import Qwen3VisionTower
from mmserve.models.qwen_config import QwenVisionConfig
from mmserve.models.qwen_vision import VisionPatchEmbed

SHAPE = dict(hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, spatial_merge_size=2,
             temporal_patch_size=2, depth=2, in_channels=3, hidden_act="silu")
CONFIGS = {"qwen2_5": QwenVisionConfig(**SHAPE, patch_size=14, window_size=56, fullatt_block_indexes=(1,)),
           "qwen3": QwenVisionConfig(**SHAPE, patch_size=16, num_position_embeddings=64,
                                     deepstack_visual_indexes=(0,))}
TOWERS = {"qwen2_5": Qwen2_5VisionTower, "qwen3": Qwen3VisionTower}
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
