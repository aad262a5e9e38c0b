"""GLM-4.1V and GLM-4.5V / 4.6V (``model_type`` ``glm4v``, ``glm4v_moe``): Qwen3-VL's positions,
GLM's own resize, and video frames written with the **image** token.

- An image is ``<|begin_of_image|>`` + ``t*h*w / 4`` x ``<|image|>`` + ``<|end_of_image|>``.
- A video is ``<|begin_of_video|>``, then per frame group (two frames) ``<|begin_of_image|>`` +
  ``h*w / 4`` x ``<|image|>`` + ``<|end_of_image|>`` + the group's first frame time in whole seconds
  (``str(int(t))``), then ``<|end_of_video|>``. Its tokens are image tokens; only the surrounding
  video pair makes them type 2 (:meth:`Glm4V.token_types`).
- Positions: Qwen3-VL's rule, each frame group its own run of grid ``(1, h, w)``
  (:meth:`Qwen3VL.video_runs`).
- Resize: GLM's ``smart_resize`` (sides under ``patch * merge`` scaled up first; the area bound
  counts the temporal patch: ``2 * h * w`` for an image, ``frames * h * w`` for a clip),
  :func:`glm4v_resize`.
- transformers' ``Glm4vModel.forward`` counts video tokens as image tokens (both are
  ``image_token_id``), so one forward holding images **and** video fails its feature-count check:
  :meth:`Glm4V.positions` refuses such a batch (one sample or a packed row alike) with
  :class:`~prealign.schemas.errors.PackingUnsupportedError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from prealign.schemas.errors import ConfigError, PackingUnsupportedError, SampleError

from .common import config_readers
from .grids import VisionGeometry, check_aspect_ratio
from .qwen3_vl import Qwen3VL


def glm4v_resize(
    frames: int,
    height: int,
    width: int,
    geometry: VisionGeometry,
    *,
    sample=None,
    field: str = "image",
) -> tuple[int, int]:
    """``(h_bar, w_bar)`` pixels a ``frames x height x width`` input is resized to by GLM-4.1V's
    processors: sides under ``factor = patch * merge`` scaled up (truncated to ints) first, then
    rounded to multiples of ``factor``; ``t_bar * h_bar * w_bar`` (``t_bar`` = ``frames`` rounded to
    the temporal patch) kept within ``[min_pixels, max_pixels]`` by scaling with ``sqrt(frames * h *
    w / bound)``.

    >>> glm4v_resize(2, 480, 640, VisionGeometry(min_pixels=112 * 112, max_pixels=28 * 28 * 15000))
    (476, 644)
    """
    factor, tp = geometry.patch_size * geometry.merge_size, geometry.temporal_patch_size
    if min(height, width) < 1 or frames < 1:
        raise SampleError(
            sample=sample, field=field, expected="at least 1x1 pixels", actual=f"{width}x{height}"
        )
    if frames < tp:
        raise SampleError(
            sample=sample,
            field=field,
            expected=f"at least {tp} frames (temporal_patch_size)",
            actual=f"{frames}",
        )
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    check_aspect_ratio(height, width, sample=sample, field=field)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / tp) * tp
    if t_bar * h_bar * w_bar > geometry.max_pixels:
        beta = math.sqrt(frames * height * width / geometry.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < geometry.min_pixels:
        beta = math.sqrt(geometry.min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def glm4v_frame_indices(
    total_frames: int,
    video_fps: float,
    *,
    duration: float | None = None,
    fps: float = 2.0,
    max_duration: float = 300.0,
) -> np.ndarray:
    """GLM-4.1V's frame sampler: int ``[n]`` indices of the frames a ``total_frames`` clip at
    ``video_fps`` keeps. Up to ``max_duration`` seconds: ``floor(duration * fps)`` frames (at least
    1), frame ``ceil(i * video_fps / fps)``; longer clips: ``max_duration * fps`` frames spread
    evenly over the clip. Repeats are dropped, and the last index is doubled when the count is odd
    (a whole temporal patch).

    >>> glm4v_frame_indices(100, 30.0, duration=100 / 30).tolist()
    [0, 15, 30, 45, 60, 75]
    """
    last = total_frames - 1
    duration = duration or round(last / video_fps) + 1
    if duration <= max_duration:
        n = max(int(math.floor(duration * fps)), 1)
        indices = [min(last, int(math.ceil(i * video_fps / fps))) for i in range(n)]
    else:
        n = int(max_duration * fps)
        if n >= total_frames:
            indices = list(range(total_frames))
        else:
            indices = [
                min(last, int(math.ceil(t * video_fps)))
                for t in np.linspace(0, duration, n, endpoint=True)
            ]
    out = list(dict.fromkeys(indices))
    if len(out) % 2:
        out.append(out[-1])
    return np.array(out, dtype=np.int64)


@dataclass(frozen=True, kw_only=True)
class Glm4V(Qwen3VL):
    """``model_type`` ``glm4v`` / ``glm4v_moe``: ``vision_start/end_token_id`` are the config's
    ``image_start/end_token_id``; ``video_start/end_token_id`` wrap a video."""

    model_types = ("glm4v", "glm4v_moe")
    position_kind = "mrope"
    media_attention = "causal"
    local_attention = None
    volume_resize = False
    one_media_kind = True
    """One forward takes images or video, not both (module docstring): the transform refuses a
    sample holding both, :meth:`positions` a batch."""
    video_defaults = {
        "min_pixels": 112 * 112,
        "max_pixels": 28 * 28 * 2 * 30000,
        "image_mean": (0.48145466, 0.4578275, 0.40821073),
        "image_std": (0.26862954, 0.26130258, 0.27577711),
    }
    video_start_token_id: int
    video_end_token_id: int

    @classmethod
    def from_config(cls, config) -> "Glm4V":
        get, vget = config_readers(config)
        values = dict(
            model_type=get("model_type"),
            image_token_id=get("image_token_id"),
            video_token_id=get("video_token_id"),
            vision_start_token_id=get("image_start_token_id"),
            vision_end_token_id=get("image_end_token_id"),
            video_start_token_id=get("video_start_token_id"),
            video_end_token_id=get("video_end_token_id"),
            patch_size=vget("patch_size"),
            spatial_merge_size=vget("spatial_merge_size"),
            temporal_patch_size=vget("temporal_patch_size"),
        )
        missing = [k for k, v in values.items() if v is None]
        if missing:
            raise ConfigError(
                f"Glm4V.from_config: the {values['model_type']} config has no {missing}"
            )
        return cls(**values)

    def __post_init__(self):
        super().__post_init__()
        ids = (
            self.image_token_id,
            self.vision_start_token_id,
            self.vision_end_token_id,
            self.video_start_token_id,
            self.video_end_token_id,
        )
        if len(set(ids)) != 5:
            raise ConfigError(
                f"Glm4V: expected five distinct ids (image, image start / end, video start / end), "
                f"got {ids}"
            )

    # ---- grids
    # ------------------------------------------------------------------------------------
    def image_grid(self, height, width, geometry, *, sample=None, field="image"):
        h, w = glm4v_resize(
            geometry.temporal_patch_size, height, width, geometry, sample=sample, field=field
        )
        return 1, h // geometry.patch_size, w // geometry.patch_size

    def video_grid(self, frames, height, width, geometry, *, sample=None, field="video"):
        tp = geometry.temporal_patch_size
        h, w = glm4v_resize(max(frames, tp), height, width, geometry, sample=sample, field=field)
        return -(-frames // tp), h // geometry.patch_size, w // geometry.patch_size

    # ---- video text
    # --------------------------------------------------------------------------------
    def wraps_video(self) -> bool:
        return False

    def frame_texts(self, frames: int, fps: float, frame_indices=None) -> list[str]:
        """Each frame group's time in whole seconds, written after its tokens: the group's first
        frame at ``index / fps``, truncated (``int``), as ``Glm4vProcessor`` writes it."""
        indices = list(range(frames) if frame_indices is None else frame_indices)
        groups = -(-len(indices) // self.temporal_patch_size)
        return [
            str(int(indices[min(k * self.temporal_patch_size, len(indices) - 1)] / fps))
            for k in range(groups)
        ]

    def video_ids(self, encode, grid, frames: int, fps: float, frame_indices=None) -> np.ndarray:
        """int64 ids of one video (module docstring); ``encode(text) -> ids`` is the tokenizer's;
        ``frame_indices``: the kept frames' source indices (``fps`` then the source's rate)."""
        t, gh, gw = grid
        group = [
            self.vision_start_token_id,
            *([self.image_token_id] * (gh * gw // self.spatial_merge_size**2)),
            self.vision_end_token_id,
        ]
        body = [
            np.concatenate((group, encode(text)))
            for text in self.frame_texts(frames, fps, frame_indices)
        ]
        return np.concatenate(
            ([self.video_start_token_id], *body, [self.video_end_token_id])
        ).astype(np.int64)

    def token_types(self, input_ids) -> np.ndarray:
        """int64 ``[L]`` types of one sequence's ids: 1 on image tokens, 2 on image tokens inside a
        video's ``<|begin_of_video|>`` ... ``<|end_of_video|>`` (a running count of the pair, no
        loop)."""
        ids = np.asarray(input_ids).reshape(-1)
        inside = (
            np.cumsum(
                (ids == self.video_start_token_id).astype(np.int64)
                - (ids == self.video_end_token_id).astype(np.int64)
            )
            > 0
        )
        return (ids == self.image_token_id).astype(np.int64) * np.where(inside, 2, 1)

    # ---- positions
    # ------------------------------------------------------------------------------------
    def positions(
        self,
        mm_token_type_ids,
        cu_seqlens,
        *,
        image_grid_thw=None,
        video_grid_thw=None,
        second_per_grid_ts=None,
        grids_per_sample=None,
    ) -> torch.Tensor:
        """Qwen3-VL's positions; a batch holding images and video together is refused (module
        docstring)."""
        check_media(self, image_grid_thw, video_grid_thw)
        return super().positions(
            mm_token_type_ids,
            cu_seqlens,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            second_per_grid_ts=second_per_grid_ts,
            grids_per_sample=grids_per_sample,
        )


def check_media(family: Glm4V, image_grid_thw, video_grid_thw, *, sample=None) -> None:
    """Refuse images and video in one forward (one sample or a packed batch): ``Glm4vModel.forward``
    counts the video's tokens as image tokens, so its check of image features against image tokens
    fails."""
    images = (
        0 if image_grid_thw is None else int(np.asarray(image_grid_thw).reshape(-1, 3).shape[0])
    )
    videos = (
        0 if video_grid_thw is None else int(np.asarray(video_grid_thw).reshape(-1, 3).shape[0])
    )
    if images and videos:
        where = "a batch" if sample is None else f"sample {sample!r}"
        raise PackingUnsupportedError(
            f"{family.model_type}: {where} holds {images} image(s) and {videos} video(s); "
            f"transformers' "
            "Glm4vModel.forward counts video tokens as image tokens (both are image_token_id), so "
            "one forward "
            "cannot take both. Way out: keep image and video samples in separate batches "
            "(separate datasets or loaders), or give each batch one kind of media."
        )
