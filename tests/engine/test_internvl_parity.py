"""InternVL 3 and 3.5: greedy outputs token-for-token equal to transformers' `generate`.

Two tiny checkpoints built here with transformers: InternVL 3's shape (a Qwen2 decoder with a
bias on q, k, v; tied embeddings, as InternVL3-1B is published) and InternVL 3.5's (a Qwen3 decoder
with q / k norms; untied). The prompts cover no image, one tile, several tiles with the thumbnail,
two images of other aspect ratios, and a request with its own tiling in vLLM's and transformers'
names. Every variant runs them batched, with prefill chunks smaller than one tile, with
preemption, again with every cache hitting, and over two tensor-parallel ranks; and in InternVL's
own layout (`InternVLChatModel`, written here from the same weights as transformers' conversion
script reads them), against transformers on the `-hf` twin. An AWQ decoder, in both layouts.
"""

from __future__ import annotations

import json

import pytest

from mmserve import LLM, SamplingParams
from mmserve.models.builtin_internvl import write_internvl_own_layout
from mmserve.models.quantization.select import describe_quantization
from helpers.hf_internvl import hf_internvl_greedy
from helpers.parity_runs import run_greedy
from helpers.quant_checkpoints import quantize_copy
from helpers.tiny_models import make_image, make_internvl_checkpoint

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')

MAX_NEW = 8
VARIANTS = {
    "internvl3": dict(text_model_type="qwen2"),
    "internvl3.5": dict(text_model_type="qwen3", tie_word_embeddings=False),
}


def chat(text: str, images: int = 0) -> str:
    return f"<|im_start|>user\n{'<IMG_CONTEXT>' * images}\n{text}<|im_end|>\n<|im_start|>assistant\n"


def prompts(vllm_names: bool = False) -> list[dict]:
    """`vllm_names`: the request's own tiling in vLLM's names (else transformers', as the
    reference takes them)."""
    a, b = make_image(0, (64, 64)), make_image(1, (160, 96))
    wide, tall = make_image(3, (400, 150)), make_image(4, (60, 300))
    tiling = {"max_dynamic_patch": 2} if vllm_names else {"max_patches": 2}
    return [
        {"prompt": chat("hello there")},
        {"prompt": chat("What is this?", 1), "multi_modal_data": {"image": a}},  # one tile
        {"prompt": chat("What is this?", 1), "multi_modal_data": {"image": b}},  # tiles and a thumbnail
        {"prompt": chat("compare these two", 2), "multi_modal_data": {"image": [wide, tall]}},
        {"prompt": chat("describe", 1), "multi_modal_data": {"image": wide}, "mm_processor_kwargs": tiling},
    ]


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    path = make_internvl_checkpoint(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    refs, prompt_lens = hf_internvl_greedy(path, prompts(), MAX_NEW)
    return path, refs, prompt_lens


def test_batched_equals_transformers(variant):
    path, refs, _ = variant
    got, _ = run_greedy(path, prompts(vllm_names=True), MAX_NEW)
    assert got == refs


def test_chunked_prefill_inside_tiles_equals_transformers(variant):
    path, refs, _ = variant
    got, _ = run_greedy(path, prompts(), MAX_NEW, max_num_batched_tokens=5, block_size=4)
    assert got == refs


def test_preemption_equals_transformers(variant):
    path, refs, prompt_lens = variant
    max_len = max(prompt_lens) + MAX_NEW + 1
    blocks = max(sum(-(-n // 4) for n in prompt_lens), -(-max_len // 4))  # growing needs preemption
    got, llm = run_greedy(path, prompts(), MAX_NEW, block_size=4, num_kv_blocks=blocks, max_model_len=max_len)
    assert llm.engine.core.scheduler.num_preemptions > 0, "the test meant to force preemption"
    assert got == refs


def test_every_cache_hitting_equals_transformers(variant):
    """The same prompts again on one engine: prefix blocks and encoder outputs are reused, and the
    tokens stay exact."""
    path, refs, _ = variant
    llm = LLM(model=path, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts(), params)]
    encoded = llm.engine.core.executor.runner.num_encoded_items
    again = llm.generate(prompts(), params)
    assert first == refs and [o.outputs[0].token_ids for o in again] == refs
    assert llm.engine.core.executor.runner.num_encoded_items == encoded, "a repeat ran the encoder"
    assert all(o.num_cached_tokens > 0 for o in again)


def test_tiles_set_the_prompt_length(variant):
    """More tiles, more tokens: one tile for a small square image, tiles plus a thumbnail for a
    larger one, fewer with the request's own max_patches. And the outputs follow the image."""
    _, refs, prompt_lens = variant
    assert prompt_lens[2] > prompt_lens[1]
    assert prompt_lens[4] < prompt_lens[3]
    assert refs[1] != refs[2]


def test_tp2_equals_transformers(variant):
    """Two gloo ranks: the decoder's and the tower's heads, the MLPs and the projector sharded;
    small steps split tiles across chunks."""
    path, refs, _ = variant
    llm = LLM(model=path, tensor_parallel_size=2, max_num_batched_tokens=16, block_size=4, num_kv_blocks=256)
    try:
        outs = llm.generate(prompts(), SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
        assert [o.outputs[0].token_ids for o in outs] == refs
    finally:
        llm.engine.core.shutdown()


def own_prompts() -> list[dict]:
    """`prompts()` as InternVL's own layout is prompted: an image is `<image>` (vLLM's placeholder)."""
    return [{**item, "prompt": item["prompt"].replace("<IMG_CONTEXT>", "<image>")} for item in prompts()]


@pytest.fixture(scope="module")
def own_layout(variant, tmp_path_factory):
    """The variant's weights in InternVL's own layout (`InternVLChatModel`: fused `qkv`, `mlp1`,
    `llm_config`, the tiling in config.json), and transformers' tokens on the same weights."""
    path, refs, _ = variant
    own = tmp_path_factory.mktemp("own") / "internvl-chat"
    write_internvl_own_layout(path, own)
    return str(own), refs


def test_internvl_s_own_layout_equals_transformers(own_layout):
    """`OpenGVLab/InternVL3-8B` as published: the same tokens as transformers on the `-hf` twin."""
    path, refs = own_layout
    got, llm = run_greedy(path, own_prompts(), MAX_NEW, max_num_batched_tokens=16, block_size=4)
    assert got == refs
    assert llm.engine.core.executor.runner.model.config.layout == "chat"


def test_internvl_s_own_layout_over_two_ranks(own_layout):
    """The fused `qkv` split by heads over two gloo ranks (q's, k's and v's rows of each rank)."""
    path, refs = own_layout
    llm = LLM(model=path, tensor_parallel_size=2, block_size=4, num_kv_blocks=256)
    try:
        outs = llm.generate(own_prompts(), SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
        assert [o.outputs[0].token_ids for o in outs] == refs
    finally:
        llm.engine.core.shutdown()


def test_an_awq_decoder_in_either_layout_equals_transformers_on_its_weights(tmp_path):
    """InternVL's AWQ releases quantize the decoder alone: the same tokens as transformers on the
    dequantized weights, from transformers' layout and from InternVL's own."""
    source = make_internvl_checkpoint(tmp_path / "dense")
    quantized, dequantized = quantize_copy(source, tmp_path, "awq")
    refs, _ = hf_internvl_greedy(dequantized, prompts()[:3], MAX_NEW)
    got, llm = run_greedy(quantized, prompts()[:3], MAX_NEW)
    assert got == refs
    assert "awq" in describe_quantization(llm.engine.core.executor.runner.model)
    own = tmp_path / "awq-own"
    write_internvl_own_layout(quantized, own)
    assert run_greedy(str(own), own_prompts()[:3], MAX_NEW)[0] == refs
    # as OpenGVLab publishes its AWQ releases: the config in `llm_config`, no modules_to_not_convert
    config = json.loads((own / "config.json").read_text())
    quant = {k: v for k, v in config.pop("quantization_config").items() if k != "modules_to_not_convert"}
    config["llm_config"]["quantization_config"] = quant
    (own / "config.json").write_text(json.dumps(config))
    got, llm = run_greedy(str(own), own_prompts()[:3], MAX_NEW)
    assert got == refs
    assert "awq" in describe_quantization(llm.engine.core.executor.runner.model)


def test_dynamic_ntk_rope_within_the_trained_length_equals_transformers(tmp_path):
    """Decoders published with dynamic NTK rope (`rope_type: dynamic`, factor 2): within
    max_position_embeddings transformers leaves the rotary base as it is, and so does mmserve (it
    was refused as an unsupported rope type)."""
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    path = make_internvl_checkpoint(tmp_path, text_config={"rope_parameters": rope})
    refs, _ = hf_internvl_greedy(path, prompts()[:3], MAX_NEW)
    assert run_greedy(path, prompts()[:3], MAX_NEW)[0] == refs
