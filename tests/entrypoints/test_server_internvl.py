"""An InternVL checkpoint in InternVL's own layout (as `mmserve serve OpenGVLab/InternVL3-8B` serves
it) through the real server with the official client: the chat template's `<image>` placeholders
answer as the offline engine does, a repeat hits every cache layer, the request's tiling (vLLM's
`max_dynamic_patch`) shows in usage, and a tiling past the checkpoint's is a 400 that leaves the
server serving. Runs with --mm-cache-type shm."""

from __future__ import annotations

import openai
import pytest

from mmserve import LLM, SamplingParams
from mmserve.models.builtin_internvl import write_internvl_own_layout
from helpers.server_process import ServerProcess, data_url, labelled, messages
from helpers.tiny_models import make_image, make_internvl_checkpoint

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')

MAX_TOKENS = 6
IMAGE = (300, 140)  # two tiles and a thumbnail under the default tiling (2 x 1 is nearest its aspect)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("internvl-server")
    write_internvl_own_layout(make_internvl_checkpoint(folder), folder / "own")
    return str(folder / "own")


@pytest.fixture(scope="module")
def server(model_path):
    s = ServerProcess(model_path, "--served-model-name", "m", "--max-model-len", "1024", "--mm-cache-type", "shm",
                      "--mm-shm-cache-gb", "0.05")
    yield s
    s.stop()


def ask(client, url: str, **extra):
    return client.chat.completions.create(model="m", messages=messages(url), max_tokens=MAX_TOKENS,
                                          temperature=0.0, **extra)


def test_an_answer_equals_the_offline_engine_s_and_a_repeat_hits_every_layer(server, client, model_path):
    url = data_url(make_image(40, IMAGE))
    first = ask(client, url)
    before = {layer: labelled(server, "mmserve_cache_hits_total", layer) for layer in ("processor", "encoder", "shm")}
    again = ask(client, url)
    after = {layer: labelled(server, "mmserve_cache_hits_total", layer) for layer in before}
    assert again.choices[0].message.content == first.choices[0].message.content
    assert after["processor"] == before["processor"] + 1 and after["shm"] == before["shm"] + 1
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    llm = LLM(model=model_path, max_model_len=1024)
    try:
        prompt = llm.engine.input_processor.processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}])
        assert "<image>\nWhat is this?" in prompt
        offline = llm.generate({"prompt": prompt, "multi_modal_data": {"image": make_image(40, IMAGE)}},
                               SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        assert offline[0].outputs[0].text == first.choices[0].message.content
        assert len(offline[0].prompt_token_ids) == first.usage.prompt_tokens
    finally:
        llm.shutdown()


def test_the_request_s_tiling_sets_the_prompt_length(client):
    url = data_url(make_image(41, IMAGE))
    full = ask(client, url)
    one = ask(client, url, extra_body={"mm_processor_kwargs": {"max_dynamic_patch": 1}})
    assert full.usage.prompt_tokens - one.usage.prompt_tokens == 2 * 16  # three tiles of 16 tokens, then one


def test_a_tiling_past_the_checkpoint_s_is_a_400_and_the_server_serves_on(client):
    url = data_url(make_image(42, IMAGE))
    with pytest.raises(openai.BadRequestError, match=r"max_patches must be an integer in \[1, 6\]"):
        ask(client, url, extra_body={"mm_processor_kwargs": {"max_dynamic_patch": 99}})
    assert ask(client, url).choices[0].message.content
