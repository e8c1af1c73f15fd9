"""The wire codec: msgpack (msgspec) with torch tensors as out-of-band, zero-copy buffers.

A message becomes a list of frames: frame 0 is msgpack; frames 1.. are the raw bytes of the
tensors it holds, in the order the encoder met them. A tensor is a msgpack Ext of type
`TENSOR_EXT` whose payload is the msgpack array `[dtype name, shape, data]`, where `data` is
the index of its frame (>= 1) or, below `inline_threshold_bytes`, the bytes themselves.
Tensors are found anywhere, typed fields and `dict[str, Any]` values alike.

Invariants:
- bytes on the wire are the tensor's C-contiguous element bytes (little-endian host order);
  any dtype works, bfloat16 included, because the bytes are viewed as uint8 on both sides.
- the encoder does not copy a contiguous CPU tensor: its frame is a view of the tensor's
  storage, so the tensor must not change until the frames are sent.
- the decoder does not copy a writable frame: the tensor views the frame's memory and keeps
  it alive. A read-only frame (`bytes`) is copied once, so every decoded tensor is writable.
- no pickle: a value msgpack cannot hold and that is not a tensor is a TypeError.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import torch

if TYPE_CHECKING:
    from collections.abc import Buffer  # bytes, bytearray, memoryview, zmq.Frame, ...

TENSOR_EXT = 1  # msgpack Ext type code of a tensor
DEFAULT_INLINE_THRESHOLD_BYTES = 256  # smaller tensors travel inside frame 0

Frames = list[bytes | memoryview]

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "complex64", "complex128",
                 "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
                 "float8_e4m3fn", "float8_e5m2")
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class MsgpackEncoder:
    """Encodes any msgspec-supported object (Structs, unions, dicts) plus torch tensors.

    Not reentrant: one encode at a time per instance (the frame list is per call state).
    """

    def __init__(self, inline_threshold_bytes: int = DEFAULT_INLINE_THRESHOLD_BYTES) -> None:
        self.inline_threshold_bytes = inline_threshold_bytes
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._header_encoder = msgspec.msgpack.Encoder()
        self._frames: Frames | None = None

    def encode(self, obj: Any) -> Frames:
        """Frame 0 is msgpack; frames 1.. view the bytes of the tensors too big to inline."""
        frames: Frames = [b""]
        self._frames = frames
        try:
            frames[0] = self._encoder.encode(obj)
        finally:
            self._frames = None
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._encode_tensor(obj)
        raise TypeError(f"cannot send a {type(obj).__module__}.{type(obj).__qualname__} over IPC "
                        "(only msgspec-supported types and torch tensors)")

    def _encode_tensor(self, tensor: torch.Tensor) -> msgspec.msgpack.Ext:
        name = _DTYPE_NAMES.get(tensor.dtype)
        if name is None or tensor.layout != torch.strided:
            raise TypeError(f"cannot send a tensor of dtype {tensor.dtype} / layout {tensor.layout} over IPC")
        data = tensor_bytes(tensor)
        assert self._frames is not None, "tensors are encoded only inside encode()"
        if data.nbytes < self.inline_threshold_bytes:
            payload: int | memoryview = data
        else:
            payload = len(self._frames)
            self._frames.append(data)
        header = self._header_encoder.encode((name, tuple(tensor.shape), payload))
        return msgspec.msgpack.Ext(TENSOR_EXT, header)


class MsgpackDecoder:
    """Decodes frames made by `MsgpackEncoder` into an instance of `type` (e.g. a tagged union).

    Not reentrant: one decode at a time per instance.
    """

    def __init__(self, type: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(type, ext_hook=self._ext_hook, dec_hook=_dec_hook)
        self._header_decoder = msgspec.msgpack.Decoder(tuple[str, tuple[int, ...], int | bytearray])
        self._frames: Sequence[Buffer] = ()

    def decode(self, frames: Sequence[Buffer]) -> Any:
        """Rebuild the object; tensors view writable frames (no copy) and keep them alive."""
        if not frames:
            raise ValueError("a message has at least one frame")
        self._frames = frames
        try:
            return self._decoder.decode(frames[0])
        finally:
            self._frames = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code != TENSOR_EXT:
            raise ValueError(f"unknown msgpack Ext type {code}")
        name, shape, payload = self._header_decoder.decode(data)  # payload: inline bytes or a frame index
        dtype = _DTYPES.get(name)
        if dtype is None:
            raise ValueError(f"unknown tensor dtype {name!r}")
        if isinstance(payload, int):
            if not 1 <= payload < len(self._frames):
                raise ValueError(f"tensor frame {payload} missing ({len(self._frames)} frames)")
            return tensor_from_bytes(_writable(self._frames[payload]), dtype, shape)
        return tensor_from_bytes(payload, dtype, shape)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A 1-d uint8 view of the tensor's elements in C order; a copy only if not contiguous/CPU."""
    t = tensor.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    # The ndarray keeps `flat` (and so its storage) alive as long as the memoryview lives.
    return memoryview(flat.view(torch.uint8).numpy())


def tensor_from_bytes(data: Buffer, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor viewing `data` (kept alive by the tensor); `data` must be writable."""
    itemsize = dtype.itemsize
    nbytes = memoryview(data).nbytes
    if nbytes != math.prod(shape) * itemsize:
        raise ValueError(f"tensor of shape {list(shape)} and dtype {dtype} needs "
                         f"{math.prod(shape) * itemsize} bytes; got {nbytes}")
    if nbytes == 0:  # torch.frombuffer refuses empty buffers
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(tuple(shape))


def _writable(frame: Buffer) -> Buffer:
    view = memoryview(frame)
    if view.readonly:
        return bytearray(view)  # one copy; tensors must own writable memory
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _dec_hook(type: Any, obj: Any) -> Any:
    """Fields typed `torch.Tensor` already hold the tensor `_ext_hook` built."""
    if type is torch.Tensor and isinstance(obj, torch.Tensor):
        return obj
    raise NotImplementedError(f"cannot decode {type!r}")
