"""``to_packed_seq_params`` refuses offsets that do not describe a packed batch (the ones TE would
read out of bounds with): a ``max_seqlen`` below the longest padded sequence, padded lengths shorter
than true ones, offsets not starting at 0 or decreasing. Every collator batch passes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate import THDCollator, to_packed_seq_params
from prealign.schemas import PadPolicy, ParallelLayout
from prealign.schemas.errors import ArgumentError
from tests.conftest import SCHEMA, examples, make_samples


def batch_of(lengths, tp=2, cp=2, rank=0, policy=PadPolicy.PER_SEQUENCE):
    layout = ParallelLayout(tp=tp, cp=cp, pad_policy=policy)
    return THDCollator(schema=SCHEMA, layout=layout, cp_rank=rank)(make_samples(lengths))


@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=6),
    tp=st.integers(1, 4),
    cp=st.integers(1, 4),
    data=st.data(),
    policy=st.sampled_from(list(PadPolicy)),
)
@examples(40)
def test_every_collator_batch_passes_the_offset_checks(lengths, tp, cp, data, policy):
    rank = data.draw(st.integers(0, cp - 1))
    for convention in ("padded", "unpadded"):
        to_packed_seq_params(batch_of(lengths, tp, cp, rank, policy), convention=convention)


@pytest.mark.parametrize(
    "edit,words",
    [
        (lambda b: b["max_seqlen"].fill_(0), "max_seqlen >= the longest padded sequence"),
        (lambda b: b["max_seqlen"].sub_(1), "max_seqlen >= the longest padded sequence"),
        (
            lambda b: b.update(
                cu_seqlens_padded=b["cu_seqlens"].clone(), cu_seqlens=b["cu_seqlens_padded"].clone()
            ),
            "padded length >= its true length",
        ),
        (lambda b: b["cu_seqlens"].add_(1), "starting at 0"),
        (lambda b: b["cu_seqlens_padded"].copy_(b["cu_seqlens_padded"].flip(0)), "non-decreasing"),
    ],
)
def test_offsets_that_describe_no_packed_batch_are_refused(edit, words):
    batch = batch_of([5, 9, 2])
    assert not torch.equal(
        batch["cu_seqlens"], batch["cu_seqlens_padded"]
    )  # real padding, so a swap shows
    edit(batch)
    with pytest.raises(ArgumentError, match=words):
        to_packed_seq_params(batch)


@pytest.mark.parametrize("unshard", ["thd", "bshd"])
def test_shards_of_mixed_dtypes_are_refused_not_promoted(unshard):
    from prealign.collate import unshard_bshd, unshard_cp

    shards = [batch_of([5, 9, 2], rank=r)["input_ids"] for r in range(2)]
    shards[1] = shards[1].to(torch.int32)
    with pytest.raises(ArgumentError, match="one dtype"):
        if unshard == "thd":
            unshard_cp(shards, cu_seqlens_padded=batch_of([5, 9, 2])["cu_seqlens_padded"])
        else:
            unshard_bshd([s.reshape(1, -1) for s in shards])
