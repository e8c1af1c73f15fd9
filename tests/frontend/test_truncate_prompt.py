"""vLLM's `truncate_prompt_tokens` offline, on a tiny Qwen2.5-VL (M-RoPE: the positions follow the
items' offsets): a prompt cut before its image answers as the prompt that starts there does (the
image's placeholder moved with the cut), a cut that would reach the image is refused and leaves
nothing in flight or in the processor cache, and the values vLLM refuses are refused."""

from __future__ import annotations

import pytest

from helpers.tiny_models import make_image, make_qwen_checkpoint
from mmserve import LLM, SamplingParams

PREFIX = "<|im_start|>system\nYou look at pictures and answer in a few words, always.<|im_end|>\n"
REST = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_qwen_checkpoint(tmp_path_factory.mktemp("truncate"), family="qwen2_5_vl",
                                min_pixels=28 * 28 * 4, max_pixels=32 * 32 * 16)
    return LLM(model=path, device="cpu", max_model_len=512)


def _params(keep: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=6, truncate_prompt_tokens=keep)


def test_a_cut_before_the_image_answers_as_the_prompt_starting_there(llm):
    image = {"image": make_image(4, (64, 48))}
    rest = llm.generate({"prompt": REST, "multi_modal_data": image}, _params())[0]
    whole = llm.generate({"prompt": PREFIX + REST, "multi_modal_data": image}, _params())[0]
    assert len(whole.prompt_token_ids) > len(rest.prompt_token_ids)  # the prefix's tokens (a special token ends it)
    cut = llm.generate({"prompt": PREFIX + REST, "multi_modal_data": image}, _params(len(rest.prompt_token_ids)))[0]
    assert cut.prompt_token_ids == rest.prompt_token_ids == whole.prompt_token_ids[-len(rest.prompt_token_ids):]
    assert cut.outputs[0].token_ids == rest.outputs[0].token_ids
    kept = llm.generate({"prompt": PREFIX + REST, "multi_modal_data": image}, _params(10**4 // 50))[0]
    assert kept.prompt_token_ids == whole.prompt_token_ids  # K past the prompt's length: nothing cut


def test_a_cut_into_the_image_is_refused_and_leaves_nothing(llm):
    items = llm.engine.input_processor.items
    image = {"image": make_image(5, (64, 48))}
    rest = llm.generate({"prompt": REST, "multi_modal_data": image}, _params())[0]
    before = items.cache.stats().entries
    pad = llm.get_tokenizer().convert_tokens_to_ids("<|image_pad|>")
    first = rest.prompt_token_ids.index(pad)  # the image's first token in REST
    keep = len(rest.prompt_token_ids) - first - 1  # the prefix, the text before the image and one image token
    with pytest.raises(ValueError, match=rf"would cut into an image.* \(keep {keep + 1} or more\)"):
        llm.generate({"prompt": PREFIX + REST, "multi_modal_data": {"image": make_image(6, (64, 48))}},
                     _params(keep))
    assert items.inflight.futures == {} and items.cache.stats().entries == before  # image 6 processed, dropped
    assert llm.generate({"prompt": REST, "multi_modal_data": image}, _params())[0].outputs[0].token_ids == \
        rest.outputs[0].token_ids  # the engine serves on


def test_token_prompts_are_cut_too_and_minus_one_fits_the_context(llm):
    ids = list(range(100, 700))  # 600 tokens, past max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": ids}, _params())
    out = llm.generate({"prompt_token_ids": ids}, _params(-1))[0]
    assert out.prompt_token_ids == ids[-511:]
    short = llm.generate({"prompt_token_ids": ids}, _params(7))[0]
    assert short.prompt_token_ids == ids[-7:]
    assert short.outputs[0].token_ids == llm.generate({"prompt_token_ids": ids[-7:]}, _params())[0].outputs[0].token_ids


@pytest.mark.parametrize("keep", [0, -2, 1.5])
def test_values_vllm_refuses_are_refused(keep):
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=keep)


def test_more_than_max_model_len_is_refused(llm):
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(513\) is greater than max_model_len \(512\)"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, _params(513))
