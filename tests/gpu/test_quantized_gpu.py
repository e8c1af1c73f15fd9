"""On a CUDA GPU: quantized weights (AWQ, GPTQ 4- and 8-bit, W4A16, W8A16, W8A8 dynamic and static,
FP8 block-wise, per row and with static activation scales (ModelOpt's), `--quantization fp8`)
through our Triton kernels at the 7B's shapes against dequantize-then-matmul, and greedy tokens
against transformers on the dequantized weights (float32 equal, bfloat16 agreement printed).
`make test-gpu`; skipped (instantly) where CUDA is absent."""

from __future__ import annotations

import pytest
import torch

from helpers.gpu_cases import checkpoint, hf_tokens, prompts
from helpers.parity_runs import run_greedy
from helpers.quant_checkpoints import FORMATS, STATIC_INPUT, W8A8, quantize_copy
from helpers.w8a8_reference import assert_w8a8_greedy_close, int8_activation_hooks
from helpers.resident_weights import random_fp8, random_int4, random_int8
from mmserve.models.quantization import int8
from mmserve.models.quantization.int4 import dequantize_rows
from mmserve.models.quantization.w8a8 import quantize_rows

pytestmark = pytest.mark.gpu
MAX_NEW = 12
SHAPES_7B = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]  # fused Q/K/V, o, fused gate/up, down


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")


@pytest.mark.parametrize("M", [1, 7, 300])
@pytest.mark.parametrize("N, K", SHAPES_7B)
def test_kernels_at_the_7b_shapes_equal_dequantize_then_matmul(M, N, K):
    from mmserve.models.quantization import triton_kernels
    from mmserve.models.quantization.triton_int8_mm import int8_scaled_mm

    gen = torch.Generator().manual_seed(M + N)
    qweight, scales, zeros = random_int4(N, K, 128, gen)
    weight, block_scale, W8 = random_fp8(N, K, (128, 128), gen)
    codes, scales8, zeros8 = random_int8(N, K, 128, gen)
    x = torch.randn(M, K, generator=gen).cuda()
    w8, w8_scale = codes.view(torch.int8), scales8[:, 0].contiguous()  # W8A8: int8 codes, a scale a row
    q, s = quantize_rows(x)
    cases = {"int4": (triton_kernels.int4_linear(x, qweight.cuda(), scales.cuda(), zeros.cuda(), 128, None),
                      dequantize_rows(qweight, scales, zeros, 128)),
             "int8": (triton_kernels.int8_linear(x, codes.cuda(), scales8.cuda(), zeros8.cuda(), 128, None),
                      int8.dequantize_rows(codes, scales8, zeros8, 128)),
             "fp8 block": (triton_kernels.fp8_linear(x, weight.cuda(), block_scale.cuda(), (128, 128), None), W8),
             "w8a8": (int8_scaled_mm(q, s, w8.cuda(), w8_scale.cuda(), None, torch.float32),
                      w8.float() * w8_scale[:, None])}
    for name, (got, W) in cases.items():
        rows = q.double() * s.double() if name == "w8a8" else x.double()  # W8A8 multiplies x as quantized
        want = rows @ W.cuda().double().t()
        bound = (x.abs().double() @ W.cuda().abs().double().t()) * K * 2**-22 + 1e-6
        assert ((got.double() - want).abs() <= bound).all(), name


@pytest.mark.parametrize("fmt", [*(f for f in FORMATS if f not in ("w8a16-asym", "w8a8-tensor", "fp8-static",
                                                                    "fp8-block-ct", "modelopt-fp8-pc")),
                                 "fp8-online"])
def test_quantized_greedy_on_the_gpu(tmp_path, fmt):
    """float32: token-equal to transformers on the dequantized weights (W8A8: close, its activations
    quantized alike, `assert_w8a8_greedy_close`); bfloat16: agreement printed."""
    from helpers.hf_reference import hf_qwen_greedy
    from helpers.quant_checkpoints import online_fp8_twin

    source, items = checkpoint("qwen3_vl", tmp_path), prompts("qwen3_vl")
    if fmt == "fp8-online":
        path, twin, extra = source, online_fp8_twin(source, tmp_path / "twin"), {"quantization": "fp8"}
    else:
        (path, twin), extra = quantize_copy(source, tmp_path, fmt), {}
    static = fmt if fmt in STATIC_INPUT else None
    prepare = (lambda model: int8_activation_hooks(model, 1, static)) if fmt in W8A8 else None
    if fmt in W8A8:
        assert_w8a8_greedy_close(path, twin, items, MAX_NEW, hf_qwen_greedy, 0.1, static, device="cuda",
                                 dtype="float32", max_model_len=512).shutdown()
    else:
        ours, _ = run_greedy(path, items, MAX_NEW, device="cuda", dtype="float32", max_model_len=512, **extra)
        assert ours == hf_tokens("qwen3_vl", twin, items, MAX_NEW, torch.float32)
    ours, _ = run_greedy(path, items, MAX_NEW, device="cuda", dtype="bfloat16", max_model_len=512, **extra)
    theirs = hf_tokens("qwen3_vl", twin, items, MAX_NEW, torch.bfloat16, prepare=prepare)
    pairs = [(a, b) for mine, ref in zip(ours, theirs) for a, b in zip(mine, ref)]
    print(f"\n{fmt}: bfloat16 tokens equal to transformers' bfloat16 on the dequantized weights: "
          f"{sum(a == b for a, b in pairs) / len(pairs):.1%} of {len(pairs)}")


@pytest.mark.parametrize("fmt", ["awq", "fp8-block", "gptq-int8", "gptq-act-order"])
def test_quantized_decode_replayed_from_cuda_graphs_equals_eager(tmp_path, fmt):
    """The quantized layers' Triton GEMV captured in the decode graphs gives the eager tokens (float32);
    act-order's gather of x's columns is captured with it."""
    (path, _), items = quantize_copy(checkpoint("qwen3_vl", tmp_path), tmp_path, fmt), prompts("qwen3_vl")
    eager, first = run_greedy(path, items, MAX_NEW, device="cuda", dtype="float32", enforce_eager=True,
                              max_model_len=512)
    first.shutdown()  # each LLM sizes its KV cache on the whole GPU
    graphed, llm = run_greedy(path, items, MAX_NEW, device="cuda", dtype="float32", max_model_len=512)
    try:
        graphs = llm.engine.core.executor.runner.decode_graphs
        assert graphs is not None and graphs.replays > 0
        assert graphed == eager
    finally:
        llm.shutdown()  # the GPU back for the next test, whatever this one found
