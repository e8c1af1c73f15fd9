"""A 20 s 720p H.264 clip on the built-in Qwen3-VL: what a repeat costs against its first sight.

Offline, per stage (cold = first sight, warm = the same request again on the same engine):
decode (PyAV, sampled at 2 fps: 40 frames), preprocessing (our video processor), encoding (the
vision tower over the 20 temporal groups), prefill (the rest of the request's time); then TTFT of
the whole request cold and warm through the server (streamed, max_tokens 1), with their ratio
(target: a repeat costs at most a fifth).

Run: `PYTHONPATH=src:tests .venv/bin/python benchmarks/video_warm_path.py [--runs N]`.
Timings on a shared 2-core machine swing: it prints min / median / max over the runs.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import sys
import time
from fractions import Fraction

import httpx
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))

from warm_path import ttft  # noqa: E402

MODEL = "builtin:tiny-qwen3-vl"
# 40 frames of ~640x352 (the clip's whole pixel budget): 220 tokens per group, 4400 in all
OPTIONS = {"video": {"max_pixels": 40 * 640 * 360}}
FLAGS = ("--max-model-len", "8192", "--max-num-batched-tokens", "8192", "--media-io-kwargs", json.dumps(OPTIONS),
         "--max-request-body-mb", "128", "--encoder-cache-tokens", "8192")


def make_clip(seconds: int = 20, fps: int = 30, width: int = 1280, height: int = 720) -> bytes:
    """Moving gradients with a little noise, H.264 in MP4 (a few MB, like a phone clip)."""
    import av

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("h264", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "23"}
        for t in range(seconds * fps):
            base = np.stack([128 + 100 * np.sin((x + 4 * t) / (61 + 9 * c) + y / (47 + 5 * c)) for c in range(3)], -1)
            pixels = np.clip(base + rng.normal(0, 4, base.shape), 0, 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def stages(clip: bytes) -> dict[str, float]:
    """Seconds per stage, cold then warm, on one offline engine."""
    from mmserve import LLM, SamplingParams
    from mmserve.multimodal.video import VideoLimits, decode_video
    from mmserve.multimodal.video_options import resolve, sample_indices

    llm = LLM(model=MODEL, max_model_len=8192, max_num_batched_tokens=8192, encoder_cache_tokens=8192,
              media_io_kwargs=OPTIONS)
    processor = llm.engine.input_processor.processor
    opts = resolve(processor.video.defaults, OPTIONS["video"])
    out: dict[str, float] = {}
    start = time.perf_counter()
    decoded = decode_video(clip, lambda m: sample_indices(m, opts, processor.family, 2), VideoLimits())
    out["decode"] = time.perf_counter() - start
    start = time.perf_counter()
    video = processor.video.process(decoded.frames, decoded.indices, decoded.metadata.fps,
                                    decoded.metadata.total_num_frames, opts)
    out["preprocess"] = time.perf_counter() - start
    model = llm.engine.core.executor.runner.model
    start = time.perf_counter()
    model.encode_items([video.group(g) for g in range(video.grid[0])], llm.engine.core.executor.runner.dtype)
    out["encode"] = time.perf_counter() - start
    prompt = processor.apply_chat_template([{"role": "user", "content": [{"type": "video"},
                                                                           {"type": "text", "text": "What happens?"}]}])
    request = {"prompt": prompt, "multi_modal_data": {"video": clip}}
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for phase in ("cold", "warm"):
        start = time.perf_counter()
        result = llm.generate(request, params)[0]
        out[f"request_{phase}"] = time.perf_counter() - start
    out["prompt_tokens"] = len(result.prompt_token_ids)
    out["groups"] = video.grid[0]
    out["prefill_cold"] = out["request_cold"] - out["decode"] - out["preprocess"] - out["encode"]
    return out


def server_ttft(clip: bytes) -> tuple[float, float]:
    from helpers.server_process import ServerProcess

    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    server = ServerProcess(MODEL, "--served-model-name", "m", *FLAGS, timeout_s=300)
    try:
        with httpx.Client(timeout=600) as client:
            first, again = (ttft(client, server.base_url, [url], "What happens?", "video_url") for _ in range(2))
            return first, again
    finally:
        server.stop()


def spread(values: list[float]) -> str:
    return f"{min(values) * 1e3:8.1f} {statistics.median(values) * 1e3:8.1f} {max(values) * 1e3:8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    start = time.perf_counter()
    clip = make_clip()
    made = time.perf_counter() - start
    print(f"clip: 20 s, 1280x720, 30 fps, H.264, {len(clip) / 1e6:.1f} MB (made in {made:.1f} s)")
    runs = [stages(clip) for _ in range(args.runs)]
    print(f"{runs[0]['groups']} temporal groups, {runs[0]['prompt_tokens']} prompt tokens")
    print(f"{'ms (min median max)':28s}")
    for key in ("decode", "preprocess", "encode", "prefill_cold", "request_cold", "request_warm"):
        print(f"offline {key:20s} {spread([r[key] for r in runs])}")
    ratios = [r["request_warm"] / r["request_cold"] for r in runs]
    print(f"offline warm / cold          {min(ratios):8.3f} {statistics.median(ratios):8.3f} {max(ratios):8.3f}")
    pairs = [server_ttft(clip) for _ in range(args.runs)]
    print(f"server TTFT cold             {spread([c for c, _ in pairs])}")
    print(f"server TTFT warm             {spread([w for _, w in pairs])}")
    ratios = [w / c for c, w in pairs]
    print(f"server warm / cold           {min(ratios):8.3f} {statistics.median(ratios):8.3f} {max(ratios):8.3f}"
          "  (target <= 0.20)")


if __name__ == "__main__":
    main()
