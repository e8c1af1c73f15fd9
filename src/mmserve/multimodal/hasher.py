"""Content hashing of multimodal items: `mm_hash`, the key of every cache layer.

blake3 over a framed stream. Every chunk is a one-byte type tag, an 8-byte little-endian
length, then the payload; containers give their element count as the length and frame each
element after it. So structurally different inputs cannot produce the same stream: a list of
two strings never equals one string of their concatenation, a tensor never equals its
transpose (the shape is framed), a dict's key order does not matter (keys are sorted), and
None, empty bytes and an empty list all differ by tag.

What an item's hash covers (`ItemHasher`): the model id, the modality, the processor settings
that change the processed output, the request's cache salt (if any), and the item itself — its
original encoded bytes when it came as bytes (data URL, file), else a PIL image's mode, size,
palette, `HASHED_INFO_KEYS` and raw pixels (no conversion first), or an array's / tensor's dtype,
shape and bytes.
A client-given uuid replaces the item (scoped by model and salt the same way).
"""

from __future__ import annotations

import struct
from typing import Any

import blake3
import numpy as np
from PIL import Image

_LEN = struct.Struct("<BQ")  # tag, length
# the `info` keys of a PIL image that processing reads (`media.to_rgb`); a test fails if it
# starts reading another (tests/multimodal/test_hash_covers_processing.py)
HASHED_INFO_KEYS = ("transparency",)


class FramedHasher:
    """Feeds objects into blake3 as framed, type-tagged chunks (see the module docstring)."""

    def __init__(self) -> None:
        self._h = blake3.blake3()

    def update(self, obj: Any) -> FramedHasher:
        if obj is None:
            self._chunk(b"N", b"")
        elif isinstance(obj, bool):
            self._chunk(b"B", b"\x01" if obj else b"\x00")
        elif isinstance(obj, int):
            self._chunk(b"I", str(obj).encode())
        elif isinstance(obj, float):
            self._chunk(b"F", struct.pack("<d", obj))
        elif isinstance(obj, str):
            self._chunk(b"S", obj.encode("utf-8", "surrogatepass"))
        elif isinstance(obj, (bytes, bytearray, memoryview)):
            self._chunk(b"Y", obj)
        elif isinstance(obj, (list, tuple)):
            self._container(b"L", obj)
        elif isinstance(obj, dict):
            self._dict(obj)
        elif isinstance(obj, Image.Image):
            self._image(obj)
        elif isinstance(obj, np.ndarray):
            self._array(b"A", str(obj.dtype), obj.shape, np.ascontiguousarray(obj))
        elif _is_tensor(obj):
            self._tensor(obj)
        else:
            raise TypeError(f"cannot hash an object of type {type(obj).__name__}")
        return self

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def _chunk(self, tag: bytes, payload: bytes | bytearray | memoryview) -> None:
        view = memoryview(payload).cast("B")
        self._h.update(_LEN.pack(tag[0], view.nbytes))
        self._h.update(view)

    def _container(self, tag: bytes, items: list | tuple) -> None:
        self._h.update(_LEN.pack(tag[0], len(items)))
        for item in items:
            self.update(item)

    def _dict(self, d: dict) -> None:
        if not all(isinstance(k, str) for k in d):
            raise TypeError("only dicts with string keys can be hashed")
        self._h.update(_LEN.pack(ord("D"), len(d)))
        for key in sorted(d):
            self.update(key)
            self.update(d[key])

    def _image(self, image: Image.Image) -> None:
        """Everything `media.to_rgb` and the processors read: mode, size, palette, the
        transparency key (a colour, or per-palette-entry alphas as bytes), pixels."""
        palette = image.getpalette() if image.mode in ("P", "PA") else None
        info = [image.info.get(key) for key in HASHED_INFO_KEYS]
        info = [list(value) if isinstance(value, tuple) else value for value in info]
        self._container(b"P", ["pil", image.mode, list(image.size), palette, *info])
        self._chunk(b"R", image.tobytes())

    def _array(self, tag: bytes, dtype: str, shape: tuple, data: Any) -> None:
        self._container(tag, [dtype, list(shape)])
        self._chunk(b"R", memoryview(data).cast("B") if data.nbytes else b"")

    def _tensor(self, t: Any) -> None:
        import torch

        t = t.detach().to("cpu").contiguous()
        raw = t.view(torch.uint8) if t.dtype.itemsize == 1 or t.dim() == 0 else t.view(-1).view(torch.uint8)
        self._array(b"T", str(t.dtype), tuple(t.shape), raw.numpy() if raw.numel() else np.empty(0, np.uint8))


def _is_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "dtype") and hasattr(obj, "shape")


def hash_object(obj: Any) -> str:
    """The framed blake3 hex digest of one object."""
    return FramedHasher().update(obj).hexdigest()


class ItemHasher:
    """Hashes a model's items: `mm_hash` = H(model id, processor settings, modality, salt, item)."""

    def __init__(self, model_id: str, processor_settings: dict[str, Any]) -> None:
        self._scope = hash_object(["mmserve-item-v1", model_id, _jsonable(processor_settings)])

    def hash_item(self, modality: str, item: Any, salt: str | None = None,
                  kwargs: dict[str, Any] | None = None) -> str:
        """`item`: the encoded bytes it came as, or a PIL image / array / tensor. `kwargs`: the
        request's processor settings (`mm_processor_kwargs`), which change the processed item."""
        kind = "bytes" if isinstance(item, (bytes, bytearray, memoryview)) else "object"
        scope = [self._scope, modality, salt, kind, _jsonable(kwargs or {})]
        return FramedHasher().update(scope).update(item).hexdigest()

    def hash_uuid(self, modality: str, uuid: str, salt: str | None = None,
                  kwargs: dict[str, Any] | None = None) -> str:
        """A client-given id in place of the content, scoped the same way."""
        return hash_object([self._scope, modality, salt, "uuid", uuid, _jsonable(kwargs or {})])


def _jsonable(value: Any) -> Any:
    """Processor settings as plain hashable values (tuples become lists, odd objects their repr)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)
