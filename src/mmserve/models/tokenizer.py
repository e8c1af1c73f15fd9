"""The checkpoint's tokenizer, as transformers' `AutoTokenizer` loads it.

A config.json transformers has no class for (InternVL's own layout, `internvl_chat`: remote code)
is read by `AutoTokenizer` as a generic config, with a warning that reads like a fault; its
decoder's config (`llm_config`) is handed over instead, which names the same tokenizer family.
"""

from __future__ import annotations

import json
import os
from typing import Any


def load_tokenizer(model_dir: str) -> Any:
    """`AutoTokenizer.from_pretrained(model_dir)`, given the decoder's config where config.json is
    InternVL's own layout."""
    from transformers import AutoConfig, AutoTokenizer

    config = None
    path = os.path.join(model_dir, "config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        llm = raw.get("llm_config")
        if raw.get("model_type") == "internvl_chat" and isinstance(llm, dict) and llm.get("model_type"):
            fields = {k: v for k, v in llm.items() if k not in ("model_type", "architectures")}
            config = AutoConfig.for_model(llm["model_type"], **fields)
    return AutoTokenizer.from_pretrained(model_dir, **({} if config is None else {"config": config}))
