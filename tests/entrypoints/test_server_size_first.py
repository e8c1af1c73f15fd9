"""Issue 40's "memory before refusal" rows through the real server (Qwen3-VL): each is a 400 with
the OpenAI error body naming the limit, decided before the work, so P0's peak RSS barely moves and
/health answers meanwhile; a large legitimate clip is served with every sampled frame kept only at
its target size."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from helpers.server_process import ServerProcess, paid_for
from helpers.tiny_models import make_qwen_checkpoint

MAX_GROWTH_MIB = 200  # before the fix each row made P0 hold 0.4 to 2.5 GiB
TEN_MIB = "word " * (2 << 20)


def make_clip(frames: int, width: int, height: int, fps: int = 24) -> bytes:
    """A smooth H.264 MP4 (small file, large frames)."""
    import av
    import numpy as np
    from fractions import Fraction

    y, x = np.mgrid[0:height, 0:width]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("h264", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "30"}
        for t in range(frames):
            pixels = np.stack([(x + 8 * t) % 256, (y + 4 * t) % 256, (x + y) % 256], -1).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def video_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def chat(parts: list[dict], **extra) -> dict:
    return {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": parts}], **extra}


def video(url: str) -> list[dict]:
    return [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_qwen_checkpoint(tmp_path_factory.mktemp("size-first-server"), family="qwen3_vl")
    s = ServerProcess(path, "--served-model-name", "m", "--max-model-len", "4096", "--max-request-body-mb", "64",
                      "--max-video-pixels", str(24 * 2560 * 1440))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def small_mp4():
    return video_url(make_clip(8, 64, 64, fps=4))


def refused_unpaid(server, path: str, body: dict, message: str) -> None:
    response, growth, health, _ = paid_for(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"], error
    assert growth < MAX_GROWTH_MIB, f"P0's peak RSS grew {growth:.0f} MiB before the refusal"
    assert set(health) == {200}


def test_an_upscaling_image_pixel_budget(server):
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 200, 30)).save(buf, format="PNG")
    png = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = chat([{"type": "image_url", "image_url": {"url": png}}, {"type": "text", "text": "hi"}],
                mm_processor_kwargs={"min_pixels": 40_000_000, "max_pixels": 40_000_000})
    refused_unpaid(server, "/v1/chat/completions", body, "embedding tokens, more than the encoder cache")


@pytest.mark.parametrize("options,message", [
    ({"min_pixels": 80_000_000, "max_pixels": 80_000_000}, "embedding tokens, more than the encoder cache"),
    ({"min_pixels": 1 << 31, "max_pixels": 1 << 31}, "--max-video-pixels"),
    ({"num_frames": 80_000_000}, "--max-video-frames"),
    ({"num_frames": 1 << 31}, "--max-video-frames"),
])
def test_video_options_beyond_the_limits(server, small_mp4, options, message):
    body = chat(video(small_mp4), media_io_kwargs={"video": options})
    refused_unpaid(server, "/v1/chat/completions", body, message)


def test_a_large_clip_is_served_at_its_target_size_and_over_the_budget_refused(server):
    clip = video_url(make_clip(24, 2560, 1440))  # 24 frames of 2560x1440, sampled whole
    served, growth, health, _ = paid_for(server, "/v1/chat/completions", chat(
        video(clip), media_io_kwargs={"video": {"num_frames": 24, "max_pixels": 24 * 320 * 180}}))
    assert served.status_code == 200, served.text
    assert growth < MAX_GROWTH_MIB and set(health) == {200}
    over = chat(video(clip), media_io_kwargs={"video": {"num_frames": 48}})  # each frame twice: over the limit
    refused_unpaid(server, "/v1/chat/completions", over, "--max-video-pixels")


def test_ten_mib_of_text(server):
    refused_unpaid(server, "/v1/chat/completions", chat([{"type": "text", "text": TEN_MIB}]), "not tokenized")
    refused_unpaid(server, "/v1/completions", {"model": "m", "prompt": TEN_MIB, "max_tokens": 1}, "not tokenized")
