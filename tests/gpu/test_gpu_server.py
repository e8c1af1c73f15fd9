"""On a CUDA GPU: the server answers the `openai` client (chat with an image, streamed and whole,
and a completion), its engine on CUDA. `make test-gpu`; skipped where CUDA is absent."""

from __future__ import annotations

import openai
import pytest

from helpers.gpu_cases import checkpoint
from helpers.server_process import ServerProcess, data_url, messages
from helpers.tiny_models import make_image

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["builtin:tiny-llava", "qwen2_5_vl"])
def test_the_server_answers_the_openai_client_on_cuda(tmp_path, name):
    # --device cuda: the engine runs on the GPU or the server does not start
    server = ServerProcess(checkpoint(name, tmp_path), "--device", "cuda", "--max-model-len", "512",
                           "--served-model-name", "m", timeout_s=300)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        chat = messages(data_url(make_image(3, (64, 48))))
        whole = client.chat.completions.create(model="m", messages=chat, max_tokens=8, temperature=0)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model="m", messages=chat, max_tokens=8, temperature=0, stream=True) if chunk.choices)
        assert whole.choices[0].message.content == streamed
        assert whole.usage.completion_tokens == 8 or whole.choices[0].finish_reason == "stop"
        text = client.completions.create(model="m", prompt="hello", max_tokens=4, temperature=0.7, seed=1)
        assert text.choices[0].text is not None
    finally:
        server.stop()
