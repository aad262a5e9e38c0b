"""Which frames of a video file each family's transformers video processor keeps, from the frame
count and rate alone (headers), so an index knows a video's grid without decoding it.

====================  =================================  ===========================================
family                default                            with ``fps`` / ``num_frames``
====================  =================================  ===========================================
Qwen2-VL, Qwen2.5-VL  every frame                        ``n``: ``num_frames`` rounded to a multiple
                      (``do_sample_frames=False``)       ``temporal_patch_size``, or ``total /
                                                         source_fps * fps`` within ``[min_frames,
                                                         max_frames]``, floored to that multiple;
                                                         indices ``arange(0, total, total / n)``
Qwen3-VL, Qwen3.5     2 fps (``do_sample_frames=True``)  ``n``: ``num_frames``, or ``int(total /
                                                         source_fps * fps)`` within ``[min_frames,
                                                         max_frames]`` and ``total``; indices
                                                         ``linspace(0, total - 1, n).round()``
====================  =================================  ===========================================

Qwen2.5-VL's ``second_per_grid_ts`` is ``temporal_patch_size / sampled_fps`` with ``sampled_fps = n
/ total * source_fps``; Qwen3-VL's ``<t seconds>`` are each frame group's mean of ``index /
source_fps``. The settings come from the video processor (or the checkpoint's
``video_preprocessor_config.json``) and the call's overrides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from prealign.schemas.errors import ConfigError

SAMPLING_KEYS = ("do_sample_frames", "fps", "num_frames", "min_frames", "max_frames")
"""The video processor settings (and call arguments) that choose frames."""


@dataclass(frozen=True, kw_only=True)
class FrameSampling:
    """One family's frame choice (its processor's class defaults, then the checkpoint's settings,
    then overrides).

    >>> FrameSampling.for_family(volume=True).indices(95, 30.0, 2).tolist()
    [0, 19, 38, 56, 75, 94]
    """

    linspace: bool
    """Qwen3-VL / 3.5's ``linspace(...).round()`` (True) or Qwen2-VL / 2.5-VL's ``arange``
    (False)."""
    do_sample_frames: bool
    fps: float | None
    num_frames: int | None
    min_frames: int = 4
    max_frames: int = 768

    @classmethod
    def for_family(
        cls, *, volume: bool, settings=None, overrides: dict | None = None
    ) -> "FrameSampling":
        """``volume``: the Qwen3-VL rules (:attr:`VisionFamily.volume_resize`); ``settings``: a
        video processor or its config dict; ``overrides``: per-call values of
        :data:`SAMPLING_KEYS`."""
        values = (
            {"do_sample_frames": True, "fps": 2.0, "num_frames": None}
            if volume
            else {"do_sample_frames": False, "fps": None, "num_frames": None}
        )
        get = (
            settings.get
            if isinstance(settings, dict)
            else (lambda k, d=None: getattr(settings, k, d))
        )
        for key in SAMPLING_KEYS:
            if settings is not None and get(key, None) is not None:
                values[key] = get(key)
        unknown = sorted(set(overrides or {}) - set(SAMPLING_KEYS))
        if unknown:
            raise ConfigError(
                f"video_sampling: unknown settings {unknown} (known: {list(SAMPLING_KEYS)})"
            )
        values.update(overrides or {})
        out = cls(linspace=volume, **values)
        out._check()
        return out

    def _check(self) -> None:
        if self.fps is not None and (
            isinstance(self.fps, bool)
            or not isinstance(self.fps, (int, float))
            or not 0 < self.fps < math.inf
        ):
            raise ConfigError(f"video sampling fps: expected a positive number, got {self.fps!r}")
        for name in ("num_frames", "min_frames", "max_frames"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ConfigError(f"video sampling {name}: expected an int >= 1, got {value!r}")

    def key(self) -> dict:
        """The settings as the index key records them."""
        return {
            "linspace": self.linspace,
            "do_sample_frames": self.do_sample_frames,
            "fps": self.fps,
            "num_frames": self.num_frames,
            "min_frames": self.min_frames,
            "max_frames": self.max_frames,
        }

    def indices(self, total: int, source_fps: float, temporal_patch_size: int) -> np.ndarray:
        """int64 ``[n]``: the frames kept of a ``total``-frame video at ``source_fps``, as the
        family's processor keeps them; a :class:`ValueError` where it refuses (more frames asked
        than there are)."""
        if not self.do_sample_frames:
            return np.arange(total, dtype=np.int64)
        if self.linspace:
            return self._linspace(total, source_fps)
        return self._arange(total, source_fps, temporal_patch_size)

    def _linspace(self, total: int, source_fps: float) -> np.ndarray:
        n = self.num_frames
        if n is None and self.fps is not None:
            n = min(
                max(int(total / (source_fps or 24) * self.fps), self.min_frames),
                self.max_frames,
                total,
            )
        if n is None:
            n = min(max(total, self.min_frames), self.max_frames)
        return np.linspace(0, total - 1, n).round().astype(np.int64)

    def _arange(self, total: int, source_fps: float, tp: int) -> np.ndarray:
        n = None
        if self.num_frames is not None:
            n = round(self.num_frames / tp) * tp
        elif self.fps is not None:
            top = math.floor(min(self.max_frames, total) / tp) * tp
            n = min(max(total / source_fps * self.fps, self.min_frames), top, total)
            n = math.floor(n / tp) * tp
        if n is None:  # (transformers fails here with a TypeError)
            raise ValueError(
                "do_sample_frames=True needs fps or num_frames for Qwen2-VL / Qwen2.5-VL"
            )
        if n > total or n < 1:
            raise ValueError(
                f"{n} frames to sample of a {total}-frame video (fps={self.fps}, "
                f"num_frames={self.num_frames}, min_frames={self.min_frames})"
            )
        return torch.arange(0, total, total / n).int().numpy().astype(np.int64)


def sampled_fps(indices: np.ndarray, total: int, source_fps: float) -> float:
    """The rate of the kept frames, ``n / total * source_fps`` (transformers'
    ``VideoMetadata.sampled_fps``).

    >>> round(sampled_fps(np.arange(4), 95, 30.0), 4)
    1.2632
    """
    return len(indices) / total * source_fps
