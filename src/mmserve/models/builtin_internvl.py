"""Tiny InternVL checkpoints (InternVL 3 / 3.5 in transformers' layout): random weights, no download.

`write_tiny_internvl` writes a directory that transformers loads as the published `-hf` repos
(`OpenGVLab/InternVL3-8B-hf`, `OpenGVLab/InternVL3_5-8B-HF`) load: `config.json`
(`InternVLForConditionalGeneration`, an InternViT tower and a Qwen2 (InternVL 3) or Qwen3
(InternVL 3.5) decoder), safetensors, `generation_config.json`, the tokenizer (the built-in
byte-level BPE with Qwen's and InternVL's special tokens, named as InternVL's tokenizer names
them), `chat_template.jinja` (an image part is `<IMG_CONTEXT>\\n`, as the published template
writes it), `preprocessor_config.json` (`GotOcr2ImageProcessor`: tiles of the tower's image size)
and `processor_config.json` (`image_seq_length`). The same arguments always give the same files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mmserve.models.builtin import fill_random, round_up, tokenizer_json

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>")
# InternVL-hf's template: a default system turn, an image part as `<IMG_CONTEXT>\n`
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif -%}"
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{ '<IMG_CONTEXT>\\n' }}"
    "{%- elif part['type'] in ('video', 'video_url') -%}{{ '<video>\\n' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
DEFAULT_INIT_STD = 0.2  # a scale where greedy outputs follow the image (see builtin.DEFAULT_INIT_STD)
# 56 px tiles of 7 px patches: 64 patches, 16 tokens per tile after the 0.5 pixel shuffle
_VISION: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                               image_size=[56, 56], patch_size=[7, 7], attention_bias=True, use_qk_norm=False,
                               norm_type="layer_norm", hidden_act="gelu", layer_scale_init_value=0.1,
                               use_mean_pooling=True, layer_norm_eps=1e-6)
_TEXT: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=8192, rms_norm_eps=1e-6,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
TEXT_MODEL_TYPES = ("qwen2", "qwen3", "llama")


def build_internvl_tokenizer() -> Any:
    """A fresh `PreTrainedTokenizerFast`: the built-in BPE with InternVL's special tokens, no BOS,
    and the names InternVL's processor reads them by."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json(SPECIAL_TOKENS, None)),
        eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=8192, chat_template=CHAT_TEMPLATE,
        extra_special_tokens={"start_image_token": "<img>", "end_image_token": "</img>",
                              "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"},
    )


def _config(tokenizer: Any, text_model_type: str, text_config: dict | None, vision_config: dict | None,
            downsample_ratio: float, tie_word_embeddings: bool) -> Any:
    from transformers import AutoConfig

    if text_model_type not in TEXT_MODEL_TYPES:
        raise ValueError(f"unknown decoder {text_model_type!r}; known: {', '.join(TEXT_MODEL_TYPES)}")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = {**_TEXT, "vocab_size": round_up(len(tokenizer), 64), **(text_config or {}),
            "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"], "bos_token_id": None}
    if text_model_type == "qwen3":
        text.setdefault("head_dim", 32)
    if text_model_type == "llama":
        text.setdefault("attention_bias", False)
    vision = {**_VISION, **(vision_config or {})}
    side, patch = vision["image_size"][0], vision["patch_size"][0]
    seq = int((side // patch) ** 2 * downsample_ratio**2)
    return AutoConfig.for_model(
        "internvl", text_config={"model_type": text_model_type, **text}, vision_config=vision,
        image_token_id=ids["<IMG_CONTEXT>"], image_seq_length=seq, downsample_ratio=downsample_ratio,
        projector_hidden_act="gelu", vision_feature_layer=-1, vision_feature_select_strategy="default",
        tie_word_embeddings=tie_word_embeddings, dtype="float32")


def _write_processor_files(path: Path, tokenizer: Any, config: Any, max_patches: int) -> None:
    tokenizer.save_pretrained(str(path))
    side = config.vision_config.image_size[0]
    pre = {"image_processor_type": "GotOcr2ImageProcessor", "crop_to_patches": False, "min_patches": 1,
           "max_patches": max_patches, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
           "do_resize": True, "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225],
           "rescale_factor": 1 / 255, "resample": 3, "size": {"height": side, "width": side}}
    (path / "preprocessor_config.json").write_text(json.dumps(pre, indent=2, sort_keys=True) + "\n")
    processor = {"processor_class": "InternVLProcessor", "image_seq_length": config.image_seq_length}
    (path / "processor_config.json").write_text(json.dumps(processor, indent=2, sort_keys=True) + "\n")
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def write_tiny_internvl(path: str | os.PathLike, *, text_model_type: str = "qwen2", text_config: dict | None = None,
                        vision_config: dict | None = None, downsample_ratio: float = 0.5, max_patches: int = 6,
                        tie_word_embeddings: bool = True, init_std: float = DEFAULT_INIT_STD, seed: int = 0) -> None:
    """Writes a random-weight InternVL checkpoint directory at `path`: an InternVL 3 shape (Qwen2
    decoder) by default, `text_model_type="qwen3"` for InternVL 3.5's; `text_config` /
    `vision_config` override the small defaults; `max_patches`: the image processor's tile limit;
    `tie_word_embeddings` (transformers 5 reads the top level's): False saves an `lm_head` of its own."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = build_internvl_tokenizer()
    config = _config(tokenizer, text_model_type, text_config, vision_config, downsample_ratio, tie_word_embeddings)
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    fill_random(model, init_std, seed)  # InternViT's layer scales too: a random scale per channel
    text = config.text_config
    model.generation_config = GenerationConfig(eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id)
    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(target))
    _write_processor_files(target, tokenizer, config, max_patches)


# InternVL's own chat template (`tokenizer_config.json` of its repos): string content, a default system turn
OWN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are InternVL, a multimodal large language model.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
_OWN_VISION_NAMES = (  # transformers' names -> InternVL's, the inverse of its conversion's renames
    ("vision_tower.", "vision_model."), (".encoder.layer.", ".encoder.layers."),
    (".embeddings.cls_token", ".embeddings.class_embedding"),
    (".embeddings.position_embeddings", ".embeddings.position_embedding"),
    (".embeddings.patch_embeddings.projection.", ".embeddings.patch_embedding."),
    (".lambda_1", ".ls1"), (".lambda_2", ".ls2"), (".attention.projection_layer.", ".attn.proj."),
    (".attention.", ".attn."), (".layernorm_before.", ".norm1."), (".layernorm_after.", ".norm2."),
    ("multi_modal_projector.layer_norm.", "mlp1.0."), ("multi_modal_projector.linear_1.", "mlp1.1."),
    ("multi_modal_projector.linear_2.", "mlp1.3."),
)


def write_internvl_own_layout(hf_dir: str | os.PathLike, path: str | os.PathLike) -> None:
    """Writes the checkpoint at `hf_dir` (transformers' layout) at `path` in InternVL's own
    (`InternVLChatModel`, as `OpenGVLab/InternVL3-8B` is published): config.json's `llm_config`,
    InternViT's names and fused `qkv`, `mlp1`, the tiling in config.json, the tokenizer's template."""
    from safetensors.torch import save_file

    source, target = Path(hf_dir), Path(path)
    target.mkdir(parents=True, exist_ok=True)
    raw = json.loads((source / "config.json").read_text())
    pre = json.loads((source / "preprocessor_config.json").read_text())
    (target / "config.json").write_text(json.dumps(_own_config(raw, pre), indent=2) + "\n")
    save_file(_own_tensors(source / "model.safetensors"), str(target / "model.safetensors"), metadata={"format": "pt"})
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = OWN_CHAT_TEMPLATE
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    for name in ("tokenizer.json", "generation_config.json"):
        (target / name).write_bytes((source / name).read_bytes())
    side = raw["vision_config"]["image_size"][0]  # what the repos publish beside: a CLIP-style file, unread
    clip = {"crop_size": side, "do_center_crop": True, "do_normalize": True, "do_resize": True,
            "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": pre["image_mean"],
            "image_std": pre["image_std"], "resample": 3, "size": side}
    (target / "preprocessor_config.json").write_text(json.dumps(clip, indent=2) + "\n")


def _own_config(raw: dict[str, Any], pre: dict[str, Any]) -> dict[str, Any]:
    """InternVL's config.json for transformers' `raw` (and its image processor's `pre`)."""
    vision, text = raw["vision_config"], raw["text_config"]
    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[text["model_type"]]
    config = {
        "architectures": ["InternVLChatModel"], "model_type": "internvl_chat", "template": "internvl2_5",
        "llm_config": {**text, "architectures": [arch], "tie_word_embeddings": raw.get("tie_word_embeddings", True)},
        "vision_config": {
            "architectures": ["InternVisionModel"], "model_type": "intern_vit_6b", "hidden_size": vision["hidden_size"],
            "intermediate_size": vision["intermediate_size"], "num_hidden_layers": vision["num_hidden_layers"],
            "num_attention_heads": vision["num_attention_heads"], "image_size": vision["image_size"][0],
            "patch_size": vision["patch_size"][0], "num_channels": 3, "qkv_bias": vision["attention_bias"],
            "qk_normalization": vision["use_qk_norm"], "norm_type": vision["norm_type"],
            "layer_norm_eps": vision["layer_norm_eps"], "hidden_act": vision["hidden_act"], "drop_path_rate": 0.0},
        "downsample_ratio": raw["downsample_ratio"], "select_layer": raw["vision_feature_layer"], "ps_version": "v2",
        "dynamic_image_size": True, "use_thumbnail": True, "min_dynamic_patch": pre["min_patches"],
        "max_dynamic_patch": pre["max_patches"], "force_image_size": vision["image_size"][0],
    }
    if "quantization_config" in raw:  # an AWQ / GPTQ decoder's: its skip list in InternVL's names
        own = {"vision_tower": "vision_model", "multi_modal_projector": "mlp1"}
        quant = dict(raw["quantization_config"])
        if "modules_to_not_convert" in quant:
            quant["modules_to_not_convert"] = [own.get(m, m) for m in quant["modules_to_not_convert"]]
        config["quantization_config"] = quant
    return config


def _own_tensors(weights: Path) -> dict[str, Any]:
    """The tensors of transformers' one-file checkpoint `weights` under InternVL's names, each
    layer's q, k and v stacked into one `qkv` (rows: q's, then k's, then v's)."""
    import torch
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    fused: dict[str, dict[str, Any]] = {}  # a layer's q, k, v, to stack into one qkv
    for name, tensor in load_file(str(weights)).items():
        if name.startswith("language_model.") or name == "lm_head.weight":
            tensors["language_model." + name if name == "lm_head.weight" else name] = tensor
            continue
        for old, new in _OWN_VISION_NAMES:
            name = name.replace(old, new)
        for part in ("q_proj", "k_proj", "v_proj"):
            if f".attn.{part}." in name:
                fused.setdefault(name.replace(f".attn.{part}.", ".attn.qkv."), {})[part] = tensor
                break
        else:
            tensors[name] = tensor
    for name, parts in fused.items():
        tensors[name] = torch.cat([parts["q_proj"], parts["k_proj"], parts["v_proj"]])
    return tensors
