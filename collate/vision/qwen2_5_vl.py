"""Qwen2.5-VL: Qwen2-VL's layout, with video temporal positions spaced by ``tokens_per_second *
second_per_grid_ts`` (fractional seconds, computed in float32 and truncated, as transformers >= 5.18
and the original Qwen2.5-VL code do; the released transformers wheels through 5.17 truncate
``second_per_grid_ts`` to an int first)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .family import VisionFamily, check_seconds


@dataclass(frozen=True, kw_only=True)
class Qwen2_5VL(VisionFamily):
    """``model_type`` ``qwen2_5_vl``; ``tokens_per_second`` from ``vision_config``."""

    model_types = ("qwen2_5_vl",)
    default_system = "You are a helpful assistant."
    tokens_per_second: float

    @classmethod
    def _extra(cls, vision) -> dict:
        return {"tokens_per_second": vision("tokens_per_second")}

    def video_steps(self, video_grid_thw, second_per_grid_ts):
        """float32 ``[num_videos]``: ``tokens_per_second * second_per_grid_ts`` (1 second per grid
        when not given, as transformers; given, checked by :func:`~.family.check_seconds`)."""
        n = np.asarray(video_grid_thw).reshape(-1, 3).shape[0]
        seconds = (
            np.ones(n, dtype=np.float32)
            if second_per_grid_ts is None
            else check_seconds(second_per_grid_ts, n)
        )
        return (seconds.dtype.type(self.tokens_per_second) * seconds).astype(seconds.dtype)
