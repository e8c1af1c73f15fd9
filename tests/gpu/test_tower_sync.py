"""On a CUDA GPU: a Qwen vision tower call (its plan from the grids, then the run) never makes the
host wait for the GPU — no device value read back, no blocking copy — under
`torch.cuda.set_sync_debug_mode("error")`, with both attention backends, and its embeddings equal
the float32 CPU tower's. `make test-gpu`; skipped (instantly) where CUDA is absent."""

from __future__ import annotations

import pytest
import torch

from mmserve.models.attention.backend import attention_backend
from helpers.qwen_towers import TOWERS, tower_configs, tower_shape

pytestmark = pytest.mark.gpu

# heads of 80 (Qwen2.5-VL's tower) so the split-head varlen kernel runs; grids with edge windows and a video
SHAPE = tower_shape(160, 256, 64)
CONFIGS = tower_configs(SHAPE, window_size=112)
GRIDS = [(1, 12, 20), (2, 8, 8), (1, 34, 18)]


def _tower(family: str) -> torch.nn.Module:
    tower = TOWERS[family](CONFIGS[family])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(tower.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return tower.eval()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("family", list(TOWERS))
def test_a_tower_call_never_waits_for_the_gpu(family, backend):
    cfg, cuda = CONFIGS[family], torch.device("cuda")
    cpu_tower = _tower(family)
    tower = _tower(family).to(cuda)
    attention = attention_backend(backend, cuda)
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), cfg.patch_dim, generator=torch.Generator().manual_seed(1))
    gpu_pixels = pixels.to(cuda)
    with torch.inference_mode():
        tower(gpu_pixels, GRIDS, attention)  # compiles the kernels and starts cuBLAS outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            embeds, deepstack = tower(gpu_pixels, GRIDS, attention)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want, want_deep = cpu_tower(pixels, GRIDS)
    for got, ref in zip([embeds, *deepstack], [want, *want_deep]):
        torch.testing.assert_close(got.cpu(), ref, atol=2e-3, rtol=2e-3)  # summation order aside
