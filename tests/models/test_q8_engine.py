"""`--cpu-activation-quant int8` through the engine: a tiny AWQ Qwen3-VL generates with it, each
token's log probabilities within a tolerance of the exact mode's while the two agree, and the
mode is refused at start, in one line, where it cannot apply."""

from __future__ import annotations

import pytest

from helpers.quant_checkpoints import quantize_copy
from helpers.tiny_models import make_qwen_checkpoint
from mmserve import LLM, SamplingParams
from mmserve.cli import main
from mmserve.models.quantization import q8_gemv
from mmserve.models.quantization.config import QuantSpec, check_cpu_activation_quant

PROMPT = "<|im_start|>user\nhello there, how are you<|im_end|>\n<|im_start|>assistant\n"
# nats, on the top-5 log probabilities: each int4 layer's output moves by ~0.7% of |y| (1.3% in
# down_proj: x's rounding), which this random model's near-flat logits (the top 20 within a std of
# 0.77) turn into up to 0.14 at the first token and 0.23 by the fifth (measured); a wrong zero
# point or scale moves them by whole nats
TOLERANCE = 0.3


@pytest.fixture(scope="module")
def awq(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("q8")
    return quantize_copy(make_qwen_checkpoint(folder), folder, "awq", group=128)[0]


def _run(path: str, mode: str):
    llm = LLM(model=path, device="cpu", cpu_activation_quant=mode)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, logprobs=5))[0].outputs[0]
    llm.engine.core.check_integrity()
    return out


@pytest.mark.skipif(q8_gemv.load() is None, reason="no C compiler for the CPU kernels")
def test_int8_activations_generate_close_to_the_exact_mode(awq):
    exact, q8 = _run(awq, "none"), _run(awq, "int8")
    assert exact.logprobs is not None and q8.logprobs is not None
    compared = 0
    for token, want, got in zip(exact.token_ids, exact.logprobs, q8.logprobs):
        for candidate in want.keys() & got.keys():
            assert abs(want[candidate].logprob - got[candidate].logprob) <= TOLERANCE
        if token != q8.token_ids[compared]:
            break
        compared += 1
    assert compared >= 2
    assert any(abs(want[t].logprob - got[t].logprob) > 0 for want, got in zip(exact.logprobs, q8.logprobs)
               for t in want.keys() & got.keys())  # the mode did run


def test_refused_without_int4_layers(tmp_path):
    with pytest.raises(ValueError, match="needs a checkpoint with 4-bit weights.*not quantized"):
        LLM(model=make_qwen_checkpoint(tmp_path), device="cpu", cpu_activation_quant="int8")


@pytest.mark.parametrize("device, dtype, words", [("cuda", "bfloat16", "is for the CPU"),
                                                  ("cpu", "bfloat16", "quantizes float32 activations")])
def test_refused_on_a_gpu_or_in_16_bits(device, dtype, words):
    with pytest.raises(ValueError, match=words):
        check_cpu_activation_quant("int8", QuantSpec("awq"), device, dtype)
    check_cpu_activation_quant("none", None, device, dtype)


def test_the_flag_takes_none_or_int8(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--port", "0", "--cpu-activation-quant", "int4"])
    assert exited.value.code == 2
    assert "cpu-activation-quant" in capsys.readouterr().err
