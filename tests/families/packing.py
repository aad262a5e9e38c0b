"""The in-model packing checks the family tests share: a THD batch (tp=2, cp=2) whose CP shards
unshard back to the whole batch, the model's keyword arguments from it, the largest logit difference
between that packed forward and each sample run alone, and the plain-packing contract of the
families that need nothing more."""

from __future__ import annotations

from typing import Callable

import torch

from prealign.collate import HFAttention, THDCollator, to_hf_kwargs, unshard_cp
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


def hf_kwargs(batch: dict, keys: list[str], model_config=None) -> dict:
    """``to_hf_kwargs`` of a packed batch (1-D positions, no labels) after checking it hands on
    exactly ``keys``; ``mm_token_type_ids`` dropped (these forwards take none), ``pixel_values`` in
    float64."""
    kwargs = to_hf_kwargs(
        batch, attention=HFAttention.POSITIONS, labels=False, model_config=model_config
    )
    assert sorted(kwargs) == keys
    kwargs.pop("mm_token_type_ids")
    kwargs["pixel_values"] = kwargs["pixel_values"].to(torch.float64)
    return kwargs


def assert_plain_packing(model_config) -> None:
    """The model's contract: 1-D positions, causal media attention, no local layers, no per-token
    mask, so ``position_ids`` and ``cu_seqlens_padded`` are all a packed row needs, and no
    consumer (HF flash / sdpa, Megatron) is refused at cp=2."""
    from prealign.collate.vision import model_contract
    from prealign.schemas.contract import Consumer, check_consumer

    contract = model_contract(model_config)
    assert (contract.position_kind, contract.media_attention, contract.local_attention) == (
        "1d",
        "causal",
        None,
    )
    assert not contract.needs_token_mask
    assert contract.fields() == ("position_ids", "cu_seqlens_padded")
    for consumer in (
        Consumer.hf("flash_attention_2"),
        Consumer.hf("sdpa"),
        Consumer.megatron("0.16.1"),
    ):
        check_consumer(contract, consumer, cp=2)  # nothing refused
