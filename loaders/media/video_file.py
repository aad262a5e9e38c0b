"""Video files (``.mp4``, ``.webm``, ``.mkv``, ...) with PyAV: headers without decoding, then only
the sampled frames decoded, each resized as it comes out of the decoder.

    bytes --probe_video-->  VideoHeader(frames, fps, width, height, seconds)
              headers only (a packet count, no decoding, where the stream header has no frame count)
          --decode_frames(indices, size)-->  uint8 [n, 3, h, w]
              seek to the keyframe before each sampled frame, decode forward

Frame ``i`` is the ``i``-th frame in presentation order, as transformers' ``load_video(...,
backend="pyav")`` counts them (its ``total_num_frames`` is the stream header's frame count, its
``fps`` the stream's average rate; both taken here alike). A frame converts to RGB with the same
PyAV call (``to_ndarray(format="rgb24")``) and is resized like transformers' video processors resize
a uint8 video tensor on the CPU: torch's bicubic interpolation with antialias
(:func:`resize_frames`), so no torchvision is needed.

Every failure is a :class:`VideoFileError` (a ``ValueError``) saying what is wrong; the transform
names the sample and member. ``DECODE_COUNT`` counts the frames this process decoded (the index pass
decodes none).
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

import numpy as np
import torch

DECODE_COUNT = [0]
"""Frames decoded by :func:`decode_frames` in this process (``[count]``; tests read it)."""


class VideoFileError(ValueError):
    """A video file that cannot be read as asked: not a container PyAV opens, no video stream, a
    codec it cannot decode, truncated data, frames that disagree with the headers, or a decode past
    its deadline."""


@dataclass(frozen=True)
class VideoHeader:
    """What a video's container and stream headers say (nothing decoded)."""

    frames: int
    """Frames in the stream: the header's count, else the demuxed packets (``counted``)."""
    fps: float
    """The stream's average frame rate (frames per second)."""
    width: int
    height: int
    seconds: float
    """Duration: ``frames / fps`` (as transformers' metadata)."""
    codec: str
    counted: bool = False
    """The frame count came from demuxing packets (the header had none: webm, mkv)."""


def _av():
    try:
        import av
    except ImportError:
        from prealign.schemas.errors import ConfigError

        raise ConfigError(
            "video files are decoded with PyAV: pip install 'prealign[video]' (the av package)"
        ) from None
    return av


def _open(data: bytes):
    av = _av()

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise VideoFileError(
            f"not a video container PyAV opens ({len(data)} bytes; {type(exc).__name__}: {exc})"
        ) from None
    if not container.streams.video:
        container.close()
        raise VideoFileError("a container without a video stream")
    return container


def probe_video(data: bytes) -> VideoHeader:
    """A video's :class:`VideoHeader` from its headers: no frame is decoded (where the stream header
    has no frame count, the video stream's packets are counted, which reads the file but decodes
    nothing)."""
    av = _av()

    container = _open(data)
    try:
        stream = container.streams.video[0]
        if stream.codec_context.name not in av.codecs_available:
            raise VideoFileError(
                f"codec {stream.codec_context.name!r}, which this PyAV cannot decode"
            )
        rate = stream.average_rate or stream.guessed_rate
        frames, counted = int(stream.frames or 0), False
        if frames <= 0:
            frames, counted = sum(1 for p in container.demux(stream) if p.size), True
        fps = float(rate) if rate else 0.0
        width, height = int(stream.codec_context.width), int(stream.codec_context.height)
        if frames <= 0 or fps <= 0 or width <= 0 or height <= 0:
            raise VideoFileError(
                f"headers without a usable video: {frames} frames at {fps:g} fps, {width}x{height}"
            )
        return VideoHeader(
            frames=frames,
            fps=fps,
            width=width,
            height=height,
            seconds=frames / fps,
            codec=stream.codec_context.name,
            counted=counted,
        )
    except av.FFmpegError as exc:
        raise VideoFileError(f"unreadable headers ({type(exc).__name__}: {exc})") from None
    finally:
        container.close()


def decode_frames(
    data: bytes,
    indices,
    header: VideoHeader,
    size: tuple[int, int] | None,
    *,
    threads: int = 1,
    deadline_s: float | None = None,
) -> np.ndarray:
    """The frames at ``indices`` (ascending presentation-order numbers, repeats allowed) -> uint8
    ``[n, 3, h, w]``, each resized to ``size = (h, w)`` (``None``: as decoded) as soon as it is
    decoded, so memory holds the sampled frames only. The packets' timestamps place each frame; the
    decoder seeks to the keyframe before a wanted frame whenever a keyframe lies between the current
    position and it, then decodes forward. ``threads``: decoder threads (1 per DataLoader worker by
    default). ``deadline_s``: wall seconds before a :class:`VideoFileError` (checked between
    frames). The stream must hold ``header.frames`` frames of ``header``'s size, else
    :class:`VideoFileError`."""
    av = _av()

    started = time.monotonic()
    wanted = np.asarray(indices, dtype=np.int64).reshape(-1)
    if (
        wanted.size == 0
        or wanted.min() < 0
        or wanted.max() >= header.frames
        or np.any(np.diff(wanted) < 0)
    ):
        raise VideoFileError(
            f"frame indices {wanted.tolist()[:8]} not ascending within 0..{header.frames - 1}"
        )
    container = _open(data)
    try:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = threads
        packets = [(p.pts, p.is_keyframe) for p in container.demux(stream) if p.size]
        if len(packets) != header.frames or any(pts is None for pts, _ in packets):
            untimed = " (some without timestamps)" if packets and packets[-1][0] is None else ""
            raise VideoFileError(
                f"the headers say {header.frames} frames, the stream holds {len(packets)}{untimed}"
            )
        pts = np.array(sorted(p for p, _ in packets), dtype=np.int64)
        keys = np.array(sorted(p for p, k in packets if k), dtype=np.int64)
        out = np.empty((wanted.size, 3, *(size or (header.height, header.width))), dtype=np.uint8)
        filled, position, frames = 0, None, None
        while filled < wanted.size:
            target = int(pts[wanted[filled]])
            if frames is None or (
                position is not None and np.any((keys > position) & (keys <= target))
            ):
                container.seek(target, stream=stream, backward=True, any_frame=False)
                frames, position = container.decode(stream), None
            frame = next(frames, None)
            if frame is None:
                raise VideoFileError(
                    f"the stream ends before frame {int(wanted[filled])} of {header.frames} "
                    "(truncated?)"
                )
            DECODE_COUNT[0] += 1
            if deadline_s is not None and time.monotonic() - started > deadline_s:
                raise VideoFileError(f"decoding took over {deadline_s:g} s (the read deadline)")
            position = frame.pts
            if frame.pts is None or frame.pts < target:
                continue
            if frame.pts > target or (frame.width, frame.height) != (header.width, header.height):
                raise VideoFileError(
                    f"decoded frame at pts {frame.pts} ({frame.width}x{frame.height}) where the "
                    f"headers place frame {int(wanted[filled])} at pts {target} "
                    f"({header.width}x{header.height})"
                )
            rgb = torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1).unsqueeze(0)
            resized = resize_frames(rgb, size)[0].numpy()
            while (
                filled < wanted.size and int(pts[wanted[filled]]) == target
            ):  # a repeated index: the same frame
                out[filled] = resized
                filled += 1
        return out
    except av.FFmpegError as exc:
        raise VideoFileError(f"undecodable ({type(exc).__name__}: {exc})") from None
    finally:
        container.close()


def resize_frames(frames: torch.Tensor, size: tuple[int, int] | None) -> torch.Tensor:
    """uint8 ``[n, 3, H, W]`` -> uint8 ``[n, 3, h, w]``: torch's bicubic interpolation with
    antialias on the uint8 tensor, what transformers' video processors run (through torchvision) on
    a CPU video tensor; as is at its own size or with ``size=None``."""
    if size is None or tuple(frames.shape[-2:]) == tuple(size):
        return frames
    return torch.nn.functional.interpolate(
        frames, size=tuple(size), mode="bicubic", align_corners=False, antialias=True
    )


VIDEO_CODECS = {"mp4": "libx264", "mkv": "libx264", "mov": "libx264", "webm": "libvpx-vp9"}
"""The codec :func:`encode_video` writes for each container extension."""


def encode_video(frames: np.ndarray, fps: float, *, container: str = "mp4") -> bytes:
    """uint8 ``[T, H, W, 3]`` RGB frames -> a video file's bytes (``container``: a key of
    :data:`VIDEO_CODECS`) at ``fps`` (yuv420p, so ``H`` and ``W`` are made even by dropping a last
    row / column); lossy, as the video files a dataset holds. What
    :class:`~prealign.loaders.index.shard_writer.ShardWriter` writes for an
    array under a video member name."""
    import fractions

    av = _av()
    frames = np.asarray(frames)
    if (
        frames.dtype != np.uint8
        or frames.ndim != 4
        or frames.shape[-1] != 3
        or 0 in frames.shape[:3]
    ):
        raise ValueError(
            f"expected uint8 frames [T, H, W, 3], got {frames.dtype} {list(frames.shape)}"
        )
    if container not in VIDEO_CODECS:
        raise ValueError(f"container {container!r}: expected one of {sorted(VIDEO_CODECS)}")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps <= 1000:
        raise ValueError(f"fps: expected a number in (0, 1000], got {fps!r}")
    h, w = frames.shape[1] - frames.shape[1] % 2, frames.shape[2] - frames.shape[2] % 2
    if h == 0 or w == 0:
        raise ValueError(f"frames of {frames.shape[2]}x{frames.shape[1]}: at least 2x2 pixels")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format={"mkv": "matroska"}.get(container, container)) as out:
        stream = out.add_stream(
            VIDEO_CODECS[container], rate=fractions.Fraction(fps).limit_denominator(1001)
        )
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for frame in frames[:, :h, :w]:
            out.mux(
                stream.encode(
                    av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
                )
            )
        out.mux(stream.encode())
    return buf.getvalue()
