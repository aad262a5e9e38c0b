"""A video file of a sample, for the transforms whose token count depends only on how many frames
are kept (LLaVA-OneVision): its headers read and checked against the decode limits before a frame
is decoded, then only the kept frames decoded, each resized to the processor's square as it leaves
the decoder.

    VideoEntry(data=bytes) --file_plan(sampling)-->  FilePlan(header, indices int64 [n])
        refused (a typed MediaError naming the sample and member) when the headers say more
        seconds, frames, pixels or RGB bytes than ``DecodeLimits`` allows
    --decode_plan(size)-->  uint8 [n, 3, h, w]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prealign.loaders.media.video_file import (
    VideoFileError,
    VideoHeader,
    decode_frames,
    probe_video,
)
from prealign.loaders.media.vlm import MediaError, MediaProblem, VideoEntry
from prealign.loaders.sources.tar_decode import DecodeLimits


@dataclass(frozen=True)
class FilePlan:
    """A video file from its headers: the header and the kept frames' indices int64 ``[n]``."""

    header: VideoHeader
    indices: np.ndarray


def file_plan(video: VideoEntry, sampling, key, limits: DecodeLimits) -> FilePlan:
    """``video``'s headers and the frames ``sampling`` (``.indices(total, source_fps)``) keeps;
    ``corrupt_video`` where PyAV cannot read the headers, ``bad_video`` where the sampler refuses or
    the video is over ``limits`` (its seconds; its kept frames, their pixels and RGB bytes at the
    source size), all before anything is decoded."""

    def bad(actual: str, expected: str) -> MediaError:
        return MediaError(
            MediaProblem.BAD_VIDEO, sample=key, field=video.name, actual=actual, expected=expected
        )

    try:
        header = probe_video(video.data)
    except VideoFileError as exc:
        raise MediaError(
            MediaProblem.CORRUPT_VIDEO,
            sample=key,
            field=video.name,
            actual=str(exc),
            expected="a video file PyAV reads (mp4, webm, mkv, ...)",
        ) from None
    if header.seconds > limits.max_video_seconds:
        raise bad(
            f"{header.seconds:.1f} s",
            f"at most {limits.max_video_seconds} s (DecodeLimits.max_video_seconds)",
        )
    try:
        indices = sampling.indices(header.frames, header.fps)
    except ValueError as exc:
        raise bad(str(exc), "a video the processor's frame sampling takes") from None
    n, area = len(indices), header.width * header.height
    if n > limits.max_video_frames:
        raise bad(
            f"{n} kept frames of {header.frames}",
            f"at most {limits.max_video_frames} frames (DecodeLimits.max_video_frames; "
            "sample fewer: video_sampling={'num_frames': ...} or {'fps': ...})",
        )
    if n * area > limits.max_video_pixels:
        raise bad(
            f"{n} frames of {header.width}x{header.height} = {n * area} pixels",
            f"at most {limits.max_video_pixels} pixels over its frames "
            "(DecodeLimits.max_video_pixels)",
        )
    if n * area * 3 > limits.max_video_bytes:
        raise bad(
            f"{n} frames of {header.width}x{header.height}",
            f"at most {limits.max_video_bytes} decoded bytes (DecodeLimits.max_video_bytes)",
        )
    return FilePlan(header=header, indices=indices)


def decode_plan(
    video: VideoEntry,
    plan: FilePlan,
    size: tuple[int, int],
    key,
    limits: DecodeLimits,
    *,
    threads: int = 1,
) -> np.ndarray:
    """The plan's frames -> uint8 ``[n, 3, *size]`` (:func:`~.video_file.decode_frames`: only
    those frames decoded, each resized as decoded); a stream that disagrees with its headers, or
    a decode over ``limits.max_video_decode_seconds``, is ``corrupt_video``."""
    try:
        return decode_frames(
            video.data,
            plan.indices,
            plan.header,
            size,
            threads=threads,
            deadline_s=limits.max_video_decode_seconds,
        )
    except VideoFileError as exc:
        raise MediaError(
            MediaProblem.CORRUPT_VIDEO,
            sample=key,
            field=video.name,
            actual=str(exc),
            expected="a video file whose kept frames decode as its headers say",
        ) from None
