"""Issue 40's "a stream that is never read" row through the real server: P0's RSS growth and the
slowest `/health` answer while a client holds a stream open without reading it.

The request: chat, `n` 8, 4,000 tokens, `logprobs` 20, `stream` true, sent on a raw socket whose
receive buffer is small and never read. For `--seconds` (30) P0's RSS and /health are sampled.

Run: `PYTHONPATH=src:tests .venv/bin/python benchmarks/stalled_stream.py`; point PYTHONPATH at
another checkout's `src` to measure it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from helpers.server_process import ServerProcess, proc_kb  # noqa: E402

MODEL = "builtin:tiny-qwen3-vl"


def open_unread_stream(port: int) -> socket.socket:
    """Send the streaming request and return its socket, never read."""
    body = json.dumps({"model": "m", "stream": True, "n": 8, "max_tokens": 4000, "ignore_eos": True,
                       "logprobs": True, "top_logprobs": 20,
                       "messages": [{"role": "user", "content": "Tell me a long story."}]}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return sock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    server = ServerProcess(MODEL, "--served-model-name", "m", "--max-model-len", "8192", timeout_s=300)
    try:
        pid = server.proc.pid
        before = proc_kb(pid, "VmRSS")
        sock = open_unread_stream(server.port)
        slowest, peak = 0.0, before
        deadline = time.monotonic() + args.seconds
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            while time.monotonic() < deadline:
                start = time.perf_counter()
                client.get("/health")
                slowest = max(slowest, time.perf_counter() - start)
                peak = max(peak, proc_kb(pid, "VmRSS"))
                time.sleep(0.2)
        end = proc_kb(pid, "VmRSS")
        sock.close()
        aborted = "its caller read none of its outputs" in server.output()
        print(f"P0 RSS growth: peak {(peak - before) / 1024:.0f} MiB, at the end {(end - before) / 1024:.0f} MiB; "
              f"slowest /health {slowest * 1000:.0f} ms; aborted as stalled: {aborted}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
