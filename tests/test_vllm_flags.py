"""A vLLM `serve` command line runs on mmserve: each vLLM flag mmserve has no flag of its own for
(config/vllm_flags.py) is done anyway, without effect, or refused by name — before any model loads,
as one `mmserve: error:` line. A server started with a typical vLLM command line serves and says
what each of its flags did; vLLM's HTTPS, root-path and CORS flags do what they do there."""

from __future__ import annotations

import time

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
    its answers carry the header; another origin gets none."""
    import httpx
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    key_file, cert_file, ca_file = tmp_path / "key.pem", tmp_path / "cert.pem", tmp_path / "ca.pem"
    cert.private_key_pem.write_to_path(str(key_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    ca.cert_pem.write_to_path(str(ca_file))
    ui, path = "https://ui.example", make_checkpoint(tmp_path)
    server = ServerProcess(path, "--served-model-name", "m", "--api-key", "sk", *VLLM_LINE,
                           "--ssl-keyfile", str(key_file), "--ssl-certfile", str(cert_file), "--root-path", "/api",
                           "--allowed-origins", f'["{ui}"]', ca=str(ca_file))
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
        with pytest.raises(httpx.ConnectError):  # the certificate is the test CA's: not trusted by default
            httpx.get(url + "/health")
    finally:
        server.stop()
    assert f"mmserve: serving {path} on https://" in log
    for flag in ("--trust-remote-code", "--disable-log-requests", "--enable-chunked-prefill", "--swap-space 4",
                 "--load-format safetensors"):
        assert f"mmserve: vLLM's {flag}: " in log, log[-3000:]
    assert "--disable-log-stats" not in log  # mmserve's own flag: the periodic stats line is off


@pytest.mark.parametrize("args, words", [
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
