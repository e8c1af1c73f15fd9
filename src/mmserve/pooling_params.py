"""What an embedding request asks of its pooling (vLLM's `PoolingParams`, the fields mmserve reads)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """`normalize`: L2-normalize the embedding (None: `--pooler-config`'s choice, true unless it
    says); `truncate_prompt_tokens` (vLLM's): keep the prompt's last K tokens (-1: the most that
    fit); `dimensions` (a Matryoshka model's shorter embedding): refused, no model family here
    declares Matryoshka representations."""

    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None:
            raise ValueError(f"dimensions {self.dimensions}: this model does not support Matryoshka embeddings "
                             "(its embedding has the hidden size; leave dimensions unset)")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false; got {self.normalize!r:.40}")
