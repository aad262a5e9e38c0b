"""Hostile ParallelLayout values: each is a LayoutError naming the value, never a TypeError, a
silent reinterpretation, or a batch that allocates terabytes (a bomb from a three-key config)."""

from __future__ import annotations

import re

import pytest

from prealign.collate import BSHDCollator
from prealign.schemas import ParallelLayout, causal_lm_schema
from prealign.schemas.errors import LayoutError
from prealign.schemas.layout import MAX_PACKED_LENGTH


@pytest.mark.parametrize("buckets", [5, 8.0], ids=repr)
def test_length_buckets_not_a_list_in_a_dict_is_a_layout_error(buckets):
    expected = "length_buckets: expected a tuple of ints or None, got"
    with pytest.raises(LayoutError, match=f"{expected} {re.escape(repr(buckets))}"):
        ParallelLayout.from_dict({"length_buckets": buckets})


@pytest.mark.parametrize("sp", ["false", "no", [], 2, 0.0], ids=repr)
def test_sp_must_be_a_bool(sp):
    """``bool("false")`` is True: a config's ``"sp": "false"`` turned SP on."""
    got = re.escape(repr(sp))
    with pytest.raises(LayoutError, match=f"sp: expected a bool or None, got {got}"):
        ParallelLayout.from_dict({"tp": 2, "sp": sp})
    assert ParallelLayout(tp=2, sp=False).sp is False and ParallelLayout(tp=2).sp is True
    assert ParallelLayout(tp=2, sp=0).sp is False and ParallelLayout(sp=1).sp is True


@pytest.mark.parametrize(
    "kw",
    [
        {"tp": 2**40, "sp": True},
        {"tp": 2**20, "cp": 2**20},
        {"token_multiple": 2**40},
        {"cp": 2**31},
        {"fp8": "mxfp8", "tp": 2**30},
    ],
    ids=repr,
)
def test_a_multiple_past_int32_is_a_layout_error_not_a_bomb(kw):
    """No batch of such a layout fits int32 cu_seqlens; a BSHD collator allocated ``S`` of
    ``2**40`` rows for a one-token sample (MemoryError, or 8 TiB where overcommit allows)."""
    with pytest.raises(LayoutError, match="total multiple .* would not fit int32 cu_seqlens"):
        layout = ParallelLayout(**kw)
        BSHDCollator(schema=causal_lm_schema(), layout=layout)([{"input_ids": [1]}])


def test_max_seqs_past_int32_is_a_layout_error():
    """``max_seqs + 1`` cu_seqlens entries for one sample: a storage-size RuntimeError in torch."""
    with pytest.raises(LayoutError, match="max_seqs: .* at most 2147483647"):
        ParallelLayout(max_seqs=2**62)
    assert ParallelLayout(max_seqs=MAX_PACKED_LENGTH).max_seqs == MAX_PACKED_LENGTH
