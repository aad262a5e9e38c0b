"""Gemma 4 (``model_type`` ``gemma4``): a vision tower fed each image at its own aspect ratio,
resized so its ``p``-px patches fit the image processor's budget (``max_soft_tokens * k^2``
patches, ``k`` the pooling kernel) with both sides multiples of ``k * p``, then pooled ``k x k``:
``(H / p) * (W / p) / k^2`` soft tokens per image, written by the processor as ``<|image>`` +
``<|image|>`` x tokens + ``<image|>``. :func:`resized_size` is transformers'
``get_aspect_ratio_preserving_size`` in prealign's own code (the same rule in 5.6.1, 5.10.4 and
5.24; tested equal).

The contract: 1-D positions; with ``text_config.use_bidirectional_attention == "vision"`` (the
larger models) image and video tokens (``mm_token_type_ids`` 1 / 2) attend bidirectionally within
their run, on the layer types :func:`~.contract.gemma4_bidirectional_layers` reads from the
installed release; a packed row then needs the per-token masks ``to_hf_kwargs(attention="mask")``
emits (:mod:`.attention`), and flash attention is refused (transformers sets
``_supports_flash_attn = False``). Smaller Gemma 4 models are plain causal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from prealign.schemas.contract import ModelContract
from prealign.schemas.errors import SampleError

from .common import OneDimFamily
from .family import config_getter, has_linear_attention, local_attention

VISION_DEFAULTS = {"patch_size": 16, "pooling_kernel_size": 3}
"""transformers' ``Gemma4VisionConfig`` defaults, used where a config has no ``vision_config``."""


def resized_size(
    height: int,
    width: int,
    *,
    patch_size: int,
    max_soft_tokens: int,
    pooling: int,
    sample=None,
    field: str = "image",
) -> tuple[int, int]:
    """``(H, W)`` Gemma 4's image processor resizes a ``height x width`` image to: the largest
    multiples of ``pooling * patch_size`` within ``max_soft_tokens * pooling^2`` patches at the
    image's aspect ratio; a side that rounds to 0 gets one cell and the other ``floor(ratio)``
    cells (at most ``max_soft_tokens`` cells). An empty size is a
    :class:`~prealign.schemas.SampleError` naming ``sample`` and ``field``.

    >>> resized_size(480, 640, patch_size=16, max_soft_tokens=280, pooling=3)
    (672, 912)
    """
    if height < 1 or width < 1:
        raise SampleError(
            sample=sample,
            field=field,
            expected="an image of at least 1 x 1 px",
            actual=f"{height} x {width}",
        )
    max_patches = max_soft_tokens * pooling**2
    target = max_patches * patch_size**2
    factor = math.sqrt(target / (height * width))
    side = pooling * patch_size
    h = int(math.floor(factor * height / side)) * side
    w = int(math.floor(factor * width / side)) * side
    longest = (max_patches // pooling**2) * side
    if h == 0 and w == 0:  # pragma: no cover - the budget's area always leaves one side >= a cell
        raise SampleError(
            sample=sample,
            field=field,
            expected=f"a size that fits one {side}-px cell",
            actual=f"{height} x {width}",
        )
    if h == 0:
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        h, w = min(int(math.floor(height / width)) * side, longest), side
    if h * w > target:  # pragma: no cover - as above
        raise SampleError(
            sample=sample,
            field=field,
            expected=f"at most {max_patches} patches",
            actual=f"{height} x {width} resized to {h} x {w}",
        )
    return h, w


@dataclass(frozen=True, kw_only=True)
class Gemma4(OneDimFamily):
    """``model_type`` ``gemma4``: ``image_token_id`` ``<|image|>``, ``video_token_id``
    ``<|video|>``, ``vision_start_token_id`` / ``vision_end_token_id`` ``<|image>`` / ``<image|>``
    (``boi`` / ``eoi_token_id``); ``spatial_merge_size`` the pooling kernel ``k``;
    ``bidirectional``: ``text_config.use_bidirectional_attention == "vision"``. The batch schema
    (:meth:`~.common.OneDimFamily.batch_schema`): the token fields, ``mm_token_type_ids`` (1 image,
    2 video), :meth:`media_fields`, teacher top-k when asked."""

    model_types = ("gemma4",)
    max_token_type = 2
    position_kind = "1d"
    media_attention = "bidirectional"  # what the family may need; contract(): the config's
    transform = "prealign.loaders.media.gemma4.Gemma4SampleTransform"
    bidirectional: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: Any) -> "Gemma4":
        get = config_getter(config)
        vision = config_getter(get("vision_config", None) or VISION_DEFAULTS)
        text = config_getter(get("text_config", None) or {})
        return cls(
            model_type=get("model_type"),
            image_token_id=get("image_token_id"),
            video_token_id=get("video_token_id"),
            vision_start_token_id=get("boi_token_id"),
            vision_end_token_id=get("eoi_token_id"),
            patch_size=vision("patch_size"),
            spatial_merge_size=vision("pooling_kernel_size"),
            temporal_patch_size=1,
            linear_attention=has_linear_attention(config),
            bidirectional=text("use_bidirectional_attention") == "vision",
            sliding_window=text("sliding_window"),
            layer_types=tuple(text("layer_types") or ()),
        )

    def contract(self, config: Any = None) -> ModelContract:
        """1-D positions, the image / video blocks where the config asks for them (on the layers
        the installed transformers gives them), the text config's local layers."""
        from .contract import block_over_window, gemma4_bidirectional_layers

        return ModelContract(
            model=self.model_type,
            position_kind="1d",
            media_attention="bidirectional" if self.bidirectional else "causal",
            local_attention=local_attention(
                {"layer_types": list(self.layer_types)} if config is None else config
            ),
            linear_attention=self.linear_attention,
            bidirectional_layers=gemma4_bidirectional_layers() if self.bidirectional else None,
            media_over_window=self.bidirectional and block_over_window(self.model_type),
        )

    def token_grid(
        self, height: int, width: int, *, max_soft_tokens: int, sample=None, field: str = "image"
    ) -> tuple[int, int]:
        """``(rows, cols)`` of soft tokens of a ``height x width`` image (its header is enough):
        the resized size (:func:`resized_size`) over ``k * p``."""
        cell = self.spatial_merge_size * self.patch_size
        h, w = resized_size(
            height,
            width,
            patch_size=self.patch_size,
            max_soft_tokens=max_soft_tokens,
            pooling=self.spatial_merge_size,
            sample=sample,
            field=field,
        )
        return h // cell, w // cell

    def media_fields(self, pixel_dtypes: tuple[str, ...]) -> tuple:
        """What the image processor hands the model: ``pixel_values`` float ``[images,
        max_patches, 3 p^2]`` (each image's patches, zero-padded to the budget) and
        ``image_position_ids`` int64 ``[images, max_patches, 2]`` (each patch's ``(x, y)``, -1 on
        padding)."""
        from prealign.schemas.schema import FieldSpec, Role

        return (
            FieldSpec(
                name="pixel_values",
                role=Role.MEDIA,
                dtypes=pixel_dtypes,
                dense_shape=("max_patches", 3 * self.patch_size**2),
            ),
            FieldSpec(
                name="image_position_ids",
                role=Role.MEDIA,
                dtypes=("int64",),
                dense_shape=("max_patches", 2),
            ),
        )
