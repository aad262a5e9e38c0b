"""``to_packed_seq_params`` given offsets that are not integers, that do not fit int32, or a
``local_cp_size`` that is no int: a typed error naming the key, never offsets silently truncated
(3.5 -> 3) or wrapped (2**32 + 8 -> 8) by the int32 cast, nor a raw ValueError."""

from __future__ import annotations

import pytest
import torch

from prealign.collate import THDCollator, to_packed_seq_params
from prealign.schemas import ParallelLayout, causal_lm_schema
from prealign.schemas.errors import ArgumentError, OffsetOverflowError

pytest.importorskip("megatron.core")

GOOD = THDCollator(schema=causal_lm_schema(), layout=ParallelLayout(cp=2), cp_rank=0)(
    [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
)


@pytest.mark.parametrize("key", ["cu_seqlens", "cu_seqlens_padded", "max_seqlen"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_offsets_not_integers_are_an_argument_error(key, dtype):
    batch = {**GOOD, key: GOOD[key].to(dtype)}
    with pytest.raises(ArgumentError, match=f"batch: expected {key} an integer tensor, got"):
        to_packed_seq_params(batch)


def test_int64_offsets_past_int32_are_an_offset_overflow_error():
    """Cast to int32 they wrapped to offsets describing another batch."""
    wrap = 2**32
    batch = {
        **GOOD,
        "cu_seqlens": GOOD["cu_seqlens"].long() + torch.tensor([0, wrap, wrap]),
        "cu_seqlens_padded": GOOD["cu_seqlens_padded"].long() + torch.tensor([0, wrap, wrap]),
    }
    with pytest.raises(OffsetOverflowError, match="cu_seqlens: .* int32"):
        to_packed_seq_params(batch)


def test_a_local_cp_size_that_is_no_int_is_an_argument_error():
    with pytest.raises(ArgumentError, match="local_cp_size: expected an int, got 'x'"):
        to_packed_seq_params({**GOOD, "local_cp_size": "x"})


def test_int64_offsets_in_range_keep_working():
    batch = {k: (v.long() if k.startswith("cu_") else v) for k, v in GOOD.items()}
    params = to_packed_seq_params(batch)
    assert params.cu_seqlens_q_padded.tolist() == GOOD["cu_seqlens_padded"].tolist()
