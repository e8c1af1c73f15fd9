"""Reading videos (P0): container metadata without decoding, then only the sampled frames.

Decoding is PyAV's (FFmpeg inside its wheels), and the metadata is what transformers' PyAV reader
(`video_utils.read_video_pyav`) reports, so frame indices and timestamps agree with it:
`total_num_frames` is the stream's frame count and `fps` its average rate. A container that does
not record its frame count (WebM, some MKV) is counted by demuxing its packets, never guessed.

Every refusal is a `MediaError` for the client: no video stream, unreadable or truncated data, zero
frames, or a limit (`VideoLimits`) exceeded. Limits are checked on the metadata before any frame is
decoded, so a long or huge clip costs only its header.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from mmserve.multimodal.media import MediaError

FLAG_MAX_FRAMES = "--max-video-frames"
FLAG_MAX_DURATION = "--max-video-duration-s"
FLAG_MAX_TOTAL_PIXELS = "--max-video-pixels"


@dataclass(frozen=True)
class VideoLimits:
    """`max_frames`: frames kept after sampling; `max_duration_s`: the clip's length in seconds;
    `max_pixels`: one frame's width * height (the media pixel limit); `max_total_pixels`: the
    sampled frames' pixels together (frames x width x height at the source size: what decoding
    converts), checked before any frame is decoded."""

    max_frames: int = 768
    max_duration_s: float = 3600.0
    max_pixels: int = 40_000_000
    max_total_pixels: int = 1 << 28

    def __post_init__(self) -> None:
        if self.max_frames < 1 or self.max_duration_s <= 0 or self.max_pixels < 1 or self.max_total_pixels < 1:
            raise ValueError(f"video limits must be positive; got {self}")


@dataclass(frozen=True)
class VideoMetadata:
    """What the container says: frame count, average frame rate, frame size."""

    total_num_frames: int
    fps: float | None
    width: int
    height: int

    @property
    def duration_s(self) -> float:
        return self.total_num_frames / self.fps if self.fps else 0.0


@dataclass(frozen=True)
class DecodedVideo:
    """Sampled frames [T, H, W, 3] uint8 RGB, their indices in the source, and its metadata."""

    frames: np.ndarray
    indices: np.ndarray
    metadata: VideoMetadata


def check_video(meta: VideoMetadata, limits: VideoLimits) -> None:
    """MediaError when the metadata alone breaks a limit or describes no frames."""
    if meta.total_num_frames < 1:
        raise MediaError("the video has no frames")
    if meta.width * meta.height > limits.max_pixels:
        raise MediaError(f"video frames of {meta.width}x{meta.height} pixels exceed the limit of "
                         f"{limits.max_pixels} pixels per frame (--max-media-pixels)")
    if meta.duration_s > limits.max_duration_s:
        raise MediaError(f"the video lasts {meta.duration_s:.1f} s, more than the limit of "
                         f"{limits.max_duration_s:g} s ({FLAG_MAX_DURATION})")


def check_sampled(num_frames: int, limits: VideoLimits, meta: VideoMetadata | None = None) -> None:
    """MediaError when sampling keeps more frames, or (given the metadata) more pixels, than allowed."""
    if num_frames > limits.max_frames:
        raise MediaError(f"sampling keeps {num_frames} frames of the video, more than the limit of "
                         f"{limits.max_frames} ({FLAG_MAX_FRAMES}); lower fps or num_frames")
    if meta is None:
        return
    total = num_frames * meta.width * meta.height
    if total > limits.max_total_pixels:
        raise MediaError(f"sampling keeps {num_frames} frames of {meta.width}x{meta.height} = {total} pixels, "
                         f"more than the limit of {limits.max_total_pixels} ({FLAG_MAX_TOTAL_PIXELS}); lower fps or "
                         "num_frames, or send a smaller video")


def decode_video(data: bytes, sample: Callable[[VideoMetadata], np.ndarray], limits: VideoLimits) -> DecodedVideo:
    """Decodes the frames `sample(metadata)` picks (sorted source indices, repeats allowed) from
    encoded video bytes. MediaError for anything unreadable, truncated or over a limit."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = _video_stream(container)
            meta = _metadata(container, stream)
            check_video(meta, limits)
            indices = np.asarray(sample(meta), dtype=np.int64)
            check_sampled(len(indices), limits)
            frames = np.stack(_read_frames(container, stream, indices))
    except MediaError:
        raise
    except (av.error.FFmpegError, ValueError, IndexError, OSError) as e:
        raise MediaError(f"the video could not be decoded: {_short(e)}") from None
    return DecodedVideo(frames, indices, meta)


def decode_frames(data: bytes, indices: np.ndarray, convert: Callable[[np.ndarray], Any]) -> list[Any]:
    """`convert(frame)` of each frame at `indices` (sorted, repeats allowed; checked by the caller
    against the limits) in order, a frame [H, W, 3] uint8 RGB converted as soon as it is decoded:
    only the converted sampled frames are kept. MediaError for anything unreadable or truncated."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            return _read_frames(container, _video_stream(container), indices, convert)
    except MediaError:
        raise
    except (av.error.FFmpegError, ValueError, IndexError, OSError) as e:
        raise MediaError(f"the video could not be decoded: {_short(e)}") from None


def probe_video(data: bytes) -> VideoMetadata:
    """The container's metadata, no frame decoded (MediaError when unreadable)."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            return _metadata(container, _video_stream(container))
    except MediaError:
        raise
    except (av.error.FFmpegError, ValueError, IndexError, OSError) as e:
        raise MediaError(f"the video could not be read: {_short(e)}") from None


def _video_stream(container: Any) -> Any:
    if not container.streams.video:
        raise MediaError("the file has no video stream")
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"
    return stream


def _metadata(container: Any, stream: Any) -> VideoMetadata:
    total = int(stream.frames)
    if total == 0:  # not recorded in the header: count the packets that carry a frame
        total = sum(1 for packet in container.demux(stream) if packet.size)
        container.seek(0)
    fps = float(stream.average_rate) if stream.average_rate else None
    return VideoMetadata(total, fps, int(stream.codec_context.width), int(stream.codec_context.height))


def _read_frames(container: Any, stream: Any, indices: np.ndarray,
                 convert: Callable[[np.ndarray], Any] = lambda frame: frame) -> list[Any]:
    """Frames at `indices` (decode order = presentation order for the codecs we read), each
    converted once, stopping after the last one needed. MediaError when the stream ends before it
    (a truncated file)."""
    if len(indices) == 0:
        raise MediaError("sampling picked no frames of the video")
    if indices[0] < 0 or np.any(np.diff(indices) < 0):
        raise ValueError("frame indices must be sorted and non-negative")
    wanted, last = set(indices.tolist()), int(indices[-1])
    kept: dict[int, Any] = {}
    count = 0
    for count, frame in enumerate(container.decode(stream), start=1):
        if count - 1 in wanted:
            kept[count - 1] = convert(frame.to_ndarray(format="rgb24"))
        if count > last:
            break
    if last not in kept:
        raise MediaError(f"the video is truncated: frame {last} was needed but the stream ended after {count} "
                         "frames")
    return [kept[int(i)] for i in indices]


def _short(e: BaseException) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__
