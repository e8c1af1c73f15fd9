"""`mmserve serve org/name` end to end: the repo id fetched from a loopback Hub by the real
huggingface_hub client, once, before the API servers and the engine core start."""

from __future__ import annotations

import json

import httpx
import pytest

from helpers.loopback_hub import LoopbackHub, read_folder
from helpers.server_process import ServerProcess
from helpers.tiny_models import make_checkpoint

pytestmark = pytest.mark.slow  # spawns a server (deselect with -m 'not slow')


def test_serve_a_repo_id_lists_it_and_answers(tmp_path):
    files = read_folder(make_checkpoint(tmp_path / "ckpt"))
    files["generation_config.json"] = json.dumps({"eos_token_id": [2, 3], "temperature": 0.5}).encode()
    with LoopbackHub() as hub:
        hub.add("org/tiny-llava", {"main": files})
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "0",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        server = ServerProcess("org/tiny-llava", "--api-server-count", "2", "--max-model-len", "256", env=env)
        try:
            status, body = server.get("/v1/models")
            assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["org/tiny-llava"]
            r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
                "model": "org/tiny-llava", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": "What is this?"}]})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"]
        finally:
            server.stop()
        output = server.output()
    assert "generation stops at EOS ids [2, 3]" in output and "temperature=0.5" in output
    assert output.count("generation stops at EOS ids") == 1  # said once, by the first API server
    infos = [p for method, p in hub.requests if p.startswith("/api/models/org/tiny-llava/revision/")]
    assert len(infos) == 1  # resolved once, in the parent, for both API servers and the engine core
    weights = [p for method, p in hub.requests if method == "GET" and p.endswith("model.safetensors")]
    assert len(weights) == 1
