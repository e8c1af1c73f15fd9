"""`prefill_attention` off the CPU (CUDA, meta) takes one causal masked attention instead of the
CPU's log-sum-exp kernel; the two agree, checked here on CPU tensors with the same mask."""

from __future__ import annotations

import pytest
import torch

from mmserve.models.attention import torch_sdpa
from mmserve.models.attention.torch_sdpa import masked_prefill_attention, prefill_attention


@pytest.mark.parametrize("start, n, heads, kv_heads", [(5, 3, 4, 2), (40, 17, 4, 4), (1, 1, 6, 1)])
def test_the_masked_form_equals_the_merged_one(start, n, heads, kv_heads):
    g = torch.Generator().manual_seed(start * n)
    q = torch.randn(n, heads, 16, generator=g)
    k, v = torch.randn(n, kv_heads, 16, generator=g), torch.randn(n, kv_heads, 16, generator=g)
    cached_k, cached_v = torch.randn(start, kv_heads, 16, generator=g), torch.randn(start, kv_heads, 16, generator=g)
    mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
    merged = prefill_attention(q, k, v, cached_k, cached_v, 0.25)
    masked = masked_prefill_attention(q, k, v, cached_k, cached_v, mask, 0.25)
    torch.testing.assert_close(masked, merged, rtol=1e-5, atol=1e-5)


def test_off_the_cpu_it_takes_the_masked_form(monkeypatch):
    def cpu_kernel(*args, **kwargs):
        raise AssertionError("the CPU kernel ran off the CPU")

    monkeypatch.setattr(torch_sdpa, "_flash_attention", cpu_kernel)
    q = torch.empty(3, 4, 16, device="meta")
    kv = torch.empty(3, 2, 16, device="meta")
    cached = torch.empty(5, 2, 16, device="meta")
    assert prefill_attention(q, kv, kv, cached, cached, 0.25).shape == (3, 4, 16)
    with pytest.raises(AssertionError, match="CPU kernel"):
        host_kv, host_cached = torch.zeros(3, 2, 16), torch.zeros(5, 2, 16)
        prefill_attention(torch.zeros(3, 4, 16), host_kv, host_kv, host_cached, host_cached, 0.25)
