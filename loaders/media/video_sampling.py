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

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from prealign.schemas.checks import int_at_least
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
            if value is not None:
                value = int_at_least(f"video sampling {name}", value, 1, ConfigError)
                object.__setattr__(self, name, value)

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


UNIFORM_KEYS = ("do_sample_frames", "fps", "num_frames")
"""The settings (and call arguments) that choose frames for transformers' base video processor."""


@dataclass(frozen=True, kw_only=True)
class UniformSampling:
    """transformers' base video processor's frame choice (``BaseVideoProcessor.sample_frames``),
    what LLaVA-OneVision's video processor inherits: by default every frame
    (``do_sample_frames=False``); asked for ``num_frames`` or ``fps``, ``n`` frames spread evenly,
    by the rule of the installed transformers (:func:`uniform_rule`):

    ==========  ===========================================  ====================================
    rule        ``n`` from ``fps``                           indices
    ==========  ===========================================  ====================================
    ``arange``  ``int(total / source_fps * fps)`` (0 is      ``torch.arange(0, total, total /
    (5.6-5.10)  refused)                                     n).int()``, those ``< total`` (a
                                                             float step can reach ``total``; the
                                                             PyAV reader drops it)
    ``floor``   ``max(1, int(total / source_fps * fps))``    ``arange(n) * total // n``
    (5.24)
    ==========  ===========================================  ====================================

    Either refuses ``n > total`` and ``fps`` with ``num_frames``.

    >>> UniformSampling(rule="floor", do_sample_frames=True, num_frames=4).indices(10, 1.0).tolist()
    [0, 2, 5, 7]
    """

    rule: str
    do_sample_frames: bool = False
    fps: float | None = None
    num_frames: int | None = None

    @classmethod
    def for_processor(
        cls, settings=None, overrides: dict | None = None, *, rule: str | None = None
    ) -> "UniformSampling":
        """``settings``: a video processor or its config dict (its :data:`UNIFORM_KEYS`, else the
        class defaults: every frame); ``overrides``: per-call values; ``rule``: the installed
        transformers' unless given."""
        get = (
            settings.get
            if isinstance(settings, dict)
            else (lambda k, d=None: getattr(settings, k, d))
        )
        values = {"do_sample_frames": False, "fps": None, "num_frames": None}
        for key in UNIFORM_KEYS:
            if settings is not None and get(key, None) is not None:
                values[key] = get(key)
        unknown = sorted(set(overrides or {}) - set(UNIFORM_KEYS))
        if unknown:
            raise ConfigError(
                f"video_sampling: unknown settings {unknown} (known: {list(UNIFORM_KEYS)})"
            )
        values.update(overrides or {})
        call = overrides or {}
        if call.get("fps") is None or call.get("num_frames") is None:
            # (transformers refuses the two only from one call: else num_frames, the call's or
            # the settings', is used and fps ignored)
            if values["num_frames"] is not None:
                values["fps"] = None
        out = cls(rule=rule or uniform_rule(), **values)
        if out.rule not in ("arange", "floor"):
            raise ConfigError(f"video sampling rule: 'arange' or 'floor', not {out.rule!r}")
        FrameSampling(  # (the same checks of fps and num_frames)
            linspace=False, do_sample_frames=True, fps=out.fps, num_frames=out.num_frames
        )._check()
        return out

    def key(self) -> dict:
        """The settings as the index key records them."""
        return {
            "rule": self.rule,
            "do_sample_frames": self.do_sample_frames,
            "fps": self.fps,
            "num_frames": self.num_frames,
        }

    def indices(self, total: int, source_fps: float) -> np.ndarray:
        """int64 ``[n]``: the frames kept of a ``total``-frame video at ``source_fps``; a
        :class:`ValueError` where transformers refuses."""
        if not self.do_sample_frames:
            return np.arange(total, dtype=np.int64)
        n = self.num_frames
        if self.fps is not None and n is not None:
            raise ValueError("fps and num_frames are mutually exclusive; give one")
        if n is None and self.fps is not None:
            n = int(total / source_fps * self.fps)
            n = max(1, n) if self.rule == "floor" else n
        if n is None:
            if self.rule == "floor":
                return np.arange(total, dtype=np.int64)
            raise ValueError("do_sample_frames=True needs fps or num_frames (transformers fails)")
        if n > total or n < 1:
            raise ValueError(
                f"{n} frames to sample of a {total}-frame video (fps={self.fps}, "
                f"num_frames={self.num_frames})"
            )
        if self.rule == "floor":
            return np.arange(n, dtype=np.int64) * total // n
        kept = torch.arange(0, total, total / n).int().numpy().astype(np.int64)
        return kept[kept < total]


def uniform_rule() -> str:
    """Which :class:`UniformSampling` rule the installed transformers' base video processor
    follows, found once per process by asking its ``sample_frames`` two questions (1 frame per 20
    of 10 at 1 fps: ``[0]`` for ``floor``, refused for ``arange``; 4 of 10: ``[0, 2, 5, 7]`` for
    both); ``floor`` without transformers. A third behaviour is a :class:`ConfigError`."""
    return _uniform_rule()


@functools.lru_cache(maxsize=1)
def _uniform_rule() -> str:
    try:
        from transformers.video_processing_utils import BaseVideoProcessor
        from transformers.video_utils import VideoMetadata
    except ImportError:  # pragma: no cover - the LLaVA-OneVision transform needs transformers
        return "floor"
    import types

    settings = types.SimpleNamespace(num_frames=None, fps=None)

    def ask(total, **kw):  # (the indices a PyAV reader keeps: those below ``total``)
        meta = VideoMetadata(total_num_frames=total, fps=1.0)
        try:
            got = np.asarray(BaseVideoProcessor.sample_frames(settings, meta, **kw))
        except (ValueError, ZeroDivisionError):
            return None
        return got[got < total].tolist()

    def mine(rule, total, **kw):
        try:
            return UniformSampling(rule=rule, do_sample_frames=True, **kw).indices(total, 1.0)
        except ValueError:
            return None

    questions = ((10, {"fps": 0.05}), (10, {"num_frames": 4}))
    seen = [ask(total, **kw) for total, kw in questions]
    for rule in ("floor", "arange"):
        want = [mine(rule, total, **kw) for total, kw in questions]
        if all(
            (a is None) == (b is None) and (a is None or a == b.tolist())
            for a, b in zip(seen, want)
        ):
            return rule
    import transformers

    raise ConfigError(
        f"transformers {transformers.__version__}: its video processors sample frames by a rule "
        f"prealign does not know ({seen}); give videos as frame lists"
    )
