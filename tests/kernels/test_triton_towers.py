"""The three Qwen vision towers with the triton backend's segments (interpreted on CPU) against the same
tower with the torch backend's: the attention through the variable-length kernel and the small ops
between the GEMMs through `TRITON_OPS` (the residual add fused into the RMSNorm that reads it, the
float32 rotary of q and k, SiLU x up over the packed gate/up projection), with heads of 80 split
64 + 16, windows cut short by the grid's edge, and a video of two frames."""

from __future__ import annotations

import pytest
import torch

from helpers.qwen_towers import TOWERS, tower_configs, tower_shape
from helpers.triton_device import DEVICE
from mmserve.models.attention.backend import attention_backend
from mmserve.models.parallel import fuse_projections

pytest.importorskip("triton")

CONFIGS = tower_configs(tower_shape(160, 256, 64), window_size=112)  # heads of 80, windows of 4x4 patches
GRIDS = [(1, 12, 20), (2, 8, 8)]


@pytest.mark.parametrize("family", list(TOWERS))
def test_the_tower_on_the_triton_backend_equals_the_torch_backends(family):
    cfg = CONFIGS[family]
    tower = TOWERS[family](cfg)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(tower.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=generator) * (0.5 if "qkv" in name else 0.1))
    assert fuse_projections(tower) == (2 if family == "qwen2_5" else 0)  # Qwen2.5-VL's gate / up, per block
    tower = tower.eval().to(DEVICE)
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), cfg.patch_dim, generator=generator).to(DEVICE)
    with torch.inference_mode():
        want, want_deep = tower(pixels, GRIDS, attention_backend("torch", DEVICE))
        got, got_deep = tower(pixels, GRIDS, attention_backend("triton", DEVICE))
    assert len(got_deep) == len(want_deep) == len(cfg.deepstack_visual_indexes)
    for g, w in zip([got, *got_deep], [want, *want_deep]):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)  # the norms' sums in another order
