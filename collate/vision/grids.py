"""Grid arithmetic of the Qwen vision processors: an image's or a video's ``(t, gh, gw)`` from its
size alone.

    (height, width)          --image_grid-->  (1, gh, gw)
        Qwen2-VL's ``smart_resize`` (every family's images)
    (frames, height, width)  --video_grid-->  (ceil(frames / temporal), gh, gw)
        per-frame area bound (Qwen2-VL / Qwen2.5-VL video processor)  or
        whole-clip volume bound (Qwen3-VL / Qwen3.5 video processor: ``frames * h * w`` within the
        pixel range)

``gh``, ``gw`` count patches (multiples of the merge size); the LLM sees ``t * gh * gw / merge**2``
tokens. The area rule is pure Python arithmetic written from the processors' resize rule (tested
equal to it). The volume rule changed between transformers releases (5.10 rounds the frames up and
refuses a side under ``patch * merge``; 5.24 rounds them to the nearest and scales such a side up),
so it is the installed transformers' own ``smart_resize`` of the Qwen3-VL video processor
(importable without torchvision).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prealign.schemas.checks import int_at_least
from prealign.schemas.errors import ConfigError, SampleError


def check_positive_ints(obj, names: tuple[str, ...]) -> None:
    """Each of ``obj``'s ``names`` an int >= 1 (``image_token_id``: >= 0), else a
    :class:`~prealign.schemas.ConfigError` naming the class and the field; a numpy int is kept as
    an int (an ``int8`` kept as it is wraps in ``patch * merge``)."""
    for name in names:
        low = 0 if name == "image_token_id" else 1
        value = int_at_least(
            f"{type(obj).__name__}.{name}",
            getattr(obj, name),
            low,
            ConfigError,
            expected="a positive int" if low else None,
        )
        object.__setattr__(obj, name, value)  # (obj: a frozen dataclass)


@dataclass(frozen=True, kw_only=True)
class VisionGeometry:
    """The processor settings that decide a grid (defaults: transformers' Qwen2-VL image
    processor)."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    def __post_init__(self):
        check_positive_ints(
            self, ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels")
        )
        if self.min_pixels > self.max_pixels:
            raise ConfigError(
                f"{type(self).__name__}: expected min_pixels <= max_pixels, got {self.min_pixels} "
                f"> {self.max_pixels}"
            )

    @classmethod
    def of(cls, processor) -> "VisionGeometry":
        """The geometry of a transformers Qwen image or video processor (its ``size`` or
        ``min/max_pixels``)."""
        size = getattr(processor, "size", None) or {}
        get = size.get if isinstance(size, dict) else (lambda k, d=None: getattr(size, k, d))
        return cls(
            patch_size=int(processor.patch_size),
            merge_size=int(processor.merge_size),
            temporal_patch_size=int(processor.temporal_patch_size),
            min_pixels=int(get("shortest_edge", None) or getattr(processor, "min_pixels")),
            max_pixels=int(get("longest_edge", None) or getattr(processor, "max_pixels")),
        )


def image_grid(
    height: int,
    width: int,
    geometry: VisionGeometry = VisionGeometry(),
    *,
    sample=None,
    field: str = "image",
) -> tuple[int, int, int]:
    """``(1, gh, gw)``: the ``image_grid_thw`` row of one ``height x width`` image.

    Each side goes to a multiple of ``factor = patch_size * merge_size`` (Python's ``round``), the
    area kept within ``[min_pixels, max_pixels]`` by a common scale. Raises :class:`SampleError` for
    an empty image or an aspect ratio over 200 (what the processor refuses).

    >>> image_grid(480, 640)
    (1, 34, 46)
    >>> image_grid(20, 20)   # scaled up to min_pixels
    (1, 4, 4)
    """
    _check_size(height, width, sample, field)
    h_bar, w_bar = _resize(height, width, geometry.patch_size * geometry.merge_size, geometry)
    return 1, h_bar // geometry.patch_size, w_bar // geometry.patch_size


def video_grid(
    frames: int,
    height: int,
    width: int,
    geometry: VisionGeometry,
    *,
    volume: bool,
    sample=None,
    field: str = "video",
) -> tuple[int, int, int]:
    """``(t, gh, gw)``: the ``video_grid_thw`` row of ``frames`` frames of ``height x width``
    (frames padded to a multiple of ``temporal_patch_size`` by repeating the last, as the video
    processors do).

    ``volume=False`` (Qwen2-VL / Qwen2.5-VL): each frame's area within ``[min_pixels, max_pixels]``.
    ``volume=True`` (Qwen3-VL / Qwen3.5): the clip's volume, by transformers' Qwen3-VL video
    ``smart_resize``. What the processor refuses (too few frames, a bad aspect ratio) is a
    :class:`SampleError`.

    >>> geometry = VisionGeometry(patch_size=16, min_pixels=4096, max_pixels=2 ** 22)
    >>> video_grid(5, 240, 320, geometry, volume=True)
    (3, 16, 20)
    """
    tp = geometry.temporal_patch_size
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
        raise SampleError(
            sample=sample, field=field, actual=f"{frames!r} frames", expected="at least 1 frame"
        )
    factor = geometry.patch_size * geometry.merge_size
    if volume:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        try:
            h_bar, w_bar = smart_resize(
                frames, height, width, tp, factor, geometry.min_pixels, geometry.max_pixels
            )
        except ValueError as exc:
            raise SampleError(
                sample=sample,
                field=field,
                actual=f"{frames} frames of {width}x{height}",
                expected=f"a video the Qwen3-VL video processor accepts ({exc})",
            ) from None
    else:
        _check_size(height, width, sample, field)
        h_bar, w_bar = _resize(height, width, factor, geometry)
    return -(-frames // tp), h_bar // geometry.patch_size, w_bar // geometry.patch_size


def check_pixels(height: int, width: int, *, sample=None, field: str = "image") -> None:
    """A :class:`SampleError` naming ``sample`` and ``field`` for an image of no pixels (every
    family's first check of a size)."""
    if min(height, width) < 1:
        raise SampleError(
            sample=sample, field=field, expected="at least 1x1 pixels", actual=f"{width}x{height}"
        )


def check_aspect_ratio(height: int, width: int, *, sample=None, field: str = "image") -> None:
    """A :class:`SampleError` for a side over 200 times the other (what Qwen's and GLM's processors
    refuse)."""
    if max(height, width) / min(height, width) > 200:
        raise SampleError(
            sample=sample,
            field=field,
            expected="an aspect ratio of at most 200",
            actual=f"{width}x{height}",
        )


def _check_size(height: int, width: int, sample, field: str) -> None:
    check_pixels(height, width, sample=sample, field=field)
    check_aspect_ratio(height, width, sample=sample, field=field)


def _resize(height: int, width: int, factor: int, geometry: VisionGeometry) -> tuple[int, int]:
    """The Qwen2-VL processors' resize: sides to multiples of ``factor``, the area kept in range."""
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > geometry.max_pixels:
        beta = math.sqrt(height * width / geometry.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < geometry.min_pixels:
        beta = math.sqrt(geometry.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
