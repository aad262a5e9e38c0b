"""Qwen3-VL (and its MoE): patch 16; a video is written frame group by frame group, each group
``<{t:.1f} seconds><|vision_start|>`` + its ``<|video_pad|>`` tokens + ``<|vision_end|>``, so
positions see one run of ``h*w / merge**2`` tokens per group (temporal offset 0), and the video
processor bounds the whole clip's volume.

The chat template writes a video as ``<|vision_start|><|video_pad|><|vision_end|>``. transformers >=
5.10's processor replaces only the ``<|video_pad|>`` (the groups stay inside that outer pair); older
ones (5.6, like Qwen's original processor and vLLM) replace the whole block. prealign writes what
the installed processor writes (:func:`processor_keeps_video_wrapper`), and the sidecar index key
names the rule in use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .family import VisionFamily


@dataclass(frozen=True, kw_only=True)
class Qwen3VL(VisionFamily):
    """``model_type`` ``qwen3_vl`` / ``qwen3_vl_moe``."""

    model_types = ("qwen3_vl", "qwen3_vl_moe")
    volume_resize = True
    video_defaults = {
        "min_pixels": 128 * 32 * 32,
        "max_pixels": 32 * 32 * 768,
        "image_mean": (0.5, 0.5, 0.5),
        "image_std": (0.5, 0.5, 0.5),
    }

    def video_runs(self, video_grid_thw) -> np.ndarray:
        """Each ``(t, h, w)`` video -> ``t`` runs of ``(1, h, w)``."""
        grid = np.asarray(video_grid_thw, dtype=np.int64).reshape(-1, 3)
        runs = np.repeat(grid, grid[:, 0], axis=0)
        runs[:, 0] = 1
        return runs

    def wraps_video(self) -> bool:
        """The installed processor's rule (:func:`processor_keeps_video_wrapper`)."""
        return processor_keeps_video_wrapper()

    def frame_texts(self, frames: int, fps: float, frame_indices=None) -> list[str]:
        """``<{t:.1f} seconds>`` per frame group (:func:`frame_timestamps` of the frames' indices,
        ``0..frames-1`` unless given, at ``fps``)."""
        indices = range(frames) if frame_indices is None else frame_indices
        return [
            f"<{t:.1f} seconds>" for t in frame_timestamps(indices, fps, self.temporal_patch_size)
        ]


def frame_timestamps(frame_indices, fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each frame group: the mean time of its first and last frame (frame ``i`` at ``i /
    fps``), the last index repeated to fill the final group, as the Qwen3-VL processor computes
    them.

    >>> frame_timestamps(range(5), 2.0, 2)   # groups (0, 1) (2, 3) (4, 4)
    [0.25, 1.25, 2.0]
    """
    indices = [int(i) for i in frame_indices]
    indices += [indices[-1]] * (-len(indices) % temporal_patch_size)
    times = [i / fps for i in indices]
    return [
        (times[k] + times[k + temporal_patch_size - 1]) / 2
        for k in range(0, len(times), temporal_patch_size)
    ]


@functools.cache
def processor_keeps_video_wrapper() -> bool:
    """Whether the installed transformers' Qwen3-VL processor keeps the chat template's outer
    ``<|vision_start|>``
    ... ``<|vision_end|>`` around a video's frame groups: True where it expands a video through
    ``replace_video_token`` (>= 5.10, which replaces the ``<|video_pad|>`` alone), False where its
    ``__call__`` replaces the whole ``<|vision_start|><|video_pad|><|vision_end|>`` block (5.6)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    return hasattr(Qwen3VLProcessor, "replace_video_token")
