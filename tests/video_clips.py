"""Tiny video files made with PyAV for the tests: moving colour patterns (every frame differs), any
length, rate, size, container and codec; a variable-frame-rate mp4 (frame durations alternating 1x
and 2x)."""

from __future__ import annotations

import fractions
import io

import numpy as np

CODECS = {"mp4": "libx264", "webm": "libvpx", "mkv": "libx264"}


def frame_pixels(i: int, w: int, h: int, seed: int = 0) -> np.ndarray:
    """uint8 ``[h, w, 3]``: smooth gradients shifted by the frame number (compressible, distinct per
    frame)."""
    y, x = np.mgrid[0:h, 0:w]
    r = (x * 255 // max(w - 1, 1) + 7 * i + seed) % 256
    g = (y * 255 // max(h - 1, 1) + 3 * i) % 256
    b = ((x + y + 11 * i + 5 * seed) * 2) % 256
    return np.stack([r, g, b], axis=-1).astype(np.uint8)


def make_clip(
    frames: int,
    w: int,
    h: int,
    fps: float,
    *,
    container: str = "mp4",
    codec: str | None = None,
    gop: int | None = None,
    vfr: bool = False,
    seed: int = 0,
) -> bytes:
    """An encoded clip of ``frames`` frames ``w x h`` at ``fps`` (``vfr``: timestamps spaced 1 and 2
    frame durations alternately, the rate in the header then an average). ``gop``: frames between
    keyframes."""
    import av

    buf = io.BytesIO()
    fmt = {"mkv": "matroska"}.get(container, container)
    with av.open(buf, mode="w", format=fmt) as out:
        rate = fractions.Fraction(fps).limit_denominator(1000)
        stream = out.add_stream(codec or CODECS[container], rate=rate)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        if gop is not None:
            stream.codec_context.gop_size = gop
            if stream.codec_context.name == "libx264":
                stream.codec_context.options = {
                    "keyint": str(gop),
                    "min-keyint": str(gop),
                    "scenecut": "0",
                }
        if vfr:
            stream.codec_context.time_base = fractions.Fraction(1, 1000)
        tick = 0
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(i, w, h, seed), format="rgb24")
            if vfr:
                frame.pts, frame.time_base = tick, fractions.Fraction(1, 1000)
                tick += int(1000 / fps) * (1 + i % 2)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()
