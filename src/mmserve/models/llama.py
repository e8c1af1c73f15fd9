"""The Llama decoder with paged KV: RMSNorm, rotary, grouped-query attention, SwiGLU.

Module and parameter names follow transformers' `LlamaModel`, so checkpoints load by name.
Tokens of all requests in a step run together, flattened: x is [T, D]. Under tensor
parallelism (models/parallel.py) each rank runs H / N query heads and its KV heads (split, or
one replicated head); x is the same full [T, D] on every rank between layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.models.hf_config import TextConfig
from mmserve.models.attention.backend import StepAttention
from mmserve.models.layers import RMSNorm, RotaryEmbedding, apply_rotary, default_scale
from mmserve.models.parallel import (SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel,
                                     VocabParallelEmbedding, kv_head_shard, project)

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, 1, Dh]


class LlamaAttention(nn.Module):
    """`num_heads` / `num_kv_heads` are this rank's (all of them when tp.size == 1)."""

    fused_projections = (("q_proj", "k_proj", "v_proj"),)  # one matrix once packed (`pack_linears`)

    def __init__(self, cfg: TextConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        D, Dh, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.num_heads = tp.split(cfg.num_attention_heads, "num_attention_heads")
        first_kv, self.num_kv_heads = kv_head_shard(cfg.num_key_value_heads, tp)
        self.head_dim = Dh
        kv_rows = (first_kv * Dh, self.num_kv_heads * Dh)
        self.q_proj = ColumnParallelLinear(D, cfg.num_attention_heads * Dh, bias, tp)
        self.k_proj = ColumnParallelLinear(D, cfg.num_key_value_heads * Dh, bias, tp, rows=kv_rows)
        self.v_proj = ColumnParallelLinear(D, cfg.num_key_value_heads * Dh, bias, tp, rows=kv_rows)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * Dh, D, bias, tp)
        self.scale = default_scale(self.head_dim)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: StepAttention) -> torch.Tensor:
        T = x.shape[0]  # heads below are this rank's: H / N and its Hkv
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(T, self.num_heads, self.head_dim)  # [T, H, Dh]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, Dh]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = meta.attend(q, k, v, kv_cache[0], kv_cache[1], self.scale)  # [T, H, Dh]
        return self.o_proj(out.reshape(T, -1))


class LlamaMLP(nn.Module):
    fused_projections = (("gate_proj", "up_proj"),)  # one matrix once packed (`pack_linears`)

    def __init__(self, cfg: TextConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        D, inner, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = ColumnParallelLinear(D, inner, bias, tp, what="intermediate_size")
        self.up_proj = ColumnParallelLinear(D, inner, bias, tp, what="intermediate_size")
        self.down_proj = RowParallelLinear(inner, D, bias, tp, what="intermediate_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D] -> [T, I / N] (this rank's share) -> [T, D] (all-reduced)
        gate, up = project(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, tp)
        self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: StepAttention) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and the final norm (no LM head)."""

    def __init__(self, cfg: TextConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: StepAttention) -> torch.Tensor:
        # inputs_embeds: [T, D]; positions: [T] -> hidden states [T, D]
        x = inputs_embeds
        rope = self.rotary_emb(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, meta)
        return self.norm(x)
