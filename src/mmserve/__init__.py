"""mmserve: a serving engine for vision-language models that makes repeated images nearly free."""

from __future__ import annotations

from typing import Any

from mmserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and transformers; import it only when asked for
    if name == "LLM":
        from mmserve.entrypoints.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from mmserve import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'mmserve' has no attribute {name!r}")
