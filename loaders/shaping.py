"""Sample shaping below both loaders: a sample cut to fit the token budget (:func:`truncate_sample`)
and the all-pad filler a rank yields when it has no real micro-batch left (:func:`filler_sample`,
:func:`filler_length`: one mechanism for :class:`~prealign.loaders.loader.PackedLoader` and
:class:`~prealign.loaders.streaming.StreamingPackedLoader`)."""

from __future__ import annotations

import numpy as np
import torch

from prealign.collate.samples import sample_token_keys
from prealign.loaders.errors import BadSampleError
from prealign.loaders.index.sample_checks import has_media, media_keys
from prealign.schemas.layout import ParallelLayout
from prealign.schemas.schema import BatchSchema, FieldSource, Role


def filler_length(layout: ParallelLayout) -> int:
    """Tokens of a filler: the smallest sequence the layout pads to (``layout.seq_multiple``), so a
    filler micro-batch costs one aligned sequence of pad."""
    return layout.seq_multiple


def truncate_sample(sample: dict, schema: BatchSchema, length: int) -> dict:
    """A copy of ``sample`` with every token field cut to its first ``length`` tokens.

    Refuses (:class:`BadSampleError`, reason ``oversize_media``) to cut a sample that carries media
    (a MEDIA field with rows): its ``pixel_values`` / ``image_grid_thw`` would no longer match its
    image tokens. The planner leaves such samples out instead (``MicrobatchPlan.skipped_media``).
    """
    out = dict(sample)
    mkeys = media_keys(schema)
    for key, dim in sample_token_keys(schema):
        if key in out and out[key] is not None:
            t = (
                torch.as_tensor(np.asarray(out[key]))
                if not isinstance(out[key], torch.Tensor)
                else out[key]
            )
            if t.shape[dim] > length and mkeys and has_media(sample, mkeys):
                raise BadSampleError(
                    sample=sample.get("__key__"),
                    field=key,
                    reason="oversize_media",
                    expected=f"at most {length} tokens (a sample carrying media is never cut)",
                    actual=f"{t.shape[dim]} tokens",
                )
            out[key] = t.narrow(dim, 0, min(length, t.shape[dim]))
    return out


def filler_sample(sample: dict, schema: BatchSchema, length: int) -> dict:
    """A sample shaped like ``sample`` but ``length`` pad tokens long, labels all ``ignore_index``
    (so its loss mask is zero), sequence fields zero and media fields empty (no images: a VLM
    filler has ``pixel_values [0, patch_dim]``, ``image_grid_thw [0, 3]``, text-only token types
    and zero ``mrope_position_ids``, consistent for
    :func:`prealign.schemas.vlm.validate_vlm_batch`)."""
    out = dict(sample)
    for spec in schema.of_role(Role.MEDIA):  # first: then the cut below never sees media
        if spec.name in out:
            out[spec.name] = torch.as_tensor(out[spec.name])[:0]
    out = truncate_sample(out, schema, length)
    for spec in schema.of_role(Role.TOKEN):
        if spec.source not in (FieldSource.SAMPLE, FieldSource.NEXT_TOKEN):
            continue
        for key in spec.sample_keys:
            if key in out and not (spec.source is FieldSource.NEXT_TOKEN and key == "input_ids"):
                # (labels read input_ids when a sample has no labels: the ids keep their own pad,
                # not -100)
                out[key] = torch.full_like(torch.as_tensor(out[key]), spec.pad_value)
        if spec.source is FieldSource.NEXT_TOKEN:
            ids = torch.as_tensor(out["input_ids"])
            out[spec.sample_keys[0]] = torch.full_like(ids, schema.ignore_index)
    if "loss_mask" in out:
        out["loss_mask"] = torch.zeros_like(torch.as_tensor(out["loss_mask"]))
    for spec in schema.of_role(Role.SEQUENCE):
        if spec.name in out:
            out[spec.name] = torch.zeros_like(torch.as_tensor(out[spec.name]))
    return out
