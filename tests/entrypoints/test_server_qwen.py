"""A Qwen3-VL checkpoint through the real server with the official client: dynamic resolution
shows in usage, a repeated request hits every cache layer and answers the same as offline,
`mm_processor_kwargs` is honoured per request, and an image larger than the encoder's budget is
a 400 that leaves the server serving. Runs with --mm-cache-type lru and shm."""

from __future__ import annotations

import openai
import pytest

from mmserve import LLM, SamplingParams
from helpers.server_process import ServerProcess, data_url, labelled, messages
from helpers.tiny_models import make_image, make_qwen_checkpoint

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')

MAX_TOKENS = 6
LAYERS = ("processor", "encoder", "prefix")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_qwen_checkpoint(tmp_path_factory.mktemp("qwen-server"), family="qwen3_vl",
                                min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 48)


@pytest.fixture(scope="module", params=["lru", "shm"])
def server(request, model_path):
    s = ServerProcess(model_path, "--served-model-name", "m", "--max-model-len", "512",
                      "--mm-cache-type", request.param,
                      "--mm-shm-cache-gb", "0.05", "--max-num-batched-tokens", "64")
    s.transport = "ipc" if request.param == "lru" else "shm"
    yield s
    s.stop()


def ask(client, url: str, **extra):
    return client.chat.completions.create(model="m", messages=messages(url), max_tokens=MAX_TOKENS,
                                          temperature=0.0, **extra)


def test_a_larger_image_costs_more_prompt_tokens(client):
    small = ask(client, data_url(make_image(30, (64, 64))))
    large = ask(client, data_url(make_image(31, (192, 160))))
    assert large.usage.prompt_tokens > small.usage.prompt_tokens


def test_a_repeat_hits_every_layer_and_answers_the_same(server, client, model_path):
    url = data_url(make_image(32, (160, 96)))
    layers = LAYERS + (server.transport,)
    before = {layer: labelled(server, "mmserve_cache_hits_total", layer) for layer in layers}
    first = ask(client, url)
    mid = {layer: labelled(server, "mmserve_cache_hits_total", layer) for layer in layers}
    again = ask(client, url)
    after = {layer: labelled(server, "mmserve_cache_hits_total", layer) for layer in layers}
    assert again.choices[0].message.content == first.choices[0].message.content
    # a first sight hits nothing but the prefix blocks of the template's shared system turn
    assert {k: v for k, v in mid.items() if k != "prefix"} == {k: v for k, v in before.items() if k != "prefix"}
    assert after["processor"] == mid["processor"] + 1 and after[server.transport] == mid[server.transport] + 1
    assert after["prefix"] > mid["prefix"]
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    llm = LLM(model=model_path, max_model_len=512)
    prompt = llm.engine.input_processor.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}])
    offline = llm.generate({"prompt": prompt, "multi_modal_data": {"image": make_image(32, (160, 96))}},
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert offline[0].outputs[0].text == first.choices[0].message.content


def test_the_encoder_cache_serves_an_image_under_new_text(server, client):
    url = data_url(make_image(33, (128, 128)))
    ask(client, url)
    before = labelled(server, "mmserve_cache_hits_total", "encoder")
    # new text before the image: no cached prefix (whole or partial block) reaches its rows
    new_text_first = [{"role": "user", "content": [{"type": "text", "text": "A different question entirely."},
                                                   {"type": "image_url", "image_url": {"url": url}}]}]
    client.chat.completions.create(model="m", messages=new_text_first, max_tokens=2, temperature=0.0)
    assert labelled(server, "mmserve_cache_hits_total", "encoder") == before + 1


def test_mm_processor_kwargs_shrink_an_image(client):
    url = data_url(make_image(34, (320, 320)))
    full = ask(client, url)
    small = ask(client, url, extra_body={"mm_processor_kwargs": {"max_pixels": 32 * 32 * 8}})
    assert small.usage.prompt_tokens < full.usage.prompt_tokens


def test_bad_processor_kwargs_and_oversized_items_are_400s(client):
    url = data_url(make_image(35, (320, 320)))
    for bad in ({"max_pixels": -1}, {"min_pixels": 4096, "max_pixels": 1024}, {"resample": 3}, {"max_pixels": 10**9}):
        with pytest.raises(openai.BadRequestError) as e:
            ask(client, url, extra_body={"mm_processor_kwargs": bad})
        assert e.value.status_code == 400
    assert ask(client, url).choices[0].message.content is not None
