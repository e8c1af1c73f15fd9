"""`--hf-overrides` (vLLM's flag): values over a checkpoint's `config.json`, seen by every process.

vLLM applies the overrides to the loaded config object (`ModelConfig._apply_dict_overrides`): a
value for a nested config (`text_config`, `vision_config`) is merged into it key by key, any other
value replaces the attribute. Here the same merge is written into a `config.json` of its own, in
a directory of links to the checkpoint's other files (`overridden_dir`), and that directory is the
checkpoint from then on: P0's processor, the engine cores, the workers, a Ray rank on another node
(which resolves the same name with the same overrides) all read the merged file, and nothing else
needs to know. The directory is named by the checkpoint's path, its config.json's bytes and the
overrides, so a changed checkpoint or other overrides never reuse a stale one.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from mmserve.models.builtin import cache_root
from mmserve.models.link_dirs import linked_directory

SUB_CONFIGS = ("text_config", "vision_config")  # merged key by key, as vLLM merges a nested config


def merged(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`raw` (a parsed config.json) with `overrides` applied: into a sub-config key by key (at any
    depth of sub-configs), every other key replaced whole."""
    out = dict(raw)
    for key, value in overrides.items():
        if key in SUB_CONFIGS and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def overridden_dir(model_dir: str, overrides: dict[str, Any]) -> str:
    """A directory holding `model_dir`'s files as links, and its config.json with `overrides` merged
    (under mmserve's cache: `link_dirs.linked_directory`)."""
    config = Path(model_dir, "config.json")
    if not config.is_file():
        raise ValueError(f"{model_dir} has no config.json for --hf-overrides to change")
    original = config.read_bytes()
    key = hashlib.sha256(b"\0".join([os.path.realpath(model_dir).encode(), original,
                                     json.dumps(overrides, sort_keys=True).encode()])).hexdigest()[:24]
    text = json.dumps(merged(json.loads(original), overrides), indent=2)
    return linked_directory(cache_root() / "hf-overrides" / key, [model_dir], {"config.json": text})
