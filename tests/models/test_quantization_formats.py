"""The quantized formats' packing, loading and refusals, without the engine: the test packer
against an unpacking written from each format's description, every loaded layer's weight
against the float weight its checkpoint stands for (bit for bit), resident bytes, and the
one-line refusal of what is not read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.quant_checkpoints import (AWQ_ORDER, FORMATS, INDEX, VISION, W8A8, Recipe, awq_pack, checkpoint_bytes,
                                       ct_pack, effective_input_scale, gptq_pack, gptq_pack_columns,
                                       fp8_rows, quantization_config, quantize_copy, quantize_entry, w4a16_config)
from helpers.w8a8_reference import int8_static_fake_quant, int8_token_fake_quant
from helpers.tiny_models import make_qwen_checkpoint
from mmserve.models.loader import load_model
from mmserve.models.parallel import FusedLinear, ParallelLinear
from mmserve.models.quantization.config import QuantSpec, read_quant_spec
from mmserve.models.quantization.int8 import unpack_bytes


EXPECTED_SUFFIXES = {"awq": ("qweight", "qzeros", "scales"), "w4a16": ("weight_packed", "weight_scale"),
                     "gptq": ("qweight", "qzeros", "scales", "g_idx"),
                     "gptq-asym": ("qweight", "qzeros", "scales", "g_idx"),
                     "gptq-act-order": ("qweight", "qzeros", "scales", "g_idx"),
                     "gptq-int8": ("qweight", "qzeros", "scales", "g_idx"),
                     "w4a16-asym": ("weight_packed", "weight_scale", "weight_zero_point"),
                     "w4a16-act-order": ("weight_packed", "weight_scale", "weight_g_idx"),
                     "w8a16": ("weight_packed", "weight_scale"),
                     "w8a16-asym": ("weight_packed", "weight_scale", "weight_zero_point"),
                     "w8a8": ("weight", "weight_scale"), "w8a8-tensor": ("weight", "weight_scale"),
                     "w8a8-static": ("weight", "weight_scale", "input_scale"),
                     "fp8-block": ("weight", "weight_scale_inv"), "fp8-block-ct": ("weight", "weight_scale"),
                     "fp8-channel": ("weight", "weight_scale"),
                     "fp8-static": ("weight", "weight_scale", "input_scale"),
                     "modelopt-fp8": ("weight", "weight_scale", "input_scale"),
                     "modelopt-fp8-pc": ("weight", "weight_scale")}


def _nibble(word: int, k: int) -> int:
    return (word & 0xFFFFFFFF) >> (4 * k) & 0xF


def test_gptq_8_bit_packer_puts_row_4r_plus_k_in_byte_k_of_word_r_and_the_loader_reads_it_so():
    codes = torch.randint(0, 256, (8, 3))
    packed = gptq_pack(codes, bits=8)
    assert packed.shape == (2, 3) and packed.dtype == torch.int32
    for r in range(2):
        for c in range(3):
            for k in range(4):
                assert (int(packed[r, c]) & 0xFFFFFFFF) >> (8 * k) & 0xFF == codes[4 * r + k, c]
    assert torch.equal(unpack_bytes(packed.t().contiguous()), codes.t().to(torch.uint8))  # the resident rows


def test_awq_packer_puts_column_8c_plus_order_k_in_nibble_k():
    codes = torch.randint(0, 16, (3, 16))
    packed = awq_pack(codes)
    assert packed.shape == (3, 2) and packed.dtype == torch.int32
    for r in range(3):
        for c in range(2):
            for k in range(8):  # AutoAWQ: qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)
                assert _nibble(int(packed[r, c]), k) == codes[r, 8 * c + AWQ_ORDER[k]]


def test_gptq_packer_puts_row_8r_plus_k_in_nibble_k_of_word_r():
    """AutoGPTQ's `pack`: qweight's word r of column c holds rows 8r..8r+7 (nibble k: row 8r + k);
    qzeros' word c of row g holds columns 8c..8c+7 (nibble k: column 8c + k)."""
    codes = torch.randint(0, 16, (16, 3))
    packed = gptq_pack(codes)
    assert packed.shape == (2, 3) and packed.dtype == torch.int32
    for r in range(2):
        for c in range(3):
            for k in range(8):
                assert _nibble(int(packed[r, c]), k) == codes[8 * r + k, c]
    zeros = torch.randint(0, 16, (3, 16))
    packed = gptq_pack_columns(zeros)
    assert packed.shape == (3, 2)
    assert all(_nibble(int(packed[g, c]), k) == zeros[g, 8 * c + k]
               for g in range(3) for c in range(2) for k in range(8))


def test_a_gptq_weight_is_q_less_its_stored_zero_plus_one_times_its_scale(source, tmp_path):
    """The dequantized layer from the published tensors as AutoGPTQ's `dequantize` reads them
    (zeros + 1, each input row's group by `g_idx`), written out here from its description."""
    quantized, _ = quantize_copy(source, tmp_path, "gptq-asym")
    stored = "model.layers.0.mlp.down_proj"  # transformers saves Qwen2.5-VL under its published names
    tensors = load_file(str(Path(quantized) / "model.safetensors"))
    qweight, qzeros, scales, g_idx = (tensors[f"{stored}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx"))
    shifts = torch.arange(0, 32, 4)
    q = ((qweight[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, qweight.shape[1])  # [in, out]
    z = ((qzeros[:, :, None] >> shifts) & 0xF).reshape(qzeros.shape[0], -1) + 1  # [groups, out]
    want = ((q - z[g_idx.long()]) * scales[g_idx.long()].float()).t()  # W [out, in]
    layer = dict(load_model(quantized).named_modules())["model.language_model.layers.0.mlp.down_proj"]
    assert torch.equal(layer.method.dequantize(layer), want)


@pytest.mark.parametrize("packed_dim", [0, 1])
def test_compressed_tensors_packer_offsets_by_8_in_sequential_nibbles(packed_dim):
    values = torch.randint(-8, 8, (16, 16))
    packed = ct_pack(values, packed_dim)
    for r in range(16):
        for c in range(16):
            word = packed[r, c // 8] if packed_dim == 1 else packed[r // 8, c]
            k = c % 8 if packed_dim == 1 else r % 8
            assert _nibble(int(word), k) == values[r, c] + 8


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    return make_qwen_checkpoint(tmp_path_factory.mktemp("dense"), family="qwen2_5_vl")


def _linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Each decoder linear holding a weight (a fused group under its first layer's name) by name;
    not the vision tower's (dense in these checkpoints)."""
    found = {}
    for name, module in model.named_modules():
        if "visual" in name:
            continue
        if isinstance(module, FusedLinear):
            found[name] = module
        elif (isinstance(module, ParallelLinear) and getattr(module, module.weight_names[0]).numel()
              and module.fused is None):  # fused siblings' own weights are freed
            found[name] = module
    return found


@pytest.mark.parametrize("fmt", FORMATS)
def test_loaded_layers_are_the_checkpoints_weights_bit_for_bit(fmt, source, tmp_path):
    """And each layer's product is the float layer's (W8A8's: on x quantized per token, as vLLM does)."""
    quantized, dequantized = quantize_copy(source, tmp_path, fmt)
    model, plain = load_model(quantized), load_model(dequantized)
    reference = _linears(plain)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    for name, layer in _linears(model).items():
        assert layer.method.name != "dense", name
        want = reference[name].method.dequantize(reference[name])
        assert torch.equal(layer.method.dequantize(layer), want), name
        if want.shape[1] == x.shape[1]:
            torch.testing.assert_close(layer(x), reference[name](_as_run(fmt, name, x)), rtol=1e-5, atol=1e-5)


def _as_run(fmt: str, layer: str, x: torch.Tensor) -> torch.Tensor:
    """x as a layer of `fmt` multiplies it on the CPU: W8A8's rounded to int8 per token, or by the
    layer's static scale (a fused layer is its first sibling's `fused`: q_proj's, gate_proj's);
    FP8's as it is (weight-only on the CPU)."""
    if fmt == "w8a8-static":
        return int8_static_fake_quant(x, effective_input_scale(fmt, layer.removesuffix(".fused")))
    return int8_token_fake_quant(x) if fmt in W8A8 else x


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_packer_quantizes_on_the_weights_device(fmt):
    """Every tensor it makes is made where the weight is (torch's `meta` device stands for a GPU:
    the GPU benchmark quantizes a 7B there); only W4A16's `weight_shape`, metadata, is on the CPU."""
    w = torch.empty(384, 256, dtype=torch.bfloat16, device="meta")
    stored, deq = quantize_entry("model.layers.0.mlp.down_proj.weight", w, Recipe(fmt, 128, 128))
    assert deq.device.type == "meta" and deq.shape == (384, 256)
    assert {name.rsplit(".", 1)[1]: t.device.type for name, t in stored.items() if "shape" not in name} == \
        dict.fromkeys(EXPECTED_SUFFIXES[fmt], "meta")


def _shard(source: str, dst: Path) -> Path:
    """The one-file checkpoint `source` as two shards and their index, as large checkpoints are stored."""
    shutil.copytree(source, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(Path(source) / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, str(dst / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (dst / INDEX).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return dst


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, checking its index names the file that holds each and their total."""
    index = json.loads((Path(folder) / INDEX).read_text())
    found = {}
    for file in sorted(set(index["weight_map"].values())):
        for name, tensor in load_file(str(Path(folder) / file)).items():
            assert index["weight_map"].pop(name) == file
            found[name] = tensor
    assert not index["weight_map"] and index["metadata"]["total_size"] == sum(t.nbytes for t in found.values())
    return found


@pytest.mark.parametrize("fmt", ["awq", "fp8-block"])
def test_a_sharded_checkpoint_is_quantized_shard_by_shard(fmt, source, tmp_path):
    """The same tensors as from its one-file form, each in its source's file, under a new index."""
    quantized, dequantized = quantize_copy(str(_shard(source, tmp_path / "sharded")), tmp_path / "from-shards", fmt)
    whole = quantize_copy(source, tmp_path / "from-one", fmt)
    for got, want in zip((quantized, dequantized), whole):
        mine, theirs = _tensors(got), load_file(str(Path(want) / "model.safetensors"))
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k].view(torch.uint8), theirs[k].view(torch.uint8)) for k in mine)
        assert (Path(got) / "config.json").read_text() == (Path(want) / "config.json").read_text()
    assert {p.name for p in Path(quantized).iterdir()} == {p.name for p in (tmp_path / "sharded").iterdir()}
    assert load_model(quantized).weight_bytes == load_model(whole[0]).weight_bytes


@pytest.mark.parametrize("fmt", FORMATS)
def test_resident_weights_are_the_checkpoints_bytes(fmt, source, tmp_path):
    quantized, _ = quantize_copy(source, tmp_path, fmt)
    model, dense = load_model(quantized), load_model(source)
    assert abs(model.weight_bytes / checkpoint_bytes(quantized) - 1) < 0.15
    assert model.weight_bytes < 0.8 * dense.weight_bytes


@pytest.mark.parametrize("stored", [torch.float16, torch.bfloat16])
def test_a_quantized_checkpoints_16_bit_lm_head_stays_16_bit_on_the_cpu(stored, source, tmp_path):
    """Its values as stored (upcasting is exact), multiplied in float32: the logits of its twin,
    whose head holds the same values in float32; a dense float32 checkpoint keeps its head."""
    quantized, dequantized = quantize_copy(source, tmp_path, "awq", unquantized=stored)
    model, plain = load_model(quantized), load_model(dequantized)
    assert model.lm_head.weight.dtype == stored and plain.lm_head.weight.dtype == torch.float32
    assert torch.equal(model.lm_head.weight.float(), plain.lm_head.weight)
    for rows in (1, 3, 300):  # the GEMV of a decode step, and a prefill's upcast tiles
        hidden = torch.randn(rows, plain.lm_head.weight.shape[1], generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(model.lm_head(hidden), plain.lm_head(hidden), rtol=1e-5, atol=1e-5)
    assert load_model(source).lm_head.weight.dtype == torch.float32


def w8a8_config(**activations) -> dict:
    """compressed-tensors' W8A8 `quantization_config` with its input activations' fields overridden."""
    config = quantization_config("w8a8", 128, 128)
    config["config_groups"]["group_0"]["input_activations"].update(activations)
    return config


def _spec(config: dict, folder: Path) -> QuantSpec | None:
    """`read_quant_spec` of a checkpoint folder whose config.json holds `config`."""
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"quantization_config": config}))
    return read_quant_spec(str(folder))


def test_compressed_tensors_8_bit_schemes_are_read_as_published(tmp_path):
    """W8A16 (pack-quantized, 8-bit: channel, or group) and W8A8 (int-quantized, per channel or tensor)."""
    skip = ("lm_head", *(f"re:.*{name}.*" for name in VISION))
    assert _spec(quantization_config("w8a16", 128, 128), tmp_path / "a") == QuantSpec(
        "w8a16", group_size=128, bits=8, skip_names=skip)
    assert _spec(quantization_config("w8a16-asym", 128, 128), tmp_path / "b") == QuantSpec(
        "w8a16", group_size=0, bits=8, symmetric=False, skip_names=skip)
    assert _spec(quantization_config("w8a8", 128, 128), tmp_path / "c") == QuantSpec("w8a8", bits=8, skip_names=skip)
    assert _spec(quantization_config("w8a8-tensor", 128, 128), tmp_path / "d") == QuantSpec(
        "w8a8", bits=8, per_tensor=True, skip_names=skip)


def test_static_activation_scales_are_read_as_published(tmp_path):
    """vLLM's serialized FP8 with `activation_scheme: static`, compressed-tensors FP8 and W8A8 with
    static `tensor` activations, ModelOpt's FP8 from `hf_quant_config.json` or config.json (and
    compressed-tensors' FP8_BLOCK, read beside them)."""
    assert _spec({"quant_method": "fp8", "activation_scheme": "static"}, tmp_path / "a") == QuantSpec(
        "fp8_channel", per_tensor=True, static_input=True)
    skip = ("lm_head", *(f"re:.*{name}.*" for name in VISION))
    assert _spec(quantization_config("fp8-static", 128, 128), tmp_path / "b") == QuantSpec(
        "fp8_channel", per_tensor=True, static_input=True, skip_names=skip)
    assert _spec(quantization_config("w8a8-static", 128, 128), tmp_path / "c") == QuantSpec(
        "w8a8", bits=8, static_input=True, skip_names=skip)
    assert _spec(quantization_config("fp8-block-ct", 64, 64), tmp_path / "f") == QuantSpec(
        "fp8_block", block=(64, 64), block_scale="weight_scale", skip_names=skip)
    exported = tmp_path / "d"
    exported.mkdir()
    (exported / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    (exported / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt"}, "quantization": quantization_config("modelopt-fp8", 128, 128)}))
    from_file = read_quant_spec(str(exported))
    flat = _spec({"quant_method": "modelopt", "quant_algo": "fp8", "ignore": ["lm_head", "*multi_modal_projector*"]},
                 tmp_path / "e")
    for spec in (from_file, flat):
        assert spec is not None and (spec.format, spec.per_tensor, spec.static_input) == ("fp8_channel", True, True)
        assert spec.quantizes("model.layers.0.mlp.up_proj") and spec.quantizes("model.language_model.layers.1.o_proj")
        assert not spec.quantizes("lm_head") and not spec.quantizes("model.multi_modal_projector.linear_1")
        assert not spec.quantizes("model.visual.blocks.0.attn.qkv")  # the tower: dense, listed or not
    per_row = _spec(quantization_config("modelopt-fp8-pc", 128, 128), tmp_path / "g")
    assert per_row is not None and (per_row.format, per_row.per_tensor, per_row.static_input) == (
        "fp8_channel", False, False)
    # config.json's own quantization_config wins over an hf_quant_config.json beside it
    (exported / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    assert read_quant_spec(str(exported)) == QuantSpec("fp8_channel", per_tensor=True)


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' of"),
    ({"quant_method": "gguf"}, "'gguf' of"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm"}, "AWQ with 8 bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "marlin"}, "AWQ version 'marlin'"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "weight_block_size and activation_scheme 'static'"),
    ({"quant_method": "fp8", "activation_scheme": "per_token"}, "activation_scheme 'per_token'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "ModelOpt quant_algo 'NVFP4'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128, "desc_act": False}, "GPTQ with 3 bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"}, "'gptq_v2'"),
    (w4a16_config("columns"), "W4A16 with actorder 'columns'"),
    (w8a8_config(dynamic=False, strategy="channel"), "W8A8 with static activation scales by 'channel'"),
    (w8a8_config(dynamic=False, strategy="tensor", symmetric=False), "static activation scales by 'tensor', asym"),
    (w8a8_config(symmetric=False), "W8A8 with dynamic activations by 'token', asymmetric"),
    (w8a8_config(num_bits=4, type="int"), "int8 weights with 4-bit int activations"),
    ({**w8a8_config(), "format": "pack-quantized"}, "'pack-quantized' with 8-bit int weights by 'channel' and act"),
])
def test_unsupported_quantization_is_refused_in_one_line(config, message, source, tmp_path):
    folder = tmp_path / "q"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**json.loads((Path(source) / "config.json").read_text()),
                                                    "quantization_config": config}))
    with pytest.raises(ValueError, match=message) as info:
        read_quant_spec(str(folder))
    assert "\n" not in str(info.value)


def test_gptq_quantizes_the_layers_its_checkpoint_holds_quantized(source, tmp_path):
    """GPTQ's config names no modules: the decoder's projections, stored as qweight, are GPTQ's;
    the vision tower, stored as plain weights, stays dense."""
    model = load_model(quantize_copy(source, tmp_path, "gptq")[0])
    methods = {name: m.method.name for name, m in model.named_modules() if isinstance(m, ParallelLinear)}
    assert {m for n, m in methods.items() if "visual" in n} == {"dense"}
    assert {m for n, m in methods.items() if "layers." in n and "visual" not in n} == {"gptq"}


def test_online_fp8_refuses_an_already_quantized_checkpoint(source, tmp_path):
    quantized, _ = quantize_copy(source, tmp_path, "awq")
    with pytest.raises(ValueError, match="already quantized"):
        read_quant_spec(quantized, "fp8")


def test_skip_lists_match_module_names_as_their_publishers_do():
    awq = QuantSpec("awq", skip_substrings=("visual",))  # vLLM: a substring of the module's name
    assert not awq.quantizes("visual.blocks.0.mlp.up_proj") and awq.quantizes("model.layers.0.mlp.up_proj")
    fp8 = QuantSpec("fp8_block", skip_names=("lm_head", "model.visual", "gate"))  # transformers' rules
    assert not fp8.quantizes("model.visual.blocks.0.attn.qkv")  # a prefix ending at a dot
    assert not fp8.quantizes("model.layers.3.mlp.gate")  # a last part
    assert fp8.quantizes("model.layers.3.mlp.gate_proj") and fp8.quantizes("model.visualx.proj")
    ct = QuantSpec("w4a16", skip_names=("lm_head", "re:.*visual.*"))  # compressed-tensors: re.match
    assert not ct.quantizes("model.visual.merger.mlp.0") and ct.quantizes("model.language_model.layers.0.mlp.up_proj")


def test_online_fp8_holds_one_float_weight_at_a_time_while_loading(source, monkeypatch):
    """`--quantization fp8`: each layer's float weight is allocated when its tensor is read and
    quantized at once, so loading never holds the whole float model."""
    from mmserve.models.quantization.fp8 import Fp8RowMethod

    seen: list[int] = []
    real = Fp8RowMethod.process_weights

    def counting(self, layer):
        model_layers = [m for m in layer_registry if m.method is self]
        seen.append(sum(not m.weight.is_meta and m.weight.dtype == torch.float32 for m in model_layers))
        real(self, layer)

    layer_registry: list[ParallelLinear] = []
    real_set = ParallelLinear.set_method

    def register(self, method):
        real_set(self, method)
        layer_registry.append(self)

    monkeypatch.setattr(Fp8RowMethod, "process_weights", counting)
    monkeypatch.setattr(ParallelLinear, "set_method", register)
    model = load_model(source, quantization="fp8")
    assert len(seen) == len(layer_registry) > 0 and max(seen) == 1
    assert all(m.method.name == "fp8_online" for m in layer_registry)
    tower = [name for name, m in model.named_modules() if m in layer_registry and "visual" in name]
    assert tower  # as vLLM's online FP8 does, the tower's linears too
    assert model.weight_bytes < 0.8 * load_model(source).weight_bytes


def test_fp8_static_scale_quantizes_activations_by_the_one_scale():
    """The FP8 tensor-core path (`_scaled_mm`; torch runs it on the CPU too): x / input_scale
    rounded to e4m3, clamped at 448 (x[0, 0] past the scale's range), times the scale, against
    the dequantized weight; per-token scales (dynamic) give another product."""
    from mmserve.models.quantization.fp8 import FP8, _scaled_mm

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=gen)
    codes, scale = fp8_rows(w)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    x[0, 0] = 10.0  # past 448 x 0.01
    static = torch.tensor([0.01])
    got = _scaled_mm(x, codes, scale, None, static)
    x_q = (x.float() / static).clamp(-448, 448).to(FP8).float() * static
    want = x_q @ (codes.float() * scale[:, None]).t()
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    assert not torch.allclose(_scaled_mm(x, codes, scale, None).float(), want, rtol=1e-2, atol=1e-2)
