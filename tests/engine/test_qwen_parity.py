"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: greedy outputs token-for-token equal to transformers' `generate`.

Each variant is a tiny checkpoint built here with transformers: Qwen3-VL (GQA, interleaved
M-RoPE, deepstack after two vision layers), Qwen2.5-VL (window attention with full-attention
blocks, sectioned M-RoPE, QKV bias) and Qwen2-VL (LayerNorm and QuickGELU in the tower, full
attention per frame, a LayerNorm merger). The prompts cover no image, one image, two images of
different sizes and aspect ratios, an image below `min_pixels` and one above `max_pixels`, and a
request with its own `mm_processor_kwargs`. Every variant runs them batched, with prefill chunks
smaller than one image, with preemption, and again with every cache hitting.
"""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from helpers.parity_runs import run_greedy
from helpers.hf_reference import hf_qwen_greedy
from helpers.tiny_models import make_image, make_qwen_checkpoint, make_tied_copy

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')

MAX_NEW = 8
MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 48  # 4 to 48 tokens at patch 16 (merge 2)

VARIANTS = {
    "qwen3-vl": dict(family="qwen3_vl", min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
    "qwen2.5-vl": dict(family="qwen2_5_vl", min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 48),
    "qwen2-vl": dict(family="qwen2_vl", min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 48),
}


def chat(text: str, images: int = 0) -> str:
    pads = "<|vision_start|><|image_pad|><|vision_end|>" * images
    return f"<|im_start|>user\n{pads}{text}<|im_end|>\n<|im_start|>assistant\n"


def prompts() -> list[dict]:
    a, b = make_image(0, (64, 64)), make_image(1, (160, 96))
    tiny, big, thin = make_image(2, (20, 24)), make_image(3, (400, 300)), make_image(4, (300, 40))
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 4)
    return [
        {"prompt": chat("hello there")},
        {"prompt": chat("What is this?", 1), "multi_modal_data": {"image": a}},
        {"prompt": chat("What is this?", 1), "multi_modal_data": {"image": b}},
        {"prompt": chat("compare these two", 2), "multi_modal_data": {"image": [b, thin]}},
        {"prompt": chat(long, 1), "multi_modal_data": {"image": tiny}},  # below min_pixels
        {"prompt": chat("describe", 1), "multi_modal_data": {"image": big}},  # above max_pixels
        {"prompt": chat("describe", 1), "multi_modal_data": {"image": big},
         "mm_processor_kwargs": {"max_pixels": 32 * 32 * 8}},  # the request's own budget
    ]


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    path = make_qwen_checkpoint(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    items = prompts()
    refs, prompt_lens = hf_qwen_greedy(path, items, MAX_NEW)
    return path, items, refs, prompt_lens


def run_mmserve(path: str, items: list[dict], **engine_args) -> tuple[list[list[int]], LLM]:
    return run_greedy(path, items, MAX_NEW, **engine_args)


def test_batched_equals_transformers(variant):
    path, items, refs, _ = variant
    got, _ = run_mmserve(path, items)
    assert got == refs


def test_chunked_prefill_inside_images_equals_transformers(variant):
    path, items, refs, _ = variant
    got, _ = run_mmserve(path, items, max_num_batched_tokens=5, block_size=4)
    assert got == refs


def test_preemption_equals_transformers(variant):
    path, items, refs, prompt_lens = variant
    max_len = max(prompt_lens) + MAX_NEW + 1
    blocks = max(sum(-(-n // 4) for n in prompt_lens), -(-max_len // 4))  # growing needs preemption
    got, llm = run_mmserve(path, items, block_size=4, num_kv_blocks=blocks, max_model_len=max_len)
    assert llm.engine.core.scheduler.num_preemptions > 0, "the test meant to force preemption"
    assert got == refs


def test_every_cache_hitting_equals_transformers(variant):
    """The same prompts again on one engine: prefix blocks (with positions that depend on the
    images inside them) and encoder outputs are reused, and the tokens stay exact."""
    path, items, refs, _ = variant
    llm = LLM(model=path, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    first = [o.outputs[0].token_ids for o in llm.generate(items, params)]
    encoded = llm.engine.core.executor.runner.num_encoded_items
    again = llm.generate(items, params)
    assert first == refs and [o.outputs[0].token_ids for o in again] == refs
    assert llm.engine.core.executor.runner.num_encoded_items == encoded, "a repeat ran the encoder"
    assert all(o.num_cached_tokens > 0 for o in again)


def test_dynamic_resolution_sets_the_prompt_length(variant):
    """A larger image costs more prompt tokens; below min_pixels and above max_pixels clamp."""
    _, items, refs, prompt_lens = variant
    assert prompt_lens[2] > prompt_lens[1]  # 160x96 vs 64x64
    assert prompt_lens[5] > prompt_lens[6]  # the request's own max_pixels shrinks the image


def test_outputs_depend_on_the_image(variant):
    """Guards the tests above: with the image ignored, they could pass by accident."""
    _, _, refs, _ = variant
    assert refs[1] != refs[2]


def test_tp2_equals_transformers(variant):
    """Two gloo ranks: decoder and vision heads, the fused vision QKV and the mergers sharded;
    small steps split images across chunks."""
    path, items, refs, _ = variant
    llm = LLM(model=path, tensor_parallel_size=2, max_num_batched_tokens=16, block_size=4, num_kv_blocks=256)
    try:
        outs = llm.generate(items, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
        assert [o.outputs[0].token_ids for o in outs] == refs
    finally:
        llm.engine.core.shutdown()


def test_a_tied_checkpoint_equals_transformers(tmp_path):
    """Tied embeddings, published without `lm_head.weight`: the head is the embedding table (it
    once came apart from the table while loading and computed logits from uninitialised memory)."""
    path = make_tied_copy(make_qwen_checkpoint(tmp_path, **VARIANTS["qwen3-vl"]), tmp_path / "tied")
    items = prompts()[:3]
    refs, _ = hf_qwen_greedy(path, items, MAX_NEW)
    got, _ = run_mmserve(path, items)
    assert got == refs
