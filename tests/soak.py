"""The soak (issue 14): one real server on loopback under mixed load — good, hostile, cancelled
and uuid-only requests at concurrency, with caches small enough to evict all the time — then
the checks that every failure path left nothing behind:

- no response is a 5xx, and every request ends (good ones 200, hostile and costly ones 4xx: a
  huge enum schema, a schema nested 330 deep or satisfied by nothing, a stop-string flood...;
  a stream its client stops reading is aborted or ends whole);
- a poison request (one that crashes its engine core, `MMSERVE_DEBUG_POISON_SEED`), sent after
  the load, is sent again once and then fails alone with the one 500 allowed, naming the cause;
  it spends two restarts, and the server serves on;
- the engine is idle: nothing running or waiting, every KV block free; P0 holds no queue,
  output state, resend record, pending processor-cache entry or shm pin; caches are intact;
- P0's IPC sender and P1's receiver hold the same keys (their key digests and sizes agree);
- /dev/shm holds what it held before: the store's one segment while serving, nothing after;
- every good request's answer equals that of a fresh server with every cache off;
- the shadow cache verifier (`--cache-verify-rate`) re-ran some cache-served requests with every
  cache bypassed and found no mismatch.

`make soak` runs it on the built-in model, lru then shm (`python tests/soak.py --help`);
tests/entrypoints/test_soak.py runs a short one. Loopback only: the server binds 127.0.0.1,
the one http(s) image URL it is sent points at 127.0.0.1 and must be refused.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx

from mmserve.engine.poison import ENV as POISON_ENV
from mmserve.entrypoints.openai.body_limit import default_body_limit
from mmserve.models.builtin import resolve_model
from soak_requests import (Pool, Spec, chat_body, draw, make_pool, with_costly,  # tests/ is on sys.path
                           with_stalled)
from soak_server import LoopbackServer, idle_state, soak_engine_args

POISON_SEED = 7_777_777  # no other soak request carries a seed the server accepts


@dataclass
class SoakReport:
    """What the soak saw: outcomes per kind ("200", "400", "cancelled", ...) and the answers of
    good requests by key; `failures` lists every broken expectation (empty: passed)."""

    cache_type: str
    requests: int = 0
    seconds: float = 0.0
    outcomes: dict[str, Counter[str]] = field(default_factory=dict)
    answers: dict[str, set[str]] = field(default_factory=dict)
    references: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase
    verified: int = 0  # cache-served requests the shadow verifier re-ran

    def count(self, spec: Spec, outcome: str) -> None:
        self.outcomes.setdefault(spec.kind, Counter())[outcome] += 1

    def summary(self) -> str:
        kinds = "; ".join(f"{kind} {dict(sorted(c.items()))}" for kind, c in sorted(self.outcomes.items()))
        verdict = "passed" if not self.failures else f"FAILED ({len(self.failures)})"
        phases = ", ".join(f"{name} {s:.1f} s" for name, s in self.phases.items())
        return (f"soak {self.cache_type}: {self.requests} requests in {self.seconds:.1f} s, "
                f"{len(self.answers)} distinct answers checked; {self.verified} re-run by the cache verifier; "
                f"{kinds}; {verdict} ({phases})")


async def _send(client: httpx.AsyncClient, spec: Spec) -> tuple[str, str | None]:
    """(outcome, answer text of a 200): outcome is the status, "cancelled", or "error: ..."."""
    content = spec.body if isinstance(spec.body, bytes) else json.dumps(
        {**spec.body, **({"stream": True} if spec.stream else {})}).encode()
    headers = {"Content-Type": "application/json"}
    if spec.stall_s is not None:
        return await _send_stalled(str(client.base_url), content, spec.stall_s)
    try:
        if not spec.stream:
            timeout = spec.cancel_after_s or 120.0
            r = await client.post("/v1/chat/completions", content=content, headers=headers, timeout=timeout)
            answer = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None
            return str(r.status_code), answer
        async with client.stream("POST", "/v1/chat/completions", content=content, headers=headers,
                                 timeout=120.0) as r:
            if r.status_code != 200:
                await r.aread()
                return str(r.status_code), None
            return await _read_stream(r, cancel=spec.kind == "cancel")
    except httpx.TimeoutException:
        return ("cancelled", None) if spec.cancel_after_s is not None else ("error: timeout", None)
    except httpx.TransportError as e:  # the server may close a refused oversized upload early
        return ("413" if spec.name == "body over the limit" else f"error: {e!r}"), None


async def _send_stalled(base_url: str, content: bytes, stall_s: float) -> tuple[str, str | None]:
    """A stream whose client reads its status line, then nothing for `stall_s` (a small receive
    buffer, so the server's sends back up), then the rest: (outcome, None)."""
    host, port = base_url.split("//", 1)[1].rstrip("/").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(content) + content)
    try:
        await writer.drain()
        status = (await asyncio.wait_for(reader.readline(), 120.0)).split()[1].decode()
        await asyncio.sleep(stall_s)
        rest = await asyncio.wait_for(reader.read(), 120.0)
    except (OSError, asyncio.TimeoutError, IndexError) as e:
        return f"error: {e!r}", None
    finally:
        writer.close()
    if status != "200" or b"stream_stalled" in rest:
        return (status if status != "200" else "stream error stream_stalled"), None
    return ("200" if b"[DONE]" in rest else "error: the stream ended early"), None


async def _read_stream(r: httpx.Response, cancel: bool) -> tuple[str, str | None]:
    text = []
    async for line in r.aiter_lines():
        if not line.startswith("data:"):
            continue
        if cancel:
            return "cancelled", None  # walk away after the first chunk
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            return f"stream error {event['error'].get('code')}", None
        text += [c["delta"].get("content") or "" for c in event.get("choices", [])]
    return "200", "".join(text)


def _judge(report: SoakReport, spec: Spec, outcome: str, answer: str | None) -> None:
    report.count(spec, outcome)
    allowed = {"good": {"200"}, "cancel": {"cancelled", "200"}, "uuid_only": {"200", "400"},
               "stalled": {"200", "stream error stream_stalled"}}.get(spec.kind)
    ok = outcome in allowed if allowed is not None else outcome.isdigit() and 400 <= int(outcome) < 500
    if not ok:
        report.failures.append(f"{spec.kind} ({spec.name}): {outcome}")
    if outcome == "200" and spec.key is not None and answer is not None:
        report.answers.setdefault(spec.key, set()).add(answer)
        report.references[spec.key] = spec.reference or {}


async def _load(base_url: str, specs: list[Spec], concurrency: int, seconds: float, report: SoakReport) -> None:
    """Send `specs` from `concurrency` clients until all are sent or `seconds` have passed."""
    deadline = time.monotonic() + seconds
    queue = iter(specs)
    limits = httpx.Limits(max_connections=concurrency + 2)

    async def worker(client: httpx.AsyncClient) -> None:
        for spec in queue:
            if time.monotonic() > deadline:
                return
            report.requests += 1
            _judge(report, spec, *(await _send(client, spec)))

    async with httpx.AsyncClient(base_url=base_url, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))


def _check_idle(report: SoakReport, state: dict[str, Any]) -> None:
    for name, (got, want) in state.items():
        if got != want:
            report.failures.append(f"after the load, {name}: {got!r:.300} (expected {want!r:.300})")


async def _reference_answers(base_url: str, bodies: dict[str, dict[str, Any]], concurrency: int) -> dict[str, str]:
    """Each body once, through a fresh server: its answer (or "HTTP <status>")."""
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
        async with gate:
            r = await client.post("/v1/chat/completions", json=body)
        return r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else f"HTTP {r.status_code}"

    async with httpx.AsyncClient(base_url=base_url, timeout=120.0) as client:
        answers = await asyncio.gather(*(one(client, body) for body in bodies.values()))
    return dict(zip(bodies, answers))


def _check_answers(reports: list[SoakReport], reference: LoopbackServer, concurrency: int) -> None:
    """Every distinct good request once, through a fresh server with every cache off."""
    bodies = {key: body for report in reports for key, body in report.references.items()}
    expected = asyncio.run(_reference_answers(reference.base_url, bodies, concurrency))
    for report in reports:
        for key, answers in sorted(report.answers.items()):
            if answers != {expected[key]}:
                report.failures.append(f"answers to {key}: {sorted(answers)} but a fresh server says {expected[key]!r}")


def run_soak(model: str, cache_types: list[str], requests: int, seconds: float, concurrency: int,
             seed: int = 0, cache_items: int = 3, verify_rate: float = 0.2,
             async_scheduling: bool = False) -> list[SoakReport]:
    """Soak one server per cache type (lru, shm) and check everything above; one report each. With
    `async_scheduling` the soaked servers run --async-scheduling and the reference does not."""
    model_dir = resolve_model(model)
    reports = [SoakReport(cache_type) for cache_type in cache_types]
    with tempfile.TemporaryDirectory(prefix="mmserve-soak-") as media, _poison_env():
        for report in reports:
            engine_args = {**soak_engine_args(model_dir, report.cache_type, Path(media), cache_items, verify_rate),
                           "async_scheduling": async_scheduling}
            _soak(report, LoopbackServer(model_dir, engine_args), Path(media), requests, seconds, concurrency, seed)
        off = {**engine_args, "mm_processor_cache_gb": 0, "mm_ipc_cache_gb": 0, "mm_cache_type": "lru",
               "enable_prefix_caching": False, "encoder_cache_tokens": 0, "cache_verify_rate": 0.0,
               "async_scheduling": False}
        start = time.monotonic()
        os.environ.pop(POISON_ENV, None)  # the reference server's engine core carries no poison
        with LoopbackServer(model_dir, off) as reference:
            _check_answers(reports, reference, concurrency)
        for report in reports:
            report.phases["reference"] = time.monotonic() - start
    return reports


def _soak(report: SoakReport, server: LoopbackServer, media: Path, requests: int, seconds: float,
          concurrency: int, seed: int) -> None:
    """The load, then the idle checks and /dev/shm (before, while serving, after)."""
    before = server.shm_segments()
    with server:
        report.phases["start"] = server.startup_s
        mm = server.engine.config.multimodal
        pool = make_pool(media, server.served_name, server.engine.max_model_len,
                         default_body_limit(mm.max_media_bytes, mm.max_images))
        specs = with_stalled(with_costly(draw(random.Random(seed), pool, requests), pool), pool)
        with _timed(report, "load"):
            asyncio.run(_load(server.base_url, specs, concurrency, seconds, report))
        report.seconds = report.phases["load"]
        with _timed(report, "poison"):
            _poison(report, server, pool, next(s for s in specs if s.kind == "good"))
        with _timed(report, "settle"):
            _check_idle(report, server.call(idle_state, timeout_s=60.0))
        _check_verified(report, server)
        serving = server.shm_segments()
    after, store = server.shm_segments(), serving - before
    if after != before or len(store) != (report.cache_type == "shm"):  # the store's one segment
        report.failures.append(f"/dev/shm: {sorted(before)} before, {sorted(serving)} while serving, "
                               f"{sorted(after)} after")


def _poison(report: SoakReport, server: LoopbackServer, pool: Pool, good: Spec) -> None:
    """The poison request alone: a 500 that names the cause, two restarts, then `good` served."""
    spec = Spec("poison", "crashes its engine core", chat_body(pool, "x", max_tokens=4, seed=POISON_SEED))
    restarts = list(server.engine.ranks.restarts)
    r = httpx.post(server.base_url + "/v1/chat/completions", json=spec.body, timeout=300.0)
    report.count(spec, str(r.status_code))
    if r.status_code != 500 or "not sent again" not in r.text:
        report.failures.append(f"poison: {r.status_code} {r.text[:300]}")
    report.requests += 2
    _judge(report, good, *asyncio.run(_send_one(server.base_url, good)))  # waits for the restart
    spent = [after - before for before, after in zip(restarts, server.engine.ranks.restarts)]
    if spent != [2]:
        report.failures.append(f"poison: it spent {spent} restarts (expected [2]: its rank's death and one resend)")


async def _send_one(base_url: str, spec: Spec) -> tuple[str, str | None]:
    async with httpx.AsyncClient(base_url=base_url) as client:
        return await _send(client, spec)


@contextlib.contextmanager
def _poison_env() -> Iterator[None]:
    """`MMSERVE_DEBUG_POISON_SEED` set for the soaked servers' engine cores (they inherit it)."""
    old = os.environ.get(POISON_ENV)
    os.environ[POISON_ENV] = str(POISON_SEED)
    try:
        yield
    finally:
        os.environ.pop(POISON_ENV, None)
        if old is not None:
            os.environ[POISON_ENV] = old


def _check_verified(report: SoakReport, server: LoopbackServer) -> None:
    """With the verifier on, it ran at least once (mismatches are an idle check)."""
    figures = server.engine.verifier.figures
    report.verified = figures.matches + figures.mismatches
    if server.engine.config.cache.cache_verify_rate > 0 and not report.verified:
        report.failures.append("the cache verifier never ran (no cache-served request was re-run)")


@contextlib.contextmanager
def _timed(report: SoakReport, phase: str) -> Iterator[None]:
    start = time.monotonic()
    try:
        yield
    finally:
        report.phases[phase] = time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny-llava")
    parser.add_argument("--cache-type", nargs="+", default=["lru", "shm"], choices=["lru", "shm"])
    parser.add_argument("--requests", type=int, default=400, help="requests per cache type (at most)")
    parser.add_argument("--seconds", type=float, default=120.0, help="load time per cache type (at most)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--cache-items", type=int, default=3, help="items each small cache holds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-verify-rate", type=float, default=0.2, help="the shadow verifier's sampling rate")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="the soaked servers run --async-scheduling (the reference server does not)")
    args = parser.parse_args(argv)
    reports = run_soak(args.model, args.cache_type, args.requests, args.seconds, args.concurrency, args.seed,
                       args.cache_items, args.cache_verify_rate, args.async_scheduling)
    for report in reports:
        print(report.summary(), flush=True)
        for failure in report.failures:
            print("  " + failure)
    failed = any(report.failures for report in reports)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
