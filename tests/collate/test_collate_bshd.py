"""BSHDCollator: one sequence per row, every rank against the reference, alignment and inverse."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from prealign.collate import BSHDCollator, unpack_bshd, unshard_bshd
from prealign.schemas import PadPolicy, ParallelLayout, causal_lm_schema, validate_batch
from tests.conftest import (
    SAMPLE_FIELDS,
    TOPK,
    assert_fields_equal,
    assert_labels_stay_in_sequence,
    brute_force_bshd_length,
    collate_case,
    collate_case_batches,
    collate_ranks,
    examples,
    make_samples,
    reference_bshd,
    schema_for,
    to_nested,
)


@pytest.mark.slow
@given(case=collate_case(bshd=True))
@examples(200)
def test_every_rank_matches_the_reference_and_unshards_to_the_input(case):
    lengths, layout, samples, schema, whole, shards = collate_case_batches(BSHDCollator, case)
    b, s = len(lengths), whole["input_ids"].shape[1]
    assert s == brute_force_bshd_length(lengths, layout)
    assert (
        whole["cu_seqlens"].diff().tolist() == lengths and whole["cu_seqlens"].dtype == torch.int32
    )

    for rank, batch in [(None, whole), *enumerate(shards)]:
        want = reference_bshd(samples, s, schema, layout, rank)
        assert batch["input_ids"].shape == (b, s if rank is None else s // layout.cp)
        assert assert_fields_equal(batch, want, leading=0) == len(batch.keys() & want.keys()) >= 5
        assert torch.equal(batch["attention_mask"], ~want["padding_mask"])
        assert validate_batch(batch, schema, layout) == []
    slot_len = torch.tensor(lengths).repeat_interleave(s)
    ends = assert_labels_stay_in_sequence(
        whole["input_ids"].reshape(-1),
        whole["labels"].reshape(-1),
        whole["position_ids"].reshape(-1),
        slot_len,
    )
    assert ends == b

    for name in whole.keys() & set(want):
        back = unshard_bshd([x[name] for x in shards], cp_layout=layout.cp_layout)
        assert torch.equal(back, whole[name]), name
    for name in SAMPLE_FIELDS:
        if name in samples[0]:
            rows = unpack_bshd(whole[name], cu_seqlens=whole["cu_seqlens"])
            assert len(rows) == b and all(torch.equal(r, x[name]) for r, x in zip(rows, samples))


def test_nested_tensor_input_gives_the_list_input_batch():
    samples = make_samples([5, 17, 2], topk=TOPK)
    for rank in (None, 0, 1, 2):
        coll = BSHDCollator(
            schema=schema_for(TOPK), layout=ParallelLayout(tp=2, cp=3), cp_rank=rank
        )
        a, b = coll(samples), coll(to_nested(samples))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


@pytest.mark.parametrize("policy, s", [(PadPolicy.MINIMAL, 4028), (PadPolicy.PER_SEQUENCE, 4032)])
def test_seed_case_4026_tokens_tp2_cp2(policy, s):
    layout = ParallelLayout(tp=2, cp=2, pad_policy=policy)
    for batch in collate_ranks(
        BSHDCollator, schema_for(TOPK), layout, make_samples([4026], topk=TOPK)
    ):
        assert batch["input_ids"].shape == (1, s // 2) and (s // 2) % 2 == 0
        assert batch["teacher_topk_log_probs"].shape == (1, s // 2, TOPK)


def test_worked_example_rows():
    """L=[5,3], cp=2: S=8; rank 0 keeps columns 0,1,6,7 of each row, rank 1 columns 2..5."""
    samples = [
        {"input_ids": torch.tensor([11, 12, 13, 14, 15])},
        {"input_ids": torch.tensor([21, 22, 23])},
    ]
    r0, r1 = collate_ranks(BSHDCollator, causal_lm_schema(), ParallelLayout(cp=2), samples)
    assert r0["input_ids"].tolist() == [[11, 12, 0, 0], [21, 22, 0, 0]]
    assert r1["input_ids"].tolist() == [[13, 14, 15, 0], [23, 0, 0, 0]]
    assert r1["labels"].tolist() == [[14, 15, -100, -100], [-100, -100, -100, -100]]
    assert r1["position_ids"].tolist() == [[2, 3, 4, 5], [2, 3, 4, 5]]
    assert r1["attention_mask"].tolist() == [[True, True, True, False], [True, False, False, False]]
