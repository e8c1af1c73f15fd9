"""How one entry of the shared-memory store lies in its chunk's payload.

`u32 meta length |
msgpack [[name, dtype, shape, offset, nbytes], ...] | tensor bytes`, each tensor 64-byte aligned
(offsets counted from the first tensor's byte). The store's owner and, with several API servers,
each writer lay entries out with `layout` + `write_payload`; readers map them with `read_tensors`."""

from __future__ import annotations

import struct
from collections.abc import Mapping

import msgspec
import torch

from mmserve.ipc.serial import tensor_bytes, tensor_from_bytes
from mmserve.item_store.shm_ring import align

_U32 = struct.Struct("<I")
_Specs = list[tuple[str, str, list[int], int, int]]  # name, dtype, shape, offset, nbytes
_META_ENCODER = msgspec.msgpack.Encoder()
_META_DECODER = msgspec.msgpack.Decoder(_Specs)


def layout(item: Mapping[str, torch.Tensor]) -> tuple[bytes, list[tuple[int, memoryview]], int]:
    """The msgpack meta, each tensor's (payload offset, bytes), and the payload size.

    TypeError (before anything is written) for a value that is not a dense tensor."""
    specs: _Specs = []
    views = []
    offset = 0  # from the first tensor's byte
    for name, tensor in item.items():
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise TypeError(f"the shared-memory store holds dense tensors only; {name!r} is a {type(tensor)}")
        view = tensor_bytes(tensor)  # no copy for a contiguous CPU tensor
        specs.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, view.nbytes))
        views.append(view)
        offset = align(offset + view.nbytes)
    meta = _META_ENCODER.encode(specs)
    start = align(_U32.size + len(meta))
    return meta, [(start + spec[3], view) for spec, view in zip(specs, views)], start + offset


def write_payload(payload: memoryview, meta: bytes, placements: list[tuple[int, memoryview]]) -> None:
    _U32.pack_into(payload, 0, len(meta))
    payload[_U32.size:_U32.size + len(meta)] = meta
    for offset, view in placements:
        payload[offset:offset + view.nbytes] = view


def read_tensors(payload: memoryview) -> dict[str, torch.Tensor]:
    (meta_len,) = _U32.unpack_from(payload)
    specs = _META_DECODER.decode(payload[_U32.size:_U32.size + meta_len])
    start = align(_U32.size + meta_len)
    data = {}
    for name, dtype_name, shape, offset, nbytes in specs:
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown tensor dtype {dtype_name!r}")
        data[name] = tensor_from_bytes(payload[start + offset:start + offset + nbytes], dtype, shape)
    return data
