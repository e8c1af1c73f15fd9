"""Act-order checkpoints (GPTQ's `desc_act: true`, compressed-tensors W4A16's `actorder: group`):
which configs mean it, each layer's columns sorted by group at load (`quantization/groups.py`), the
siblings kept fused where their orders agree, and the refusals (groups of other sizes, tensor
parallelism). Their tokens against transformers: tests/models/test_quantized_checkpoints.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.quant_checkpoints import quantization_config, quantize_copy, w4a16_config
from helpers.tiny_models import make_qwen_checkpoint
from mmserve.models.loader import load_model
from mmserve.models.parallel import FusedLinear, ParallelLinear
from mmserve.models.quantization.config import read_quant_spec


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    return make_qwen_checkpoint(tmp_path_factory.mktemp("dense"), family="qwen2_5_vl")


def test_a_gptq_checkpoint_whose_groups_are_not_all_of_its_group_size_is_refused_at_load(source, tmp_path):
    """Group 0's input rows moved into group 1 (one group empty, one twice its size): no order of
    the columns makes runs of `group_size`; one line, not wrong tokens."""
    quantized, _ = quantize_copy(source, tmp_path, "gptq-act-order")
    path = Path(quantized) / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.1.mlp.down_proj.g_idx"
    g_idx = tensors[name].clone()
    g_idx[g_idx == 0] = 1 if int(g_idx.max()) >= 1 else 0
    tensors[name] = g_idx
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="g_idx does not give each") as info:
        load_model(quantized)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("fmt", ["gptq-act-order", "w4a16-act-order"])
def test_act_order_sorts_each_layers_input_columns_once_and_keeps_qkv_fused(fmt, source, tmp_path):
    """An act-order layer holds its columns sorted by group and the order (`perm`); siblings that
    share it (one input, one Hessian) stay one GEMM; a layer in order holds none."""
    model = load_model(quantize_copy(source, tmp_path, fmt)[0])
    fused = [m for name, m in model.named_modules() if isinstance(m, FusedLinear) and "visual" not in name]
    assert fused and all(layer.perm.shape == (layer.shape.in_features,) for layer in fused)
    assert all(not torch.equal(layer.perm, torch.arange(layer.perm.shape[0])) for layer in fused)
    in_order = load_model(quantize_copy(source, tmp_path / "in-order", "gptq")[0])
    assert not any(hasattr(m, "perm") for m in in_order.modules() if isinstance(m, (FusedLinear, ParallelLinear)))


@pytest.mark.parametrize("fmt, name", [("gptq-act-order", r"GPTQ with act-order \(desc_act: true\)"),
                                       ("w4a16-act-order", "W4A16 with actorder group")])
def test_act_order_over_tensor_parallel_ranks_is_refused_before_loading(fmt, name, source, tmp_path):
    """A rank holding half an act-order layer's input columns would hold parts of every group: one
    line before any worker starts."""
    from mmserve import LLM

    quantized = quantize_copy(source, tmp_path, fmt)[0]
    with pytest.raises(ValueError, match=f"{name} runs on one rank only") as info:
        LLM(model=quantized, tensor_parallel_size=2, max_model_len=256)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("change, act_order", [({}, True), ({"static_groups": True}, False),
                                                ({"group_size": -1}, False), ({"desc_act": False}, False)])
def test_gptq_act_order_is_desc_act_unless_static_groups_or_one_group_keep_g_idx_in_order(change, act_order,
                                                                                          tmp_path):
    config = {**quantization_config("gptq-act-order", 128, 128), **change}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": config}))
    assert read_quant_spec(str(tmp_path)).act_order is act_order


@pytest.mark.parametrize("actorder, act_order", [(None, False), ("weight", False), ("static", False), ("group", True)])
def test_w4a16_act_order_is_actorder_group_the_others_keep_weight_g_idx_out(actorder, act_order, tmp_path):
    """llm-compressor's "weight" (alias "static") orders the calibration only: no `weight_g_idx`."""
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": w4a16_config(actorder)}))
    assert read_quant_spec(str(tmp_path)).act_order is act_order


def test_act_order_siblings_stack_only_where_their_column_orders_agree():
    from types import SimpleNamespace

    from mmserve.models.quantization.int4 import Int4Method

    def layer(perm: list[int] | None) -> SimpleNamespace:
        tensors = {"qweight": torch.zeros(8, 2, dtype=torch.int32), "scales": torch.ones(8, 1),
                   "zeros": torch.zeros(8, 1, dtype=torch.uint8)}
        return SimpleNamespace(**tensors, **({} if perm is None else {"perm": torch.tensor(perm)}))

    method = Int4Method("gptq", 16, True)
    order, other = list(range(15, -1, -1)), list(range(16))
    assert torch.equal(method.concat([layer(order), layer(order)])["perm"], torch.tensor(order))
    assert method.concat([layer(order), layer(other)]) is None
    assert method.concat([layer(None), layer(order)]) is None and method.concat([layer(order), layer(None)]) is None
    assert "perm" not in method.concat([layer(None), layer(None)])
