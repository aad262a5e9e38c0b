"""Mistral3 (Mistral Small 3.1, ``model_type`` ``mistral3``) and Pixtral (``llava`` with a
``pixtral`` vision tower): 1-D positions, each image resized to patch multiples and written as rows
of ``[IMG]`` tokens.

An image of ``height x width`` pixels is scaled down (never up) to fit ``longest_edge`` (floor),
then each side rounded up to a multiple of ``patch_size * spatial_merge_size``
(:func:`resized_size`, transformers' ``get_resize_output_image_size``). One vision token covers
``merge x merge`` patches (Mistral3's patch merger; Pixtral: 1), so the image is ``rows x cols``
tokens, written row by row, each row followed by ``[IMG_BREAK]`` and the last one by ``[IMG_END]``
instead: ``rows * (cols + 1)`` ids, ``rows * cols`` of them ``[IMG]``.

The contract: 1-D positions (``position_ids`` restarting per sequence), causal attention. The vision
tower runs every image of a forward as one sequence with a block-diagonal mask per image
(``generate_block_attention_mask``; flash: ``cu_seqlens`` per image), built from ``image_sizes``
alone: images of several packed samples are kept apart exactly as several images of one sample are,
so packing needs only ``cu_seqlens`` / ``position_ids``. Pixels travel as patches ``[sum h*w, 3, p,
p]`` (each image's patches in raster order) with ``image_sizes`` int64 ``[images, 2]`` (resized
height, width); :func:`hf_pixel_values` rebuilds the model's zero-padded ``[images, 3, H_max,
W_max]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from prealign.schemas.errors import ConfigError, SampleError

from .common import (
    OneDimFamily,
    config_readers,
    int64_field,
    tiles_field,
)
from .family import config_getter
from .grids import check_pixels, check_positive_ints


def resized_size(height: int, width: int, longest_edge: int, step: int) -> tuple[int, int]:
    """``(height, width)`` an image is resized to: scaled down to fit ``longest_edge`` (floor of the
    aspect-preserving size), then each side rounded up to a multiple of ``step`` (``patch *
    merge``).

    >>> resized_size(30, 50, 112, 28), resized_size(300, 1000, 112, 28)
    ((56, 56), (56, 112))
    """
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        height, width = math.floor(height / ratio), math.floor(width / ratio)
    return ((height - 1) // step + 1) * step, ((width - 1) // step + 1) * step


@dataclass(frozen=True, kw_only=True)
class Mistral3(OneDimFamily):
    """``model_type`` ``mistral3`` (patch merger ``spatial_merge_size``) or ``llava`` with a Pixtral
    tower (merge 1): ``image_token_id`` the ``[IMG]`` token, ``patch_size`` and ``longest_edge``
    (the vision tower's ``image_size``) from the config; ``[IMG_BREAK]`` / ``[IMG_END]`` are the
    tokenizer's (``vision_start`` / ``vision_end_token_id`` stay ``None`` until a transform reads
    them from its tokenizer)."""

    model_types = ("mistral3",)
    """(Pixtral's ``llava`` configs are not dispatched by ``model_type``, which most LLaVA models
    share: build the family with ``Mistral3.from_config(llava_config)``, which takes a ``pixtral``
    vision tower only.)"""
    position_kind = "1d"
    media_attention = "causal"
    transform = "prealign.loaders.media.mistral3.Mistral3SampleTransform"

    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    longest_edge: int = 1540

    @classmethod
    def from_config(cls, config) -> "Mistral3":
        get, vision = config_readers(config)
        model_type = get("model_type")
        if model_type == "llava" and vision("model_type") != "pixtral":
            raise ConfigError(
                f"Mistral3.from_config: a llava config with a {vision('model_type')!r} vision "
                f"tower; "
                "expected a 'pixtral' one (Pixtral) or a mistral3 config"
            )
        image = get("image_token_id")
        image = get("image_token_index") if image is None else image
        patch, size = vision("patch_size"), vision("image_size")
        if image is None or patch is None or size is None:
            raise ConfigError(
                f"Mistral3.from_config: the {model_type} config has no image_token_id / "
                "vision_config.patch_size / image_size"
            )
        merge = get("spatial_merge_size", 1) if model_type == "mistral3" else 1
        return cls(
            model_type=model_type,
            image_token_id=int(image),
            patch_size=int(patch),
            spatial_merge_size=int(merge),
            temporal_patch_size=1,
            longest_edge=int(size),
        )

    def __post_init__(self):
        check_positive_ints(
            self, ("image_token_id", "patch_size", "spatial_merge_size", "longest_edge")
        )

    @property
    def token_step(self) -> int:
        """Pixels per vision token side: ``patch_size * spatial_merge_size``."""
        return self.patch_size * self.spatial_merge_size

    def token_grid(
        self,
        height: int,
        width: int,
        *,
        longest_edge: int | None = None,
        sample=None,
        field: str = "image",
    ) -> tuple[int, int]:
        """``(rows, cols)`` of vision tokens of a ``height x width`` image (``longest_edge``: the
        image processor's, default the config's).

        >>> Mistral3(model_type="mistral3", image_token_id=10, patch_size=14, spatial_merge_size=2,
        ...          temporal_patch_size=1).token_grid(600, 800)
        (22, 29)
        """
        check_pixels(height, width, sample=sample, field=field)
        edge = longest_edge or self.longest_edge
        h, w = resized_size(height, width, edge, self.token_step)
        if min(h, w) < 1:  # a side floors to 0 once scaled (transformers' processor fails too)
            raise SampleError(
                sample=sample,
                field=field,
                expected=f"an image whose shorter side keeps >= 1 pixel once its longer side is "
                f"scaled to {edge}",
                actual=f"{width}x{height}",
            )
        return h // self.token_step, w // self.token_step

    def image_ids(self, rows: int, cols: int, image_break: int, image_end: int) -> torch.Tensor:
        """int64 ``[rows * (cols + 1)]``: ``cols`` x ``[IMG]`` + ``[IMG_BREAK]`` per row, the last
        ``[IMG_END]``."""
        grid = torch.full((rows, cols + 1), self.image_token_id, dtype=torch.int64)
        grid[:, -1] = image_break
        grid[-1, -1] = image_end
        return grid.reshape(-1)

    def media_fields(self, pixel_dtypes: tuple[str, ...]) -> tuple:
        """``pixel_values`` ``[patches, 3, p, p]`` and ``image_sizes`` int64 ``[images, 2]``;
        ``mm_token_type_ids`` is 1 on ``[IMG]``."""
        return (
            tiles_field("pixel_values", pixel_dtypes, self.patch_size),
            int64_field("image_sizes", pairs=True),
        )


def is_pixtral(model_config) -> bool:
    """Whether a config (object, dict or family) is Mistral3's or Pixtral's (``llava`` with a
    ``pixtral`` tower): the models whose batches carry patches + ``image_sizes``."""
    if isinstance(model_config, Mistral3):
        return True
    get = config_getter(model_config)
    vision = config_getter(get("vision_config", None) or {})
    return get("model_type") == "mistral3" or (
        get("model_type") == "llava" and vision("model_type") == "pixtral"
    )


def image_patches(image: torch.Tensor, patch: int) -> torch.Tensor:
    """float ``[3, H, W]`` (H, W multiples of ``patch``) -> ``[H/p * W/p, 3, p, p]``, patches in
    raster order."""
    c, h, w = image.shape
    return (
        image.reshape(c, h // patch, patch, w // patch, patch)
        .permute(1, 3, 0, 2, 4)
        .reshape(-1, c, patch, patch)
    )


def hf_pixel_values(patches: torch.Tensor, image_sizes: torch.Tensor) -> torch.Tensor:
    """Patches ``[sum h*w, 3, p, p]`` + ``image_sizes`` int ``[n, 2]`` (pixels) -> ``[n, 3, H_max,
    W_max]``, each image top-left and zeros around it: what ``PixtralImageProcessor`` hands
    ``Mistral3ForConditionalGeneration``."""
    sizes = torch.as_tensor(image_sizes, dtype=torch.int64).reshape(-1, 2)
    p = patches.shape[-1]
    if sizes.shape[0] == 0:
        return patches.new_zeros(0, 3, p, p)
    grid = sizes // p
    if int(grid.prod(-1).sum()) != patches.shape[0]:
        raise SampleError(
            sample=None,
            field="pixel_values",
            actual=f"{patches.shape[0]} patches",
            expected=f"{int(grid.prod(-1).sum())} patches (image_sizes {sizes.tolist()} / {p})",
        )
    hmax, wmax = (int(v) for v in sizes.max(0).values)
    out = patches.new_zeros(sizes.shape[0], 3, hmax, wmax)
    for i, part in enumerate(patches.split(grid.prod(-1).tolist())):
        gh, gw = (int(v) for v in grid[i])
        out[i, :, : gh * p, : gw * p] = (
            part.reshape(gh, gw, 3, p, p).permute(2, 0, 3, 1, 4).reshape(3, gh * p, gw * p)
        )
    return out
