"""generation_config.json read as vLLM reads it (models/generation_config.py): every EOS id stops
generation, and the file's sampling values fill what a request leaves unset (the request wins)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from helpers.fake_engine import FakeEngine, messages, post
from helpers.tiny_models import make_checkpoint, make_image
from mmserve import LLM, SamplingParams
from mmserve.entrypoints.openai.app import build_app
from mmserve.entrypoints.openai.protocol_completions import CompletionRequest
from mmserve.models.generation_config import load_generation_defaults
from mmserve.models.hf_config import eos_token_id, eos_token_ids

PROMPT = {"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": make_image(0)}}
QWEN_25_VL = {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
              "repetition_penalty": 1.05, "temperature": 0.1, "top_p": 0.001, "top_k": 1, "min_p": 0.05,
              "transformers_version": "4.49.0"}


def with_generation_config(src: str, dst: Path, values: dict) -> str:
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps(values))
    return str(dst)


def test_a_list_of_eos_ids_is_read_whole(tmp_path):
    path = with_generation_config(make_checkpoint(tmp_path / "a"), tmp_path / "b", QWEN_25_VL)
    assert eos_token_ids(path) == (151645, 151643) and eos_token_id(path) == 151645
    defaults = load_generation_defaults(path)
    assert defaults.sampling == {"repetition_penalty": 1.05, "temperature": 0.1, "top_p": 0.001, "top_k": 1,
                                 "min_p": 0.05}
    assert "temperature=0.1" in defaults.describe() and "min_p=0.05" in defaults.describe()
    assert load_generation_defaults(path, "vllm").sampling == {}
    assert load_generation_defaults(path, "vllm").eos_token_ids == (151645, 151643)  # EOS either way
    params = defaults.with_eos_stops(SamplingParams(stop_token_ids=[9]))
    assert params.stop_token_ids == [9, 151643]
    assert defaults.with_eos_stops(SamplingParams(ignore_eos=True)).stop_token_ids == []


def test_invalid_sampling_defaults_are_refused_at_start(tmp_path):
    path = with_generation_config(make_checkpoint(tmp_path / "a"), tmp_path / "b", {"top_p": 0.0})
    with pytest.raises(ValueError, match="sampling defaults are not valid: top_p must be in"):
        load_generation_defaults(path)


def test_every_eos_id_stops_generation_and_the_defaults_apply_offline(tmp_path):
    base = make_checkpoint(tmp_path / "a")
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    full = LLM(model=base, max_model_len=256).generate([PROMPT], greedy)[0].outputs[0].token_ids
    second = next(i for i, t in enumerate(full) if i > 0 and t not in full[:i])  # its first appearance
    eos = eos_token_id(base)
    path = with_generation_config(base, tmp_path / "b", {"eos_token_id": [eos, full[second]], "temperature": 0.0,
                                                         "max_new_tokens": 6})
    llm = LLM(model=path, max_model_len=256)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=6)
    out = llm.generate([PROMPT])[0].outputs[0]  # the file's defaults: greedy, and every EOS id stops it
    assert out.token_ids == full[: second + 1] and out.finish_reason == "stop"
    assert out.stop_reason == full[second]  # as vLLM reports a generation config's EOS id
    assert llm.generate([PROMPT], greedy)[0].outputs[0].token_ids == full  # ignore_eos: on to max_tokens


@pytest.fixture
def engine(tmp_path) -> FakeEngine:
    (tmp_path / "generation_config.json").write_text(json.dumps({**QWEN_25_VL, "max_new_tokens": 10}))
    engine = FakeEngine()
    engine.generation_defaults = load_generation_defaults(str(tmp_path))
    return engine


def test_the_servers_requests_take_the_files_defaults_where_they_set_none(engine):
    client = TestClient(build_app(engine, ["tiny"]))
    assert post(client, {"messages": messages()}).status_code == 200
    unset = engine.params[-1]
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p, unset.repetition_penalty, unset.max_tokens) == (
        0.1, 0.001, 1, 0.05, 1.05, 10)
    body = {"messages": messages(), "temperature": 0.9, "top_p": 0.5, "top_k": -1, "min_p": 0.0,
            "repetition_penalty": 1.0, "max_tokens": 3}
    assert post(client, body).status_code == 200
    own = engine.params[-1]
    assert (own.temperature, own.top_p, own.top_k, own.min_p, own.repetition_penalty, own.max_tokens) == (
        0.9, 0.5, None, 0.0, 1.0, 3)
    defaults = engine.generation_defaults
    completion = CompletionRequest(prompt="hi").to_sampling_params(64, defaults.request_defaults)
    assert (completion.temperature, completion.max_tokens) == (0.1, 16)  # OpenAI's default max_tokens stays
    r = client.post("/v1/responses", json={"input": "hi"})
    assert r.status_code == 200, r.text
    assert (engine.params[-1].temperature, engine.params[-1].top_k, engine.params[-1].max_tokens) == (0.1, 1, 10)


def test_max_new_tokens_never_exceeds_the_models_length(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 100_000, "eos_token_id": 2}))
    engine = FakeEngine()
    engine.generation_defaults = load_generation_defaults(str(tmp_path))
    client = TestClient(build_app(engine, ["tiny"]))
    assert post(client, {"messages": messages()}).status_code == 200
    assert engine.params[-1].max_tokens == FakeEngine.max_model_len


def test_override_generation_config_sets_defaults_over_the_files(tmp_path, capsys):
    """vLLM's `--override-generation-config`: its values over the file's (auto), or alone (vllm)."""
    path = with_generation_config(make_checkpoint(tmp_path / "a"), tmp_path / "b", QWEN_25_VL)
    over = {"temperature": 0.7, "max_new_tokens": 3}
    merged = load_generation_defaults(path, "auto", over)
    assert merged.sampling == {"repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.001, "top_k": 1,
                               "min_p": 0.05, "max_tokens": 3}
    assert "--override-generation-config" in merged.describe()
    alone = load_generation_defaults(path, "vllm", over)
    assert alone.sampling == {"temperature": 0.7, "max_tokens": 3} and "vllm ignores" not in alone.describe()
    with pytest.raises(ValueError, match="sampling defaults are not valid: top_p"):
        load_generation_defaults(path, "auto", {"top_p": 2.0})
    llm = LLM(model=path, max_model_len=256, override_generation_config={"temperature": 0.0, "max_new_tokens": 3})
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_p=0.001, top_k=1, min_p=0.05,
                                                               repetition_penalty=1.05, max_tokens=3)
    assert len(llm.generate([PROMPT])[0].outputs[0].token_ids) <= 3
    from mmserve.cli import main
    assert main(["serve", "--port", "0", "--override-generation-config", '{"max_tokens": 5}']) == 2
    err = capsys.readouterr().err
    assert "override_generation_config must be a JSON object of generation_config.json's sampling names" in err
