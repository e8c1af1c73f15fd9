"""Loading a Hugging Face LLaVA directory: config, then safetensors weights by name.

Under tensor parallelism each rank reads only its shard: a parameter whose module lists it in
`tp_shards` is read with `safe_open(...).get_slice(name)[...]` over its `Shard` (zero-padded
where the shard runs past the checkpoint, e.g. vocab rows), everything else whole.

One file (`model.safetensors`) or several with `model.safetensors.index.json`. Names in the
module-tree layout (`model.language_model.*`) load as they are; the saved layouts
(`language_model.model.*`, `vision_tower.vision_model.*` or `vision_tower.*`) are renamed. Weights of vision layers past the deepest selected
feature layer, and the vision tower's post-norm, are not needed and skipped.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from mmserve.models.hf_config import LlavaModelConfig, load_model_config
from mmserve.models.llava import LlavaForConditionalGeneration
from mmserve.models.parallel import SINGLE, Shard, TensorParallel, check_shardable

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_OLD_PREFIXES = (  # saved layouts -> the module tree (first match wins)
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("vision_tower.vision_model.", "model.vision_tower."),
    ("vision_tower.", "model.vision_tower."),  # what transformers 5 writes
    ("multi_modal_projector.", "model.multi_modal_projector."),
)


def load_model(model_dir: str, dtype: str = "float32", tp: TensorParallel = SINGLE) -> LlavaForConditionalGeneration:
    """Build the model (this rank's shard of it) from `model_dir/config.json` and load its
    weights (eval mode, no grad)."""
    cfg = load_model_config(model_dir)
    check_shardable(cfg, tp)
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(cfg, tp)
    model = model.to_empty(device="cpu")
    params = dict(model.named_parameters())
    shards = _shards(model)
    loaded: set[str] = set()
    for name, tensor_slice in iter_checkpoint(model_dir):
        name = canonical_name(name)
        if name in params:
            with torch.no_grad():
                _copy_checked(params[name], _read(tensor_slice, shards.get(name)), name, shards.get(name))
            loaded.add(name)
        elif not _is_unused(name, cfg):
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
    missing = set(params) - loaded
    if cfg.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint {model_dir!r} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    return model.to(_DTYPES[dtype]).eval().requires_grad_(False)


def iter_checkpoint(model_dir: str):
    """Yield (name, lazy slice) for every tensor in the directory's safetensors files; index
    the slice (`[:]`, `[a:b]`, `[:, a:b]`) to read the bytes."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{model_dir!r} has no *.safetensors weights")
    for file in files:
        with safe_open(os.path.join(model_dir, file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def _shards(model: torch.nn.Module) -> dict[str, Shard]:
    """Parameter name -> its checkpoint slice, for every sharded parameter."""
    found = {}
    for prefix, module in model.named_modules():
        for pname, shard in getattr(module, "tp_shards", {}).items():
            found[f"{prefix}.{pname}" if prefix else pname] = shard
    return found


def _read(tensor_slice, shard: Shard | None) -> torch.Tensor:
    """The whole tensor, or the shard's indices along its dim (zero-padded past the shape)."""
    if shard is None:
        return tensor_slice[:]
    index = (slice(None),) * shard.dim + (slice(shard.start, shard.start + shard.length),)
    return tensor_slice[index]


def canonical_name(name: str) -> str:
    for old, new in _OLD_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _is_unused(name: str, cfg: LlavaModelConfig) -> bool:
    prefix = "model.vision_tower."
    if not name.startswith(prefix):
        return False
    rest = name[len(prefix):]
    if rest.startswith("post_layernorm.") or rest == "embeddings.position_ids":
        return True
    if rest.startswith("encoder.layers."):
        return int(rest.split(".")[2]) >= max(cfg.feature_layers)
    return False


def _copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str, shard: Shard | None = None) -> None:
    """Copy `tensor` in; a shard shorter than `param` along its dim (padded vocab rows) is zero-filled."""
    expected = list(param.shape)
    if shard is not None:
        expected[shard.dim] = shard.length
    if list(tensor.shape) != expected:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")
    if shard is None or shard.length == param.shape[shard.dim]:
        param.copy_(tensor)
    else:
        param.zero_()
        param.narrow(shard.dim, 0, shard.length).copy_(tensor)
