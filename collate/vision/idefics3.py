"""SmolVLM and Idefics3 (``model_type`` ``smolvlm``, ``idefics3``): 1-D positions, images split into
square tiles plus a global view, each tile pixel-shuffled to ``image_seq_len`` tokens.

An image of ``height x width`` is resized so its longest side is ``longest_edge`` (up or down; the
other side keeps the aspect ratio, rounded to even), then each side rounded up to a multiple of the
tile size ``S`` (the vision tower's ``image_size``), cut into ``rows x cols`` tiles of ``S x S``,
and a global view (the image resized to ``S x S``) is added (:func:`tile_grid`, transformers'
Idefics3 image processor's arithmetic). An image no larger than one tile is its global view alone
(``rows = cols = 0``). Every tile gives ``image_seq_len = (S / patch)**2 / scale_factor**2`` image
tokens (the pixel shuffle); the text holds, per tile row, ``<fake_token_around_image><row_r_col_c>``
+ ``<image>`` x ``image_seq_len`` per tile and a ``\\n``, then
  ``\\n<fake_token_around_image><global-img>`` + ``<image>`` x ``image_seq_len`` +
  ``<fake_token_around_image>``.

The contract: 1-D positions, causal attention; the vision tower encodes each tile on its own (a
batch of tiles), so packed rows need only ``cu_seqlens`` / ``position_ids``. Pixels are ``[tiles, 3,
S, S]`` (each image's tiles row by row, then its global view) with ``image_rows_cols`` int64
``[images, 2]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prealign.schemas.errors import ConfigError

from .common import (
    OneDimFamily,
    config_readers,
    int64_field,
    tiles_field,
)
from .grids import check_pixels, check_positive_ints

MAX_IMAGE_SIZE = 4096
"""transformers' cap on a resized side (Idefics3's ``MAX_IMAGE_SIZE``)."""


def resized_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """``(height, width)`` after the first resize: the longest side set to ``longest_edge`` (the
    other by the aspect ratio, truncated, made even), then both kept under :data:`MAX_IMAGE_SIZE`.

    >>> resized_size(30, 50, 1456), resized_size(500, 100, 1456)
    ((874, 1456), (1456, 292))
    """
    aspect = width / height
    if width >= height:
        width, height = longest_edge, int(longest_edge / aspect)
        height += height % 2
    else:
        height, width = longest_edge, int(longest_edge * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def tile_grid(height: int, width: int, longest_edge: int, tile: int) -> tuple[int, int]:
    """``(rows, cols)`` of ``tile``-px tiles an image is cut into (``(0, 0)``: its global view
    alone).

    >>> tile_grid(30, 50, 1456, 364), tile_grid(100, 100, 364, 364)
    ((3, 4), (0, 0))
    """
    height, width = resized_size(height, width, longest_edge)
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    if height > tile or width > tile:
        return (height - tile) // tile + 1, (width - tile) // tile + 1
    return 0, 0


@dataclass(frozen=True, kw_only=True)
class Idefics3(OneDimFamily):
    """``model_type`` ``idefics3`` / ``smolvlm``: ``image_token_id`` (``<image>``), the tile size
    and patch size (``vision_config``), ``scale_factor`` (the pixel shuffle: ``spatial_merge_size``)
    from the config; ``<fake_token_around_image>``, ``<global-img>`` and ``<row_r_col_c>`` are the
    tokenizer's. Splitting defaults are the image processor's as checkpoints set them (longest edge
    ``4 * S``); a transform takes them from the
    image processor it runs."""

    model_types = ("idefics3", "smolvlm")
    position_kind = "1d"
    media_attention = "causal"
    transform = "prealign.loaders.media.idefics3.Idefics3SampleTransform"

    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    tile_size: int = 364
    longest_edge: int = 4 * 364
    split: bool = True

    @classmethod
    def from_config(cls, config) -> "Idefics3":
        get, vision = config_readers(config)
        size, patch, scale = vision("image_size"), vision("patch_size"), get("scale_factor")
        if get("image_token_id") is None or None in (size, patch, scale):
            raise ConfigError(
                f"Idefics3.from_config: the {get('model_type')} config has no image_token_id / "
                "scale_factor / vision_config.image_size / patch_size"
            )
        return cls(
            model_type=get("model_type"),
            image_token_id=int(get("image_token_id")),
            patch_size=int(patch),
            spatial_merge_size=int(scale),
            temporal_patch_size=1,
            tile_size=int(size),
            longest_edge=4 * int(size),
        )

    def __post_init__(self):
        check_positive_ints(
            self,
            ("image_token_id", "patch_size", "spatial_merge_size", "tile_size", "longest_edge"),
        )

    @property
    def image_seq_len(self) -> int:
        """``<image>`` tokens per tile: ``(S / patch)**2 / scale_factor**2`` (the processors'
        formula)."""
        return int((self.tile_size // self.patch_size) ** 2 / self.spatial_merge_size**2)

    def rows_cols(
        self, height: int, width: int, *, sample=None, field: str = "image"
    ) -> tuple[int, int]:
        """``(rows, cols)`` of one image's tiles (``(0, 0)``: the global view alone).

        >>> Idefics3(model_type="idefics3", image_token_id=9, patch_size=14, spatial_merge_size=2,
        ...          temporal_patch_size=1).rows_cols(300, 700)
        (2, 4)
        """
        check_pixels(height, width, sample=sample, field=field)
        if not self.split:
            return 0, 0
        return tile_grid(height, width, self.longest_edge, self.tile_size)

    def media_fields(self, pixel_dtypes: tuple[str, ...]) -> tuple:
        """``pixel_values`` ``[tiles, 3, S, S]`` (each image's tiles row by row, then its global
        view) and ``image_rows_cols`` int64 ``[images, 2]``; ``mm_token_type_ids`` is 1 on
        ``<image>``."""
        return (
            tiles_field("pixel_values", pixel_dtypes, self.tile_size),
            int64_field("image_rows_cols", pairs=True),
        )
