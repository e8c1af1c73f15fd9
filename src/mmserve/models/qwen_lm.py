"""The Qwen2 / Qwen3 decoder of Qwen2.5-VL and Qwen3-VL (`model.language_model`), with M-RoPE and
paged KV.

Qwen2 (Qwen2.5-VL): Llama's layer with a bias on q, k and v. Qwen3 (Qwen3-VL): per-head RMSNorm
on q and k before the rotary, biases as `attention_bias` says. Deepstack (Qwen3-VL): after decoder
layer i < layers, the vision features of layer i are added to the hidden states (rows of text
tokens are zero). Tokens of a step are flattened ([T, D]) and attend through the paged cache as in
models/llama.py; tensor parallelism splits heads the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.models.layers import AttentionMetadata, RMSNorm, apply_rotary, default_scale, paged_attention
from mmserve.models.llama import LlamaMLP
from mmserve.models.parallel import (SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel,
                                     VocabParallelEmbedding, kv_head_shard)
from mmserve.models.qwen_config import QwenTextConfig
from mmserve.models.qwen_rope import MRotaryEmbedding

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, 1, Dh]
KVCache = tuple[torch.Tensor, torch.Tensor]


class QwenAttention(nn.Module):
    """`num_heads` / `num_kv_heads` are this rank's (all of them when tp.size == 1)."""

    def __init__(self, cfg: QwenTextConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        D, Dh = cfg.hidden_size, cfg.head_dim
        self.num_heads = tp.split(cfg.num_attention_heads, "num_attention_heads")
        first_kv, self.num_kv_heads = kv_head_shard(cfg.num_key_value_heads, tp)
        self.head_dim = Dh
        kv_rows = (first_kv * Dh, self.num_kv_heads * Dh)
        self.q_proj = ColumnParallelLinear(D, cfg.num_attention_heads * Dh, cfg.qkv_bias, tp)
        self.k_proj = ColumnParallelLinear(D, cfg.num_key_value_heads * Dh, cfg.qkv_bias, tp, rows=kv_rows)
        self.v_proj = ColumnParallelLinear(D, cfg.num_key_value_heads * Dh, cfg.qkv_bias, tp, rows=kv_rows)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * Dh, D, cfg.attention_bias, tp)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(Dh, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = default_scale(Dh)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)  # [T, H, Dh]
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, Dh]
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)  # [T, H, Dh]
        return self.o_proj(out.reshape(T, -1))


class QwenDecoderLayer(nn.Module):
    def __init__(self, cfg: QwenTextConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = QwenAttention(cfg, tp)
        self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class QwenTextModel(nn.Module):
    """Embeddings, decoder layers and the final norm (no LM head)."""

    def __init__(self, cfg: QwenTextConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(QwenDecoderLayer(cfg, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, deepstack: torch.Tensor | None = None) -> torch.Tensor:
        """inputs_embeds: [T, D]; positions: [3, T]; deepstack: [layers, T, D] or None -> [T, D]."""
        x = inputs_embeds
        rope = self.rotary_emb(positions, x.dtype)
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, rope, kv_cache, meta)
            if deepstack is not None and index < deepstack.shape[0]:
                x = x + deepstack[index]
        return self.norm(x)
