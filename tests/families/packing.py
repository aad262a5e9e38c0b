"""The in-model packing check the family tests share: a THD batch (tp=2, cp=2) whose CP shards
unshard back to the whole batch, and the largest logit difference between that packed forward and
each sample run alone."""

from __future__ import annotations

from typing import Callable

import torch

from prealign.collate import THDCollator, unshard_cp
from prealign.schemas import ParallelLayout
from tests.consumers.models import real_slots


def packed_batch(schema, samples: list[dict]) -> dict:
    """The unsharded THD batch (tp=2, cp=2) after checking that both CP ranks' shards unshard back
    to it and that media (never sharded) is whole on each."""
    layout = ParallelLayout(tp=2, cp=2)
    whole = THDCollator(schema=schema, layout=layout)(samples)
    shards = [THDCollator(schema=schema, layout=layout, cp_rank=r)(samples) for r in range(2)]
    for name in ("input_ids", "position_ids", "mm_token_type_ids"):
        back = unshard_cp([s[name] for s in shards], cu_seqlens_padded=whole["cu_seqlens_padded"])
        assert torch.equal(back, whole[name]), name
    assert all(torch.equal(s["pixel_values"], whole["pixel_values"]) for s in shards)
    return whole


def worst_gap(
    model, kwargs: dict, batch: dict, samples: list[dict], alone: Callable[[dict], dict]
) -> float:
    """max |packed logits - alone logits| over every real token (``alone(sample)``: that sample's
    kwargs)."""
    with torch.no_grad():
        out, bad = model(**kwargs).logits[0], 0.0
        for slots, sample in zip(real_slots(batch), samples, strict=True):
            bad = max(bad, float((out[slots] - model(**alone(sample)).logits[0]).abs().max()))
    return bad
