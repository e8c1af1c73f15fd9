"""Issue 40's "memory before refusal" rows through the real server: P0's peak RSS growth and the
slowest `/health` answer while each request is handled.

Rows: a 64x64 PNG with min/max_pixels 4e7; a small MP4 with video min_pixels 8e7, num_frames 8e7
and num_frames 2**31; a 48-frame 2560x1440 H.264 clip (sampled whole, at a small pixel budget:
served); a 10 MiB chat message and a 10 MiB completions prompt. Before each row P0's peak RSS is
reset (`/proc/<pid>/clear_refs`), so `peak+` is what that request alone made P0 hold.

Run: `PYTHONPATH=src:tests .venv/bin/python benchmarks/size_first_memory.py [--skip-huge]`; point
PYTHONPATH at another checkout's `src` to measure it (`--skip-huge` leaves out num_frames 2**31,
which an unbounded build would try to allocate).
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import sys
from typing import Any

from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))

from helpers.server_process import ServerProcess, paid_for  # noqa: E402
from video_warm_path import make_clip  # noqa: E402

MODEL = "builtin:tiny-qwen3-vl"
TEN_MIB = "word " * (2 << 20)


def chat(parts: list[dict], **extra: Any) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": "m", "max_tokens": 1,
                                    "messages": [{"role": "user", "content": parts}], **extra}


def rows(skip_huge: bool) -> dict[str, tuple[str, dict]]:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 200, 30)).save(buf, format="PNG")
    png = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    small = "data:video/mp4;base64," + base64.b64encode(make_clip(2, 4, 64, 64)).decode()
    big = "data:video/mp4;base64," + base64.b64encode(make_clip(2, 24, 2560, 1440)).decode()
    image = [{"type": "image_url", "image_url": {"url": png}}, {"type": "text", "text": "hi"}]

    def video(url: str) -> list[dict]:
        return [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "hi"}]

    out = {
        "png min/max_pixels 4e7": chat(image, mm_processor_kwargs={"min_pixels": 40_000_000,
                                                                   "max_pixels": 40_000_000}),
        "mp4 min_pixels 8e7": chat(video(small), media_io_kwargs={"video": {"min_pixels": 80_000_000,
                                                                            "max_pixels": 80_000_000}}),
        "mp4 num_frames 8e7": chat(video(small), media_io_kwargs={"video": {"num_frames": 80_000_000}}),
        "mp4 num_frames 2**31": chat(video(small), media_io_kwargs={"video": {"num_frames": 1 << 31}}),
        "48 x 2560x1440 clip": chat(video(big), media_io_kwargs={"video": {"num_frames": 48,
                                                                            "max_pixels": 48 * 320 * 180}}),
        "10 MiB chat message": chat([{"type": "text", "text": TEN_MIB}]),
        "10 MiB completions prompt": ("/v1/completions", {"model": "m", "prompt": TEN_MIB, "max_tokens": 1}),
    }
    if skip_huge:
        del out["mp4 num_frames 2**31"]
    return out


def measure(server: ServerProcess, path: str, body: dict) -> tuple[int, float, float, str]:
    """(status, P0 peak RSS growth MiB, slowest /health ms, error message)."""
    response, growth, _, slowest = paid_for(server, path, body)
    message = response.json().get("error", {}).get("message", "") if response.status_code != 200 else ""
    return response.status_code, growth, slowest * 1000, message


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-huge", action="store_true", help="leave out num_frames 2**31")
    args = parser.parse_args()
    cases = rows(args.skip_huge)
    server = ServerProcess(MODEL, "--served-model-name", "m", "--max-model-len", "8192",
                           "--max-request-body-mb", "64", timeout_s=300)
    try:
        print(f"{'row':28} {'status':>6} {'peak+ MiB':>10} {'/health max ms':>15}  message")
        for name, (path, body) in cases.items():
            status, growth, health_ms, message = measure(server, path, body)
            print(f"{name:28} {status:>6} {growth:>10.0f} {health_ms:>15.0f}  {message[:90]}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
