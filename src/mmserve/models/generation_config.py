"""The checkpoint's `generation_config.json`, read as vLLM reads it (no torch, no transformers).

Two things come from it, following vLLM (`ModelConfig.get_diff_sampling_param`,
`SamplingParams.update_from_generation_config`):

- **EOS ids.** Every id of its `eos_token_id` (an int or a list) ends generation, beside the
  tokenizer's EOS: the engine stops at the first (`hf_config.eos_token_id`), the others join a
  request's `stop_token_ids` unless it sets `ignore_eos` (`GenerationDefaults.with_eos_stops`).
  This holds whatever `--generation-config` says.
- **Sampling defaults.** With `--generation-config auto` (the default) the file's `temperature`,
  `top_p`, `top_k`, `min_p`, `repetition_penalty` and `max_new_tokens` (as `max_tokens`) fill the
  fields a request leaves unset; a request's own value always wins. `vllm` takes none of them; a
  directory takes its own `generation_config.json` instead of the checkpoint's (for its EOS ids
  too). `--override-generation-config` (vLLM's) sets any of these names over what the mode took.
  A value is taken when the file gives it and it is not null: transformers 5's
  `GenerationConfig.to_diff_dict`, whose defaults are all None.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import msgspec

from mmserve.config.model import GENERATION_KEYS
from mmserve.models.hf_config import eos_token_ids
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger("mmserve")

# generation_config.json's sampling names (vLLM's `available_params`) -> SamplingParams'
_SAMPLING_NAMES = {k: "max_tokens" if k == "max_new_tokens" else k for k in GENERATION_KEYS}


@dataclass(frozen=True)
class GenerationDefaults:
    """What a checkpoint's generation config adds to every request.

    `eos_token_ids`: every EOS id, the engine's primary one first. `sampling`: SamplingParams
    names -> values that fill a request's unset fields (`max_tokens` among them when the file
    sets `max_new_tokens`). `source`: where they come from, for the start-up line.
    """

    eos_token_ids: tuple[int, ...] = ()
    sampling: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def request_defaults(self) -> dict[str, Any]:
        """The defaults of a request's sampling fields, `max_tokens` aside (see `max_tokens`)."""
        return {k: v for k, v in self.sampling.items() if k != "max_tokens"}

    def max_tokens(self, limit: int) -> int:
        """A request's `max_tokens` when it sets none: the file's `max_new_tokens`, else `limit`
        (the model's length), and never above `limit`."""
        return min(self.sampling.get("max_tokens", limit), limit)

    def with_eos_stops(self, params: SamplingParams, tokenizer_eos: int | None = None) -> SamplingParams:
        """`params` with the EOS ids other than the primary one among its `stop_token_ids`
        (`tokenizer_eos` too when it differs), unless it ignores EOS; `params` itself if nothing changes."""
        if params.ignore_eos or not self.eos_token_ids:
            return params
        extra = [*self.eos_token_ids[1:], *([tokenizer_eos] if tokenizer_eos is not None else [])]
        missing = [t for t in dict.fromkeys(extra) if t != self.eos_token_ids[0] and t not in params.stop_token_ids]
        if not missing:
            return params
        return msgspec.structs.replace(params, stop_token_ids=[*params.stop_token_ids, *missing])

    def describe(self) -> str:
        """One line for the start-up log: which defaults apply and where they come from."""
        eos = f"generation stops at EOS ids {list(self.eos_token_ids)}"
        if not self.sampling:
            return f"{eos}; no sampling defaults ({self.source})"
        values = ", ".join(f"{k}={v}" for k, v in self.sampling.items())
        hint = "" if self.source.startswith("--generation-config vllm") else "; --generation-config vllm ignores them"
        return f"{eos}; requests that do not set them sample with {values} ({self.source}{hint})"


def load_generation_defaults(model_dir: str, mode: str = "auto",
                             overrides: dict[str, Any] | None = None) -> GenerationDefaults:
    """The defaults `--generation-config mode` gives a checkpoint in `model_dir`, with `overrides`
    (`--override-generation-config`, the file's names) over them; a ValueError when the values
    are not valid sampling parameters (refused at start, not per request)."""
    folder = model_dir if mode in ("auto", "vllm") else mode
    path = os.path.join(folder, "generation_config.json")
    raw: dict[str, Any] = {}
    if os.path.isfile(path):
        with open(path) as f:
            raw = json.load(f)
    eos = eos_token_ids(folder if raw.get("eos_token_id") is not None else model_dir)
    source = "--generation-config vllm: vLLM's neutral defaults" if mode == "vllm" else \
        path if os.path.isfile(path) else f"no {path}"
    chosen = {} if mode == "vllm" else {k: v for k, v in raw.items() if k in _SAMPLING_NAMES and v is not None}
    if overrides:
        chosen.update({k: v for k, v in overrides.items() if v is not None})
        source += ", --override-generation-config over it"
    sampling = {_SAMPLING_NAMES[k]: v for k, v in chosen.items()}
    try:
        SamplingParams(**sampling)
    except ValueError as e:
        raise ValueError(f"{source}: the sampling defaults are not valid: {e}") from None
    return GenerationDefaults(eos, sampling, source=source)


def announce(defaults: GenerationDefaults) -> None:
    """Log once, at start-up, which generation defaults apply."""
    logger.info("%s", defaults.describe())
