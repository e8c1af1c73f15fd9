"""The model layer's config: which checkpoint, in which dtype, on which attention backend."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any

from mmserve.config.fields import opt

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")  # models/attention/backend.py
_CPU_ACTIVATION_QUANT = ("none", "int8")  # models/quantization/q8_gemv.py
_RUNNERS = ("auto", "generate", "pooling")  # vLLM's --runner; auto: generate (every family here is generative)
_POOLER_KEYS = {"pooling_type": str, "normalize": bool}  # vLLM's --pooler-config keys read here
# generation_config.json's sampling names that --override-generation-config sets (vLLM's `available_params`)
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


@dataclass(frozen=True)
class ModelConfig:
    model: str = opt("builtin:tiny-llava", "Model: a Hugging Face repo id (org/name: downloaded once, or found in the "
                     "Hugging Face cache), a checkpoint directory, or a builtin name.")
    revision: str | None = opt(None, "Branch, tag or commit of a repo id's checkpoint (default: its main branch).")
    tokenizer_revision: str | None = opt(
        None, "Branch, tag or commit the tokenizer files and chat template of a repo id come from (default: "
        "--revision).")
    download_dir: str | None = opt(
        None, "Where repo ids are downloaded to and looked up, laid out as the Hugging Face cache (default: "
        "HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub).")
    generation_config: str = opt(
        "auto", "Default sampling parameters of requests that do not set them: auto (the checkpoint's "
        "generation_config.json: temperature, top_p, top_k, repetition_penalty, max_new_tokens as max_tokens), vllm "
        "(vLLM's neutral defaults), or a directory holding a generation_config.json. Every eos_token_id the file "
        "lists stops generation either way.")
    override_generation_config: dict[str, Any] = opt(
        {}, 'Sampling defaults over the generation config\'s, as JSON: {"temperature": 0.6, "max_new_tokens": 512} '
        "(generation_config.json's names: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens); "
        "with --generation-config vllm they are the only defaults (vLLM's flag).", parse=json.loads)
    hf_overrides: dict[str, Any] = opt(
        {}, 'Values over the checkpoint\'s config.json, as JSON (vLLM\'s flag): {"max_position_embeddings": 65536}, '
        '{"architectures": ["Qwen2VLForConditionalGeneration"]}; a "text_config" or "vision_config" object is merged '
        "into that part key by key, any other value replaces the key's. Every process reads the checkpoint through a "
        "directory of links to its files with the merged config.json.", parse=json.loads)
    model_dir: str | None = opt(
        None, "The checkpoint directory --model resolves to (set once by models/hub.py, not a flag).", cli=False)
    dtype: str = opt("auto", "Weights and activations dtype (auto: bfloat16 on CUDA, float32 on CPU).",
                     choices=_DTYPES)
    max_model_len: int | None = opt(None, "Longest prompt + output in tokens (default: the model's).")
    seed: int = opt(0, "Seed of the engine's random state (requests without their own seed).")
    attention_backend: str = opt("auto", "How attention is computed: torch (PyTorch's SDPA), triton (our Triton "
                                 "kernels), flashinfer (when installed); auto: triton on CUDA, torch on CPU.",
                                 choices=_ATTENTION_BACKENDS)
    quantization: str | None = opt(None, "Quantize a float checkpoint's decoder weights at load: fp8 (per output "
                                   "row). Quantized checkpoints are read from their quantization_config without it.",
                                   choices=("fp8",))
    cpu_activation_quant: str = opt(
        "none", "On the CPU, multiply a 4-bit (AWQ / W4A16) checkpoint's weights by activations rounded to int8 per "
        "group (integer dot products, as llama.cpp's Q4_0 x Q8_0) in steps of up to 256 tokens (decode, short "
        "prefill chunks): faster, not exact. none keeps activations float32 (exact to the dequantized model); "
        "longer steps stay exact either way. Refused on a GPU, with a dtype other than float32, or with a "
        "checkpoint without int4 layers.",
        choices=_CPU_ACTIVATION_QUANT)
    runner: str = opt(
        "auto", "What the model serves (vLLM's flag): generate (auto) text, or pooling: embeddings — the prompt's "
        "last hidden state, on /v1/embeddings and LLM.embed, instead of chat and completions.", choices=_RUNNERS)
    pooler_config: dict[str, Any] = opt(
        {}, 'How --runner pooling pools, as JSON (vLLM\'s flag): {"pooling_type": "LAST", "normalize": true}; LAST '
        "(the last token) is the one pooling type; normalize (default true): L2-normalized, unless a request says.",
        parse=json.loads)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}; got {self.dtype!r}")
        if self.attention_backend not in _ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(_ATTENTION_BACKENDS)}; "
                             f"got {self.attention_backend!r}")
        needs = self.attention_backend in ("triton", "flashinfer")
        if needs and importlib.util.find_spec(self.attention_backend) is None:
            raise ValueError(f"attention_backend {self.attention_backend} needs the {self.attention_backend!r} "
                             "package, which is not installed")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be fp8 (or unset); got {self.quantization!r}")
        if self.cpu_activation_quant not in _CPU_ACTIVATION_QUANT:
            raise ValueError(f"cpu_activation_quant must be one of {', '.join(_CPU_ACTIVATION_QUANT)}; "
                             f"got {self.cpu_activation_quant!r}")
        if self.runner not in _RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(_RUNNERS)}; got {self.runner!r}")
        self._check_pooler_config()
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2; got {self.max_model_len}")
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            raise ValueError(f"generation_config must be auto, vllm or a directory; got {self.generation_config!r}")
        overrides = self.override_generation_config
        if not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a JSON object of config.json keys; got {self.hf_overrides!r:.80}")
        if not isinstance(overrides, dict) or any(k not in GENERATION_KEYS for k in overrides):
            raise ValueError("override_generation_config must be a JSON object of generation_config.json's sampling "
                             f"names ({', '.join(GENERATION_KEYS)}); got {overrides!r}")

    def _check_pooler_config(self) -> None:
        config = self.pooler_config
        if not isinstance(config, dict) or any(not isinstance(config.get(k, t()), t) for k, t in _POOLER_KEYS.items()):
            raise ValueError('pooler_config must be a JSON object such as {"pooling_type": "LAST", "normalize": true}; '
                             f"got {config!r:.80}")
        unknown = sorted(set(config) - set(_POOLER_KEYS))
        if unknown:
            raise ValueError(f"pooler_config: {', '.join(unknown)} not supported (pooling_type, normalize)")
        if str(config.get("pooling_type", "LAST")).upper() != "LAST":
            raise ValueError(f"pooler_config pooling_type {config['pooling_type']!r} is not supported: LAST (the "
                             "prompt's last token) only, whose hidden state the prefix cache serves like a prompt")

    @property
    def pools(self) -> bool:
        """Whether the model serves embeddings (`--runner pooling`) rather than text."""
        return self.runner == "pooling"

    @property
    def pooling_normalize(self) -> bool:
        """Whether embeddings are L2-normalized when a request does not say (`--pooler-config`)."""
        return bool(self.pooler_config.get("normalize", True))

    @property
    def checkpoint_dir(self) -> str:
        """The checkpoint directory `model` resolved to (`models/hub.py: resolve_engine_model`)."""
        if self.model_dir is None:
            raise RuntimeError(f"model {self.model!r} is not resolved yet (models/hub.py: resolve_engine_model)")
        return self.model_dir
