"""LLaVA as transformers' `LlavaForConditionalGeneration` defines it: a CLIP vision tower, the
feature-layer / select-strategy choice, a two-layer projector, and a Llama decoder.

The runner calls three things: `encode_items` (processed images -> embedding rows for the placeholders),
`embed_tokens` + `forward` (the decoder over one step's flattened tokens), `compute_logits`.
With a `TensorParallel` of size N the model is this rank's shard (models/parallel.py): every
call must run on all N ranks with the same inputs, and returns the same full result on each.
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.models.clip import CLIPVisionTower
from mmserve.models.hf_config import LlavaModelConfig
from mmserve.models.attention.backend import StepAttention
from mmserve.models.layers import activation
from mmserve.models.llama import LlamaModel
from mmserve.models.parallel import (SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel,
                                     check_decoder_shardable)
from mmserve.models.vlm import VisionLanguageModel
from mmserve.ipc.pixel_codes import pixel_values


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


class LlavaForConditionalGeneration(VisionLanguageModel):
    OLD_PREFIXES = (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.vision_model.", "model.vision_tower."),
        ("vision_tower.", "model.vision_tower."),  # what transformers 5 writes
        ("multi_modal_projector.", "model.multi_modal_projector."),
    )

    def __init__(self, cfg: LlavaModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__(cfg, tp, LlavaInner(cfg, tp))

    # ---- loading --------------------------------------------------------------------------------

    @staticmethod
    def check_shardable(cfg: LlavaModelConfig, tp: TensorParallel) -> None:
        """ValueError naming the first size that does not split over tp.size."""
        check_decoder_shardable(cfg.text, tp)
        tp.split(cfg.text.hidden_size, "the decoder's hidden_size (the projector's inner size)")
        tp.split(cfg.vision.num_attention_heads, "the vision tower's num_attention_heads")
        tp.split(cfg.vision.intermediate_size, "the vision tower's intermediate_size")

    @staticmethod
    def is_unused(name: str, cfg: LlavaModelConfig) -> bool:
        """Vision layers past the deepest selected feature layer and the post-norm are skipped."""
        prefix = "model.vision_tower."
        if not name.startswith(prefix):
            return False
        rest = name[len(prefix):]
        if rest.startswith("post_layernorm.") or rest == "embeddings.position_ids":
            return True
        if rest.startswith("encoder.layers."):
            return int(rest.split(".")[2]) >= max(cfg.feature_layers)
        return False

    # ---- the runner's interface -------------------------------------------------------------

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values: [N, C, H, W] -> image embeddings [N, F, D] (F placeholder tokens each)."""
        hidden = self.model.vision_tower(pixel_values, self.attention)  # each [N, P+1, Dv]
        if self.config.vision_feature_select_strategy == "default":
            hidden = [h[:, 1:] for h in hidden]  # drop CLS
        features = torch.cat(hidden, dim=-1)  # [N, F, Dv * len(feature_layers)]
        return self.model.multi_modal_projector(features)

    def largest_item_data(self) -> dict[str, torch.Tensor]:
        """A processed image's shape (every LLaVA image has it), zeros on the host: what the
        memory profile encodes."""
        size = self.config.vision.image_size
        return {"pixel_codes": torch.zeros(3, size, size, dtype=torch.uint8), "pixel_lut": torch.zeros(3, 256)}

    @torch.inference_mode()
    def encode_items(self, datas: list[dict[str, torch.Tensor]], dtype: torch.dtype) -> list[torch.Tensor]:
        """One processed image per entry -> its embedding rows [F, D], in order."""
        pixels = torch.stack([pixel_values(data, dtype) for data in datas])  # [N, C, H, W]
        return list(self.encode_images(pixels))

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> [T, D]. Image placeholders embed as token 0; the runner overwrites them."""
        ids = torch.where(input_ids == self.config.image_token_id, 0, input_ids)
        return self.model.language_model.embed_tokens(ids)

    @torch.inference_mode()
    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: StepAttention,
                deepstack: torch.Tensor | None = None) -> torch.Tensor:
        """inputs_embeds: [T, D], positions: [T] -> hidden states [T, D]."""
        return self.model.language_model(inputs_embeds, positions, kv_caches, meta)
