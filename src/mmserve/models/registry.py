"""Model families, by the config their checkpoint's `config.json` reads into.

A family is one module under `models/` whose top-level class has the runner's interface
(`encode_items`, `embed_tokens`, `forward`, `compute_logits`, `num_kv_heads`, `uses_mrope`,
`num_deepstack`) and the loader's (`check_shardable`, `canonical_name`, `is_unused`), plus an
entry here. Classes are imported on demand: P0 reads configs without importing torch models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mmserve.models.hf_config import LlavaModelConfig, ModelConfig

if TYPE_CHECKING:
    from mmserve.models.parallel import TensorParallel


def model_class(cfg: ModelConfig) -> Any:
    """The `nn.Module` class that serves a checkpoint with config `cfg`."""
    if isinstance(cfg, LlavaModelConfig):
        from mmserve.models.llava import LlavaForConditionalGeneration

        return LlavaForConditionalGeneration
    from mmserve.models.internvl_config import InternVLModelConfig

    if isinstance(cfg, InternVLModelConfig):
        from mmserve.models.internvl import InternVLForConditionalGeneration

        return InternVLForConditionalGeneration
    from mmserve.models.qwen_vl import QwenVLForConditionalGeneration

    return QwenVLForConditionalGeneration


def check_shardable(cfg: ModelConfig, tp: TensorParallel) -> None:
    """Raise ValueError, before any process starts, for a model that does not split over tp.size."""
    model_class(cfg).check_shardable(cfg, tp)
