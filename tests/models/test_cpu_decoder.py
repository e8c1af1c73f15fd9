"""The compiled CPU decode step (models/cpu_decoder.py): a quantized model's decode steps run all
decoder layers in one C call, and equal the step run layer by layer in Python bit for bit —
hidden states, every cache row written (float32, float16 and bfloat16 caches), and through the
engine every token and log probability — for each weight kernel (int4 exact and with int8
activations, FP8 by block and by row, int8 weights and W8A8's int8 products) and each decoder
(Qwen3's q/k norms, Qwen2's q/k/v bias, Llama's). Steps the plan does not cover run in Python;
`--enforce-eager` and float32 weights (oneDNN's) get no plan."""

from __future__ import annotations

import pytest
import torch

from helpers.quant_checkpoints import quantize_copy
from helpers.tiny_models import make_checkpoint, make_qwen_checkpoint
from mmserve import LLM, SamplingParams
from mmserve.models import cpu_decoder, cpu_ops
from mmserve.models.attention import cpu_kernels
from mmserve.models.attention.torch_sdpa import AttentionMetadata

pytestmark = pytest.mark.skipif(cpu_decoder.load() is None or cpu_kernels.load() is None
                                or cpu_ops.load() is None, reason="no C compiler for the CPU kernels")
QWEN_CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = ["hello there, how are you", "write a poem about the sea and the sky", "hi"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
# (family, format, group, --cpu-activation-quant, --kv-cache-dtype)
CASES = [("qwen3_vl", "awq", 128, "none", "auto"),
         ("qwen3_vl", "awq", 128, "int8", "float16"),
         ("qwen3_vl", "fp8-block", 32, "none", "bfloat16"),
         ("qwen2_5_vl", "w4a16", 128, "none", "auto"),
         ("llava", "fp8-channel", 32, "none", "float16"),
         ("qwen2_5_vl", "w8a16", 32, "none", "auto"),  # int8 weights (GPTQ 8-bit's resident form)
         ("qwen3_vl", "w8a8-static", 32, "none", "auto")]  # int8 x int8 (up to w8a8_cpu.MAX_ROWS rows)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict[tuple[str, str, int], str] = {}

    def get(family: str, fmt: str, group: int) -> str:
        if (family, fmt, group) not in made:
            folder = tmp_path_factory.mktemp(f"{family}-{fmt}")
            src = make_checkpoint(folder) if family == "llava" else make_qwen_checkpoint(folder, family=family)
            made[family, fmt, group] = quantize_copy(src, folder, fmt, group=group, block=group)[0]
        return made[family, fmt, group]
    return get


def _engine(path: str, eager: bool, activations: str = "none", kv: str = "auto") -> LLM:
    return LLM(model=path, device="cpu", enforce_eager=eager, cpu_activation_quant=activations, kv_cache_dtype=kv,
               num_kv_blocks=256)


def _text_model(llm: LLM):
    return llm.engine.core.executor.runner.model.text_model


def _prompts(family: str) -> list[str]:
    return [QWEN_CHAT.format(p) if family != "llava" else f"USER: {p} ASSISTANT:" for p in PROMPTS]


def _generate(llm: LLM, family: str) -> list[tuple[list[int], list[dict[int, float]]]]:
    outs = llm.generate(_prompts(family), PARAMS)
    return [(list(o.outputs[0].token_ids), [{t: p.logprob for t, p in d.items()} for d in o.outputs[0].logprobs or []])
            for o in outs]


@pytest.mark.parametrize("family, fmt, group, activations, kv", CASES)
def test_the_engine_generates_what_the_python_step_does(checkpoints, family, fmt, group, activations, kv):
    """Three requests of different lengths decode together: every token and log probability equal."""
    path = checkpoints(family, fmt, group)
    eager = _engine(path, True, activations, kv)
    assert _text_model(eager).cpu_decoder is None
    want = _generate(eager, family)
    compiled = _engine(path, False, activations, kv)
    plan = _text_model(compiled).cpu_decoder
    assert plan is not None
    got = _generate(compiled, family)
    assert plan.steps >= PARAMS.max_tokens - 1  # every decode step of the batch went through it
    assert got == want
    compiled.engine.core.check_integrity()


def _step(text_model, kv_caches, T: int, block_size: int, gen: torch.Generator, qwen: bool):
    """One decode step's inputs for T requests with contexts of different lengths in shuffled blocks."""
    lens = [int(n) for n in torch.randint(1, 3 * block_size, (T,), generator=gen)]
    free = torch.randperm(kv_caches[0][0].shape[0], generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    meta = AttentionMetadata.build([1] * T, lens, tables, block_size)
    positions = torch.tensor([n - 1 for n in lens])
    if qwen:
        positions = positions.expand(3, -1).contiguous()
    embeds = torch.randn(T, text_model.norm.weight.shape[0], generator=gen) * 3
    return embeds, positions, meta


@pytest.mark.parametrize("family, fmt, group, activations, kv", CASES[:3] + CASES[4:])
@pytest.mark.parametrize("T", [1, 7, cpu_decoder.MAX_ROWS])
def test_a_step_equals_the_python_step_and_writes_the_same_cache(checkpoints, family, fmt, group, activations,
                                                                 kv, T):
    """The text model's forward with and without the plan from the same cache: the same hidden
    states and the same cache, every row (the rounding of a 16-bit cache's K/V included)."""
    llm = _engine(checkpoints(family, fmt, group), False, activations, kv)
    runner = llm.engine.core.executor.runner
    text_model, kv_caches = _text_model(llm), runner.kv_caches
    plan, gen = text_model.cpu_decoder, torch.Generator().manual_seed(T)
    for k, v in kv_caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    before = [(k.clone(), v.clone()) for k, v in kv_caches]
    embeds, positions, meta = _step(text_model, kv_caches, T, runner.block_size, gen, family != "llava")
    with torch.inference_mode():
        compiled = text_model(embeds.clone(), positions, kv_caches, meta)
        assert plan.steps == (T <= plan.max_rows)  # W8A8's plan stops at its GEMV's rows
        written = [(k.clone(), v.clone()) for k, v in kv_caches]
        for (k, v), (k0, v0) in zip(kv_caches, before):
            k.copy_(k0)
            v.copy_(v0)
        text_model.cpu_decoder = None
        python = text_model(embeds.clone(), positions, kv_caches, meta)
    assert torch.equal(compiled, python)
    for (k, v), (wk, wv), (k0, _) in zip(kv_caches, written, before):
        assert torch.equal(k, wk) and torch.equal(v, wv)
        assert not torch.equal(k, k0)  # the step did write


def test_steps_it_does_not_cover_run_in_python(checkpoints):
    """A prefill, and a decode batch past MAX_ROWS, take the Python layers (the plan's count stays)."""
    llm = _engine(checkpoints("qwen3_vl", "awq", 128), False)
    runner = llm.engine.core.executor.runner
    text_model, kv_caches = _text_model(llm), runner.kv_caches
    plan, gen = text_model.cpu_decoder, torch.Generator().manual_seed(0)
    embeds, positions, meta = _step(text_model, kv_caches, cpu_decoder.MAX_ROWS + 1, runner.block_size, gen, True)
    with torch.inference_mode():
        text_model(embeds, positions, kv_caches, meta)
        prefill = AttentionMetadata.build([4], [4], [[1]], runner.block_size)
        text_model(embeds[:4], torch.arange(4).expand(3, -1), kv_caches, prefill)
    assert plan.steps == 0


def test_no_plan_for_float32_weights_or_with_enforce_eager(checkpoints, tmp_path):
    dense = LLM(model=make_qwen_checkpoint(tmp_path), device="cpu")
    assert _text_model(dense).cpu_decoder is None  # oneDNN's packed float32 weights: no C GEMV
    assert _text_model(_engine(checkpoints("qwen3_vl", "awq", 128), True)).cpu_decoder is None
