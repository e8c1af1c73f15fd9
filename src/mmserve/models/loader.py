"""Loading a Hugging Face checkpoint directory: config, the family's model class (models/registry.py),
then safetensors weights by name.

Weights stream to the rank's device tensor by tensor: parameters are allocated there (in the
target dtype) and each checkpoint tensor is read into host memory alone and copied in, so no
whole CPU copy of the model ever exists. On the `meta` device nothing is read (structure only).

Under tensor parallelism each rank reads only its shard: a parameter whose module lists it in
`tp_shards` is read with `safe_open(...).get_slice(name)[...]` over its `Shard` (zero-padded
where the shard runs past the checkpoint, e.g. vocab rows), everything else whole. A list of
`Shard`s (a fused QKV: the rank's rows of q, k and v) is read range by range and concatenated.

One file (`model.safetensors`) or several with `model.safetensors.index.json`. Names in the
module-tree layout (`model.language_model.*`) load as they are; each family renames its older
saved layouts (`canonical_name`) and names the checkpoint tensors it does not need (`is_unused`).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from mmserve.models.attention.backend import attention_backend
from mmserve.models.hf_config import load_model_config
from mmserve.models.parallel import SINGLE, ParallelLinear, Shard, TensorParallel, fuse_projections
from mmserve.models.quantization.base import keeps_dtype
from mmserve.models.quantization.select import keep_half_head
from mmserve.models.quantization.config import read_quant_spec
from mmserve.models.quantization.select import assign_methods
from mmserve.models.registry import model_class
from mmserve.models.vlm import VisionLanguageModel

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}



def load_model(model_dir: str, dtype: str | torch.dtype = "float32", tp: TensorParallel = SINGLE,
               device: str | torch.device = "cpu", attention: str = "torch",
               quantization: str | None = None, activation_quant: str = "none") -> VisionLanguageModel:
    """Build the model (this rank's shard of it) from `model_dir/config.json` on `device` and load
    its weights (eval mode, no grad); it attends with the `attention` backend (`--attention-backend`)
    chosen for `device`. Its linear layers take the methods the checkpoint's `quantization_config`
    (or `quantization`, `--quantization`) names (models/quantization/), int4 ones multiplying
    GEMV-sized steps by int8-rounded activations with `activation_quant` "int8"
    (`--cpu-activation-quant`); sibling projections are fused (`fuse_projections`). A quantized
    checkpoint's 16-bit LM head stays 16-bit on the CPU (`keep_half_head`). `model.weight_bytes`:
    the bytes its parameters hold."""
    cfg = load_model_config(model_dir)
    cls = model_class(cfg)
    cls.check_shardable(cfg, tp)
    spec = read_quant_spec(model_dir, quantization)
    dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    device = torch.device(device)
    with torch.device("meta"):  # no initialisation: every value comes from the checkpoint
        model = cls(cfg, tp)
        names = checkpoint_module_names(model_dir, cls) if spec is not None else {}
        assign_methods(model, spec, names, activation_quant,
                       stored_quantized(model_dir) if spec is not None and spec.by_tensors else None)
        if spec is not None and device.type == "cpu" and dtype == torch.float32 and not cfg.tie_word_embeddings:
            keep_half_head(model, checkpoint_dtype(model_dir, cls, "lm_head.weight"))
    if device.type != "meta":
        _materialize(model, dtype, device)
        _load_weights(model, cls, cfg, model_dir, dtype, device)
        _process_weights(model)
    _move_tensor_attributes(model, device)
    _cast_floats(model, dtype)
    model = model.eval().requires_grad_(False)
    if device.type != "meta":
        fuse_projections(model)
    model.attention = attention_backend(attention, device)
    model.weight_bytes = weight_bytes(model)
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's parameters hold (tied ones once): its resident weights."""
    seen = {id(p): p for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in seen.values())


def checkpoint_module_names(model_dir: str, cls) -> dict[str, str]:
    """Module name in this model -> the checkpoint's name for it (older layouts differ), from
    the checkpoint's tensor names: what `quantization_config`'s module lists name."""
    names = {}
    for name, _ in iter_checkpoint(model_dir):
        module = name.rpartition(".")[0]
        names[cls.canonical_name(name).rpartition(".")[0]] = module
    return names


def stored_quantized(model_dir: str) -> set[str]:
    """The checkpoint's names of the modules it holds quantized (a `qweight` of theirs): GPTQ's
    config names none, its checkpoints leave the vision tower dense by storing it so."""
    return {name.removesuffix(".qweight") for name, _ in iter_checkpoint(model_dir) if name.endswith(".qweight")}


_SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


def checkpoint_dtype(model_dir: str, cls, name: str) -> torch.dtype | None:
    """The dtype the checkpoint stores tensor `name` (this model's name for it) in, or None."""
    for stored, tensor_slice in iter_checkpoint(model_dir):
        if cls.canonical_name(stored) == name:
            return _SAFETENSORS_DTYPES.get(tensor_slice.get_dtype())
    return None


def _linear_layers(model: torch.nn.Module) -> dict[str, ParallelLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, ParallelLinear)}


def _allocate(layer: torch.nn.Module, attr: str, param: torch.nn.Parameter, dtype: torch.dtype,
              device: torch.device) -> torch.nn.Parameter:
    """The meta parameter `attr` of `layer` given memory on `device` (as `_materialize` would)."""
    new = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype if keeps_dtype(param) else dtype,
                                         device=device), requires_grad=False)
    new.__dict__.update(param.__dict__)
    setattr(layer, attr, new)
    return new


def _process_layer(layer: ParallelLinear) -> None:
    """The layer's loaded checkpoint tensors into its method's resident form (once)."""
    if not getattr(layer, "weights_processed", False):
        with torch.no_grad():
            layer.method.process_weights(layer)
        layer.weights_processed = True


def _process_weights(model: torch.nn.Module) -> None:
    """Each linear layer not processed while loading (`_process_layer`)."""
    for layer in _linear_layers(model).values():
        _process_layer(layer)


def _cast_floats(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """`model.to(dtype)` for the tensors in a standard float dtype, save those a method keeps
    (FP8 weights, float32 scales: `keeps_dtype`)."""
    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if keeps_dtype(param) or param.dtype == dtype:
                continue
            if id(param) not in done:
                done[id(param)] = torch.nn.Parameter(param.detach().to(dtype), requires_grad=False)
            module.register_parameter(name, done[id(param)])
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None and buffer.dtype.is_floating_point and not keeps_dtype(buffer):
                module.register_buffer(name, buffer.to(dtype))


KV_CACHE_SCALES = (".k_scale", ".v_scale", ".q_scale", ".prob_scale", ".kv_scale")


def _load_weights(model: VisionLanguageModel, cls, cfg, model_dir: str, dtype: torch.dtype,
                  device: torch.device) -> None:
    """Copy every checkpoint tensor (this rank's slice of it) into its parameter, one at a time;
    a linear layer whose tensors are all in is turned into its method's resident form at once, and
    a parameter left on the meta device (`load_lazily`: a float weight quantized at load) is
    allocated only then, so at most one such float weight exists at a time."""
    params = dict(model.named_parameters())
    shards, layers = _shards(model), _linear_layers(model)
    loaded: set[str] = set()
    for name, tensor_slice in iter_checkpoint(model_dir):
        name = cls.canonical_name(name)
        if name in params:
            param = params[name]
            prefix, _, attr = name.rpartition(".")
            if param.is_meta:
                param = _allocate(layers[prefix], attr, param, dtype, device)
            with torch.no_grad():
                _copy_checked(param, _read(tensor_slice, shards.get(name)), name, shards.get(name))
            loaded.add(name)
            if prefix in layers and all(f"{prefix}.{n}" in loaded for n in layers[prefix].weight_names):
                _process_layer(layers[prefix])
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # some tied checkpoints also store the head: the model's is the embedding table
        elif name.endswith(KV_CACHE_SCALES):
            continue  # an FP8 KV cache's scales (compressed-tensors' kv_cache_scheme, ModelOpt's): not one here
        elif not cls.is_unused(name, cfg):
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
    missing = set(params) - loaded
    if cfg.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint {model_dir!r} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def _materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give each parameter of a model built on the meta device uninitialised memory on `device`
    (floating ones in `dtype`), tied ones staying tied: what `Module.to_empty` does, without its
    `empty_like` of a meta tensor, which imports sympy (part of every engine core's start)."""
    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if getattr(param, "load_lazily", False):
                continue  # allocated when its tensor is read (`_load_weights`)
            if id(param) not in done:
                kind = param.dtype if keeps_dtype(param) else dtype
                done[id(param)] = torch.nn.Parameter(torch.empty(param.shape, dtype=kind, device=device),
                                                     requires_grad=param.requires_grad)
                done[id(param)].__dict__.update(param.__dict__)  # its method's marks (`register`)
            module.register_parameter(name, done[id(param)])


def _move_tensor_attributes(model: torch.nn.Module, device: torch.device) -> None:
    """Move the plain tensor attributes modules keep beside their parameters (rotary inverse
    frequencies, built on the host) to `device`."""
    if device.type == "cpu":
        return
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                setattr(module, name, value.to(device))


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


ShardSpec = Shard | list[Shard]


def _shards(model: torch.nn.Module) -> dict[str, ShardSpec]:
    """Parameter name -> its checkpoint slice, for every sharded parameter."""
    found = {}
    for prefix, module in model.named_modules():
        for pname, shard in getattr(module, "tp_shards", {}).items():
            found[f"{prefix}.{pname}" if prefix else pname] = shard
    return found


def _read(tensor_slice, shard: ShardSpec | None) -> torch.Tensor:
    """The whole tensor, or the shard's indices along its dim (zero-padded past the shape); a
    list of shards along one dim is read piece by piece and concatenated."""
    if shard is None:
        return tensor_slice[...]  # `[:]` fails on a scalar (a per-tensor scale stored as [])
    if isinstance(shard, list):
        return torch.cat([_read(tensor_slice, s) for s in shard], dim=shard[0].dim)
    index = (slice(None),) * shard.dim + (slice(shard.start, shard.start + shard.length),)
    return tensor_slice[index]


def _copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str, shard: ShardSpec | None = None) -> None:
    """Copy `tensor` in; a shard shorter than `param` along its dim (padded vocab rows) is zero-filled."""
    expected = list(param.shape)
    if isinstance(shard, list):
        shard = Shard(shard[0].dim, 0, sum(s.length for s in shard))
    if shard is not None:
        expected[shard.dim] = shard.length
    if getattr(param, "any_shape_of_one", False) and tensor.numel() == 1:
        tensor = tensor.reshape(expected)  # a per-tensor scale, stored as [] or [1]
    elif getattr(param, "column_or_flat", False) and tensor.dim() == 1:
        tensor = tensor[:, None]  # a scale per row, stored [out] (ModelOpt) rather than [out, 1]
    if list(tensor.shape) != expected:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")
    if shard is None or shard.length == param.shape[shard.dim]:
        param.copy_(tensor)
    else:
        param.zero_()
        param.narrow(shard.dim, 0, shard.length).copy_(tensor)
