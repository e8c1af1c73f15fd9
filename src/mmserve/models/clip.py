"""The CLIP vision tower, run only up to the deepest hidden state LLaVA selects.

Names follow transformers 5's `CLIPVisionModel` under LLaVA (`embeddings`, `pre_layrnorm`,
`encoder.layers.N`), so checkpoints load by name. Images are fixed-size: x is [N, P+1, Dv]
with P patches plus the CLS token. Under tensor parallelism the attention heads and the MLP's
inner features are split (models/parallel.py); embeddings and layer norms are replicated.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from mmserve.models.attention.backend import AttentionBackend, SegmentAttention
from mmserve.models.attention.torch_sdpa import TORCH
from mmserve.models.hf_config import VisionConfig
from mmserve.models.layers import EmbeddingTable, LayerOps, activation, add_norm
from mmserve.models.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel, project


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, kernel_size=cfg.patch_size,
                                         stride=cfg.patch_size, bias=False)
        self.position_embedding = EmbeddingTable(cfg.num_patches + 1, cfg.hidden_size)
        self.image_size = cfg.image_size

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values: [N, C, H, W] -> [N, P+1, Dv]
        N, _, H, W = pixel_values.shape
        if H != self.image_size or W != self.image_size:
            raise ValueError(f"image of {H}x{W} pixels does not match the vision tower's {self.image_size}")
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))  # [N, Dv, h, w]
        patches = patches.flatten(2).transpose(1, 2)  # [N, P, Dv]
        cls = self.class_embedding.expand(N, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight[None]


class CLIPAttention(nn.Module):
    """`num_heads` is this rank's share of the heads."""

    fused_projections = (("q_proj", "k_proj", "v_proj"),)  # one matrix once packed (`fuse_projections`)

    def __init__(self, cfg: VisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        D, what = cfg.hidden_size, "the vision tower's num_attention_heads"
        self.num_heads = tp.split(cfg.num_attention_heads, what)
        self.head_dim = D // cfg.num_attention_heads
        self.q_proj = ColumnParallelLinear(D, D, True, tp, what=what)
        self.k_proj = ColumnParallelLinear(D, D, True, tp, what=what)
        self.v_proj = ColumnParallelLinear(D, D, True, tp, what=what)
        self.out_proj = RowParallelLinear(D, D, True, tp, what=what)

    def forward(self, x: torch.Tensor, images: SegmentAttention) -> torch.Tensor:
        # x: [N, L, Dv]; `images`: the N images as N segments of L rows
        N, L, D = x.shape
        q, k, v = (t.view(N * L, self.num_heads, self.head_dim)  # [N * L, H/tp, Dh] each, views once packed
                   for t in project(x.view(N * L, D), self.q_proj, self.k_proj, self.v_proj))
        out = images.attend(q, k, v, self.head_dim**-0.5)  # [N * L, H/tp, Dh]
        return self.out_proj(out.reshape(N, L, -1))  # [N, L, Dv], all-reduced


class MLPShape(Protocol):
    """What a tower's two-layer MLP reads of its config (CLIP's, InternViT's)."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def intermediate_size(self) -> int: ...

    @property
    def hidden_act(self) -> str: ...


class CLIPMLP(nn.Module):
    """fc1 (column-parallel), the activation, fc2 (row-parallel); InternViT's MLP is the same."""

    def __init__(self, cfg: MLPShape, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        what = "the vision tower's intermediate_size"
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, True, tp, what=what)
        self.fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, True, tp, what=what)
        activation(cfg.hidden_act)  # an unknown one is refused here, when the model is built
        self.act = cfg.hidden_act  # applied through the backend's ops (a fused kernel for quick_gelu)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return self.fc2(ops.activation(self.act, self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = CLIPAttention(cfg, tp)
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = CLIPMLP(cfg, tp)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                images: SegmentAttention) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [N, L, Dv] -> (the MLP's output, the stream before it); the stream is carried
        # as the decoder's is (llama.py), each norm with its add through the backend's ops
        h, residual = add_norm(images.ops, self.layer_norm1, x, residual)
        h, residual = add_norm(images.ops, self.layer_norm2, self.self_attn(h, images), residual)
        return self.mlp(h, images.ops), residual


class CLIPEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig, num_layers: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(cfg, tp) for _ in range(num_layers))


class CLIPVisionTower(nn.Module):
    """Returns the hidden states LLaVA selects: index 0 is the (pre-normed) embeddings,
    index i the output of encoder layer i. Layers past the deepest selected one are not built."""

    def __init__(self, cfg: VisionConfig, feature_layers: tuple[int, ...], tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.feature_layers = feature_layers
        self.embeddings = CLIPVisionEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.encoder = CLIPEncoder(cfg, max(feature_layers), tp)

    def forward(self, pixel_values: torch.Tensor, attention: AttentionBackend = TORCH) -> list[torch.Tensor]:
        # pixel_values: [N, C, H, W] -> one [N, P+1, Dv] per feature layer
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        images = attention.equal_segments(x.shape[0], x.shape[1], x.device)
        hidden = {0: x.clone()} if 0 in self.feature_layers else {}  # the fused norms overwrite the stream
        residual = None
        for index, layer in enumerate(self.encoder.layers, 1):
            x, residual = layer(x, residual, images)
            if index in self.feature_layers:
                hidden[index] = residual + x
        return [hidden[i] for i in self.feature_layers]
