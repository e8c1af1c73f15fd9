"""Tiny test videos made with PyAV (import as `from tiny_videos import ...`).

`encode_video(frames, fps, codec)`: "png" in a .mov is lossless (decodes bit-exact to `frames`),
"h264" in an .mp4 is lossy (compare both sides on the same decoded frames).
"""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np


def make_frames(seed: int, count: int, size: tuple[int, int] = (64, 48)) -> np.ndarray:
    """[count, H, W, 3] uint8: coloured blocks that move a little from frame to frame, plus noise."""
    rng = np.random.default_rng(seed)
    width, height = size
    blocks = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    base = np.kron(blocks, np.ones((-(-height // 4), -(-width // 4), 1), dtype=np.uint8))[:height, :width]
    frames = []
    for t in range(count):
        shifted = np.roll(base, shift=3 * t, axis=1).astype(np.int16)
        noise = rng.integers(-20, 21, (height, width, 3), dtype=np.int16)
        frames.append(np.clip(shifted + noise, 0, 255).astype(np.uint8))
    return np.stack(frames)


_CONTAINERS = {"png": ("mov", "rgb24"), "h264": ("mp4", "yuv420p"), "ffv1": ("matroska", "bgr0"),
               "libvpx-vp9": ("webm", "yuv420p")}


def encode_video(frames: np.ndarray, fps: int = 4, codec: str = "png") -> bytes:
    """The frames as a video file's bytes: "png" (lossless, .mov), "h264" (.mp4), "ffv1" (lossless,
    .mkv) or "libvpx-vp9" (.webm); the last two record no frame count in their headers."""
    import av

    buf = io.BytesIO()
    fmt, pix_fmt = _CONTAINERS[codec]
    with av.open(buf, mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=Fraction(fps))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = pix_fmt
        if codec == "h264":
            stream.options = {"preset": "ultrafast", "crf": "18"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def decoded_frames(data: bytes) -> tuple[np.ndarray, float]:
    """All frames of a video file as PyAV decodes them (what a reference must be fed), and its fps."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        return np.stack(frames), float(stream.average_rate)


def audio_only_file() -> bytes:
    """A WAV file: a container with no video stream."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), dtype=np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    return buf.getvalue()
