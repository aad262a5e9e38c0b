"""Vision-language (Qwen2-VL style) batch schema and the media checks ``validate_batch`` cannot do.

A VLM sample carries, besides the causal-LM fields:

- ``mm_token_type_ids`` int64 ``[L]``: 0 text, 1 image token, 2 video token (the placeholders that
  the vision embeddings replace); padded with 0 and CP-sharded like the tokens.
- ``mrope_position_ids`` int64 ``[3, L]``: Qwen2-VL 3-D rotary positions (temporal, height, width),
  computed by :class:`prealign.collate.mrope.MRoPECollator`; THD ``[3, 1, T_out]``, BSHD ``[3, B,
  S_out]``; pads hold 0 (as transformers' ``get_rope_index`` leaves masked slots).
- ``pixel_values`` float32/bf16 ``[num_patches, patch_dim]`` and ``image_grid_thw`` int64
  ``[num_images, 3]`` (MEDIA: concatenated over the batch in sample order, never CP-sharded;
  a text-only sample gives ``[0, patch_dim]`` and ``[0, 3]``).
- optional, for video: ``pixel_values_videos`` ``[sum t*h*w, patch_dim]``, ``video_grid_thw`` int64
  ``[num_videos, 3]`` and ``second_per_grid_ts`` float32 ``[num_videos]`` (seconds per temporal grid
  step, fractional; Qwen2.5-VL's temporal positions), MEDIA like the image fields.

Invariant tying them together (checked by :func:`media_violations`): the batch holds
``sum(t*h*w)`` patches and, when unsharded, ``sum(t*h*w) / spatial_merge_size**2`` image tokens.

>>> s = vlm_schema(topk=8)
>>> [f.name for f in s.fields if f.name.startswith(("mm_", "mrope", "pixel", "image"))]
['mm_token_type_ids', 'mrope_position_ids', 'pixel_values', 'image_grid_thw', 'pixel_values_videos']
>>> s["mrope_position_ids"].leading_shape
(3,)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import int_at_least
from .errors import BatchValidationError, SchemaError
from .layout import ParallelLayout
from .schema import (
    IGNORE_INDEX,
    BatchSchema,
    FieldSpec,
    Role,
    core_token_fields,
    token_type_field,
    topk_fields,
)
from .validate import Violation, validate_batch

TEXT_TOKEN_TYPE = 0
IMAGE_TOKEN_TYPE = 1
VIDEO_TOKEN_TYPE = 2


@dataclass(frozen=True, kw_only=True)
class VisionTokens:
    """Token ids and vision geometry shared by the sample transform, the collator and the checks."""

    image_token_id: int
    """The placeholder id repeated once per merged vision token (Qwen2-VL ``<|image_pad|>``)."""
    vision_start_token_id: int
    """Opens every image's run of placeholders (Qwen2-VL ``<|vision_start|>``); a text token."""
    vision_end_token_id: int
    """Closes every image's run (Qwen2-VL ``<|vision_end|>``); a text token."""
    spatial_merge_size: int = 2
    """Patches merged per side before the LLM: one image token per ``spatial_merge_size**2``
    patches."""

    def __post_init__(self):
        ids = (self.image_token_id, self.vision_start_token_id, self.vision_end_token_id)
        if len(set(ids)) != 3 or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids
        ):
            raise SchemaError(
                f"VisionTokens: expected three distinct non-negative token ids, got {ids}"
            )
        name, merge = "VisionTokens.spatial_merge_size", self.spatial_merge_size
        merge = int_at_least(name, merge, 1, SchemaError, expected="a positive int")
        object.__setattr__(self, "spatial_merge_size", merge)  # (a numpy int as an int: no wrap)

    def tokens_per_image(self, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """int64 ``[num_images, 3]`` grids -> int64 ``[num_images]`` image tokens (``t*h*w /
        merge**2``)."""
        return image_grid_thw.to(torch.int64).prod(-1) // self.spatial_merge_size**2


def vlm_fields(
    *, pixel_dtypes: tuple[str, ...] = ("float32", "bfloat16"), patch_dim: int | str = "patch_dim"
) -> tuple[FieldSpec, ...]:
    """The VLM-specific fields (see the module docstring): four always, the three video ones
    optional."""
    return (
        token_type_field(VIDEO_TOKEN_TYPE),
        FieldSpec(
            name="mrope_position_ids",
            dtypes=("int64",),
            leading_shape=(3,),
            pad_value=0,
            min_value=0,
        ),
        FieldSpec(
            name="pixel_values", role=Role.MEDIA, dtypes=pixel_dtypes, dense_shape=(patch_dim,)
        ),
        FieldSpec(name="image_grid_thw", role=Role.MEDIA, dtypes=("int64",), dense_shape=(3,)),
        FieldSpec(
            name="pixel_values_videos",
            role=Role.MEDIA,
            dtypes=pixel_dtypes,
            dense_shape=(patch_dim,),
            required=False,
        ),
        FieldSpec(
            name="video_grid_thw",
            role=Role.MEDIA,
            dtypes=("int64",),
            dense_shape=(3,),
            required=False,
        ),
        FieldSpec(name="second_per_grid_ts", role=Role.MEDIA, dtypes=("float32",), required=False),
    )


def vlm_schema(
    *,
    pad_token_id: int = 0,
    topk: int | str | None = None,
    vocab_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    pixel_dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    patch_dim: int | str = "patch_dim",
) -> BatchSchema:
    """Causal-LM fields + ``mm_token_type_ids``, ``mrope_position_ids``, ``pixel_values``,
    ``image_grid_thw`` (+ teacher top-k fields when ``topk`` is given, as in ``causal_lm_schema``).
    """
    fields = (
        *core_token_fields(pad_token_id, ignore_index, vocab_size),
        *vlm_fields(pixel_dtypes=pixel_dtypes, patch_dim=patch_dim),
    )
    if topk is not None:
        fields += topk_fields(topk, vocab_size)
    return BatchSchema(
        name="vlm" if topk is None else "vlm_topk", fields=fields, ignore_index=ignore_index
    )


# ---- media checks ------------------------------------------------------------------------------
def media_violations(batch: dict, *, spatial_merge_size: int = 2) -> list[Violation]:
    """What :func:`prealign.schemas.validate_batch` leaves to the producer: ``pixel_values`` rows
    equal ``sum(t*h*w)`` of ``image_grid_thw`` (``pixel_values_videos`` of ``video_grid_thw``, when
    present), and (only when the batch holds whole sequences, i.e. ``cp_rank == -1``) the image
    (video) tokens of ``mm_token_type_ids`` equal ``sum(t*h*w) / merge**2``.
    """
    out: list[Violation] = []
    types = batch.get("mm_token_type_ids")
    for kind, type_id, grid_key, pixel_key in (
        ("image", IMAGE_TOKEN_TYPE, "image_grid_thw", "pixel_values"),
        ("video", VIDEO_TOKEN_TYPE, "video_grid_thw", "pixel_values_videos"),
    ):
        grid, pixels = batch.get(grid_key), batch.get(pixel_key)
        if kind == "video" and grid is None and pixels is None:
            grid = torch.zeros(
                0, 3, dtype=torch.int64
            )  # no video in the batch: no video tokens either
        elif not isinstance(grid, torch.Tensor) or grid.ndim != 2 or grid.shape[-1] != 3:
            return out + [Violation(grid_key, f"int64 tensor [num_{kind}s, 3]", _describe(grid))]
        elif not isinstance(pixels, torch.Tensor) or pixels.ndim != 2:
            return out + [
                Violation(pixel_key, "tensor [num_patches, patch_dim]", _describe(pixels))
            ]
        patches = int(grid.to(torch.int64).prod(-1).sum())
        if pixels is not None and pixels.shape[0] != patches:
            out.append(
                Violation(
                    f"{pixel_key}.shape[0]",
                    f"{patches} (sum of t*h*w over {grid_key})",
                    pixels.shape[0],
                )
            )
        bad = grid[:, 1:] % spatial_merge_size != 0
        if bool(bad.any()):
            k = int(torch.nonzero(bad.any(1))[0])
            out.append(
                Violation(
                    f"{grid_key}[{k}]",
                    f"h and w multiples of spatial_merge_size {spatial_merge_size}",
                    grid[k].tolist(),
                )
            )
        if isinstance(types, torch.Tensor) and batch.get("cp_rank", -1) == -1:
            n_tok = int(
                (types == type_id).sum()
            )  # pads hold TEXT_TOKEN_TYPE (validate_batch checks)
            want = patches // spatial_merge_size**2
            if n_tok != want:
                out.append(
                    Violation(
                        "mm_token_type_ids",
                        f"{want} {kind} tokens (sum(t*h*w) / {spatial_merge_size}**2)",
                        f"{n_tok}",
                    )
                )
    return out


def validate_vlm_batch(
    batch: dict,
    schema: BatchSchema,
    layout: ParallelLayout,
    *,
    spatial_merge_size: int = 2,
    raise_on_error: bool = True,
) -> list[Violation]:
    """:func:`prealign.schemas.validate_batch` plus :func:`media_violations`, all reported at
    once."""
    violations = validate_batch(batch, schema, layout, raise_on_error=False)
    if (
        "image_grid_thw" in schema
    ):  # Qwen-style patches (an image_tokens_schema has whole images, no grids)
        violations += media_violations(batch, spatial_merge_size=spatial_merge_size)
    if violations and raise_on_error:
        raise BatchValidationError(violations)
    return violations


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
    return "missing" if value is None else type(value).__name__


def image_tokens_schema(
    *,
    image_size: int | str = "image_size",
    pad_token_id: int = 0,
    topk: int | str | None = None,
    vocab_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    pixel_dtypes: tuple[str, ...] = ("float32", "bfloat16"),
) -> BatchSchema:
    """A VLM with 1-D positions and whole images (Gemma 3): causal-LM fields + ``mm_token_type_ids``
    (0 text, 1 image) + ``pixel_values`` ``[num_images, 3, image_size, image_size]`` (MEDIA,
    concatenated over the batch).

    >>> image_tokens_schema(image_size=896)["pixel_values"].dense_shape
    (3, 896, 896)
    """
    fields = (
        *core_token_fields(pad_token_id, ignore_index, vocab_size),
        token_type_field(IMAGE_TOKEN_TYPE),
        FieldSpec(
            name="pixel_values",
            role=Role.MEDIA,
            dtypes=pixel_dtypes,
            dense_shape=(3, image_size, image_size),
        ),
    )
    if topk is not None:
        fields += topk_fields(topk, vocab_size)
    return BatchSchema(
        name="image_tokens" if topk is None else "image_tokens_topk",
        fields=fields,
        ignore_index=ignore_index,
    )
