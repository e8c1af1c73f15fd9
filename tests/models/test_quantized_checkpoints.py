"""Quantized checkpoints (AWQ, GPTQ 4- and 8-bit, W4A16, W8A16, W8A8 dynamic and static, FP8 block-wise,
per channel and with static activation scales (compressed-tensors', ModelOpt's), `--quantization fp8`):
greedy float32 tokens equal transformers running the dequantized weights (for W8A8 with its
activations quantized per token or by each layer's scale, `int8_activation_hooks`), on Qwen3-VL,
Qwen2.5-VL and LLaVA, with the weights held quantized.

The quantized checkpoints are written here from random weights in the published layouts
(`helpers/quant_checkpoints.py`, written from AutoAWQ's, compressed-tensors' and transformers'
code); their twins hold the float weights they stand for, which transformers runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.hf_reference import hf_greedy, hf_qwen_greedy
from helpers.parity_runs import run_greedy
from helpers.quant_checkpoints import FORMATS, STATIC_INPUT, W8A8, checkpoint_bytes, online_fp8_twin, quantize_copy
from helpers.w8a8_reference import assert_w8a8_greedy_close
from mmserve import LLM
from mmserve.models.quantization.select import describe_quantization
from helpers.tiny_models import make_checkpoint, make_image, make_qwen_checkpoint

pytestmark = pytest.mark.slow  # runs transformers and the engine on each format (deselect with -m 'not slow')

MAX_NEW = 6
W8A8_TOL = 0.1  # log-probability: a few activation quanta rounded the other way move it ~0.03 here
METHOD = {"awq": "awq", "gptq": "gptq", "gptq-asym": "gptq", "gptq-act-order": "gptq", "gptq-int8": "gptq-int8",
          "w4a16": "w4a16", "w4a16-asym": "w4a16", "w4a16-act-order": "w4a16", "w8a16": "w8a16",
          "w8a16-asym": "w8a16", "w8a8": "w8a8", "w8a8-tensor": "w8a8", "w8a8-static": "w8a8_static",
          "fp8-block": "fp8_block", "fp8-block-ct": "fp8_block", "fp8-channel": "fp8_channel",
          "fp8-static": "fp8_static", "modelopt-fp8": "fp8_static", "modelopt-fp8-pc": "fp8_channel"}
FAMILIES = ("qwen3_vl", "qwen2_5_vl", "llava")


def _checkpoint(family: str, folder: Path) -> str:
    if family == "llava":
        return make_checkpoint(folder)
    return make_qwen_checkpoint(folder, family=family, min_pixels=28 * 28 * 4, max_pixels=32 * 32 * 16)


def _prompts(family: str) -> list[dict]:
    image = make_image(0, (64, 48))
    if family == "llava":
        return [{"prompt": "USER: hello there ASSISTANT:"},
                {"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": image}}]
    pads = "<|vision_start|><|image_pad|><|vision_end|>"
    return [{"prompt": "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"},
            {"prompt": f"<|im_start|>user\n{pads}What is this?<|im_end|>\n<|im_start|>assistant\n",
             "multi_modal_data": {"image": image}}]


def _reference(family: str, path: str, items: list[dict]) -> list[list[int]]:
    return (hf_greedy if family == "llava" else hf_qwen_greedy)(path, items, MAX_NEW)[0]


def _check(fmt: str, family: str, quantized: str, dequantized: str, items: list[dict], **engine_args) -> LLM:
    """The engine's greedy tokens against transformers' on the dequantized weights: equal; W8A8's
    close (`assert_w8a8_greedy_close`: its activations rounded to int8 turn float noise into quanta)."""
    reference = hf_greedy if family == "llava" else hf_qwen_greedy
    if fmt in W8A8:
        static = fmt if fmt in STATIC_INPUT else None
        return assert_w8a8_greedy_close(quantized, dequantized, items, MAX_NEW, reference, W8A8_TOL, static,
                                        **engine_args)
    got, llm = run_greedy(quantized, items, MAX_NEW, **engine_args)
    assert got == reference(dequantized, items, MAX_NEW)[0]
    return llm


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("dense")
    return {family: _checkpoint(family, folder) for family in FAMILIES}


# every format on every family; GPTQ's asymmetric and the act-order variants on one each
ONE_FAMILY = {"gptq-asym": "qwen3_vl", "gptq-act-order": "qwen2_5_vl", "w4a16-act-order": "llava",
              "w8a16-asym": "qwen2_5_vl", "w8a8-tensor": "llava", "w8a8-static": "qwen2_5_vl",
              "fp8-static": "qwen3_vl", "modelopt-fp8": "llava", "fp8-block-ct": "qwen2_5_vl",
              "modelopt-fp8-pc": "qwen3_vl"}
# GPTQ's 8-bit form (as Qwen's Qwen2-VL-*-GPTQ-Int8) on every family: its own method and kernels
CASES = [(fmt, family) for fmt in FORMATS for family in FAMILIES if ONE_FAMILY.get(fmt, family) == family]


@pytest.mark.parametrize("fmt, family", CASES)
def test_greedy_equals_transformers_on_the_dequantized_weights(fmt, family, sources, tmp_path):
    quantized, dequantized = quantize_copy(sources[family], tmp_path, fmt)
    llm = _check(fmt, family, quantized, dequantized, _prompts(family))
    stats = llm.engine.core.stats()  # the metric's source: resident bytes as held
    assert abs(stats.weight_bytes / checkpoint_bytes(quantized) - 1) < 0.15
    assert METHOD[fmt] in describe_quantization(llm.engine.core.executor.runner.model)


@pytest.mark.parametrize("family, stored", [("qwen3_vl", torch.float16), ("llava", torch.bfloat16)])
def test_16_bit_unquantized_weights_as_published_give_the_same_tokens(family, stored, sources, tmp_path):
    """Every tensor left unquantized stored 16-bit (Qwen's AWQ releases: float16): the LM head held
    so on the CPU and multiplied in float32, the rest upcast; transformers' tokens on the twin."""
    quantized, dequantized = quantize_copy(sources[family], tmp_path, "awq", unquantized=stored)
    items = _prompts(family)
    got, llm = run_greedy(quantized, items, MAX_NEW)
    assert got == _reference(family, dequantized, items)
    assert llm.engine.core.executor.runner.model.lm_head.weight.dtype == stored


@pytest.mark.parametrize("family", ["qwen3_vl", "llava"])
def test_online_fp8_equals_transformers_on_its_dequantized_weights(family, sources, tmp_path):
    items = _prompts(family)
    got, _ = run_greedy(sources[family], items, MAX_NEW, quantization="fp8")
    assert got == _reference(family, online_fp8_twin(sources[family], tmp_path / "twin"), items)


@pytest.mark.parametrize("fmt, stored", [("awq", None), ("gptq-asym", None), ("gptq-int8", None), ("w4a16-asym", None),
                                         ("w8a16", None), ("w8a8", None), ("w8a8-static", None), ("fp8-block", None),
                                         ("fp8-channel", None), ("modelopt-fp8-pc", None), ("awq", torch.float16)])
def test_tensor_parallel_shards_of_quantized_weights_give_the_same_tokens(fmt, stored, sources, tmp_path):
    """Each rank reads its slice of the packed tensors (words of 8, groups, blocks; a float16 LM
    head's rows): two ranks give transformers' tokens on the dequantized weights, as one does."""
    quantized, dequantized = quantize_copy(sources["qwen3_vl"], tmp_path, fmt, unquantized=stored)
    llm = _check(fmt, "qwen3_vl", quantized, dequantized, _prompts("qwen3_vl"), tensor_parallel_size=2)
    both = llm.engine.core.stats().weight_bytes  # the ranks' shards and the replicated tensors twice
    assert checkpoint_bytes(quantized) < both < 2 * checkpoint_bytes(quantized)
