"""Tiny LLaVA checkpoints and test images for tests (import as `from tiny_models import ...`).

`tests/conftest.py` puts this folder on `sys.path`, so any test file can import it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmserve.models.builtin import write_tiny_llava
from mmserve.models.builtin_internvl import write_tiny_internvl
from mmserve.models.builtin_qwen_vl import write_tiny_qwen_vl

# Small enough that writing, loading and generating take well under a second each.
TINY_TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
TINY_VISION_CONFIG: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 42,
    "patch_size": 14,
    "projection_dim": 32,
}


def llava_item_bytes(side: int) -> int:
    """Bytes of one processed LLaVA image of `side` x `side` as the caches count them: its uint8
    codes and the [3, 256] float32 table of their values (ipc/pixel_codes.py)."""
    return 3 * side * side + 3 * 256 * 4


def make_checkpoint(tmp_dir: str | Path, **kwargs: Any) -> str:
    """Writes a tiny LLaVA under `tmp_dir` and returns its path.

    `kwargs` are `write_tiny_llava`'s; `text_config` / `vision_config` are merged over the tiny
    defaults above. Each distinct set of arguments gets its own sub-folder, written once.
    """
    text = {**TINY_TEXT_CONFIG, **(kwargs.pop("text_config", None) or {})}
    vision = {**TINY_VISION_CONFIG, **(kwargs.pop("vision_config", None) or {})}
    key = json.dumps([text, vision, kwargs], sort_keys=True, default=str)
    path = Path(tmp_dir) / f"tiny-llava-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if not (path / "config.json").is_file():
        write_tiny_llava(path, text_config=text, vision_config=vision, **kwargs)
    return str(path)


def make_qwen_checkpoint(tmp_dir: str | Path, family: str = "qwen3_vl", **kwargs: Any) -> str:
    """Writes a tiny Qwen3-VL, Qwen2.5-VL or Qwen2-VL under `tmp_dir` and returns its path (`kwargs` are
    `write_tiny_qwen_vl`'s); each distinct set of arguments gets its own sub-folder, written once."""
    key = json.dumps([family, kwargs], sort_keys=True, default=str)
    path = Path(tmp_dir) / f"tiny-{family}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if not (path / "config.json").is_file():
        write_tiny_qwen_vl(path, family=family, **kwargs)
    return str(path)


def make_internvl_checkpoint(tmp_dir: str | Path, **kwargs: Any) -> str:
    """Writes a tiny InternVL under `tmp_dir` and returns its path (`kwargs` are `write_tiny_internvl`'s:
    `text_model_type="qwen3"` for InternVL 3.5's decoder); each distinct set of arguments gets its
    own sub-folder, written once."""
    key = json.dumps(kwargs, sort_keys=True, default=str)
    path = Path(tmp_dir) / f"tiny-internvl-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if not (path / "config.json").is_file():
        write_tiny_internvl(path, **kwargs)
    return str(path)


def make_tied_copy(src: str | Path, dst: Path, keep_head: bool = False) -> str:
    """A copy of the one-file checkpoint `src` at `dst` with `tie_word_embeddings` set, as Qwen2.5-VL-3B
    and Qwen3-VL-2B / 4B are published: without `lm_head.weight` (`keep_head`: with it, as some
    are saved), the head being the embedding table."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for file in Path(src).iterdir():
        if file.suffix != ".safetensors":
            (dst / file.name).write_bytes(file.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(Path(src) / "model.safetensors"))
    if not keep_head:
        del tensors["lm_head.weight"]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def make_image(seed: int, size: tuple[int, int] = (48, 48), mode: str = "RGB") -> Image.Image:
    """A deterministic image of `size` (width, height): random colour blocks plus noise.

    The blocks survive resizing and cropping, so two seeds give visibly different pixels.
    """
    rng = np.random.default_rng(seed)
    width, height = size
    blocks = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8))
    base = np.asarray(blocks.resize((width, height), Image.NEAREST), dtype=np.int16)
    noise = rng.integers(-24, 25, (height, width, 3), dtype=np.int16)
    image = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))
    return image if mode == "RGB" else image.convert(mode)


make_image.__test__ = False  # not a pytest test despite its name
