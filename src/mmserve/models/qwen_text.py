"""The Qwen2 / Qwen3 decoder of Qwen2.5-VL and Qwen3-VL (`model.language_model`): M-RoPE over
paged KV.

Qwen2 (Qwen2.5-VL): Llama's layer with a bias on q, k and v (none on o). Qwen3 (Qwen3-VL):
per-head RMSNorm on q and k (over Dh, before the rotary), `qkv_bias` on q, k, v and
`attention_bias` on o. Deepstack (Qwen3-VL): after decoder layer i < Ld the vision features of
layer i are added to the hidden states; rows of non-vision tokens are zero, which equals
transformers' masked add (`Qwen3VLTextModel._deepstack_process`, right after the layer, before
the next one and before the final norm).

Module and parameter names follow transformers' `model.language_model`, so checkpoints load by
name. Tokens of a step are flattened ([T, D]) and attend through the paged cache as in
models/llama.py; tensor parallelism splits heads the same way (q_norm / k_norm replicated).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from mmserve.models.attention.backend import StepAttention
from mmserve.models.layers import RMSNorm, default_scale, norm_residual
from mmserve.models.llama import LlamaDecoderLayer
from mmserve.models.mrope import MRotaryEmbedding
from mmserve.models.parallel import (SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel,
                                     VocabParallelEmbedding, kv_head_shard, project)
from mmserve.models.qwen_config import QwenTextConfig

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, 1, Dh]
KVCache = tuple[torch.Tensor, torch.Tensor]  # k_cache, v_cache: [N, S, Hkv, Dh]

if TYPE_CHECKING:
    from mmserve.models.cpu_decoder import CpuDecoder


class QwenAttention(nn.Module):
    """`num_heads` / `num_kv_heads` are this rank's (all of them when tp.size == 1)."""

    fused_projections = (("q_proj", "k_proj", "v_proj"),)  # one matrix once packed (`pack_linears`)

    def __init__(self, cfg: QwenTextConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        D, Dh, bias = cfg.hidden_size, cfg.head_dim, cfg.qkv_bias
        self.num_heads = tp.split(cfg.num_attention_heads, "num_attention_heads")
        first_kv, self.num_kv_heads = kv_head_shard(cfg.num_key_value_heads, tp)
        self.head_dim = Dh
        kv_rows = (first_kv * Dh, self.num_kv_heads * Dh)
        self.q_proj = ColumnParallelLinear(D, cfg.num_attention_heads * Dh, bias, tp)
        self.k_proj = ColumnParallelLinear(D, cfg.num_key_value_heads * Dh, bias, tp, rows=kv_rows)
        self.v_proj = ColumnParallelLinear(D, cfg.num_key_value_heads * Dh, bias, tp, rows=kv_rows)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * Dh, D, cfg.attention_bias, tp)
        self.q_norm = RMSNorm(Dh, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = default_scale(Dh)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: StepAttention) -> torch.Tensor:
        T = x.shape[0]  # heads below are this rank's: H / N and its Hkv
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(T, self.num_heads, self.head_dim)  # [T, H, Dh]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, Dh]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q_norm, k_norm = self.q_norm, self.k_norm
        norms = None  # one eps: both are built from rms_norm_eps
        if q_norm is not None and k_norm is not None:
            norms = (q_norm.weight, k_norm.weight, q_norm.eps)
        out = meta.attend(q, k, v, kv_cache[0], kv_cache[1], self.scale, rope, norms)  # [T, H, Dh]
        return self.o_proj(out.reshape(T, -1))


class QwenDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (the residual stream carried as there) around Qwen's attention."""

    def __init__(self, cfg: QwenTextConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__(cfg, tp, QwenAttention(cfg, tp))


class QwenTextModel(nn.Module):
    """Embeddings, decoder layers and the final norm (no LM head). `cpu_decoder`: the compiled CPU
    decode step the runner sets where it covers the model (models/cpu_decoder.py), else None."""

    cpu_decoder: CpuDecoder | None = None

    def __init__(self, cfg: QwenTextConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config, self.tp = cfg, tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(QwenDecoderLayer(cfg, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank caches (all of them when not tensor-parallel)."""
        return kv_head_shard(self.config.num_key_value_heads, self.tp)[1]

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: StepAttention, deepstack: torch.Tensor | None = None) -> torch.Tensor:
        """inputs_embeds: [T, D]; positions: [3, T] (or [T]); deepstack: [Ld, T, D] or None -> [T, D]."""
        if deepstack is not None and deepstack.shape[0] > len(self.layers):
            raise ValueError(f"{deepstack.shape[0]} deepstack layers for {len(self.layers)} decoder layers")
        # inputs_embeds may be overwritten (a fused add + norm updates the stream in place)
        x, residual = inputs_embeds, None
        rope = self.rotary_emb(positions, x.dtype)
        if deepstack is None and self.cpu_decoder is not None:  # a CPU decode step: all layers in one C call
            hidden = self.cpu_decoder.run(x, rope, kv_caches, meta)
            if hidden is not None:
                return hidden
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(x, residual, rope, kv_cache, meta)
            if deepstack is not None and i < deepstack.shape[0]:
                x, residual = residual + x + deepstack[i], None  # the whole stream; zero on non-vision rows
        return norm_residual(meta.ops, self.norm, x, residual)[0]
