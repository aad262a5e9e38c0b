"""Build every TOKEN field of a schema from a :class:`FlatBatch` and a :class:`GatherPlan`.

One ``index_select`` per sample-backed field; derived fields (positions, padding mask, loss mask)
come from the plan itself. Outputs have the token dim flat: ``[*leading, T_out, *dense]``.
"""
from __future__ import annotations

from typing import Callable

import torch

from schemas.schema import BatchSchema, Role, Source
from .indices import GatherPlan
from .samples import FlatBatch, resolve_key


def token_fields(schema: BatchSchema, flat: FlatBatch, plan: GatherPlan,
                 unsharded_plan: Callable[[], GatherPlan] | None = None) -> dict[str, torch.Tensor]:
    """name -> ``[*leading, T_out, *dense]`` for every TOKEN field the batch provides.

    ``unsharded_plan`` builds the plan of the whole padded batch, used by fields with
    ``cp_sharded=False``.
    """
    out: dict[str, torch.Tensor] = {}
    labels_name = next((f.name for f in schema.of_role(Role.TOKEN) if f.source is Source.NEXT_TOKEN), None)
    for spec in sorted(schema.of_role(Role.TOKEN), key=lambda f: f.source is Source.LOSS_MASK):
        p = plan if spec.cp_sharded or unsharded_plan is None else unsharded_plan()
        if spec.source in (Source.SAMPLE, Source.NEXT_TOKEN):
            key = resolve_key(spec, flat.token.keys())
            if key is None:
                continue  # optional and absent from every sample (flatten checked that)
            nxt = spec.source is Source.NEXT_TOKEN
            values = flat.token[key].index_select(spec.token_dim, p.src_next if nxt else p.src)
            if nxt and key != spec.name:  # e.g. labels read from input_ids: the pad row holds another value
                values.masked_fill_(p.src_next == p.num_real, spec.pad_value)
            out[spec.name] = values
        elif spec.source is Source.POSITIONS:
            out[spec.name] = p.positions.to(spec.dtype)
        elif spec.source is Source.PADDING_MASK:
            out[spec.name] = p.is_pad if spec.dtype == torch.bool else p.is_pad.to(spec.dtype)
        elif spec.source is Source.LOSS_MASK:
            out[spec.name] = _loss_mask(spec, schema, flat, p, out.get(labels_name))
    return out


def _loss_mask(spec, schema: BatchSchema, flat: FlatBatch, plan: GatherPlan, labels: torch.Tensor | None):
    """1.0 where a label is trained on: label != ignore_index and not a pad, times the sample's own
    ``loss_mask`` (aligned with its tokens, so shifted like the labels) when it has one."""
    mask = (labels != schema.ignore_index) if labels is not None else ~plan.is_pad
    sample_mask = flat.token.get("loss_mask")
    if sample_mask is not None:
        mask = mask & sample_mask.index_select(0, plan.src_next).bool()
    return mask.to(spec.dtype)
