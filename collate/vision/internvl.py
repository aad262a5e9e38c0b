"""InternVL 3 / 3.5 (``model_type`` ``internvl``): 1-D positions, images cut into 448-px tiles.

An image of ``height x width`` pixels is resized onto a canvas of ``columns x rows`` tiles whose
aspect ratio is closest to the image's (:func:`tile_canvas`), cut into those tiles, and a thumbnail
of the whole image is added when there is more than one tile. Every tile gives ``image_seq_length``
(256) image tokens; the text holds ``<img>`` + ``256 * tiles`` x ``<IMG_CONTEXT>`` + ``</img>`` per
image. A video is its frames, one tile each, written ``Frame{i}: <img>...</img>`` and joined by
newlines. Images and video frames share ``pixel_values`` float ``[tiles, 3, 448, 448]`` in the order
the text names them; every vision token is an image token (type 1) and positions are plain
``0..L-1`` per sequence: packed rows need only ``cu_seqlens``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from prealign.schemas.errors import ConfigError

from .common import (
    OneDimFamily,
    config_readers,
    int64_field,
    tiles_field,
)
from .grids import check_pixels, check_positive_ints


@functools.lru_cache(maxsize=16)
def tile_arrangements(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every ``(columns, rows)`` with ``min_tiles <= columns * rows <= max_tiles``, by area (ties:
    more columns later), the order the choice below scans them in.

    >>> tile_arrangements(1, 4)
    ((1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (1, 4), (2, 2), (4, 1))
    """
    grids = [
        (c, r)
        for c in range(1, max_tiles + 1)
        for r in range(1, max_tiles + 1)
        if min_tiles <= c * r <= max_tiles
    ]
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


@functools.lru_cache(maxsize=4096)
def tile_canvas(
    height: int, width: int, tile: tuple[int, int], min_tiles: int, max_tiles: int
) -> tuple[int, int]:
    """``(columns, rows)`` of the canvas an image is resized to: the arrangement whose ``columns /
    rows`` is nearest the image's ``width / height``; on a tie the later (larger) one wins while the
    image's area is more than half the larger canvas's.

    >>> tile_canvas(300, 700, (448, 448), 1, 12), tile_canvas(448, 448, (448, 448), 1, 12)
    ((5, 2), (1, 1))
    """
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for columns, rows in tile_arrangements(min_tiles, max_tiles):
        diff = abs(aspect - columns / rows)
        if diff < best_diff:
            best, best_diff = (columns, rows), diff
        elif diff == best_diff and area > 0.5 * tile[0] * tile[1] * columns * rows:
            best = (columns, rows)
    return best


@dataclass(frozen=True, kw_only=True)
class InternVL(OneDimFamily):
    """``model_type`` ``internvl``: ``image_token_id`` (``<IMG_CONTEXT>``), ``image_seq_length`` and
    the tile size from the config; ``<img>`` / ``</img>`` are the tokenizer's
    (``vision_start/end_token_id`` stay ``None`` until a transform sets them from its tokenizer).
    Tiling defaults are the InternVL processor's
    (``crop_to_patches``, 1 to 12 tiles); a transform takes them from the image processor it
    runs."""

    model_types = ("internvl",)
    position_kind = "1d"
    media_attention = "causal"
    local_attention = None
    schema_name = "internvl"

    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    image_seq_length: int = 256
    tile_size: int = 448
    min_tiles: int = 1
    max_tiles: int = 12
    crop_to_patches: bool = True

    @classmethod
    def from_config(cls, config) -> "InternVL":
        get, vision = config_readers(config)
        size, patch = vision("image_size", 448), vision("patch_size", 14)
        size = size[0] if isinstance(size, (list, tuple)) else size
        patch = patch[0] if isinstance(patch, (list, tuple)) else patch
        ratio = get("downsample_ratio", 0.5)
        if get("image_token_id") is None or not ratio:
            raise ConfigError(
                f"InternVL.from_config: the {get('model_type')} config has no image_token_id / "
                "downsample_ratio"
            )
        return cls(
            model_type=get("model_type"),
            image_token_id=get("image_token_id"),
            patch_size=int(patch),
            spatial_merge_size=round(1 / ratio),
            temporal_patch_size=1,
            image_seq_length=int(get("image_seq_length", 256)),
            tile_size=int(size),
        )

    def __post_init__(self):
        check_positive_ints(
            self,
            (
                "image_token_id",
                "patch_size",
                "spatial_merge_size",
                "image_seq_length",
                "tile_size",
                "min_tiles",
                "max_tiles",
            ),
        )
        if self.min_tiles > self.max_tiles:
            raise ConfigError(
                f"InternVL: expected min_tiles <= max_tiles, got {self.min_tiles} > "
                f"{self.max_tiles}"
            )

    def tiles(self, height: int, width: int, *, sample=None, field: str = "image") -> int:
        """Tiles of one image (the thumbnail included): what its ``pixel_values`` rows and tokens
        count.

        >>> fam = InternVL(model_type="internvl", image_token_id=5, patch_size=14,
        ...                spatial_merge_size=2, temporal_patch_size=1)
        >>> fam.tiles(300, 700), fam.tiles(448, 448), fam.image_tokens(300, 700)
        (11, 1, 2816)
        """
        check_pixels(height, width, sample=sample, field=field)
        if not self.crop_to_patches or self.max_tiles <= 1:
            return 1
        columns, rows = tile_canvas(
            height, width, (self.tile_size, self.tile_size), self.min_tiles, self.max_tiles
        )
        return 1 if columns * rows == 1 else columns * rows + 1

    def image_tokens(self, height: int, width: int, *, sample=None, field: str = "image") -> int:
        """``<IMG_CONTEXT>`` tokens of one image (``image_seq_length`` per tile; ``<img>``,
        ``</img>`` not counted)."""
        return self.image_seq_length * self.tiles(height, width, sample=sample, field=field)

    def media_fields(self, pixel_dtypes: tuple[str, ...]) -> tuple:
        """``pixel_values`` ``[tiles, 3, s, s]`` and ``image_num_patches`` int64 ``[blocks]``;
        ``mm_token_type_ids`` is 1 on ``<IMG_CONTEXT>``."""
        return (
            tiles_field("pixel_values", pixel_dtypes, self.tile_size),
            int64_field("image_num_patches"),
        )

    def frame_text(self, index: int) -> str:
        """The text before frame ``index`` (from 0) of a video, as the InternVL processor writes
        it."""
        return f"Frame{index + 1}: "
