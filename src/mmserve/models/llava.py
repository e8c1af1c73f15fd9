"""LLaVA as transformers' `LlavaForConditionalGeneration` defines it: a CLIP vision tower, the
feature-layer / select-strategy choice, a two-layer projector, and a Llama decoder.

The runner calls three things: `encode_images` (pixels -> embedding rows for the placeholders),
`embed_tokens` + `forward` (the decoder over one step's flattened tokens), `compute_logits`.
With a `TensorParallel` of size N the model is this rank's shard (models/parallel.py): every
call must run on all N ranks with the same inputs, and returns the same full result on each.
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.models.clip import CLIPVisionTower
from mmserve.models.hf_config import LlavaModelConfig
from mmserve.models.layers import AttentionMetadata, activation
from mmserve.models.llama import LlamaModel
from mmserve.models.parallel import (SINGLE, ColumnParallelLinear, ParallelLMHead, RowParallelLinear, TensorParallel,
                                     kv_head_shard)


class LlavaMultiModalProjector(nn.Module):
    """Column-parallel linear_1, elementwise activation, row-parallel linear_2."""

    def __init__(self, cfg: LlavaModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        in_dim = cfg.vision.hidden_size * len(cfg.feature_layers)
        out_dim, bias, what = cfg.text.hidden_size, cfg.multimodal_projector_bias, "the decoder's hidden_size"
        self.linear_1 = ColumnParallelLinear(in_dim, out_dim, bias, tp, what=what)
        self.act = activation(cfg.projector_hidden_act)
        self.linear_2 = RowParallelLinear(out_dim, out_dim, bias, tp, what=what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, F, Dv * layers] -> [N, F, D / tp] -> [N, F, D] (all-reduced)
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaInner(nn.Module):
    """The `model.` prefix of the checkpoint: vision tower, projector, language model."""

    def __init__(self, cfg: LlavaModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.vision_tower = CLIPVisionTower(cfg.vision, cfg.feature_layers, tp)
        self.multi_modal_projector = LlavaMultiModalProjector(cfg, tp)
        self.language_model = LlamaModel(cfg.text, tp)


class LlavaForConditionalGeneration(nn.Module):
    def __init__(self, cfg: LlavaModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = LlavaInner(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.text.vocab_size, cfg.text.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank caches (all of them when not tensor-parallel)."""
        return kv_head_shard(self.config.text.num_key_value_heads, self.tp)[1]

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values: [N, C, H, W] -> image embeddings [N, F, D] (F placeholder tokens each)."""
        hidden = self.model.vision_tower(pixel_values)  # each [N, P+1, Dv]
        if self.config.vision_feature_select_strategy == "default":
            hidden = [h[:, 1:] for h in hidden]  # drop CLS
        features = torch.cat(hidden, dim=-1)  # [N, F, Dv * len(feature_layers)]
        return self.model.multi_modal_projector(features)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> [T, D]. Image placeholders embed as token 0; the runner overwrites them."""
        ids = torch.where(input_ids == self.config.image_token_id, 0, input_ids)
        return self.model.language_model.embed_tokens(ids)

    @torch.inference_mode()
    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """inputs_embeds: [T, D], positions: [T] -> hidden states [T, D]."""
        return self.model.language_model(inputs_embeds, positions, kv_caches, meta)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, D] (the rows to sample from) -> float32 logits [R, V]."""
        return self.lm_head(hidden).float()
