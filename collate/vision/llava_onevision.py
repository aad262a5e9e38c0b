"""LLaVA-OneVision (``model_type`` ``llava_onevision``): 1-D positions; AnyRes images whose token
count depends on the original size.

An image alone in its sample is the base view (``base`` = ``(image_size / patch_size)**2`` tokens,
729 for 384 / 14) plus its AnyRes tiles: the grid pinpoint that keeps most of the image
(:func:`best_resolution`) is cut into ``384``-px tiles, their ``(rows * p) x (columns * p)`` feature
map is unpadded back to the image's aspect ratio, pooled down when it holds more than 1.1 x
``anyres_max_N`` tiles' worth, and every remaining row ends with an ``image_newline`` token
(:meth:`LlavaOneVision.image_tokens`). An image among several in one sample is the base view plus
one newline. ``vision_feature_select_strategy="default"`` drops one token per image.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from prealign.schemas.errors import ConfigError

from .common import OneDimFamily, config_readers, int64_field, tiles_field
from .grids import check_pixels


def best_resolution(
    height: int, width: int, pinpoints: tuple[tuple[int, int], ...]
) -> tuple[int, int]:
    """``(height, width)`` of the pinpoint an image is resized into: the most of the image's pixels
    kept after fitting it inside (never more than it has), then the least canvas wasted; the first
    such pinpoint wins.

    >>> best_resolution(300, 700, ((384, 384), (384, 768), (768, 384)))
    (384, 768)
    """
    best, kept_best, wasted_best = None, 0, float("inf")
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = pw * ph - kept
        if kept > kept_best or (kept == kept_best and wasted < wasted_best):
            best, kept_best, wasted_best = (ph, pw), kept, wasted
    return best


@dataclass(frozen=True, kw_only=True)
class LlavaOneVision(OneDimFamily):
    """``model_type`` ``llava_onevision``: ``image_token_index`` / ``video_token_index``, the
    pinpoints, the feature strategy and ``vision_aspect_ratio`` from the config; 384-px tiles of
    14-px patches by default."""

    model_types = ("llava_onevision",)
    position_kind = "1d"
    media_attention = "causal"
    local_attention = None
    schema_name = "llava_onevision"
    max_token_type = 2
    transform = "prealign.loaders.media.llava_onevision.LlavaOnevisionSampleTransform"

    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    tile_size: int = 384
    pinpoints: tuple[tuple[int, int], ...] = ()
    max_tiles: int = 9
    drop_first: bool = False
    """``vision_feature_select_strategy == "default"``: one token fewer per image."""

    @classmethod
    def from_config(cls, config) -> "LlavaOneVision":
        get, vget = config_readers(config)
        image = get("image_token_id", get("image_token_index"))
        video = get("video_token_id", get("video_token_index"))
        ratio = str(get("vision_aspect_ratio", "anyres_max_9"))
        if image is None or video is None or not ratio.startswith("anyres_max_"):
            raise ConfigError(
                f"LlavaOneVision.from_config: expected image / video token ids and an "
                f"'anyres_max_N' vision_aspect_ratio, got {image}, {video}, {ratio!r}"
            )
        size, patch = int(vget("image_size", 384)), int(vget("patch_size", 14))
        return cls(
            model_type=get("model_type"),
            image_token_id=int(image),
            video_token_id=int(video),
            patch_size=patch,
            spatial_merge_size=1,
            temporal_patch_size=1,
            tile_size=size,
            pinpoints=tuple(tuple(int(v) for v in p) for p in get("image_grid_pinpoints")),
            max_tiles=int(ratio.removeprefix("anyres_max_")),
            drop_first=get("vision_feature_select_strategy", "full") == "default",
        )

    def __post_init__(self):
        if not self.pinpoints:
            raise ConfigError("LlavaOneVision: expected image_grid_pinpoints")
        if self.image_token_id == self.video_token_id:
            raise ConfigError(
                f"LlavaOneVision: image and video ids must differ, got {self.image_token_id}"
            )

    @property
    def base_tokens(self) -> int:
        """Tokens of the base (resized whole-image) view: ``(tile_size / patch_size)**2``."""
        return (self.tile_size // self.patch_size) ** 2

    @property
    def frame_tokens(self) -> int:
        """``<video>`` tokens of one frame: its ``side x side`` features pooled (bilinear) to
        ``ceil(side / 2)`` per side (196 for 384 / 14)."""
        return math.ceil(self.tile_size // self.patch_size / 2) ** 2

    def video_tokens(self, frames: int) -> int:
        """``<video>`` tokens of a video of ``frames`` frames, as the processor writes them: each
        frame's pooled features, then one ``image_newline`` for the whole video.

        >>> fam = LlavaOneVision(model_type="llava_onevision", image_token_id=1, video_token_id=2,
        ...                      patch_size=14, spatial_merge_size=1, temporal_patch_size=1,
        ...                      pinpoints=((384, 384),))
        >>> fam.video_tokens(8)
        1569
        """
        return frames * self.frame_tokens + 1

    def tiles(self, height: int, width: int, *, images_in_sample: int = 1) -> int:
        """``pixel_values`` rows of one image: the base view plus the AnyRes tiles of its best
        pinpoint (an image among several: the base view alone)."""
        if images_in_sample != 1:
            return 1
        bh, bw = best_resolution(height, width, self.pinpoints)
        return 1 + (bh // self.tile_size) * (bw // self.tile_size)

    def image_tokens(
        self,
        height: int,
        width: int,
        *,
        images_in_sample: int = 1,
        sample=None,
        field: str = "image",
    ) -> int:
        """``<image>`` tokens of one ``height x width`` image in a sample holding
        ``images_in_sample`` images.

        >>> fam = LlavaOneVision(model_type="llava_onevision", image_token_id=1, video_token_id=2,
        ...                      patch_size=14, spatial_merge_size=1, temporal_patch_size=1,
        ...                      pinpoints=((384, 384), (384, 768)))
        >>> fam.image_tokens(300, 700), fam.image_tokens(300, 700, images_in_sample=2)
        (1994, 730)
        """
        check_pixels(height, width, sample=sample, field=field)
        if images_in_sample != 1:
            return self.base_tokens + 1 - self.drop_first
        return (
            _anyres_tokens(
                height, width, self.tile_size, self.patch_size, self.pinpoints, self.max_tiles
            )
            - self.drop_first
        )

    def media_fields(self, pixel_dtypes: tuple[str, ...]) -> tuple:
        """Concatenated over the batch: ``pixel_values_videos`` ``[frames, 3, s, s]`` with
        ``video_num_frames`` int64 ``[videos]``, ``pixel_values`` ``[tiles, 3, s, s]`` (each image's
        base view then its AnyRes tiles), ``image_sizes`` int64 ``[images, 2]`` (height, width as
        decoded) and ``batch_num_images`` int64 ``[samples with images]`` (images per sample: the
        model tiles only an image alone in its sample); ``mm_token_type_ids`` 1 image, 2 video."""
        return (
            tiles_field("pixel_values", pixel_dtypes, self.tile_size),
            tiles_field("pixel_values_videos", pixel_dtypes, self.tile_size),
            int64_field("video_num_frames"),
            int64_field("image_sizes", pairs=True),
            int64_field("batch_num_images"),
        )


@functools.lru_cache(maxsize=8192)
def _anyres_tokens(
    height: int, width: int, tile: int, patch: int, pinpoints: tuple, max_tiles: int
) -> int:
    """Base view + unpadded (and, past ``1.1 * max_tiles`` tiles' worth, pooled) tile features + a
    newline per row."""
    side = tile // patch
    bh, bw = best_resolution(height, width, pinpoints)
    rows, cols = side * (bh // tile), side * (bw // tile)
    if width / height > cols / rows:  # wider than the canvas: padding above and below is cut away
        kept = int(round(height * (cols / width), 7))
        rows -= (rows - kept) // 2 * 2
    else:
        kept = int(round(width * (rows / height), 7))
        cols -= (cols - kept) // 2 * 2
    features, newlines = rows * cols, rows
    ratio = math.sqrt(rows * cols / (max_tiles * side**2))
    if ratio > 1.1:
        features, newlines = int(rows // ratio) * int(cols // ratio), int(rows // ratio)
    return side**2 + features + newlines
