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


def interleaved_ttfts(model: str, server_urls: list[str], offline_urls: list[str],
                      *server_flags: str) -> tuple[list[float], list[float]]:
    """TTFT in seconds of each `server_urls` image through a fresh server (HTTP, streamed, first
    event) and of each `offline_urls` image through an offline `LLM` in this process, the two
    alternating request by request: this VM's speed drifts by tens of percent over a minute, and
    alternating puts the same drift into both lists. Each list has one warm-up request first
    (not returned); every image is a first sight."""
    from mmserve import LLM, SamplingParams
    from server_process import ServerProcess

    llm = LLM(model=model)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    server = ServerProcess(model, *server_flags)
    try:
        with httpx.Client(timeout=60) as client:
            def through_server(url: str) -> float:
                body = {"model": model, "messages": chat_messages(url), "max_tokens": 1, "temperature": 0,
                        "stream": True}
                content = json.dumps(body).encode()  # before the clock: the client's cost, not the server's
                start = time.perf_counter()
                elapsed = None
                with client.stream("POST", server.base_url + "/v1/chat/completions", content=content,
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

            pairs = [(through_server(a), offline(b)) for a, b in zip(server_urls, offline_urls)]
    finally:
        server.stop()
        llm.shutdown()
    return [p[0] for p in pairs[1:]], [p[1] for p in pairs[1:]]


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
    srv, off = interleaved_ttfts(args.model, [image_url(2 * i) for i in range(args.runs + 1)],
                                 [image_url(2 * i + 1) for i in range(args.runs + 1)])
    srv_ms, off_ms = statistics.median(srv) * 1e3, statistics.median(off) * 1e3
    print(f"TTFT median over {args.runs} one-image requests each, alternating: offline LLM {off_ms:.1f} ms, "
          f"server {srv_ms:.1f} ms, server adds {srv_ms - off_ms:.1f} ms (target < 5 ms)")
    item = processed_item()
    mb = item.data["pixel_values"].nbytes / 1e6
    ch, pk = channel_seconds(item, 50), pickle_seconds(item, 50)
    print(f"one processed image item ({mb:.2f} MB) P0 -> P1: channel {ch * 1e3:.2f} ms, pickle over a socket "
          f"{pk * 1e3:.2f} ms, ratio {pk / ch:.2f}x (target >= 2x)")


if __name__ == "__main__":
    main()
