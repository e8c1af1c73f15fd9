"""The Llama decoder with paged KV: RMSNorm, rotary, grouped-query attention, SwiGLU.

Module and parameter names follow transformers' `LlamaModel`, so checkpoints load by name.
Tokens of all requests in a step run together, flattened: x is [T, D]. Under tensor
parallelism (models/parallel.py) each rank runs H / N query heads and its KV heads (split, or
one replicated head); x is the same full [T, D] on every rank between layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from mmserve.models.hf_config import TextConfig
from mmserve.models.attention.backend import StepAttention
from mmserve.models.layers import TORCH_OPS, LayerOps, RMSNorm, RotaryEmbedding, default_scale, norm_residual
from mmserve.models.parallel import (SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel,
                                     VocabParallelEmbedding, kv_head_shard, project)

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, 1, Dh]
Stream = tuple[torch.Tensor, torch.Tensor]  # (a layer's output or normed rows [T, D], the residual stream [T, D])

if TYPE_CHECKING:
    from mmserve.models.cpu_decoder import CpuDecoder


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
        out = meta.attend(q, k, v, kv_cache[0], kv_cache[1], self.scale, rope)  # [T, H, Dh], rotary inside
        return self.o_proj(out.reshape(T, -1))


class LlamaMLP(nn.Module):
    fused_projections = (("gate_proj", "up_proj"),)  # one matrix once packed (`pack_linears`)

    def __init__(self, cfg: TextConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        D, inner, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = ColumnParallelLinear(D, inner, bias, tp, what="intermediate_size")
        self.up_proj = ColumnParallelLinear(D, inner, bias, tp, what="intermediate_size")
        self.down_proj = RowParallelLinear(inner, D, bias, tp, what="intermediate_size")

    def forward(self, x: torch.Tensor, ops: LayerOps = TORCH_OPS) -> torch.Tensor:
        # x: [T, D] -> [T, I / N] (this rank's share) -> [T, D] (all-reduced)
        gate, up = project(x, self.gate_proj, self.up_proj)  # views of one [T, 2I / N] once packed
        return self.down_proj(ops.silu_mul(gate, up))


class LlamaDecoderLayer(nn.Module):
    """Attention then MLP, each after an RMSNorm and added to the residual stream. The stream is
    carried as (x, residual): a layer's input is their sum, added by the fused add + norm of the
    layer that reads it (residual None: x is the whole stream, the first layer's input).
    A family with its own attention module (Qwen's) passes it as `attention`."""

    def __init__(self, cfg: TextConfig, tp: TensorParallel = SINGLE, attention: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = attention if attention is not None else LlamaAttention(cfg, tp)
        self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: StepAttention) -> Stream:
        ops = meta.ops
        h, residual = norm_residual(ops, self.input_layernorm, x, residual)
        x = self.self_attn(h, rope, kv_cache, meta)
        h, residual = ops.add_rms_norm(x, residual, self.post_attention_layernorm.weight,
                                       self.post_attention_layernorm.eps)
        return self.mlp(h, ops), residual


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and the final norm (no LM head). `cpu_decoder`: the compiled CPU
    decode step the runner sets where it covers the model (models/cpu_decoder.py), else None."""

    cpu_decoder: CpuDecoder | None = None

    def __init__(self, cfg: TextConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: StepAttention) -> torch.Tensor:
        # inputs_embeds: [T, D]; positions: [T] -> hidden states [T, D]
        # inputs_embeds may be overwritten (a fused add + norm updates the stream in place)
        x, residual = inputs_embeds, None
        rope = self.rotary_emb(positions, x.dtype)
        if self.cpu_decoder is not None:  # a CPU decode step: all layers in one C call
            hidden = self.cpu_decoder.run(x, rope, kv_caches, meta)
            if hidden is not None:
                return hidden
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        return norm_residual(meta.ops, self.norm, x, residual)[0]
