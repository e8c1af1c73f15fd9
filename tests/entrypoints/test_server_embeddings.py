"""`POST /v1/embeddings` through the real server (`--runner pooling`, tiny LLaVA) and the `openai`
client: texts, token ids and a conversation with an image give the vectors `LLM.embed` gives for
the same prompts, in float or base64; usage counts the prompt tokens; a repeated input is the same
vector. Refusals are 400s with OpenAI's error body, decided before any work, and the server
serves on: text routes on a pooling server, embeddings on a text one, Matryoshka `dimensions`,
no input, a broken image."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from helpers.server_process import ServerProcess, data_url
from helpers.tiny_models import make_checkpoint, make_image
from mmserve import LLM, PoolingParams
from mmserve.multimodal.chat_templates import ChatTemplatePolicy

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')

TEXTS = ["USER: hello there ASSISTANT:", "USER: what is the weather like by the sea"]
IMAGE = make_image(3)
TURN = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMAGE)}},
                                     {"type": "text", "text": "What is this?"}]}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("embed"))


@pytest.fixture(scope="module")
def server(checkpoint):
    s = ServerProcess(checkpoint, "--served-model-name", "m", "--runner", "pooling", "--max-model-len", "256")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline(checkpoint):
    with LLM(model=checkpoint, device="cpu", runner="pooling", max_model_len=256) as llm:
        yield llm


def _post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def test_texts_and_token_ids_give_the_offline_vectors_in_float_and_base64(server, offline):
    want = [out.outputs.embedding for out in offline.embed(TEXTS)]
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    answer = client.embeddings.create(model="m", input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.embedding for d in answer.data] == want and [d.index for d in answer.data] == [0, 1]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(
        len(out.prompt_token_ids) for out in offline.embed(TEXTS))
    floats = _post(server, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "float"}).json()
    assert floats["object"] == "list" and floats["model"] == "m" and floats["id"].startswith("embd-")
    assert floats["data"][0]["embedding"] == want[0] and floats["data"][0]["object"] == "embedding"
    assert np.linalg.norm(want[0]) == pytest.approx(1.0, abs=1e-6)
    ids = offline.get_tokenizer()(TEXTS[1])["input_ids"]
    by_ids = _post(server, "/v1/embeddings", {"input": [ids], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(by_ids["data"][0]["embedding"]), dtype="<f4").tolist()
    assert decoded == want[1]


def test_a_conversation_with_an_image_and_normalize_false(server, offline):
    body = {"model": "m", "messages": TURN, "encoding_format": "float", "normalize": False}
    first = _post(server, "/v1/embeddings", body).json()
    again = _post(server, "/v1/embeddings", body).json()
    assert first["data"][0]["embedding"] == again["data"][0]["embedding"]  # the first-token cache's answer
    assert first["usage"]["prompt_tokens"] > 20 and np.linalg.norm(first["data"][0]["embedding"]) > 2
    no_reply_header = ChatTemplatePolicy().options(None, None, False, False)  # the route's default
    prompt = offline.engine.input_processor.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}], None,
        no_reply_header)
    mine = offline.embed({"prompt": prompt, "multi_modal_data": {"image": IMAGE}}, PoolingParams(normalize=False))
    assert len(mine[0].prompt_token_ids) == first["usage"]["prompt_tokens"]
    assert first["data"][0]["embedding"] == mine[0].outputs.embedding


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"input": "hi", "dimensions": 8}, "dimensions"),
    ("/v1/embeddings", {}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, None),
])
def test_bad_input_is_a_400_and_the_server_serves_on(server, path, body, param):
    answer = _post(server, path, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["message"] and (param is None or error["param"] == param)
    assert _post(server, "/v1/embeddings", {"input": "still here"}).status_code == 200
    health = httpx.get(server.base_url + "/health", timeout=10)
    assert health.status_code == 200


def test_each_server_refuses_the_other_runners_routes(server, checkpoint):
    chat = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "unsupported_model_task"
    assert "--runner pooling" in chat.json()["error"]["message"]
    text = ServerProcess(checkpoint, "--max-model-len", "256")
    try:
        answer = _post(text, "/v1/embeddings", {"input": "hi"})
        assert answer.status_code == 400
        assert "start the server with --runner pooling" in answer.json()["error"]["message"]
    finally:
        text.stop()
