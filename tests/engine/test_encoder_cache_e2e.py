"""The encoder cache with a tiny model: the same image after different text runs the vision
encoder zero times and its tokens equal transformers'; `--encoder-cache-tokens 0` encodes again
with the same tokens; with prefix caching, a hit that ends inside a resident image stays exact.
(Chunked prefill across images and preemption are covered by test_parity.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmserve import LLM, SamplingParams
from mmserve.metrics import ServerMetrics
from helpers.tiny_models import make_checkpoint, make_image

MAX_NEW = 8
FIRST = "USER: <image>\nWhat is this? ASSISTANT:"
OTHER_TEXT = "USER: look at the red car. <image>\nDescribe the colours you see. ASSISTANT:"
SAME_START = "USER: <image>\nHow many cats are sleeping on the sofa? ASSISTANT:"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("encoder_e2e"))


@pytest.fixture(scope="module")
def hf(path):
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(path)


def hf_tokens(hf, prompt: str, image) -> list[int]:
    model, processor = hf
    inputs = processor(text=prompt, images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def generate(llm: LLM, prompt: str, image):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, params)[0]
    llm.engine.core.check_integrity()
    return out


def encoder_runs(llm: LLM) -> int:
    return llm.engine.core.executor.runner.num_encoded_items


def test_the_same_image_after_different_text_is_not_encoded_again(path, hf):
    llm = LLM(model=path, enable_prefix_caching=False)
    image = make_image(0)
    first = generate(llm, FIRST, image)
    assert encoder_runs(llm) == 1
    second = generate(llm, OTHER_TEXT, image)
    assert encoder_runs(llm) == 1  # the prefix cache could not help: the encoder cache did
    assert second.outputs[0].token_ids == hf_tokens(hf, OTHER_TEXT, image)
    assert first.outputs[0].token_ids == hf_tokens(hf, FIRST, image)
    enc = llm.engine.core.stats().caches["encoder"]
    feature_size = llm.engine.core.model_config.max_item_tokens
    assert (enc.queries, enc.hits, enc.entries, enc.bytes_used, enc.evictions) == (2, 1, 1, feature_size, 0)
    exported = ServerMetrics(llm.engine.core.stats).render().decode()
    assert 'mmserve_cache_hits_total{layer="encoder"} 1.0' in exported
    generate(llm, OTHER_TEXT, make_image(1))
    assert encoder_runs(llm) == 2  # another image is encoded


def test_encoder_cache_off_encodes_again_with_the_same_tokens(path, hf):
    llm = LLM(model=path, enable_prefix_caching=False, encoder_cache_tokens=0)
    image = make_image(0)
    generate(llm, FIRST, image)
    second = generate(llm, OTHER_TEXT, image)
    assert encoder_runs(llm) == 2
    assert second.outputs[0].token_ids == hf_tokens(hf, OTHER_TEXT, image)
    runner = llm.engine.core.executor.runner
    llm.engine.core.step()  # the next step tells the runner to drop the unused output
    assert runner.encoder_outputs == {} and llm.engine.core.stats().caches["encoder"].entries == 0


def test_a_prefix_hit_ending_inside_a_resident_image_is_used_and_exact(path, hf):
    image = make_image(2)
    bs = 3
    llm = LLM(model=path, block_size=bs, enable_partial_block_caching=False)  # else the hit goes past the image
    processor = hf[1]
    ids = processor(text=FIRST, images=[image], return_tensors="pt")["input_ids"][0].tolist()
    image_id = llm.engine.core.model_config.image_token_id
    start, end = ids.index(image_id), len(ids) - ids[::-1].index(image_id)
    assert start < end // bs * bs < end, "the test needs a block boundary inside the image"
    generate(llm, FIRST, image)
    second = generate(llm, SAME_START, image)  # same blocks up to inside the image, then other text
    assert second.num_cached_tokens == end // bs * bs  # before the encoder cache: start // bs * bs
    assert encoder_runs(llm) == 1
    assert second.outputs[0].token_ids == hf_tokens(hf, SAME_START, image)
    partial = LLM(model=path, block_size=bs)
    generate(partial, FIRST, image)
    again = generate(partial, SAME_START, image)  # copies the shared text after the image too
    assert again.num_cached_tokens > end and again.outputs[0].token_ids == second.outputs[0].token_ids


def test_unchunked_mm_input_with_small_steps_is_exact_and_a_too_small_step_is_refused(path, hf):
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        LLM(model=path, max_num_batched_tokens=4, disable_chunked_mm_input=True)
    llm = LLM(model=path, max_num_batched_tokens=12, disable_chunked_mm_input=True, block_size=4)
    image = make_image(3)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": image}} for p in (FIRST, OTHER_TEXT)], params)
    assert encoder_runs(llm) == 1  # both requests in the same steps: one encoder run
    assert [o.outputs[0].token_ids for o in outs] == [hf_tokens(hf, p, image) for p in (FIRST, OTHER_TEXT)]
