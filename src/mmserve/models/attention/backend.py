"""The attention backend interface and its selection (`--attention-backend`).

A backend makes, for each call of the model, an object that knows where the call's tokens read
and write and computes their attention: a step's `StepAttention` (paged decoder attention, K/V
written into the cache first) and a vision tower call's `SegmentAttention` (full attention inside
each segment). Models call only `attend` on those objects, so a backend is chosen once, in the
loader, and nothing in a model names one.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Protocol

import torch

from mmserve.models.layers import LayerOps, QKNorm, Rope


class StepAttention(Protocol):
    """One decoder step's attention metadata, built by a backend once for every layer."""

    @property
    def ops(self) -> LayerOps:
        """The backend's small ops between the layers' GEMMs (norms, SiLU x up, rotary)."""
        ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float, rope: Rope | None = None,
               qk_norm: QKNorm | None = None) -> torch.Tensor:
        """Normalise each head of q and k by `qk_norm` (`LayerOps.qk_norm`) and rotate them by
        `rope` (cos, sin: [T, 1, Dh], rotate-half) when given, write the step's K/V into the
        cache, then attend over each request's context (the triton backend does the first three
        in one kernel). q: [T, H, Dh]; k, v: [T, Hkv, Dh]; k_cache, v_cache: [N, S, Hkv, Dh].
        Returns [T, H, Dh]; q, k, v may be overwritten."""
        ...


class SegmentAttention(Protocol):
    """One vision tower call's segments (frames, windows or whole images of a packed sequence)."""

    @property
    def ops(self) -> LayerOps:
        """The backend's small ops between the tower's GEMMs (norms, SiLU x up, rotary)."""
        ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q, k, v: [P, H, Dh] -> [P, H, Dh]: full attention within each segment."""
        ...


class AttentionBackend(Protocol):
    """A way to compute attention: builds the per-call objects above."""

    name: str

    def build_metadata(self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                       block_size: int) -> StepAttention:
        """`query_lens[b]` new tokens of request b end its `seq_lens[b]` tokens of context,
        cached in the blocks `block_tables[b]` (block_size tokens each)."""
        ...

    def segments(self, cu: list[int], device: torch.device) -> SegmentAttention:
        """Segments by cumulative boundaries `cu` ([S + 1] ints, `cu[0] == 0`) of P = cu[-1] rows."""
        ...

    def equal_segments(self, count: int, length: int, device: torch.device) -> SegmentAttention:
        """`count` segments of `length` rows in order (a batch of fixed-size images)."""
        ...


BACKENDS = ("auto", "torch", "triton", "flashinfer")


def missing_package(name: str) -> str | None:
    """The package a backend needs and this environment lacks, or None (checked at start-up,
    without importing it)."""
    needed = {"triton": "triton", "flashinfer": "flashinfer"}.get(name)
    return needed if needed is not None and importlib.util.find_spec(needed) is None else None


def attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend `name` computes with on `device`: "auto" is triton on CUDA, torch elsewhere."""
    from mmserve.models.attention.torch_sdpa import TORCH, TorchBackend

    if name == "auto":
        name = "triton" if device.type == "cuda" and missing_package("triton") is None else "torch"
    if name == "torch":  # decodes read K/V in place by our C kernel on the CPU, padded copies elsewhere
        if device.type != "cpu":
            return TorchBackend(in_place=False)
        from mmserve.models.attention import cpu_kernels

        cpu_kernels.load()  # built (once per machine) at start, not in a request's first step
        return TORCH
    missing = missing_package(name)
    if missing is not None:
        raise ValueError(f"--attention-backend {name} needs the {missing!r} package, which is not installed")
    if name == "flashinfer":
        raise ValueError("--attention-backend flashinfer is not built yet; use triton or torch")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--attention-backend triton runs on CPU only under Triton's interpreter "
                         "(TRITON_INTERPRET=1, for tests); use torch on CPU")
    from mmserve.models.attention.triton_backend import TritonBackend

    return TritonBackend(device)
