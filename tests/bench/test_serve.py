"""`mmserve bench serve` against a real server on loopback (a tiny checkpoint), and with --launch."""

from __future__ import annotations

import base64
import io
import json
import time

import pytest

from mmserve.bench import launch
from mmserve.cli import main
from mmserve.metrics import CACHE_LAYERS
from helpers.server_process import ServerProcess, child_pids, pid_alive
from helpers.tiny_models import make_checkpoint, make_image

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')

OUTPUT_LEN = 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("bench"))


@pytest.fixture(scope="module")
def server(model_path):
    s = ServerProcess(model_path, "--max-model-len", "256")
    yield s
    s.stop()


def bench(*argv: str) -> int:
    return main(["bench", "serve", "--no-progress", *argv])


def server_counts(server: ServerProcess) -> tuple[float, float, float]:
    return (server.metric("mmserve_prompt_tokens_total"), server.metric("mmserve_generation_tokens_total"),
            _requests(server, "success"))


def _requests(server: ServerProcess, outcome: str) -> float:
    _, text = server.get("/metrics")
    prefix = f'mmserve_requests_total{{outcome="{outcome}"}} '
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def test_counts_agree_with_the_servers_usage(server, tmp_path, capsys):
    prompt0, generated0, success0 = server_counts(server)
    result = tmp_path / "result.json"
    assert bench("--base-url", server.base_url, "--num-prompts", "6", "--image-size", "42", "--input-len", "6",
                 "--output-len", str(OUTPUT_LEN), "--image-repeat-rate", "0.5", "--repeat", "2",
                 "--max-concurrency", "3", "--save-result", str(result)) == 0
    prompt1, generated1, success1 = server_counts(server)
    body = json.loads(result.read_text())
    runs = body["runs"]
    assert [r["label"] for r in runs] == ["cold", "warm"]
    assert body["dataset"]["measured_image_repeat_rate"] == 0.5
    for run in runs:
        assert (run["completed"], run["failed"]) == (6, 0)
        assert run["total_output_tokens"] == 6 * OUTPUT_LEN  # ignore_eos: exactly --output-len each
        assert run["server_requests"]["success"] == 6
        assert run["median_ttft_ms"] > 0 and run["mean_tpot_ms"] > 0 and run["mean_itl_ms"] > 0
        assert 0 < run["server_mean_ttft_ms"] <= run["mean_ttft_ms"]  # the client's adds HTTP and parsing
        assert set(run["cache_hit_rate"]) == set(CACHE_LAYERS)
        assert all(rate is None or 0.0 <= rate <= 1.0 for rate in run["cache_hit_rate"].values())
    assert runs[0]["total_input_tokens"] == runs[1]["total_input_tokens"] > 0  # the same requests twice
    assert sum(r["total_input_tokens"] for r in runs) == prompt1 - prompt0
    assert sum(r["total_output_tokens"] for r in runs) == generated1 - generated0
    assert success1 - success0 == 12
    out = capsys.readouterr().out
    assert "run 1 (cold)" in out and "run 2 (warm)" in out
    assert "Median TTFT: run 1 (cold)" in out and "; run 2 (warm)" in out


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_failed_requests_are_counted_not_fatal(server, tmp_path, capsys):
    make_image(5).save(tmp_path / "ok.png")
    part = lambda url: {"type": "image_url", "image_url": {"url": url}}  # noqa: E731
    lines = [[{"role": "user", "content": [part("ok.png"), {"type": "text", "text": "What is this?"}]}],
             [{"role": "user", "content": [part("data:image/png;base64,bm90IGFuIGltYWdl")]}],  # "not an image"
             [{"role": "user", "content": [part(data_url(make_image(6))), {"type": "text", "text": "Hi"}]}]]
    dataset = tmp_path / "chats.jsonl"
    dataset.write_text("\n".join(json.dumps(line) for line in lines))
    result = tmp_path / "result.json"
    assert bench("--base-url", server.base_url, "--dataset-name", "jsonl", "--dataset-path", str(dataset),
                 "--output-len", "3", "--save-result", str(result)) == 0
    run = json.loads(result.read_text())["runs"][0]
    assert (run["completed"], run["failed"], run["total_output_tokens"]) == (2, 1, 6)
    [(message, count)] = run["errors"].items()
    assert count == 1 and message.startswith("HTTP 400")
    assert "1 failed: HTTP 400" in capsys.readouterr().out
    assert server.get("/health")[0] == 200


def test_an_unreachable_server_is_a_clear_error(capsys):
    assert bench("--base-url", "http://127.0.0.1:9", "--num-prompts", "1") == 1
    assert "is a server running there?" in capsys.readouterr().err
    # with --model no lookup happens: every request fails, and a run with nothing completed exits 1
    assert bench("--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "2", "--image-size", "8") == 1
    assert "2 failed: ConnectError" in capsys.readouterr().out


@pytest.fixture
def launched(monkeypatch):
    """Record every launched server's command and process ids (server and children) as it is stopped."""
    seen: list[dict] = []
    stop = launch.LaunchedServer.stop

    def recording_stop(self, **kwargs):
        if self.proc is not None:
            seen.append({"command": self.command, "pids": [self.proc.pid, *child_pids(self.proc.pid)]})
        return stop(self, **kwargs)

    monkeypatch.setattr(launch.LaunchedServer, "stop", recording_stop)
    return seen


def still_alive(pids: list[int], grace_s: float = 5.0) -> list[int]:
    """The pids still running after `grace_s` (a helper such as multiprocessing's resource
    tracker may take a moment to finish exiting after its parent)."""
    deadline = time.monotonic() + grace_s
    while (alive := [pid for pid in pids if pid_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def test_launch_passes_flags_and_leaves_no_process(model_path, launched, capsys):
    assert bench("--launch", "--model", model_path, "--num-prompts", "2", "--image-size", "42", "--input-len", "4",
                 "--output-len", "2", "--launch-args", "--max-num-seqs 4", "--", "--max-model-len", "256") == 0
    [server] = launched
    assert server["command"][3:] == ["serve", model_path, "--max-num-seqs", "4", "--max-model-len", "256",
                                     "--host", "127.0.0.1", "--port", server["command"][-1]]
    assert len(server["pids"]) >= 2  # the server and its engine core
    assert not still_alive(server["pids"])
    assert "Successful requests" in capsys.readouterr().out


def test_launch_failure_shows_the_server_log(model_path, launched, capsys):
    assert bench("--launch", "--model", model_path, "--num-prompts", "1", "--", "--max-model-len", "1") == 1
    assert "max_model_len must be at least 2" in capsys.readouterr().err
    [server] = launched  # stopped although it never became healthy
    assert not still_alive(server["pids"])
