"""Greedy outputs are token-for-token equal to transformers' `generate` on the same weights.

Each variant is a tiny LLaVA built here with transformers; between them they cover GQA and
MHA, two image sizes and two patch sizes, both feature-select strategies and feature layers
-1 and -2. Every variant runs its prompts all together, with prefill chunks smaller than one
image's placeholders, and with so few KV blocks that requests are preempted.
"""

from __future__ import annotations

import pytest

from mmserve import LLM
from helpers.parity_runs import run_greedy
from helpers.hf_reference import hf_greedy
from helpers.tiny_models import make_checkpoint, make_image

MAX_NEW = 10

VARIANTS = {
    "gqa-28px-p14-default-l-2": dict(text_config=dict(num_attention_heads=4, num_key_value_heads=2),
                                     vision_config=dict(image_size=28, patch_size=14),
                                     vision_feature_select_strategy="default", vision_feature_layer=-2),
    "mha-56px-p14-full-l-1": dict(text_config=dict(num_attention_heads=4, num_key_value_heads=4),
                                  vision_config=dict(image_size=56, patch_size=14),
                                  vision_feature_select_strategy="full", vision_feature_layer=-1),
    "gqa-32px-p8-full-l-2": dict(text_config=dict(num_attention_heads=4, num_key_value_heads=1),
                                 vision_config=dict(image_size=32, patch_size=8),
                                 vision_feature_select_strategy="full", vision_feature_layer=-2),
    "mha-32px-p8-default-l-1": dict(text_config=dict(num_attention_heads=2, num_key_value_heads=2),
                                    vision_config=dict(image_size=32, patch_size=8),
                                    vision_feature_select_strategy="default", vision_feature_layer=-1),
}

LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 8)


def prompts() -> list[dict]:
    a, b = make_image(0, (40, 40)), make_image(1, (64, 48))
    odd, thin = make_image(2, (17, 93)), make_image(3, (300, 20))
    return [
        {"prompt": "USER: hello there ASSISTANT:"},
        {"prompt": f"USER: {LONG} ASSISTANT:"},
        {"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": a}},
        {"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": b}},
        {"prompt": f"USER: <image>\n{LONG} ASSISTANT:", "multi_modal_data": {"image": odd}},
        {"prompt": "USER: compare <image> and <image> please ASSISTANT:", "multi_modal_data": {"image": [a, thin]}},
        {"prompt": "USER: <image>\nshort ASSISTANT:", "multi_modal_data": {"image": thin}},
        {"prompt": "<image>", "multi_modal_data": {"image": odd}},
    ]


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    items = prompts()
    refs, prompt_lens = hf_greedy(path, items, MAX_NEW)
    return path, items, refs, prompt_lens


def run_mmserve(path: str, items: list[dict], **engine_args) -> tuple[list[list[int]], LLM]:
    return run_greedy(path, items, MAX_NEW, **engine_args)


def test_batched_equals_transformers(variant):
    path, items, refs, _ = variant
    got, _ = run_mmserve(path, items)
    assert got == refs


def test_chunked_prefill_across_an_image_equals_transformers(variant):
    path, items, refs, _ = variant
    got, _ = run_mmserve(path, items, max_num_batched_tokens=3, block_size=4)
    assert got == refs


def test_preemption_equals_transformers(variant):
    path, items, refs, prompt_lens = variant
    max_len = max(prompt_lens) + MAX_NEW + 1
    # blocks for every prompt plus two: all are admitted, and they cannot all grow while decoding
    blocks = max(sum(-(-n // 4) for n in prompt_lens) + 2, -(-max_len // 4))
    got, llm = run_mmserve(path, items, block_size=4, num_kv_blocks=blocks, max_model_len=max_len)
    assert llm.engine.core.scheduler.num_preemptions > 0, "the test meant to force preemption"
    assert got == refs


def test_outputs_depend_on_the_image(variant):
    """Guards the tests above: with the image ignored, they could pass by accident."""
    _, _, refs, _ = variant
    assert refs[2] != refs[3]
