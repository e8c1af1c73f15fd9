"""The rank's device and the few host <-> device copies a step makes.

A step's host-built metadata (token ids, positions, slot mapping, block tables, masks: any
dataclass tree of CPU tensors) crosses as one pinned byte buffer copied without blocking
(`to_device`); the sampled tokens and log probabilities come back as one tensor (`to_host_async`,
read once its event has fired), the step's only device-to-host transfer. On CPU both are the
identity: nothing is copied.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import torch

from mmserve.config import EngineConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ALIGN = 16  # bytes: every tensor starts at an offset any dtype may view

T = TypeVar("T")


def resolve_device(name: str, index: int = 0) -> torch.device:
    """`--device` -> the torch device of GPU `index` (auto: CUDA when present, else CPU)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda, but torch sees no CUDA device (use --device cpu or auto)")
        return torch.device("cuda", index % torch.cuda.device_count())
    return torch.device(name)


def rank_device(config: EngineConfig, tp_rank: int) -> torch.device:
    """The device of tensor-parallel rank `tp_rank` of this engine core (data-parallel ranks on
    one node take consecutive GPUs: dp_rank * tp_size + tp_rank)."""
    parallel = config.parallel
    return resolve_device(config.device.device, parallel.data_parallel_rank * parallel.tensor_parallel_size + tp_rank)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`--dtype` -> a torch dtype (auto: bfloat16 on CUDA, float32 elsewhere)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """`--kv-cache-dtype` -> the KV cache's torch dtype (auto: the model's, `model_dtype`)."""
    return model_dtype if name == "auto" else _DTYPES[name]


def kv_cache_dtype_of(config: EngineConfig) -> torch.dtype:
    """The KV cache's dtype every rank of `config` allocates (rank 0's device decides `auto`)."""
    return resolve_kv_cache_dtype(config.cache.kv_cache_dtype, resolve_dtype(config.model.dtype,
                                                                              rank_device(config, 0)))


def to_device(tree: T, device: torch.device) -> T:
    """The same tree (tensors, lists, tuples, dicts, dataclasses) with every CPU tensor on
    `device`, all of them copied as one pinned buffer without blocking; on CPU, `tree` itself."""
    if device.type == "cpu":
        return tree
    tensors: list[torch.Tensor] = []
    _walk(tree, tensors.append)
    if not tensors:
        return tree
    moved = iter(_copy_packed(tensors, device))
    return _rebuild(tree, lambda _: next(moved))


def to_host_async(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A device tensor's CPU copy under way (the step's one device-to-host transfer): (pinned host
    tensor, the CUDA event that marks it filled: wait on it before reading); a CPU tensor as it is,
    or another device's copy, with None."""
    if tensor.device.type == "cpu":
        return tensor, None
    if tensor.device.type != "cuda":
        return tensor.cpu(), None
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    out.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return out, done


def staged(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied once to `device` through pinned staging memory (pixel values)."""
    if device.type == "cpu" or tensor.device == device:
        return tensor
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def item_on(data: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A processed item's tensors with its pixels (uint8 codes, float tables) on `device`; int64
    metadata (grids) stays on the host, where the model reads it."""
    return {key: value if value.dtype == torch.int64 else staged(value, device) for key, value in data.items()}


def _copy_packed(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Copy CPU tensors to `device` in one transfer; each comes back with its dtype and shape."""
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    offsets, total = [], 0
    for part in flat:
        offsets.append(total)
        total += -(-part.numel() // _ALIGN) * _ALIGN
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    for part, offset in zip(flat, offsets):
        host[offset:offset + part.numel()].copy_(part)
    dev = host.to(device, non_blocking=True)
    return [dev[o:o + p.numel()].view(t.dtype).view(t.shape) for t, p, o in zip(tensors, flat, offsets)]


def _walk(node: Any, visit: Any) -> None:
    if isinstance(node, torch.Tensor):
        if node.device.type == "cpu":
            visit(node)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            if f.init:
                _walk(getattr(node, f.name), visit)
    elif isinstance(node, (list, tuple)):
        for item in node:
            _walk(item, visit)
    elif isinstance(node, dict):
        for item in node.values():
            _walk(item, visit)


def _rebuild(node: Any, replace: Any) -> Any:
    """`node` with each CPU tensor swapped for `replace(tensor)`, in `_walk`'s order."""
    if isinstance(node, torch.Tensor):
        return replace(node) if node.device.type == "cpu" else node
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.replace(node, **{f.name: _rebuild(getattr(node, f.name), replace)
                                            for f in dataclasses.fields(node) if f.init})
    if isinstance(node, list):
        return [_rebuild(item, replace) for item in node]
    if isinstance(node, tuple):
        return tuple(_rebuild(item, replace) for item in node)
    if isinstance(node, dict):
        return {key: _rebuild(item, replace) for key, item in node.items()}
    return node
