"""mmserve: a serving engine for vision-language models that makes repeated images nearly free."""

from __future__ import annotations

import os
from typing import Any

# CPU: torch's OpenMP threads sleep when idle instead of spinning. The engine process shares its
# cores with the frontend (HTTP, tokenizer, image processor threads) and, on a dev box, with
# everything else; spinning threads then wait for a descheduled peer at every parallel region and
# a 5 ms forward became 1100 ms on 2 busy cores (PASSIVE: 8 ms). Set before torch is first imported
# (children inherit it); an explicit OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ...but not asleep at once: a thread that sleeps after every parallel region must be woken for the
# next one, tens of microseconds later, and a woken thread was often put on the core its master
# runs on (in a spawned engine core: ~250 preemptions per forward, a 336 px prefill 7.7+24.7 ms
# against 6.3+16.4 ms in the offline LLM's process). Spinning up to 20k turns (~0.6 ms here) keeps
# it on its core through a forward and bounds what an idle thread burns. An explicit value wins.
os.environ.setdefault("GOMP_SPINCOUNT", "20000")

from mmserve.pooling_params import PoolingParams
from mmserve.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "EmbeddingRequestOutput"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and transformers; import it only when asked for
    if name == "LLM":
        from mmserve.entrypoints.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput", "EmbeddingRequestOutput"):
        from mmserve import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'mmserve' has no attribute {name!r}")
