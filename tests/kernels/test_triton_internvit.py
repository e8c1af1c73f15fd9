"""InternViT with the triton backend's segments (interpreted on CPU) against the same tower with the
torch backend's: every tile one segment of its patches and CLS token (an odd length, 17 rows), at
the head sizes of the two published towers, 64 (InternViT-300M: LayerNorm, QKV bias, three
separate projections fused) and 128 (InternViT-6B: RMSNorm, q / k norm over all heads, InternVL's own
fused `qkv`)."""

from __future__ import annotations

import pytest
import torch

from helpers.triton_device import DEVICE
from mmserve.models.attention.backend import attention_backend
from mmserve.models.internvl_config import InternVisionConfig
from mmserve.models.internvl_vision import InternVisionTower
from mmserve.models.parallel import fuse_projections

pytest.importorskip("triton")

SHAPES = {  # hidden size, heads, norm, q / k norm, InternVL's own fused qkv
    "300m-head-64": (128, 2, "layer_norm", False, False),
    "6b-head-128": (256, 2, "rms_norm", True, True),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_tower_on_the_triton_backend_equals_the_torch_backends(shape):
    hidden, heads, norm, qk_norm, fused = SHAPES[shape]
    cfg = InternVisionConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                             num_attention_heads=heads, image_size=28, patch_size=7, num_channels=3,
                             attention_bias=not qk_norm, use_qk_norm=qk_norm, norm_type=norm, layer_norm_eps=1e-6,
                             hidden_act="gelu", use_mean_pooling=not qk_norm)
    tower = InternVisionTower(cfg, feature_layer=2, fused=fused)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(tower.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    assert fuse_projections(tower) == (0 if fused else 2)  # q, k, v of each layer: one matrix either way
    tower = tower.eval().to(DEVICE)
    tiles = torch.randn(3, 3, 28, 28, generator=generator).to(DEVICE)  # 16 patches and a CLS token each
    with torch.inference_mode():
        want = tower(tiles, attention_backend("torch", DEVICE))
        got = tower(tiles, attention_backend("triton", DEVICE))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
