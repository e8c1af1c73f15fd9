"""What the server path adds: time to first token through HTTP + P0/P1 vs the offline `LLM`,
and the cost of moving one processed image item P0 -> P1 over the channel vs pickle over a socket.

Targets: the server adds under 5 ms median TTFT; the channel moves the item >= 2x faster than
pickle. Run: `python benchmarks/serving_overhead.py` (built-in model, 20 runs each).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import pickle
import socket
import statistics
import sys
import threading
import time

import httpx

import mmserve  # noqa: F401  (first: sets OMP_WAIT_POLICY before torch loads, as the server's processes have it)
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def image_url(variant: int) -> str:
    from mmserve.multimodal.sample_image import sample_image

    buf = io.BytesIO()
    sample_image(336, variant).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat_messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is in this image?"}]}]


ASKERS = ("httpx", "raw", "offline")


def interleaved_ttfts(model: str, urls: list[str], *server_flags: str) -> dict[str, list[float]]:
    """TTFT in seconds of fresh one-image requests (`urls`, each a first sight), by who asked:
    "httpx" through a fresh server (the OpenAI SDK's HTTP client, streamed, to the first event),
    "raw" through the same server over one kept-alive socket with the request's bytes prepared
    before the clock (the server alone, without an HTTP library's own ~1 ms), "offline" through an
    offline `LLM` in this process. The three take turns request by request, the first of them
    rotating each round: this VM's speed drifts by tens of percent over a minute, and taking turns
    puts the same drift into every list. Round 0 is a warm-up (not returned)."""
    from mmserve import LLM, SamplingParams
    from helpers.server_process import ServerProcess

    llm = LLM(model=model)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    server = ServerProcess(model, *server_flags)
    times: dict[str, list[float]] = {asker: [] for asker in ASKERS}
    try:
        with httpx.Client(timeout=60) as client, RawClient(server.base_url) as raw:
            def content(url: str) -> bytes:  # before the clock: the client's cost, not the server's
                return json.dumps({"model": model, "messages": chat_messages(url), "max_tokens": 1,
                                   "temperature": 0, "stream": True}).encode()

            def through_httpx(url: str) -> float:
                body = content(url)
                start = time.perf_counter()
                elapsed = None
                with client.stream("POST", server.base_url + "/v1/chat/completions", content=body,
                                   headers={"Content-Type": "application/json"}) as r:
                    # the server answers once the first token exists: time the first event, read to the end
                    for line in r.iter_lines():
                        if elapsed is None and line.startswith("data:"):
                            elapsed = time.perf_counter() - start
                assert elapsed is not None, "empty stream"
                return elapsed

            def offline(url: str) -> float:
                start = time.perf_counter()
                llm.chat(chat_messages(url), params)
                return time.perf_counter() - start

            ask = {"httpx": through_httpx, "raw": lambda url: raw.ttft("/v1/chat/completions", content(url)),
                   "offline": offline}
            rounds = [urls[i:i + len(ASKERS)] for i in range(0, len(urls) - len(ASKERS) + 1, len(ASKERS))]
            for n, round_urls in enumerate(rounds):
                order = ASKERS[n % len(ASKERS):] + ASKERS[:n % len(ASKERS)]
                for asker, url in zip(order, round_urls):
                    took = ask[asker](url)
                    if n:
                        times[asker].append(took)
    finally:
        server.stop()
        llm.shutdown()
    return times


class RawClient:
    """HTTP/1.1 over one kept-alive TCP socket, nothing parsed but what finding the first SSE
    event and the end of the chunked body needs."""

    def __init__(self, base_url: str) -> None:
        host, port = base_url.removeprefix("http://").rstrip("/").rsplit(":", 1)
        self.host = f"{host}:{port}"
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def ttft(self, path: str, body: bytes) -> float:
        """Seconds from sending a streamed POST of the JSON `body` to the first `data:` event."""
        request = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        start = time.perf_counter()
        self.sock.sendall(request)
        got, elapsed = b"", None
        while not got.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's last chunk
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("the server closed the connection")
            got += data
            if elapsed is None and b"data:" in got:
                elapsed = time.perf_counter() - start
        if not got.startswith(b"HTTP/1.1 200") or elapsed is None:
            raise RuntimeError(f"unexpected response: {got[:200]!r}")
        return elapsed


def processed_item():
    from mmserve.ipc.items import MultiModalItem, PlaceholderRange

    return MultiModalItem("image", "x" * 32, {"pixel_values": torch.randn(3, 336, 336)}, PlaceholderRange(5, 144))


def channel_seconds(item, runs: int) -> float:
    """msgpack + out-of-band tensor frames over a ZMQ ipc PUSH/PULL pair, median per item."""
    import tempfile

    import zmq

    from mmserve.ipc.serial import MsgpackDecoder, MsgpackEncoder
    from mmserve.ipc.items import MultiModalItem

    ctx = zmq.Context()
    tmp = tempfile.TemporaryDirectory(prefix="mmserve-bench-")
    path = f"ipc://{tmp.name}/bench.sock"
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    pull.bind(path)
    push.connect(path)
    enc, dec = MsgpackEncoder(), MsgpackDecoder(MultiModalItem)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        push.send_multipart(enc.encode(item), copy=False)
        got = dec.decode(pull.recv_multipart(copy=False))
        times.append(time.perf_counter() - start)
    assert torch.equal(got.data["pixel_values"], item.data["pixel_values"])
    push.close(0)
    pull.close(0)
    ctx.term()
    tmp.cleanup()
    return statistics.median(times)


def pickle_seconds(item, runs: int) -> float:
    """pickle.dumps -> a Unix socket -> pickle.loads, median per item."""
    a, b = socket.socketpair()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        payload = pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
        framed = len(payload).to_bytes(8, "little") + payload
        sender = threading.Thread(target=a.sendall, args=(framed,))
        sender.start()
        size = int.from_bytes(_recv_exact(b, 8), "little")
        got = pickle.loads(_recv_exact(b, size))
        sender.join()
        times.append(time.perf_counter() - start)
    assert torch.equal(got.data["pixel_values"], item.data["pixel_values"])
    a.close()
    b.close()
    return statistics.median(times)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        got += sock.recv_into(view[got:], n - got)
    return buf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-llava")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    from mmserve.models.builtin import resolve_model

    resolve_model(args.model)
    times = interleaved_ttfts(args.model, [image_url(i) for i in range(len(ASKERS) * (args.runs + 1))])
    ms = {asker: statistics.median(t) * 1e3 for asker, t in times.items()}
    print(f"TTFT median over {args.runs} one-image requests each, taking turns: offline LLM {ms['offline']:.1f} ms, "
          f"server {ms['httpx']:.1f} ms through httpx ({ms['raw']:.1f} ms through a raw socket); the server adds "
          f"{ms['httpx'] - ms['offline']:.1f} ms ({ms['raw'] - ms['offline']:.1f} ms) (target < 5 ms)")
    item = processed_item()
    mb = item.data["pixel_values"].nbytes / 1e6
    ch, pk = channel_seconds(item, 50), pickle_seconds(item, 50)
    print(f"one processed image item ({mb:.2f} MB) P0 -> P1: channel {ch * 1e3:.2f} ms, pickle over a socket "
          f"{pk * 1e3:.2f} ms, ratio {pk / ch:.2f}x (target >= 2x)")


if __name__ == "__main__":
    main()
