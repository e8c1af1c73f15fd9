"""A vLLM `serve` command line runs on mmserve: each vLLM flag mmserve has no flag of its own for
(config/vllm_flags.py) is done anyway, without effect, or refused by name — before any model loads,
as one `mmserve: error:` line. A server started with a typical vLLM command line serves and says
what each of its flags did; vLLM's HTTPS, root-path and CORS flags do what they do there."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from mmserve.cli import main
from mmserve.config.vllm_flags import DONE, REFUSED, VLLM_FLAGS
from helpers.server_process import ServerProcess
from helpers.tiny_models import make_checkpoint

# what `vllm serve Qwen/Qwen2.5-VL-7B-Instruct ...` lines commonly carry, besides flags mmserve shares
VLLM_LINE = ["--trust-remote-code", "--disable-log-requests", "--disable-log-stats", "--enable-chunked-prefill",
             "--swap-space", "4", "--max-logprobs", "20", "--uvicorn-log-level", "warning", "--tokenizer-mode",
             "auto", "--load-format", "safetensors", "--distributed-executor-backend", "mp",
             "--guided-decoding-backend", "xgrammar", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


@pytest.mark.parametrize("flag", [f for f in VLLM_FLAGS if f.kind == REFUSED], ids=lambda f: f.flag)
def test_a_feature_mmserve_lacks_is_refused_by_name_before_anything_loads(capsys, flag):
    args = [flag.flag] if flag.switch else [flag.flag, "x"]
    assert main(["serve", "--port", "0", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mmserve: error: {flag.flag} (vLLM's flag): "), err


@pytest.mark.parametrize("args, words", [
    (["--load-format", "gguf"], "--load-format (vLLM's flag) takes auto or safetensors here"),
    (["--distributed-executor-backend", "ray"], "--data-parallel-backend ray"),
    (["--pipeline-parallel-size", "2"], "takes 1 here"),
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill (vLLM's flag) cannot be honoured"),
    (["--no-trust-remote-code", "--no-enable-lora", "--task", "embed"], "--task (vLLM's flag)"),  # those two are fine
    (["--task", "embed"], "--task (vLLM's flag) takes auto or generate here"),
])
def test_a_value_mmserve_cannot_honour_is_refused(capsys, args, words):
    assert main(["serve", "--port", "0", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmserve: error: ") and words in err[0], err


def test_every_flag_is_vllms_and_none_shadows_mmservess_own():
    import argparse

    from mmserve.cli import _add_serve_parser

    parser = argparse.ArgumentParser()
    _add_serve_parser(parser.add_subparsers())  # argparse refuses a flag added twice
    assert len({f.flag for f in VLLM_FLAGS}) == len(VLLM_FLAGS)
    assert all(f.kind != REFUSED or not f.accepts for f in VLLM_FLAGS)
    assert {f.kind for f in VLLM_FLAGS} == {DONE, "ignored", REFUSED}


def test_a_vllm_command_line_with_https_a_root_path_and_cors_serves(tmp_path):
    """A typical vLLM command line starts, says what each of its vLLM flags did, and serves; with
    vLLM's `--ssl-keyfile` / `--ssl-certfile` the official client talks to it over HTTPS (a test
    CA's certificate, untrusted by default); `--root-path`: the OpenAPI page is addressed under the
    prefix; `--allowed-origins`: a preflight from that origin is answered before the API key and
    its answers carry the header; another origin gets none; `--middleware`: a class and a function
    of the operator's see every request, a refused one too; then `_tokens_by_id_and_usage_always`."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    key_file, cert_file, ca_file = tmp_path / "key.pem", tmp_path / "cert.pem", tmp_path / "ca.pem"
    cert.private_key_pem.write_to_path(str(key_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    ca.cert_pem.write_to_path(str(ca_file))
    ui, path = "https://ui.example", make_checkpoint(tmp_path)
    tests = str(Path(__file__).parent)  # helpers.user_middleware, for the server's --middleware
    server = ServerProcess(path, "--served-model-name", "m", "--api-key", "sk", *VLLM_LINE,
                           "--ssl-keyfile", str(key_file), "--ssl-certfile", str(cert_file), "--root-path", "/api",
                           "--allowed-origins", f'["{ui}"]', "--middleware", "helpers.user_middleware.Stamp",
                           "--middleware", "helpers.user_middleware.seen", "--return-tokens-as-token-ids",
                           "--enable-force-include-usage", "--enable-request-id-headers", ca=str(ca_file),
                           env={"PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])})
    try:
        deadline = time.monotonic() + 10  # healthy first, then the line
        while "mmserve: serving" not in server.output() and time.monotonic() < deadline:
            time.sleep(0.05)
        log = server.output()
        url = server.base_url
        with httpx.Client(verify=server.ssl) as http, \
                openai.OpenAI(base_url=url + "/v1", api_key="sk", http_client=http, max_retries=0) as client:
            r = client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
            assert r.choices[0].message.content is not None
            preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
            allowed = http.options(url + "/v1/chat/completions", headers={"Origin": ui, **preflight})
            assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ui
            other = http.options(url + "/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight})
            assert "access-control-allow-origin" not in other.headers
            models = http.get(url + "/v1/models", headers={"Origin": ui, "Authorization": "Bearer sk"})
            assert models.status_code == 200 and models.headers["access-control-allow-origin"] == ui
            assert "/api/openapi.json" in http.get(url + "/docs").text
            refused = http.get(url + "/v1/models")  # no key: the middleware is outside the key's check
            assert refused.status_code == 401 and refused.headers["x-stamp"] == "asgi"
            assert refused.headers["x-seen"].endswith("/v1/models")
            _tokens_by_id_and_usage_always(client, http, url)
            _request_ids(http, url)
        with pytest.raises(httpx.ConnectError):  # the certificate is the test CA's: not trusted by default
            httpx.get(url + "/health")
    finally:
        server.stop()
    assert f"mmserve: serving {path} on https://" in log
    for flag in ("--trust-remote-code", "--disable-log-requests", "--enable-chunked-prefill", "--swap-space 4",
                 "--load-format safetensors"):
        assert f"mmserve: vLLM's {flag}: " in log, log[-3000:]
    assert "--disable-log-stats" not in log  # mmserve's own flag: the periodic stats line is off


def _tokens_by_id_and_usage_always(client: openai.OpenAI, http: httpx.Client, url: str) -> None:
    """`--return-tokens-as-token-ids`: logprobs name tokens "token_id:N", each N the token whose
    text a request with `return_tokens_as_token_ids: false` shows; `--enable-force-include-usage`:
    a stream that asks for no usage ends with it; `continuous_usage_stats`: every chunk has the
    usage so far."""
    messages = [{"role": "user", "content": "Count with me"}]
    ask: dict[str, Any] = {"model": "m", "max_tokens": 5, "temperature": 0, "messages": messages, "logprobs": True,
                           "top_logprobs": 2}
    by_id = client.chat.completions.create(**ask).choices[0].logprobs.content
    by_text = client.chat.completions.create(**ask, extra_body={"return_tokens_as_token_ids": False})
    texts = by_text.choices[0].logprobs.content
    assert len(by_id) == len(texts) == 5
    headers = {"Authorization": "Bearer sk"}
    for named, shown in zip(by_id, texts):
        assert named.token.startswith("token_id:") and named.bytes == list(named.token.encode())
        assert all(alt.token.startswith("token_id:") for alt in named.top_logprobs)
        token_id = int(named.token.removeprefix("token_id:"))
        text = http.post(url + "/detokenize", json={"model": "m", "tokens": [token_id]}, headers=headers).json()
        assert text["prompt"] == shown.token and named.logprob == pytest.approx(shown.logprob, abs=1e-4)
    legacy = http.post(url + "/v1/completions", headers=headers, json={
        "model": "m", "prompt": "one two", "max_tokens": 3, "temperature": 0, "logprobs": 2}).json()
    logprobs = legacy["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in logprobs["tokens"])
    assert all(k.startswith("token_id:") for top in logprobs["top_logprobs"] for k in top)
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"][-1] < len(legacy["choices"][0]["text"]) + 1

    chunks = list(client.chat.completions.create(model="m", max_tokens=4, messages=messages, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])
    chunks = list(client.chat.completions.create(
        model="m", max_tokens=4, messages=messages, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))  # type: ignore[typeddict-unknown-key]
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4 and counts[0] < 4
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)


def _request_ids(http: httpx.Client, url: str) -> None:
    """A client's request id (X-Request-Id, else the body's request_id) names the answer and, with
    `--enable-request-id-headers`, comes back in X-Request-Id; two requests under one id both run;
    an answer to a request without one carries its own id; a bad id is a 400 naming it."""
    from concurrent.futures import ThreadPoolExecutor

    headers = {"Authorization": "Bearer sk"}
    body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}

    def chat(extra_headers: dict[str, str], **fields: Any) -> httpx.Response:
        return http.post(url + "/v1/chat/completions", json={**body, **fields}, headers={**headers, **extra_headers})

    with ThreadPoolExecutor(2) as pool:
        twins = list(pool.map(lambda _: chat({"X-Request-Id": "trace-7"}, request_id="ignored"), range(2)))
    assert [r.status_code for r in twins] == [200, 200]
    assert [r.json()["id"] for r in twins] == ["chatcmpl-trace-7"] * 2
    assert [r.headers["x-request-id"] for r in twins] == ["trace-7"] * 2
    named = chat({}, request_id="job-1")
    assert named.json()["id"] == "chatcmpl-job-1" and named.headers["x-request-id"] == "job-1"
    fresh = chat({})
    assert fresh.headers["x-request-id"] == fresh.json()["id"]
    bad = chat({}, request_id="two words")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id" and bad.headers["x-request-id"]
    refused = http.get(url + "/v1/models", headers={"X-Request-Id": "no-key"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "no-key"


@pytest.mark.parametrize("args, words", [
    (["--middleware", "no_such_module.Thing"], "--middleware 'no_such_module.Thing': cannot import"),
    (["--middleware", "json.nothing"], "'json' has no 'nothing'"),
    (["--middleware", "json.dumps"], "must be an ASGI middleware class or an async function"),
    (["--middleware", "Thing"], "give an import path"),
    (["--ssl-keyfile", "/no/key.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-keyfile", "/no/key.pem", "--ssl-certfile", "/no/cert.pem"], "is not a file"),
    (["--allowed-origins", "*"], "argument --allowed-origins: not valid JSON"),
    (["--allowed-methods", "{}"], "must be a JSON list of strings"),
    (["--allow-credentials"], "need --allowed-origins"),
])
def test_tls_and_cors_flags_are_checked_before_anything_loads(capsys, args, words):
    try:
        code = main(["serve", "--port", "0", *args])
    except SystemExit as exit:  # argparse's own refusal of a flag's value
        code = exit.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err and words in err[-1], err


def parse_with(tmp_path, yaml_text: str, *cli: str):
    """`mmserve serve --config FILE *cli`, parsed as `main` parses it."""
    import argparse

    from mmserve.cli import _add_serve_parser
    from mmserve.config.config_file import with_config_file

    config = tmp_path / "config.yaml"
    config.write_text(yaml_text)
    parser = argparse.ArgumentParser()
    serve = _add_serve_parser(parser.add_subparsers(dest="command"))
    return with_config_file(parser, serve, ["serve", "--config", str(config), *cli])


def test_a_config_file_gives_flags_and_the_command_line_wins(tmp_path):
    """vLLM's `--config FILE.yaml`: long flag names (dashes or underscores) to values; switches,
    lists, mappings; the command line's own value wins over the file's."""
    args = parse_with(tmp_path, """
model: org/name
max-num-seqs: 4
max_model_len: 1024
served-model-name: [a, b]
enable-prefix-caching: false
disable-fastapi-docs: true
trust-remote-code: true
mm-processor-kwargs: {max_pixels: 1003520}
middleware: [pkg.one, pkg.two]
scheduling-policy: priority
""", "--max-num-seqs", "2", "org/other")
    assert (args.model, args.model_tag, args.max_num_seqs, args.max_model_len) == ("org/name", "org/other", 2, 1024)
    assert args.served_model_name == ["a", "b"] and args.enable_prefix_caching is False
    assert args.disable_fastapi_docs is True and args.vllm_trust_remote_code is True
    assert args.mm_processor_kwargs == {"max_pixels": 1003520} and args.middleware == ["pkg.one", "pkg.two"]
    assert args.scheduling_policy == "priority"
    assert parse_with(tmp_path, "").max_num_seqs == 64  # an empty file: the defaults


@pytest.mark.parametrize("text, words", [
    ("max-num-seqz: 4", "'max-num-seqz' is not a flag of this command"),
    ("- max-num-seqs", "must map flag names to values"),
    ("disable-fastapi-docs: 1", "disable-fastapi-docs is a switch: true or false"),
    ("max-num-seqs: [", "not valid YAML"),
    ("config: other.yaml", "'config' is not a flag"),
])
def test_a_bad_config_file_is_one_error_line_naming_it(tmp_path, capsys, text, words):
    config = tmp_path / "config.yaml"
    config.write_text(text)
    assert main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mmserve: error: --config {config}: ") and words in err[0], err
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_vllms_spellings_of_a_command_line_are_read_as_vllm_reads_them(tmp_path, capsys):
    """A vLLM recipe's line: underscores in flag names, a JSON flag's keys as flags of their own
    (merged over the flag's own object), vLLM's `{"count": N}` limits, `--mm-encoder-tp-mode data`."""
    import argparse

    from mmserve.cli import _add_serve_parser
    from mmserve.config import MultiModalConfig
    from mmserve.config.vllm_argv import json_flags, vllm_argv

    parser = argparse.ArgumentParser()
    serve = _add_serve_parser(parser.add_subparsers(dest="command"))
    argv = vllm_argv(["serve", "org/m", "--max_model_len", "4096", "--limit-mm-per-prompt", '{"image": 2}',
                      "--limit-mm-per-prompt.video", "0", "--mm-processor-kwargs.max_pixels=1003520",
                      "--mm_processor_kwargs.fps", "2.0", "--kv-events-config.publisher", "zmq",
                      "--kv-events-config.enable_kv_cache_events", "true", "--cuda-graph-sizes", "1",
                      "--override-generation-config.stop+", "a,b", "--mm-encoder-tp-mode", "data",
                      "--hf-overrides", '{"architectures": ["Qwen2VLForConditionalGeneration"]}'],
                     json_flags(serve))
    args = parser.parse_args(argv)
    assert args.max_model_len == 4096 and args.limit_mm_per_prompt == {"image": 2, "video": 0}
    assert args.mm_processor_kwargs == {"max_pixels": 1003520, "fps": 2.0}
    assert args.kv_events_config == {"publisher": "zmq", "enable_kv_cache_events": True}
    assert args.override_generation_config == {"stop": ["a", "b"]}
    assert args.hf_overrides == {"architectures": ["Qwen2VLForConditionalGeneration"]}
    assert MultiModalConfig(limit_mm_per_prompt={"image": {"count": 3, "width": 512, "height": 512},
                                                 "video": {"count": 0}}).limit_mm_per_prompt == {"image": 3, "video": 0}
    for bad, words in ((["--max-num-seqs.x", "1"], "--max-num-seqs takes no JSON object"),
                       (["--limit-mm-per-prompt.video"], "needs a value"),
                       (["--limit-mm-per-prompt", "[1]", "--limit-mm-per-prompt.video", "0"], "not a JSON object"),
                       (["--limit-mm-per-prompt", '{"image": {"count": "x"}}'], "must be a non-negative integer")):
        assert main(["serve", "--port", "0", *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("mmserve: error: ") and words in err[0], err


def test_vllms_api_key_variable_protects_the_server_as_in_vllm(tmp_path, monkeypatch):
    """A vLLM deployment that sets VLLM_API_KEY (and no --api-key) is not left open here; the flag wins."""
    from mmserve.entrypoints.openai.server_config import ServerConfig

    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert ServerConfig.from_cli(parse_with(tmp_path, "")).api_key == "from-env"
    assert ServerConfig.from_cli(parse_with(tmp_path, "", "--api-key", "flag")).api_key == "flag"
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert ServerConfig.from_cli(parse_with(tmp_path, "")).api_key is None
