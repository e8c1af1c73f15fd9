"""InternViT, InternVL's vision tower, as transformers' `InternVLVisionModel` defines it.

Every image arrives as tiles of one fixed size (the processor's crop to tiles plus a thumbnail):
x is [N, P+1, Dv], P patches of a tile plus its CLS token. A layer is pre-norm with learned
per-channel layer scales: x + lambda_1 * attention(norm1(x)), then x + lambda_2 * mlp(norm2(x)).
InternViT-300M (InternVL 3 / 3.5 up to 38B) uses LayerNorm and a bias on q, k, v;
InternViT-6B uses RMSNorm, no bias, and an RMSNorm over all heads' q and k (`use_qk_norm`).

Names follow transformers 5's module tree (`embeddings`, `encoder.layer.N`), so checkpoints load
by name. Under tensor parallelism the heads and the MLP's inner features are split; a tower with
`use_qk_norm` normalises over every head at once and so runs whole on each rank (replicated).
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.models.attention.backend import AttentionBackend, SegmentAttention
from mmserve.models.attention.torch_sdpa import TORCH
from mmserve.models.clip import CLIPMLP
from mmserve.models.internvl_config import InternVisionConfig
from mmserve.models.layers import RMSNorm
from mmserve.models.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel, project
from mmserve.models.qwen_vision import QKVParallelLinear


def _norm(cfg: InternVisionConfig, dim: int) -> nn.Module:
    return RMSNorm(dim, cfg.layer_norm_eps) if cfg.norm_type == "rms_norm" else nn.LayerNorm(dim, cfg.layer_norm_eps)


class InternVisionPatchEmbeddings(nn.Module):
    def __init__(self, cfg: InternVisionConfig) -> None:
        super().__init__()
        self.projection = nn.Conv2d(cfg.num_channels, cfg.hidden_size, kernel_size=cfg.patch_size,
                                    stride=cfg.patch_size)


class InternVisionEmbeddings(nn.Module):
    def __init__(self, cfg: InternVisionConfig) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.hidden_size))
        self.patch_embeddings = InternVisionPatchEmbeddings(cfg)
        self.position_embeddings = nn.Parameter(torch.zeros(1, cfg.grid**2 + 1, cfg.hidden_size))
        self.image_size = cfg.image_size

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values: [N, C, S, S] -> [N, P+1, Dv]
        N, _, H, W = pixel_values.shape
        if H != self.image_size or W != self.image_size:
            raise ValueError(f"a tile of {H}x{W} pixels does not match the vision tower's {self.image_size}")
        projection = self.patch_embeddings.projection
        patches = projection(pixel_values.to(projection.weight.dtype)).flatten(2).transpose(1, 2)  # [N, P, Dv]
        return torch.cat([self.cls_token.expand(N, -1, -1), patches], dim=1) + self.position_embeddings


class InternVisionAttention(nn.Module):
    """`num_heads` is this rank's share of the heads. q, k and v are three matrices (transformers'
    layout) or InternVL's own one fused `qkv` (`fused`), split by heads the same way under TP."""

    fused_projections: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"),)  # one matrix once packed

    def __init__(self, cfg: InternVisionConfig, tp: TensorParallel = SINGLE, fused: bool = False) -> None:
        super().__init__()
        D, bias, what = cfg.hidden_size, cfg.attention_bias, "the vision tower's num_attention_heads"
        self.num_heads = tp.split(cfg.num_attention_heads, what)
        self.head_dim = cfg.head_dim
        self.qkv = QKVParallelLinear(D, cfg.num_attention_heads, tp, bias) if fused else None
        if fused:
            self.fused_projections = ()  # one matrix already
        else:
            self.q_proj = ColumnParallelLinear(D, D, bias, tp, what=what)
            self.k_proj = ColumnParallelLinear(D, D, bias, tp, what=what)
            self.v_proj = ColumnParallelLinear(D, D, bias, tp, what=what)
        self.projection_layer = RowParallelLinear(D, D, True, tp, what=what)
        self.q_norm = RMSNorm(D, 1e-6) if cfg.use_qk_norm else None  # transformers' default eps
        self.k_norm = RMSNorm(D, 1e-6) if cfg.use_qk_norm else None

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: [P, D] -> q, k, v: [P, D / tp] each."""
        if self.qkv is not None:
            return self.qkv(x).chunk(3, dim=-1)
        return project(x, self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, tiles: SegmentAttention) -> torch.Tensor:
        # x: [N, L, Dv]; `tiles`: the N tiles as N segments of L rows
        N, L, D = x.shape
        q, k, v = self._project(x.view(N * L, D))  # [N * L, D / tp] each
        if self.q_norm is not None and self.k_norm is not None:  # over every head: a replicated tower
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.reshape(N * L, self.num_heads, self.head_dim) for t in (q, k, v))
        out = tiles.attend(q, k, v, self.head_dim**-0.5)  # [N * L, H / tp, Dh]
        return self.projection_layer(out.reshape(N, L, -1))  # [N, L, Dv], all-reduced


class InternVisionLayer(nn.Module):
    def __init__(self, cfg: InternVisionConfig, tp: TensorParallel = SINGLE, fused: bool = False) -> None:
        super().__init__()
        self.attention = InternVisionAttention(cfg, tp, fused)
        self.mlp = CLIPMLP(cfg, tp)
        self.layernorm_before = _norm(cfg, cfg.hidden_size)
        self.layernorm_after = _norm(cfg, cfg.hidden_size)
        self.lambda_1 = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lambda_2 = nn.Parameter(torch.ones(cfg.hidden_size))

    def forward(self, x: torch.Tensor, tiles: SegmentAttention) -> torch.Tensor:
        # x: [N, L, Dv] -> [N, L, Dv]
        x = self.lambda_1 * self.attention(self.layernorm_before(x), tiles) + x
        return self.lambda_2 * self.mlp(self.layernorm_after(x), tiles.ops) + x


class InternVisionEncoder(nn.Module):
    def __init__(self, cfg: InternVisionConfig, num_layers: int, tp: TensorParallel = SINGLE,
                 fused: bool = False) -> None:
        super().__init__()
        self.layer = nn.ModuleList(InternVisionLayer(cfg, tp, fused) for _ in range(num_layers))


class InternVisionTower(nn.Module):
    """The output of layer `feature_layer` (1..L), through the final LayerNorm when that is the last
    layer of a tower without mean pooling. Layers past it are not built. `fused`: InternVL's own
    layout, one `qkv` matrix per layer."""

    def __init__(self, cfg: InternVisionConfig, feature_layer: int, tp: TensorParallel = SINGLE,
                 fused: bool = False) -> None:
        super().__init__()
        tp = SINGLE if cfg.use_qk_norm else tp
        self.embeddings = InternVisionEmbeddings(cfg)
        self.encoder = InternVisionEncoder(cfg, feature_layer, tp, fused)
        last = feature_layer == cfg.num_hidden_layers
        self.layernorm = nn.LayerNorm(cfg.hidden_size, cfg.layer_norm_eps) if last and not cfg.use_mean_pooling \
            else None

    def forward(self, pixel_values: torch.Tensor, attention: AttentionBackend = TORCH) -> torch.Tensor:
        # pixel_values: [N, C, S, S] -> [N, P+1, Dv]
        x = self.embeddings(pixel_values)
        tiles = attention.equal_segments(x.shape[0], x.shape[1], x.device)
        for layer in self.encoder.layer:
            x = layer(x, tiles)
        return self.layernorm(x) if self.layernorm is not None else x
