"""vLLM's `/tokenize` and `/detokenize` through the real server (tiny LLaVA): a prompt's or a
conversation's tokens are the ones its request runs (`count` equals `usage.prompt_tokens`, an
image counted as its placeholder tokens); ids decode back; bad input is a 400, and an API key
guards the routes as it guards /v1."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from helpers.server_process import ServerProcess, data_url
from helpers.tiny_models import make_checkpoint, make_image

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')

KEY = {"Authorization": "Bearer k"}
TURN = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(make_image(6))}},
                                     {"type": "text", "text": "What is this?"}]}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tokenize"))


@pytest.fixture(scope="module")
def server(checkpoint):
    s = ServerProcess(checkpoint, "--served-model-name", "m", "--max-model-len", "256", "--api-key", "k")
    yield s
    s.stop()


def post(server: ServerProcess, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=KEY if headers is None else headers, timeout=60)


def test_a_conversations_count_is_its_requests_prompt_tokens(server):
    tokens = post(server, "/tokenize", {"model": "m", "messages": TURN}).json()
    chat = post(server, "/v1/chat/completions", {"model": "m", "messages": TURN, "max_tokens": 1}).json()
    assert tokens["count"] == len(tokens["tokens"]) == chat["usage"]["prompt_tokens"] > 20
    assert tokens["max_model_len"] == 256 and tokens["token_strs"] is None
    bare = post(server, "/tokenize", {"messages": TURN, "add_generation_prompt": False}).json()
    assert bare["count"] < tokens["count"] and tokens["tokens"][:bare["count"]] == bare["tokens"]


def test_a_prompts_tokens_strings_and_their_decoding(server, checkpoint):
    text = "USER: hello there ASSISTANT:"
    tokens = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    reference = AutoTokenizer.from_pretrained(checkpoint)
    assert tokens["tokens"] == reference(text)["input_ids"]
    assert tokens["token_strs"] == reference.convert_ids_to_tokens(tokens["tokens"])
    completion = post(server, "/v1/completions", {"prompt": text, "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == tokens["count"]
    decoded = post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()
    assert decoded == {"prompt": reference.decode(tokens["tokens"])}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": TURN}, "prompt"),
    ("/tokenize", {"messages": TURN, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"model": "other", "prompt": "a"}, "model"),
    ("/tokenize", {"prompt": "a" * 5000}, None),  # past max_model_len, as its request would be
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": "12"}, None),
    ("/detokenize", {"tokens": [1] * 257}, "tokens"),
])
def test_bad_input_is_a_400_with_the_openai_body(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["message"] and (param is None or error["param"] == param), error


def test_the_api_key_guards_them(server):
    assert post(server, "/tokenize", {"prompt": "a"}, headers={}).status_code == 401
    assert post(server, "/detokenize", {"tokens": [1]}, headers={}).status_code == 401
