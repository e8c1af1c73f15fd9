"""What every family's top-level model shares: the LM head and logits, the KV heads a rank
caches, and renaming a checkpoint's older saved layout into the module tree.

A family subclasses `VisionLanguageModel` and hands its `model` (vision tower + decoder) to its
constructor; the runner's and loader's interface is listed in models/registry.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mmserve.models.attention.backend import AttentionBackend
from mmserve.models.attention.torch_sdpa import TORCH
from mmserve.models.parallel import ParallelLMHead, TensorParallel, kv_head_shard


class VisionLanguageModel(nn.Module):
    OLD_PREFIXES: tuple[tuple[str, str], ...] = ()  # saved layouts -> the module tree (first match wins)
    uses_mrope = False  # 1-D positions unless a family says otherwise
    num_deepstack = 0  # decoder layers that take vision features besides the embeddings

    attention: AttentionBackend = TORCH  # the loader sets the engine's (`--attention-backend`)
    weight_bytes = 0  # the loader sets it: bytes its parameters hold (quantized ones as held)
    config: Any
    tp: TensorParallel
    model: Any  # the family's `model.` prefix: its tower(s) and `language_model`

    def __init__(self, cfg: Any, tp: TensorParallel, model: Any) -> None:
        """The family's config, this rank's place, its `model` (built for that rank), and the LM
        head over the decoder's embeddings (the same table when tied)."""
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = model
        text = cfg.text
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = model.language_model.embed_tokens.weight  # type: ignore[assignment]

    @classmethod
    def canonical_name(cls, name: str) -> str:
        """A checkpoint tensor's name in this module tree (older saved layouts renamed)."""
        for old, new in cls.OLD_PREFIXES:
            if name.startswith(old):
                return new + name[len(old):]
        return name

    @property
    def text_model(self) -> Any:
        """The decoder (`model.language_model`: embeddings, layers, final norm)."""
        return self.model.language_model

    @property
    def hidden_size(self) -> int:
        return self.config.text.hidden_size

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank caches (all of them when not tensor-parallel)."""
        return kv_head_shard(self.config.text.num_key_value_heads, self.tp)[1]

    # ---- what the runner calls; each family implements these (models/registry.py) ----------

    def mrope_positions(self, token_ids: list[int], items: list[Any]) -> tuple[torch.Tensor, int]:
        """M-RoPE families: positions [3, len(token_ids)] and the decode delta."""
        raise NotImplementedError(f"{type(self).__name__} does not use M-RoPE")

    def encode_items(self, datas: list[dict[str, torch.Tensor]], dtype: torch.dtype) -> list[torch.Tensor]:
        """Processed items -> each one's encoder rows [F_i, D * (1 + num_deepstack)], in order."""
        raise NotImplementedError

    def largest_item_data(self) -> dict[str, torch.Tensor]:
        """Processed data (zeros, on the host) of the largest image the family admits: the memory
        profile runs it through the vision tower."""
        raise NotImplementedError

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> [T, D]; the runner overwrites placeholders with encoder rows."""
        raise NotImplementedError

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, D] (the rows to sample from) -> float32 logits [R, V]."""
        return self.lm_head(hidden).float()
