"""Configuration: one frozen dataclass per layer; CLI flags and their help come from the fields.

Every field's `metadata["help"]` is its flag's help text; `--snake-case` of the field name is the
flag, and the same snake_case name is the offline engine argument (`LLM(max_num_seqs=8)`).
Derived values are properties; validation lives in `__post_init__`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, get_type_hints

from mmserve.kv_cache_dtype import check_kv_cache_dtype

if TYPE_CHECKING:
    from mmserve.multimodal.media import MediaLimits
    from mmserve.multimodal.video import VideoLimits

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cuda", "cpu")
_ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")  # models/attention/backend.py
_CPU_ACTIVATION_QUANT = ("none", "int8")  # models/quantization/q8_gemv.py


def _opt(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ModelConfig:
    model: str = _opt("builtin:tiny-llava", "Model: a Hugging Face repo id (org/name: downloaded once, or found in the "
                      "Hugging Face cache), a checkpoint directory, or a builtin name.")
    revision: str | None = _opt(None, "Branch, tag or commit of a repo id's checkpoint (default: its main branch).")
    tokenizer_revision: str | None = _opt(
        None, "Branch, tag or commit the tokenizer files and chat template of a repo id come from (default: "
        "--revision).")
    download_dir: str | None = _opt(
        None, "Where repo ids are downloaded to and looked up, laid out as the Hugging Face cache (default: "
        "HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub).")
    generation_config: str = _opt(
        "auto", "Default sampling parameters of requests that do not set them: auto (the checkpoint's "
        "generation_config.json: temperature, top_p, top_k, repetition_penalty, max_new_tokens as max_tokens), vllm "
        "(vLLM's neutral defaults), or a directory holding a generation_config.json. Every eos_token_id the file "
        "lists stops generation either way.")
    model_dir: str | None = _opt(
        None, "The checkpoint directory --model resolves to (set once by models/hub.py, not a flag).", cli=False)
    dtype: str = _opt("auto", "Weights and activations dtype (auto: bfloat16 on CUDA, float32 on CPU).",
                      choices=_DTYPES)
    max_model_len: int | None = _opt(None, "Longest prompt + output in tokens (default: the model's).")
    seed: int = _opt(0, "Seed of the engine's random state (requests without their own seed).")
    attention_backend: str = _opt("auto", "How attention is computed: torch (PyTorch's SDPA), triton (our Triton "
                                  "kernels), flashinfer (when installed); auto: triton on CUDA, torch on CPU.",
                                  choices=_ATTENTION_BACKENDS)
    quantization: str | None = _opt(None, "Quantize a float checkpoint's decoder weights at load: fp8 (per output "
                                    "row). Quantized checkpoints are read from their quantization_config without it.",
                                    choices=("fp8",))
    cpu_activation_quant: str = _opt(
        "none", "On the CPU, multiply a 4-bit (AWQ / W4A16) checkpoint's weights by activations rounded to int8 per "
        "group (integer dot products, as llama.cpp's Q4_0 x Q8_0) in steps of up to 256 tokens (decode, short "
        "prefill chunks): faster, not exact. none keeps activations float32 (exact to the dequantized model); "
        "longer steps stay exact either way. Refused on a GPU, with a dtype other than float32, or with a "
        "checkpoint without int4 layers.",
        choices=_CPU_ACTIVATION_QUANT)

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
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2; got {self.max_model_len}")
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            raise ValueError(f"generation_config must be auto, vllm or a directory; got {self.generation_config!r}")

    @property
    def checkpoint_dir(self) -> str:
        """The checkpoint directory `model` resolved to (`models/hub.py: resolve_engine_model`)."""
        if self.model_dir is None:
            raise RuntimeError(f"model {self.model!r} is not resolved yet (models/hub.py: resolve_engine_model)")
        return self.model_dir


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _opt(16, "Tokens per KV cache block.")
    kv_cache_memory_gb: float | None = _opt(
        None, "Memory for the KV cache in GiB, per tensor-parallel rank (ignored with --num-kv-blocks; default: "
        "1 on CPU, on CUDA what --gpu-memory-utilization leaves).")
    num_kv_blocks: int | None = _opt(None, "Exact number of KV cache blocks (overrides --kv-cache-memory-gb).")
    enable_prefix_caching: bool = _opt(True, "Reuse the KV blocks of identical prompt prefixes (images included).")
    enable_last_block_caching: bool = _opt(
        True, "With prefix caching, also keep each prompt's last KV block (full or partial): an identical "
        "prompt copies it and computes only its last token, instead of up to a block of tokens.")
    enable_partial_block_caching: bool = _opt(
        True, "With prefix caching, also reuse the leading tokens of a computed block after the full-block hits (the "
        "same image, then another question): the block is copied and only the tokens after the common prefix are "
        "computed, instead of up to a block of them.")
    enable_first_token_caching: bool = _opt(
        True, "With last-block caching, also keep the first token of each greedy prompt (no penalties, "
        "logit_bias, min_tokens or grammar): an identical greedy prompt asking no logprobs takes it and runs no "
        "forward for its first token.")
    cache_verify_rate: float = _opt(
        0.0, "Share of requests (0 to 1) that, when a cache served them, are run once more with every cache "
        "bypassed, at the lowest priority after they finish, to check the caches changed nothing (mismatches are "
        "logged and counted in mmserve_cache_verify_total).")
    prefix_caching_hash_algo: str = _opt(
        "sha256", "Block hash: sha256 or blake3 (collision-resistant), xxh3_128 (fast, not collision-resistant).",
        choices=("sha256", "blake3", "xxh3_128"))
    kv_events_config: dict[str, Any] | None = _opt(
        None, 'Publish the prefix cache\'s changes for external routers, in vLLM\'s format and names, as JSON: '
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"} '
        "(kv_events_config.py).", parse=json.loads)
    kv_cache_dtype: str = _opt(
        "auto", "KV cache element type: auto (the model's dtype), float16 or bfloat16 (half a float32 model's cache "
        "bytes; K/V rounded as they are written, read widened: not exact). vLLM's fp8 values are refused "
        "(kv_cache_dtype.py).")

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_events_config is not None:
            from mmserve.kv_events_config import KVEventsConfig

            KVEventsConfig.from_dict(self.kv_events_config)  # a ValueError names the fault
        if self.prefix_caching_hash_algo not in ("sha256", "blake3", "xxh3_128"):
            raise ValueError(f"unknown prefix_caching_hash_algo {self.prefix_caching_hash_algo!r}")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024]; got {self.block_size}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be positive; got {self.kv_cache_memory_gb}")
        if not 0.0 <= self.cache_verify_rate <= 1.0:
            raise ValueError(f"cache_verify_rate must be in [0, 1]; got {self.cache_verify_rate}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1; got {self.num_kv_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = _opt(64, "Most requests running in one step.")
    max_num_batched_tokens: int = _opt(4096, "Token budget of one step (prefill chunks + decodes).")
    max_num_encoder_input_tokens: int | None = _opt(
        None, "Vision encoder budget of one step in embedding tokens (default: --max-num-batched-tokens; "
        "never below one image's).")
    encoder_cache_tokens: int | None = _opt(
        None, "Encoder outputs kept for reuse across requests, in embedding tokens (default: "
        "--max-num-batched-tokens; never below one image's); 0 keeps an output only while running "
        "requests use it (no reuse by later requests).")
    disable_chunked_mm_input: bool = _opt(
        False, "Never split an image's placeholder tokens across steps (--max-num-batched-tokens must hold one image).")
    max_grammar_compile_s: float = _opt(
        10.0, "Longest a structured-output grammar may take to compile (off the engine step); a request "
        "whose grammar takes longer is refused.")
    stalled_stream_abort_s: float = _opt(
        60.0, "A request whose caller has read none of its outputs for this long while new ones arrive (a "
        "stream nobody reads) is aborted with one log line; until then its unread outputs are merged into one.")

    def __post_init__(self) -> None:
        if not self.stalled_stream_abort_s > 0:
            raise ValueError(f"stalled_stream_abort_s must be positive; got {self.stalled_stream_abort_s}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1; got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1; got {self.max_num_batched_tokens}")
        if self.max_num_encoder_input_tokens is not None and self.max_num_encoder_input_tokens < 1:
            raise ValueError("max_num_encoder_input_tokens must be at least 1; "
                             f"got {self.max_num_encoder_input_tokens}")
        if not self.max_grammar_compile_s > 0:
            raise ValueError(f"max_grammar_compile_s must be positive; got {self.max_grammar_compile_s}")
        if self.encoder_cache_tokens is not None and self.encoder_cache_tokens < 0:
            raise ValueError(f"encoder_cache_tokens must not be negative; got {self.encoder_cache_tokens}")


def compute_encoder_budget(config: SchedulerConfig, max_item_tokens: int) -> tuple[int, int]:
    """(encoder compute budget per step, encoder cache size), both in embedding tokens.

    Each is its flag (`--max-num-encoder-input-tokens`, `--encoder-cache-tokens`; unset or 0:
    `--max-num-batched-tokens`), raised to the largest item's `max_item_tokens` so that every
    item can run. With `--disable-chunked-mm-input` an item's placeholders must fit one step's
    token budget: a ValueError naming the flag to raise when the largest does not.
    """
    if config.disable_chunked_mm_input and max_item_tokens > config.max_num_batched_tokens:
        raise ValueError(f"with --disable-chunked-mm-input an image's {max_item_tokens} placeholder tokens must fit "
                         f"one step, but --max-num-batched-tokens is {config.max_num_batched_tokens}; raise "
                         f"--max-num-batched-tokens to at least {max_item_tokens}")
    compute = max(config.max_num_encoder_input_tokens or config.max_num_batched_tokens, max_item_tokens)
    cache_size = max(config.encoder_cache_tokens or config.max_num_batched_tokens, max_item_tokens)
    return compute, cache_size


@dataclass(frozen=True)
class MultiModalConfig:
    limit_mm_per_prompt: dict[str, int] = _opt(
        {"image": 4}, 'Most items per prompt by modality, as JSON: {"image": 4, "video": 1} (video defaults '
        'to 1).', parse=json.loads)
    allowed_local_media_path: str | None = _opt(
        None, "Directory under which file:// images may be read (default: none may).")
    max_media_bytes: int = _opt(20 << 20, "Largest encoded image in bytes.")
    mm_processor_cache_gb: float = _opt(4.0, "P0's processed-item cache in GiB (0 turns it off).")
    mm_ipc_cache_gb: float = _opt(4.0, "P0 -> P1 item cache in GiB, mirrored on both sides (0 turns it off).")
    mm_cache_type: str | None = _opt(
        None, "How processed items reach P1: lru (the IPC cache) or shm (shared memory). Default: shm with "
        "--api-server-count > 1 when /dev/shm holds --mm-shm-cache-gb (one store for the node), else lru.",
        choices=("lru", "shm"))
    mm_shm_cache_gb: float = _opt(4.0, "Shared-memory object store size in GiB (with --mm-cache-type shm).")
    mm_shm_max_object_mb: float = _opt(128.0, "Largest item the shared-memory store takes, in MiB.")
    max_media_pixels: int = _opt(40_000_000, "Largest decoded image in pixels (width x height).")
    allowed_media_domains: list[str] = _opt(
        [], "Hosts http(s) images may be fetched from, comma-separated or repeated (default: none).",
        parse=lambda text: _comma_list(text), action="extend")
    allow_private_media_addresses: bool = _opt(
        False, "Let an allowed media host resolve to loopback, link-local or private addresses (default: such "
        "a fetch is refused, so a request cannot reach this machine or its network through an image URL).")
    max_video_bytes: int = _opt(256 << 20, "Largest encoded video in bytes.")
    max_video_frames: int = _opt(768, "Most frames a video may keep after sampling.")
    max_video_duration_s: float = _opt(3600.0, "Longest video in seconds.")
    max_video_pixels: int = _opt(1 << 28, "Most pixels a video's sampled frames may hold together (frames x width "
                                 "x height at the source size), checked from the container's metadata before "
                                 "decoding.")
    media_io_kwargs: dict[str, Any] = _opt(
        {}, 'Server-wide media loading options, as JSON: {"video": {"fps": 1, "num_frames": 16, "min_frames": 4, '
        '"max_frames": 64, "min_pixels": 4096, "max_pixels": 65536}} (a request\'s media_io_kwargs and '
        'mm_processor_kwargs override them).', parse=json.loads)

    def __post_init__(self) -> None:
        if isinstance(self.allowed_media_domains, str):
            object.__setattr__(self, "allowed_media_domains", _comma_list(self.allowed_media_domains))
        for modality, limit in self.limit_mm_per_prompt.items():
            if modality not in ("image", "video"):
                raise ValueError(f"limit_mm_per_prompt: unknown modality {modality!r} (image or video)")
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
                raise ValueError(f"limit_mm_per_prompt[{modality!r}] must be a non-negative integer")
        if self.max_media_bytes < 1 or self.max_media_pixels < 1:
            raise ValueError("max_media_bytes and max_media_pixels must be positive")
        if (self.max_video_bytes < 1 or self.max_video_frames < 1 or self.max_video_duration_s <= 0
                or self.max_video_pixels < 1):
            raise ValueError("max_video_bytes, max_video_frames, max_video_duration_s and max_video_pixels must be "
                             "positive")
        if not isinstance(self.media_io_kwargs, dict) or set(self.media_io_kwargs) - {"video"}:
            raise ValueError('media_io_kwargs takes only the key "video" (an object of video options)')
        for name in ("mm_processor_cache_gb", "mm_ipc_cache_gb", "mm_shm_cache_gb", "mm_shm_max_object_mb"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative; got {getattr(self, name)}")
        if self.mm_cache_type not in (None, "lru", "shm"):
            raise ValueError(f"mm_cache_type must be lru or shm; got {self.mm_cache_type!r}")

    def media_limits(self) -> MediaLimits:
        from mmserve.multimodal.media import MediaLimits

        return MediaLimits(max_bytes=self.max_media_bytes, max_pixels=self.max_media_pixels,
                           allowed_local_media_path=self.allowed_local_media_path,
                           allowed_media_domains=tuple(self.allowed_media_domains),
                           allow_private_addresses=self.allow_private_media_addresses)

    @property
    def max_images(self) -> int:
        return self.limit_mm_per_prompt.get("image", 4)

    @property
    def max_videos(self) -> int:
        return self.limit_mm_per_prompt.get("video", 1)

    def video_limits(self) -> VideoLimits:
        from mmserve.multimodal.video import VideoLimits

        return VideoLimits(max_frames=self.max_video_frames, max_duration_s=self.max_video_duration_s,
                           max_pixels=self.max_media_pixels, max_total_pixels=self.max_video_pixels)

    # ---- the item transport, decided once: P0 and P1 both read these ----------------------------

    @property
    def uses_shm(self) -> bool:
        """Items reach P1 (and TP workers) through the shared-memory store, not the IPC cache (an
        unset `mm_cache_type` is lru here; `deployment_defaults.py` decides it for a server)."""
        return self.mm_cache_type == "shm" and self.mm_shm_cache_gb > 0

    @property
    def ipc_cache_bytes(self) -> int:
        """Capacity of the mirrored IPC cache, the same on both sides: 0 under shm (P1 keeps no
        receiver entries then, neither inline items nor views of shared memory)."""
        return 0 if self.mm_cache_type == "shm" else int(self.mm_ipc_cache_gb * (1 << 30))


_DP_BACKENDS = ("mp", "ray")
_DP_ROUTINGS = ("cache_aware", "load")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = _opt(
        1, "Worker processes the model is sharded over (Megatron-style); 1 runs it inside the engine core.")
    data_parallel_size: int = _opt(
        1, "Engine-core processes (ranks), each with its own scheduler, KV, prefix and encoder caches "
        "and its own tensor-parallel workers; requests are routed between them.")
    data_parallel_backend: str = _opt(
        "mp", "How ranks are started: mp (local processes) or ray (actors in a placement group per rank; "
        "pip install mmserve[ray]).", choices=_DP_BACKENDS)
    ray_address: str | None = _opt(None, "Ray cluster to join with --data-parallel-backend ray "
                                   "(default: RAY_ADDRESS, else a local cluster is started).")
    dp_routing: str = _opt(
        "cache_aware", "How a request picks its rank: cache_aware (where its prefix blocks and images are "
        "cached, weighed against load) or load (least loaded).", choices=_DP_ROUTINGS)
    dp_imbalance_slack: int = _opt(
        4, "Routing guard: a rank chosen for its cache may carry at most this many in-flight requests "
        "(plus half the least-loaded rank's) more than the least-loaded rank.")
    engine_restart_limit: int = _opt(
        3, "Restarts per rank after its engine core dies (requests that showed the client nothing "
        "move to a live rank meanwhile); 0: a dead engine stops the server.")
    api_server_count: int = _opt(
        1, "API-server processes sharing the listening socket; every one reaches every engine core, and the "
        "processor and IPC caches' budgets are split between them (one budget in all, not one each).")
    data_parallel_rank: int = _opt(0, "This engine core's rank (set per process, not a flag).", cli=False)
    api_server_index: int = _opt(0, "This API server's index (set per process, not a flag).", cli=False)
    engine_restarts: int = _opt(0, "How often this rank's engine core was restarted (set per process, not a flag).",
                                cli=False)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1; got {self.tensor_parallel_size}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1; got {self.data_parallel_size}")
        if self.data_parallel_backend not in _DP_BACKENDS:
            raise ValueError(f"data_parallel_backend must be mp or ray; got {self.data_parallel_backend!r}")
        if self.dp_routing not in _DP_ROUTINGS:
            raise ValueError(f"dp_routing must be cache_aware or load; got {self.dp_routing!r}")
        if self.dp_imbalance_slack < 0 or self.engine_restart_limit < 0:
            raise ValueError("dp_imbalance_slack and engine_restart_limit must not be negative")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, {self.data_parallel_size}); "
                             f"got {self.data_parallel_rank}")
        if self.api_server_count < 1:
            raise ValueError(f"api_server_count must be at least 1; got {self.api_server_count}")
        if not 0 <= self.api_server_index < self.api_server_count:
            raise ValueError(f"api_server_index must be in [0, {self.api_server_count}); got {self.api_server_index}")
        if self.api_server_count > 1 and self.data_parallel_backend == "ray":
            raise ValueError("--api-server-count > 1 runs with --data-parallel-backend mp only, for now")

    def for_rank(self, rank: int, restarts: int = 0) -> ParallelConfig:
        """This config as the engine core of `rank` gets it (its `restarts` so far)."""
        return dataclasses.replace(self, data_parallel_rank=rank, engine_restarts=restarts)


def _graph_sizes(text: str) -> list[int]:
    """`"1,2,4"` -> [1, 2, 4] (the --cuda-graph-sizes flag)."""
    return [int(item) for item in _comma_list(text)]


@dataclass(frozen=True)
class DeviceConfig:
    """Where each rank runs and how its GPU memory and decode steps are set up."""

    device: str = _opt("auto", "Device of every rank: cuda (rank r on GPU r), cpu, or auto (cuda when present).",
                       choices=_DEVICES)
    gpu_memory_utilization: float = _opt(
        0.9, "On CUDA, the share of each GPU's memory mmserve may use: weights, the activations of the largest "
        "step (profiled at start) and the KV cache, which gets the rest (--num-kv-blocks overrides it, as does "
        "an explicit --kv-cache-memory-gb). Ignored on CPU.")
    enforce_eager: bool = _opt(False, "Never capture CUDA graphs, and on the CPU never run a decode step's layers "
                               "in one compiled C call: every decode step runs layer by layer.")
    cuda_graph_sizes: list[int] = _opt(
        [], "Decode batch sizes captured as CUDA graphs, comma-separated (default: 1, 2, 4, 8 and multiples "
        "of 8 up to --max-num-seqs); a batch runs in the smallest graph that holds it, padded.",
        parse=_graph_sizes)

    def __post_init__(self) -> None:
        if self.device not in _DEVICES and self.device != "meta":  # meta: structure only (device tests)
            raise ValueError(f"device must be one of {', '.join(_DEVICES)}; got {self.device!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        if any(size < 1 for size in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be positive; got {self.cuda_graph_sizes}")

    def graph_sizes(self, max_num_seqs: int) -> list[int]:
        """The decode batch sizes to capture, ascending (the flag's, else 1, 2, 4, 8, 16, ...)."""
        if self.cuda_graph_sizes:
            return sorted(set(self.cuda_graph_sizes))
        sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 8, 8))
        return sorted({min(s, max_num_seqs) for s in sizes})


_LAYERS: dict[str, Any] = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                           "multimodal": MultiModalConfig, "parallel": ParallelConfig, "device": DeviceConfig}


@dataclass(frozen=True)
class EngineConfig:
    """All layers' configs; each process gets its own copy."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)

    def __post_init__(self) -> None:
        for layer in (self.model, self.cache, self.scheduler, self.multimodal, self.parallel, self.device):
            check_finite(layer)

    @property
    def needs_item_hash(self) -> bool:
        """Whether any layer keys on an item's content hash (processor, IPC or shm store, encoder
        cache across requests, prefix blocks); if none does, items get random ids instead."""
        mm = self.multimodal
        return (mm.mm_processor_cache_gb > 0 or mm.ipc_cache_bytes > 0 or mm.uses_shm
                or self.cache.enable_prefix_caching or self.scheduler.encoder_cache_tokens != 0)

    def for_rank(self, rank: int, restarts: int = 0) -> EngineConfig:
        """The config the engine core of data-parallel `rank` (and its workers) runs with."""
        return dataclasses.replace(self, parallel=self.parallel.for_rank(rank, restarts))

    def for_api_server(self, index: int) -> EngineConfig:
        """The config API server `index` runs with."""
        return dataclasses.replace(self, parallel=dataclasses.replace(self.parallel, api_server_index=index))

    @property
    def ipc_cache_bytes_per_server(self) -> int:
        """Each API server's share of the IPC cache: its sender's capacity and that of its receiver
        in every engine core (`MultiModalConfig.ipc_cache_bytes` split evenly)."""
        return self.multimodal.ipc_cache_bytes // self.parallel.api_server_count

    @property
    def processor_cache_bytes_per_server(self) -> int:
        """Each API server's share of `--mm-processor-cache-gb`."""
        return int(self.multimodal.mm_processor_cache_gb * (1 << 30)) // self.parallel.api_server_count

    @classmethod
    def from_kwargs(cls, **engine_args: Any) -> EngineConfig:
        """Build from flat snake_case engine arguments; unknown names are a ValueError."""
        parts: dict[str, dict[str, Any]] = {name: {} for name in _LAYERS}
        for key, value in engine_args.items():
            layer = _layer_of(key)
            if layer is None:
                raise ValueError(f"unknown engine argument {key!r}")
            parts[layer][key] = value
        return cls(**{name: _LAYERS[name](**kw) for name, kw in parts.items()})


def check_finite(config: Any) -> None:
    """ValueError naming the first float field of a config dataclass that is NaN or infinite."""
    for f in fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name} (--{f.name.replace('_', '-')}) must be a finite number; got {value}")


def _layer_of(key: str) -> str | None:
    for name, layer in _LAYERS.items():
        if key in {f.name for f in fields(layer)}:
            return name
    return None


def add_cli_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per config field (`--max-num-seqs`), help and type from the field."""
    for layer in _LAYERS.values():
        hints = get_type_hints(layer)
        for f in fields(layer):
            if f.name in skip or not f.metadata.get("cli", True):
                continue
            flag = "--" + f.name.replace("_", "-")
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[operator]
            kw: dict[str, Any] = {"default": default, "help": f.metadata["help"], "dest": f.name}
            if hints[f.name] is bool:
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = f.metadata.get("parse") or _scalar_type(hints[f.name])
                if "choices" in f.metadata:
                    kw["choices"] = f.metadata["choices"]
                if "action" in f.metadata:  # e.g. "extend": a repeatable flag whose parse returns a list
                    kw["action"] = f.metadata["action"]
            parser.add_argument(flag, **kw)


def engine_args_from_cli(ns: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The engine arguments held by a parsed namespace."""
    return {f.name: getattr(ns, f.name) for layer in _LAYERS.values() for f in fields(layer)
            if f.name not in skip and f.metadata.get("cli", True) and hasattr(ns, f.name)}


def _comma_list(text: str) -> list[str]:
    """`"a.com, b.com"` -> `["a.com", "b.com"]` (blank items dropped)."""
    return [item.strip() for item in text.split(",") if item.strip()]


def _scalar_type(hint: Any) -> Any:
    for t in (int, float, str):
        if hint is t or t in getattr(hint, "__args__", ()):
            return t
    return str
