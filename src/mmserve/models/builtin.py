"""The built-in tiny LLaVA: a random-weight Hugging Face checkpoint made on first use, no download.

`write_tiny_llava` writes a complete LLaVA directory (config, safetensors weights, generation
config, a byte-level BPE tokenizer trained on the corpus below, a llava-1.5 chat template and the
processor config) that `LlavaForConditionalGeneration.from_pretrained` and
`AutoProcessor.from_pretrained` load. The same arguments always give byte-identical files.
`resolve_model` turns a model name (`builtin:tiny-llava` or a directory) into a path.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

from mmserve.models.builtin_corpus import CORPUS as _CORPUS

BUILTIN_PREFIX = "builtin:"
# Bump when anything that changes the written files changes: the cache folder is named after it.
BUILTIN_VERSION = "v3"  # v3: the Qwen template renders tools
BUILTIN_MODELS = ("tiny-llava", "tiny-qwen3-vl")

IMAGE_TOKEN = "<image>"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN)
TOKENIZER_VOCAB_SIZE = 1280
# Std of the random weights. At 0.02 (the usual init) greedy decoding cycles through one or two
# tokens; at 0.1-0.15 some tiny variants still repeat one token 20 times; at 0.2 every variant
# tried (GQA/MHA, 28-56 px, patch 8/14, both strategies, layers -1/-2) gives varied outputs that
# follow the image. Larger stds saturate attention and amplify float32 rounding.
DEFAULT_INIT_STD = 0.2

# llava-1.5 style: "USER: <image>\nWhat is this? ASSISTANT:"; string content or a list of parts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{ 'USER: ' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ 'ASSISTANT: ' }}{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{ '<image>\\n' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{ '</s>' }}{%- else -%}{{ ' ' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'ASSISTANT:' }}{%- endif -%}"
)

_DEFAULT_VISION: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "image_size": 336,
    # 28px patches: a 12x12 grid, 144 placeholder tokens per image (llava-1.5 has 576 at 14px);
    # keeps a batch of 64 images' prefill around a second on a 2-core CPU
    "patch_size": 28,
    "projection_dim": 128,
}
_DEFAULT_TEXT: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "rms_norm_eps": 1e-5,
}



@functools.lru_cache(maxsize=4)
def tokenizer_json(special_tokens: tuple[str, ...] = SPECIAL_TOKENS, bos: str | None = "<s>") -> str:
    """Trains the byte-level BPE tokenizer on `_CORPUS` (deterministic) and returns its JSON;
    `bos` (if any) is prepended to every encoded text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    if bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    return tokenizer.to_str()


def build_tokenizer() -> Any:
    """Returns a fresh `PreTrainedTokenizerFast` over the built-in BPE (trained once per process)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json()),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": IMAGE_TOKEN},
        model_max_length=4096,
        chat_template=CHAT_TEMPLATE,
    )


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _llava_config(
    tokenizer: Any,
    text_config: dict | None,
    vision_config: dict | None,
    vision_feature_layer: int,
    vision_feature_select_strategy: Literal["default", "full"],
) -> Any:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in
           (("bos", "<s>"), ("eos", "</s>"), ("pad", "<pad>"), ("image", IMAGE_TOKEN))}
    text = {**_DEFAULT_TEXT, "vocab_size": round_up(len(tokenizer), 64), **(text_config or {})}
    if text["vocab_size"] < len(tokenizer):
        raise ValueError(f"text vocab_size {text['vocab_size']} < tokenizer size {len(tokenizer)}")
    text.update(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    vision_args = {**_DEFAULT_VISION, **(vision_config or {})}
    vision = CLIPVisionConfig(**vision_args)
    num_patches = (vision_args["image_size"] // vision_args["patch_size"]) ** 2
    return LlavaConfig(
        vision_config=vision,
        text_config=LlamaConfig(**text),
        image_token_index=ids["image"],
        image_seq_length=num_patches + (1 if vision_feature_select_strategy == "full" else 0),
        vision_feature_layer=vision_feature_layer,
        vision_feature_select_strategy=vision_feature_select_strategy,
        pad_token_id=ids["pad"],  # type: ignore[call-arg]  # a PreTrainedConfig kwarg
        dtype="float32",
    )


def fill_random(model: Any, init_std: float, seed: int) -> None:
    """Overwrites every parameter from a private generator: norms 1/0, biases 0, rest N(0, std).

    Parameters are visited in sorted name order so the result does not depend on module order.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name.rsplit(".", 2)[-2]:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * init_std)


def _processor(tokenizer: Any, config: Any) -> Any:
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    size = config.vision_config.image_size
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=config.vision_config.patch_size,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )


def write_llava_files(path: str | os.PathLike, *, text_config: dict, vision_config: dict) -> Any:
    """Writes a LLaVA directory's tokenizer and processor files (no config, no weights) and returns
    its transformers config: for a model whose weights are made elsewhere or never (the kernel
    resource report builds LLaVA-1.5-7B on the `meta` device)."""
    tokenizer = build_tokenizer()
    config = _llava_config(tokenizer, text_config, vision_config, -2, "default")
    Path(path).mkdir(parents=True, exist_ok=True)
    _processor(tokenizer, config).save_pretrained(str(path))
    return config


def write_tiny_llava(
    path: str | os.PathLike,
    *,
    text_config: dict | None = None,
    vision_config: dict | None = None,
    vision_feature_layer: int = -2,
    vision_feature_select_strategy: Literal["default", "full"] = "default",
    init_std: float = DEFAULT_INIT_STD,
    seed: int = 0,
    max_shard_size: str | None = None,
) -> None:
    """Writes a random-weight LLaVA (CLIP vision + Llama text) checkpoint directory at `path`.

    `text_config` / `vision_config` override the small defaults (`LlamaConfig` /
    `CLIPVisionConfig` fields). Weights are float32 N(0, init_std) from a generator seeded with
    `seed` (global RNG state is left untouched), saved as safetensors, sharded with an index
    file when `max_shard_size` (e.g. "200KB") is given. Same arguments -> byte-identical files.
    """
    import torch
    from transformers import GenerationConfig, LlavaForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = build_tokenizer()
    config = _llava_config(
        tokenizer, text_config, vision_config, vision_feature_layer, vision_feature_select_strategy
    )
    with torch.random.fork_rng(devices=[]):
        model = LlavaForConditionalGeneration(config)
    fill_random(model, init_std, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=config.text_config.bos_token_id,
        eos_token_id=config.text_config.eos_token_id,
        pad_token_id=config.text_config.pad_token_id,
    )
    save_kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), **save_kwargs)
    _processor(tokenizer, config).save_pretrained(str(path))


def cache_root() -> Path:
    """mmserve's own cache folder (built-in models, tokenizer overlays): `$MMSERVE_CACHE`, else ~/.cache/mmserve."""
    root = os.environ.get("MMSERVE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "mmserve"


def _create_builtin(name: str) -> Path:
    """Creates builtin `name` in the cache (once): written beside the target, then renamed in."""
    target = cache_root() / "builtin" / f"{name}-{BUILTIN_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    os.chmod(staging, 0o755)
    try:
        _writer(name)(staging)
        for file in staging.iterdir():
            os.chmod(file, 0o644)  # some files are written private (0600); the cache is shared
        try:
            os.rename(staging, target)
        except OSError:
            # A concurrent creator renamed its copy first; theirs is identical, keep it.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _writer(name: str) -> Any:
    """The function that writes built-in `name` into a directory."""
    if name == "tiny-qwen3-vl":
        from mmserve.models.builtin_qwen_vl import write_tiny_qwen_vl

        return write_tiny_qwen_vl
    return write_tiny_llava


def resolve_model(name: str) -> str:
    """Returns the checkpoint directory for a model name.

    `builtin:<model>` creates the built-in checkpoint on first use (under `$MMSERVE_CACHE`,
    default ~/.cache/mmserve) and returns its path; an existing directory is returned as is.
    Raises `ValueError` for an unknown built-in or a path that is not a directory.
    """
    if name.startswith(BUILTIN_PREFIX):
        builtin = name[len(BUILTIN_PREFIX):]
        if builtin not in BUILTIN_MODELS:
            known = ", ".join(BUILTIN_PREFIX + m for m in BUILTIN_MODELS)
            raise ValueError(f"unknown built-in model {name!r}; known: {known}")
        return str(_create_builtin(builtin))
    if os.path.isdir(name):
        return name
    raise ValueError(
        f"model {name!r} is not a directory; give a Hugging Face checkpoint directory "
        f"or {BUILTIN_PREFIX}{BUILTIN_MODELS[0]}"
    )
