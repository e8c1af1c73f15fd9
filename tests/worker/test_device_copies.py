"""`worker/device.py` on CPU: the one-buffer packing that carries a step's inputs to a GPU (run
here with the CPU as target, so the bytes can be compared), the tree walk that keeps every
non-tensor field, and `--device` / `--dtype` resolution."""

from __future__ import annotations

import pytest
import torch

from mmserve.config import EngineConfig
from mmserve.models.attention.torch_sdpa import AttentionMetadata
from mmserve.worker.device import _copy_packed, rank_device, resolve_device, resolve_dtype, to_device, to_host_async


def test_packed_copy_gives_back_every_tensor_whatever_its_dtype_shape_or_layout():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 1 << 40, (7,), generator=g), torch.rand(3, 5, generator=g) > 0.5,
               torch.randn(2, 3, generator=g), torch.randint(0, 9, (3,), dtype=torch.int32, generator=g),
               torch.empty(0, dtype=torch.int64), torch.randn(4, 6, generator=g).T,  # not contiguous
               torch.randn(5, generator=g).to(torch.bfloat16), torch.tensor(3)]
    copies = _copy_packed(tensors, torch.device("cpu"))
    for before, after in zip(tensors, copies):
        assert after.dtype == before.dtype and after.shape == before.shape
        assert torch.equal(after, before)


def test_to_device_keeps_the_tree_and_moves_every_tensor():
    meta = AttentionMetadata.build([3, 1, 2], [3, 9, 6], [[4], [1, 2, 3], [5, 6]], block_size=4)
    tree = {"ids": torch.arange(6), "meta": meta, "rows": [torch.tensor([2]), 7], "names": ("a", "b")}
    moved = to_device(tree, torch.device("meta"))
    assert moved["ids"].device.type == "meta" and moved["rows"][1] == 7 and moved["names"] == ("a", "b")
    assert moved["meta"].decode_mask.shape == meta.decode_mask.shape
    assert all(p.block_table.device.type == "meta" for p in moved["meta"].prefills)
    assert [(p.lo, p.hi, p.start) for p in moved["meta"].prefills] == [(p.lo, p.hi, p.start) for p in meta.prefills]
    assert to_device(tree, torch.device("cpu")) is tree  # the CPU copies nothing


def test_device_and_dtype_resolution():
    host, ready = to_host_async(torch.ones(2))
    assert host.device.type == "cpu" and ready is None
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        assert rank_device(EngineConfig(), 0) == torch.device("cpu")
        with pytest.raises(ValueError, match="--device cuda"):
            resolve_device("cuda")
