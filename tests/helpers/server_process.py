"""Start `mmserve serve` as a real process on a free loopback port, for tests and benchmarks."""

from __future__ import annotations

import base64
import glob
import io
import os
import signal
import re
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request

import httpx
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable


SERVING = re.compile(r"^mmserve: serving .* on https?://\S+:(\d+)", re.M)  # the line a server prints once it listens


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc; no psutil)."""
    pids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return pids


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


class ServerProcess:
    """`mmserve serve MODEL --port 0 ...` in a subprocess; `port` and `base_url` once it is healthy.
    With `ca` (a CA certificate file) the server is reached over HTTPS, trusting that CA.

    The server binds a port the kernel picks and prints it (`mmserve: serving ... on URL`): a port
    chosen here and handed over would stay free until the server binds it, seconds later, and a
    server another test worker starts meanwhile could take it (CI44: one module's requests were
    answered by another module's server, 401 with its API key)."""

    def __init__(self, model: str, *args: str, timeout_s: float = 120.0, env: dict[str, str] | None = None,
                 ca: str | None = None) -> None:
        self.port = 0
        self.base_url = ""
        self.scheme = "https" if ca else "http"
        self.ssl = None if ca is None else ssl.create_default_context(cafile=ca)
        cmd = [sys.executable, "-m", "mmserve.cli", "serve", model, "--port", "0", *args]
        # the server's output goes to a file, not a pipe: nobody reads it while the tests run, and a
        # full pipe (64 KiB) would block the server's next log line
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=self.log,
                                     stderr=subprocess.STDOUT, text=True)
        self._wait_healthy(timeout_s)

    def output(self) -> str:
        """Everything the server printed so far."""
        self.log.seek(0)
        return self.log.read()

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            if not self.port:
                found = SERVING.search(self.output())
                if found is None:
                    time.sleep(0.1)
                    continue
                self.port = int(found.group(1))
                self.base_url = f"{self.scheme}://127.0.0.1:{self.port}"
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2, context=self.ssl) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become healthy in time")

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=10, context=self.ssl) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metric(self, name: str) -> float:
        """The value of an unlabelled Prometheus sample from /metrics."""
        _, text = self.get("/metrics")
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def data_url(image, fmt="PNG") -> str:
    """A PIL image as a `data:` URL."""
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def messages(url: str, text: str = "What is this?") -> list[dict]:
    """One user turn: an image part, then a text part."""
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def labelled(server: ServerProcess, name: str, layer: str) -> float:
    """The value of a `{layer="..."}` sample from the server's /metrics."""
    _, text = server.get("/metrics")
    for line in text.splitlines():
        if line.startswith(f'{name}{{layer="{layer}"}} '):
            return float(line.split()[1])
    raise KeyError(name)


def children_titled(server, prefix: str) -> dict[str, int]:
    """The server's descendants whose title starts with `mmserve::<prefix>`: title -> pid."""
    found = {}
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            title = Path(cmdline).read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        pid = int(cmdline.split("/")[2])
        if title.startswith("mmserve::" + prefix) and _ancestor(pid, server.proc.pid):
            found[title] = pid
    return found


def _ancestor(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
    return False


def kill_under_load(post: Callable[[str], Any], urls: list[str], victim: int, after_s: float = 1.0) -> list[Any]:
    """`post(url)` for every url at once; `victim` is killed (SIGKILL) `after_s` into it; the responses."""
    with ThreadPoolExecutor(len(urls)) as pool:
        futures = [pool.submit(post, u) for u in urls]
        time.sleep(after_s)
        os.kill(victim, signal.SIGKILL)
        return [f.result() for f in futures]


def answers_through_a_kill(server: Any, urls: list[str], want: list[str], victim: int) -> None:
    """A greedy 40-token request per url, all at once, with `victim` killed (SIGKILL) under them:
    every one answers 200 with the answer in `want`."""
    answers = kill_under_load(lambda u: post(server, u, "What is this?", 40), urls, victim)
    assert [r.status_code for r in answers] == [200] * len(urls), [r.text for r in answers if r.status_code != 200]
    assert [r.json()["choices"][0]["message"]["content"] for r in answers] == want


def expected(offline: Any, url: str, text: str = "What is this?", max_tokens: int = 8) -> str:
    """What the offline engine answers to that request."""
    from mmserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return offline.chat(messages(url, text), params)[0].outputs[0].text


def post(server: Any, url: str, text: str = "What is this?", max_tokens: int = 8, **headers: str) -> httpx.Response:
    """A greedy chat request for `url` with `text`, on a connection of its own; `headers` with _ for -."""
    body = {"model": server.model, "messages": messages(url, text), "temperature": 0, "max_tokens": max_tokens}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120,
                      headers={k.replace("_", "-"): v for k, v in headers.items()})


def concurrent_answers(server: Any, urls: list[str]) -> list[str]:
    """`post(server, url)` for every url at once (a connection each); the answers' texts."""
    with ThreadPoolExecutor(len(urls)) as pool:
        responses = list(pool.map(lambda u: post(server, u), urls))
    return [r.json()["choices"][0]["message"]["content"] for r in responses]


def scrape(server: Any) -> Any:
    """The server's /metrics, parsed."""
    from mmserve.bench.prometheus import MetricsSnapshot

    return MetricsSnapshot.parse(server.get("/metrics")[1])


def proc_kb(pid: int, key: str) -> int:
    """A `/proc/<pid>/status` field in KiB (VmRSS, VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def paid_for(server: Any, path: str, body: dict) -> tuple[httpx.Response, float, list[int], float]:
    """POST `body` to `path` while polling /health: (the response, P0's peak RSS growth in MiB
    during it, the /health statuses seen meanwhile, the slowest /health answer in seconds). P0's
    peak RSS is reset first (`/proc/<pid>/clear_refs`), so the growth is this request's."""
    pid = server.proc.pid
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    before = proc_kb(pid, "VmRSS")
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, server.base_url + path, json=body, timeout=600)
        statuses: list[int] = []
        slowest = 0.0
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            while not pending.done() or not statuses:
                start = time.perf_counter()
                statuses.append(client.get("/health").status_code)
                slowest = max(slowest, time.perf_counter() - start)
                time.sleep(0.02)
        response = pending.result()
    return response, (proc_kb(pid, "VmHWM") - before) / 1024, statuses, slowest
