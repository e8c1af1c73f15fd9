"""The per-request cache report (`x-mmserve-cache`, `usage.prompt_tokens_details`) through a real
server, and the shadow cache verifier on the same server (`--cache-verify-rate 1`): a clean run
verifies requests that caches served and finds no mismatch."""

from __future__ import annotations

import time

import pytest

from mmserve.cache_report import HEADER
from helpers.server_process import ServerProcess, data_url, messages
from helpers.tiny_models import make_checkpoint, make_image

pytestmark = pytest.mark.slow  # spawns processes (deselect with -m 'not slow')

SYSTEM = {"role": "system", "content": "You describe pictures of foxes in a few words. " * 3}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("cache_report"))


@pytest.fixture(scope="module")
def server(model_path):
    s = ServerProcess(model_path, "--max-model-len", "512", "--cache-verify-rate", "1")
    yield s
    s.stop()


def report(response) -> dict[str, tuple[int, int]]:
    """`x-mmserve-cache: a=1/2 b=0/3` -> {"a": (1, 2), "b": (0, 3)}."""
    counts = {}
    for part in response.headers[HEADER].split():
        layer, _, frac = part.partition("=")
        hits, queries = frac.split("/")
        counts[layer] = (int(hits), int(queries))
    return counts


def chat(client, model_path, url: str, text: str, **kw):
    raw = client.chat.completions.with_raw_response.create(
        model=model_path, messages=[SYSTEM, *messages(url, text)], max_tokens=4, **kw)
    return raw, raw.parse()


def test_a_cold_request_then_its_repeats_show_each_layer_hitting(client, model_path):
    url = data_url(make_image(101))
    raw, cold = chat(client, model_path, url, "What is this?", temperature=0)
    first = report(raw)
    n = cold.usage.prompt_tokens
    assert first == {"processor": (0, 1), "ipc": (0, 1), "encoder": (0, 1), "prefix": (0, n)}
    assert cold.usage.prompt_tokens_details.cached_tokens == 0

    raw, again = chat(client, model_path, url, "What is this?", temperature=0)  # greedy: no forward at all
    assert report(raw) == {"processor": (1, 1), "ipc": (1, 1), "prefix": (n, n), "last_block": (1, 1),
                           "first_token": (1, 1)}
    assert again.usage.prompt_tokens_details.cached_tokens == n
    assert again.choices[0].message.content == cold.choices[0].message.content

    raw, sampled = chat(client, model_path, url, "What is this?", temperature=1.0, seed=3)  # not greedy
    assert report(raw) == {"processor": (1, 1), "ipc": (1, 1), "prefix": (n - 1, n), "last_block": (1, 1)}
    assert sampled.usage.prompt_tokens_details.cached_tokens == n - 1


def test_the_same_image_after_other_words_hits_the_encoder_cache(client, model_path):
    url = data_url(make_image(102))
    raw, _ = question_first(client, model_path, url, "Describe it.")
    assert report(raw)["encoder"] == (0, 1)
    raw, other = question_first(client, model_path, url, "Which animal is it, and what colour is its fur?")
    counts = report(raw)
    assert counts["processor"] == (1, 1) and counts["ipc"] == (1, 1) and counts["encoder"] == (1, 1)
    hit, queries = counts["prefix"]
    assert queries == other.usage.prompt_tokens and 0 < hit < queries  # the system turn, not the question


def question_first(client, model_path, url: str, text: str):
    """A user turn whose question comes before its image (so the image's blocks differ too)."""
    turn = {"role": "user", "content": [{"type": "text", "text": text},
                                        {"type": "image_url", "image_url": {"url": url}}]}
    raw = client.chat.completions.with_raw_response.create(model=model_path, messages=[SYSTEM, turn], max_tokens=4,
                                                           temperature=0)
    return raw, raw.parse()


def test_a_stream_sends_the_report_with_its_status_line(client, model_path):
    url = data_url(make_image(103))
    raw, _ = chat(client, model_path, url, "What is this?", temperature=0)
    cold = report(raw)
    raw = client.chat.completions.with_raw_response.create(
        model=model_path, messages=[SYSTEM, *messages(url, "What is this?")], max_tokens=4, temperature=0,
        stream=True, stream_options={"include_usage": True})
    streamed = report(raw)  # the headers came with the first output: P1's layers are in
    chunks = list(raw.parse())
    n = chunks[-1].usage.prompt_tokens
    assert cold["processor"] == (0, 1) and cold["prefix"][0] < n  # the system turn's blocks are cached already
    assert streamed["prefix"] == (n, n) and streamed["first_token"] == (1, 1) and streamed["processor"] == (1, 1)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == n


def test_completions_report_the_prefix_layer(client, model_path):
    prompt = "A fox is a small animal with a bushy tail and pointed ears. " * 3
    first = client.completions.with_raw_response.create(model=model_path, prompt=prompt, max_tokens=3,
                                                        temperature=0)
    second = client.completions.with_raw_response.create(model=model_path, prompt=prompt, max_tokens=3,
                                                         temperature=0)
    n = first.parse().usage.prompt_tokens
    assert report(first) == {"prefix": (0, n)}  # text only: no processor, IPC or encoder lookups
    assert report(second) == {"prefix": (n, n), "last_block": (1, 1), "first_token": (1, 1)}
    assert second.parse().usage.prompt_tokens_details.cached_tokens == n


def test_the_verifier_reran_cached_requests_and_found_no_mismatch(server, client, model_path):
    """The requests above hit every layer (processor, IPC, encoder, prefix, last block, first
    token); at rate 1 each one a cache served is re-run with every cache bypassed (one at a time:
    some are skipped while another runs)."""
    url = data_url(make_image(104))
    chat(client, model_path, url, "What is this?", temperature=0)
    chat(client, model_path, url, "What is this?", temperature=0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and verified(server, "match") < 3:
        time.sleep(0.2)
    assert verified(server, "mismatch") == 0, server.output()[-3000:]
    assert verified(server, "match") >= 3
    assert 0 <= server.metric("mmserve_cache_verify_max_abs_diff") < 1e-3


def verified(server: ServerProcess, outcome: str) -> float:
    _, text = server.get("/metrics")
    for line in text.splitlines():
        if line.startswith(f'mmserve_cache_verify_total{{outcome="{outcome}"}} '):
            return float(line.split()[1])
    raise KeyError(outcome)
