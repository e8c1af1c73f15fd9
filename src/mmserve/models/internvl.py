"""InternVL 3 / 3.5 as transformers' `InternVLForConditionalGeneration` defines it: InternViT over an
image's tiles, a pixel shuffle, a LayerNorm + two-layer projector, and a Qwen2 / Qwen3 / Llama
decoder with 1-D positions (the Qwen decoder module, models/qwen_text.py, whose rotary reduces to
Llama's under 1-D positions).

An item is one image: its tiles ([N, C, S, S] uint8 codes; the processor's crop plus a thumbnail)
encode to N * `tile_tokens` rows, in tile order, as transformers concatenates them. The runner's
interface is LLaVA's (models/llava.py).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from mmserve.ipc.pixel_codes import decode
from mmserve.models.attention.backend import StepAttention
from mmserve.models.internvl_config import CHAT, InternVLModelConfig
from mmserve.models.internvl_vision import InternVisionTower
from mmserve.models.layers import activation
from mmserve.models.parallel import (SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel,
                                     check_decoder_shardable)
from mmserve.models.qwen_text import QwenTextModel
from mmserve.models.vlm import VisionLanguageModel


class InternVLMultiModalProjector(nn.Module):
    """LayerNorm over the shuffled features, column-parallel linear_1, activation, row-parallel linear_2."""

    def __init__(self, cfg: InternVLModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        in_dim = cfg.vision.hidden_size * cfg.scale**2
        out_dim, what = cfg.text.hidden_size, "the decoder's hidden_size"
        self.layer_norm = nn.LayerNorm(in_dim)  # transformers' default eps (1e-5)
        self.linear_1 = ColumnParallelLinear(in_dim, out_dim, True, tp, what=what)
        self.act = activation(cfg.projector_hidden_act)
        self.linear_2 = RowParallelLinear(out_dim, out_dim, True, tp, what=what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, F, Dv * scale²] -> [N, F, D]
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


def pixel_shuffle(features: torch.Tensor, scale: int) -> torch.Tensor:
    """[N, G, G, C] -> [N, G / scale, G / scale, C * scale²], InternVL's element order
    (transformers' `InternVLModel.pixel_shuffle` with scale_factor 1 / scale)."""
    N, width, height, channels = features.shape
    x = features.reshape(N, width, height // scale, channels * scale)
    x = x.permute(0, 2, 1, 3).reshape(N, height // scale, width // scale, channels * scale * scale)
    return x.permute(0, 2, 1, 3)


# InternVL's own names -> transformers' (its conversion script's renames; `attn.qkv` stays one matrix)
_OWN_NAMES = [(re.compile(pattern), repl) for pattern, repl in (
    (r"^vision_model\.", "model.vision_tower."),
    (r"\.encoder\.layers\.", ".encoder.layer."),
    (r"\.embeddings\.class_embedding$", ".embeddings.cls_token"),
    (r"\.embeddings\.position_embedding$", ".embeddings.position_embeddings"),
    (r"\.embeddings\.patch_embedding\.", ".embeddings.patch_embeddings.projection."),
    (r"\.ls(\d)$", r".lambda_\1"),
    (r"\.attn\.proj\.", ".attention.projection_layer."),
    (r"\.attn\.", ".attention."),
    (r"\.norm1\.", ".layernorm_before."),
    (r"\.norm2\.", ".layernorm_after."),
    (r"^mlp1\.0\.", "model.multi_modal_projector.layer_norm."),
    (r"^mlp1\.1\.", "model.multi_modal_projector.linear_1."),
    (r"^mlp1\.3\.", "model.multi_modal_projector.linear_2."),
)]


class InternVLInner(nn.Module):
    """The `model.` prefix of the checkpoint: vision tower, projector, decoder."""

    def __init__(self, cfg: InternVLModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.vision_tower = InternVisionTower(cfg.vision, cfg.feature_layer, tp, fused=cfg.layout == CHAT)
        self.multi_modal_projector = InternVLMultiModalProjector(cfg, tp)
        self.language_model = QwenTextModel(cfg.text, tp)


class InternVLForConditionalGeneration(VisionLanguageModel):
    OLD_PREFIXES = (  # the layout transformers saves (and the published -hf repos hold) -> the module tree
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    )

    def __init__(self, cfg: InternVLModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__(cfg, tp, InternVLInner(cfg, tp))

    @classmethod
    def canonical_name(cls, name: str) -> str:
        """A checkpoint tensor's name in this module tree: InternVL's own names (`vision_model.*`,
        `mlp1.*`) renamed as transformers' conversion renames them (its fused `qkv` kept whole),
        then the saved layouts' prefixes."""
        if name.startswith(("vision_model.", "mlp1.")):
            for pattern, repl in _OWN_NAMES:
                name = pattern.sub(repl, name)
        return super().canonical_name(name)

    # ---- loading --------------------------------------------------------------------------------

    @staticmethod
    def check_shardable(cfg: InternVLModelConfig, tp: TensorParallel) -> None:
        """ValueError naming the first size that does not split over tp.size."""
        check_decoder_shardable(cfg.text, tp)
        tp.split(cfg.text.hidden_size, "the decoder's hidden_size (the projector's inner size)")
        if not cfg.vision.use_qk_norm:  # a tower with q / k norms over all heads is replicated
            tp.split(cfg.vision.num_attention_heads, "the vision tower's num_attention_heads")
            tp.split(cfg.vision.intermediate_size, "the vision tower's intermediate_size")

    @staticmethod
    def is_unused(name: str, cfg: InternVLModelConfig) -> bool:
        """Tower layers past the feature layer, the final norm unless it is applied, the mask token."""
        prefix = "model.vision_tower."
        if not name.startswith(prefix):
            return False
        rest = name[len(prefix):]
        if rest.startswith("encoder.layer."):
            return int(rest.split(".")[2]) >= cfg.feature_layer
        if rest.startswith("layernorm."):
            return cfg.vision.use_mean_pooling or cfg.feature_layer != cfg.vision.num_hidden_layers
        return rest == "embeddings.mask_token"

    # ---- the runner's interface -------------------------------------------------------------

    @torch.inference_mode()
    def encode_tiles(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values: [N, C, S, S] tiles -> [N, F, D] (F = `tile_tokens` each)."""
        hidden = self.model.vision_tower(pixel_values, self.attention)[:, 1:]  # [N, P, Dv], CLS dropped
        N, P, channels = hidden.shape
        side = self.config.vision.grid
        shuffled = pixel_shuffle(hidden.reshape(N, side, side, channels), self.config.scale)
        return self.model.multi_modal_projector(shuffled.reshape(N, -1, shuffled.shape[-1]))

    def largest_item_data(self) -> dict[str, torch.Tensor]:
        """The largest image the default processor settings make, zeros on the host: `max_tiles`
        tiles (the memory profile encodes it)."""
        vision = self.config.vision
        codes = torch.zeros(self.config.max_tiles, vision.num_channels, vision.image_size, vision.image_size,
                            dtype=torch.uint8)
        return {"pixel_codes": codes, "pixel_lut": torch.zeros(vision.num_channels, 256)}

    @torch.inference_mode()
    def encode_items(self, datas: list[dict[str, torch.Tensor]], dtype: torch.dtype) -> list[torch.Tensor]:
        """Processed images (each [N_i, C, S, S] tile codes) -> each one's rows [N_i * F, D], in
        order. All tiles run in one tower call; attention never crosses a tile."""
        tiles = torch.cat([decode(data["pixel_codes"], data["pixel_lut"].to(dtype)).view(data["pixel_codes"].shape)
                           for data in datas])  # [sum N_i, C, S, S]
        rows = self.encode_tiles(tiles)  # [sum N_i, F, D]
        counts = [int(data["pixel_codes"].shape[0]) for data in datas]
        return [item.reshape(-1, item.shape[-1]) for item in rows.split(counts)]

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> [T, D]; the runner overwrites image placeholders with encoder rows."""
        return self.model.language_model.embed_tokens(input_ids)

    @torch.inference_mode()
    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: StepAttention,
                deepstack: torch.Tensor | None = None) -> torch.Tensor:
        """inputs_embeds: [T, D], positions: [T] -> hidden states [T, D]."""
        return self.model.language_model(inputs_embeds, positions, kv_caches, meta)
