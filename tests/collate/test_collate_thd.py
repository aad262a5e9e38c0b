"""THDCollator: every field of every CP rank against the reference packer, the alignment it
promises, the inverse maps, and the worked examples."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import prealign.collate.assemble
from prealign.collate import BSHDCollator, THDCollator, unpack_thd, unshard_cp
from prealign.schemas import (
    ArgumentError,
    CPLayout,
    PadPolicy,
    ParallelLayout,
    causal_lm_schema,
    rl_schema,
    validate_batch,
)
from tests.conftest import (
    SAMPLE_FIELDS,
    TOPK,
    assert_fields_equal,
    assert_labels_stay_in_sequence,
    brute_force_total,
    collate_case,
    collate_case_batches,
    collate_ranks,
    examples,
    lengths_st,
    local_ok,
    make_samples,
    reference_thd,
    required_seq_multiple,
    schema_for,
    to_nested,
)


@pytest.mark.slow
@given(case=collate_case())
@examples(250)
def test_every_rank_matches_the_reference_and_unshards_to_the_input(case):
    lengths, layout, samples, schema, whole, shards = collate_case_batches(THDCollator, case)

    # alignment, read off the output itself
    padded = whole["cu_seqlens_padded"].diff().tolist()
    t = int(whole["cu_seqlens_padded"][-1])
    assert whole["cu_seqlens"].diff().tolist() == lengths
    assert padded == layout.padded_lengths(torch.tensor(lengths)).tolist()
    assert t == brute_force_total(lengths, layout)
    assert all(p % required_seq_multiple(layout) == 0 for p in padded)
    assert whole["input_ids"].shape == (1, t) and whole["max_seqlen"].tolist() == [max(padded)]
    assert t >= layout.cp * layout.min_local_rows and (
        layout.length_buckets is None or t in layout.length_buckets
    )
    for shard in shards:
        t_local = shard["input_ids"].shape[1]
        assert t_local * layout.cp == t and local_ok(layout, t_local)
        assert torch.equal(shard["cu_seqlens_padded"], whole["cu_seqlens_padded"])

    # content: the unsharded batch and every rank's shard, field by field
    for rank, batch in [(None, whole), *enumerate(shards)]:
        want = reference_thd(samples, padded, schema, layout, rank)
        assert assert_fields_equal(batch, want, leading=1) == len(batch.keys() & want.keys()) >= 5
        assert validate_batch(batch, schema, layout) == []
        assert batch["cp_rank"] == (-1 if rank is None else rank) and batch["cp_size"] == layout.cp
    slot_len = torch.repeat_interleave(torch.tensor(lengths), torch.tensor(padded))
    ends = assert_labels_stay_in_sequence(
        whole["input_ids"][0], whole["labels"][0], whole["position_ids"][0], slot_len
    )
    assert ends == len(lengths)

    # inverse: shards -> whole -> samples, for every field
    for name in whole.keys() & set(want):
        back = unshard_cp(
            [s[name] for s in shards],
            cu_seqlens_padded=whole["cu_seqlens_padded"],
            cp_layout=layout.cp_layout,
        )
        assert torch.equal(back, whole[name]), name
    for name in SAMPLE_FIELDS:
        if name in samples[0]:
            rows = unpack_thd(
                whole[name],
                cu_seqlens=whole["cu_seqlens"],
                cu_seqlens_padded=whole["cu_seqlens_padded"],
            )
            assert len(rows) == len(samples) and all(
                torch.equal(r, s[name]) for r, s in zip(rows, samples)
            )


@pytest.mark.slow
@given(
    lengths=lengths_st,
    cp=st.integers(1, 8),
    tp=st.integers(1, 8),
    cp_layout=st.sampled_from(list(CPLayout)),
    blocked=st.booleans(),
)
@examples(60)
def test_nested_tensor_input_gives_the_list_input_batch(lengths, cp, tp, cp_layout, blocked):
    samples = make_samples(lengths, topk=TOPK)
    layout = ParallelLayout(tp=tp, cp=cp, cp_layout=cp_layout)
    for rank in [None, *range(cp)]:
        coll = THDCollator(schema=schema_for(TOPK), layout=layout, cp_rank=rank)
        with pytest.MonkeyPatch.context() as mp:
            if blocked:  # the blocked gather of large sharded fields, forced on small ones
                mp.setattr(prealign.collate.assemble, "BLOCK_MIN_BYTES", 0)
            a, b = coll(samples), coll(to_nested(samples))
        assert a.keys() == b.keys()
        for k in a:
            assert (
                (torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype)
                if torch.is_tensor(a[k])
                else a[k] == b[k]
            ), k


def test_worked_example_tp1_cp2():
    """REFERENCE.md: L=[5,3] -> P=[8,4], cu_seqlens_padded=[0,8,12];
    rank 0: a0 a1 _ _ b0 _ ; rank 1: a2 a3 a4 _ b1 b2."""
    a, b = [11, 12, 13, 14, 15], [21, 22, 23]
    samples = [{"input_ids": torch.tensor(a)}, {"input_ids": torch.tensor(b)}]
    layout = ParallelLayout(tp=1, cp=2)
    r0, r1 = collate_ranks(THDCollator, causal_lm_schema(), layout, samples)
    for r in (r0, r1):
        assert r["cu_seqlens_padded"].tolist() == [0, 8, 12] and r["cu_seqlens"].tolist() == [
            0,
            5,
            8,
        ]
        assert (
            r["cu_seqlens_padded"].dtype
            == r["cu_seqlens"].dtype
            == r["max_seqlen"].dtype
            == torch.int32
        )
        assert r["max_seqlen"].tolist() == [8]
    assert r0["input_ids"].tolist() == [[11, 12, 0, 0, 21, 0]]
    assert r1["input_ids"].tolist() == [[13, 14, 15, 0, 22, 23]]
    assert r0["position_ids"].tolist() == [[0, 1, 6, 7, 0, 3]]
    assert r1["position_ids"].tolist() == [[2, 3, 4, 5, 1, 2]]
    assert r0["labels"].tolist() == [[12, 13, -100, -100, 22, -100]]
    assert r1["labels"].tolist() == [[14, 15, -100, -100, 23, -100]]
    assert r0["padding_mask"].tolist() == [[False, False, True, True, False, True]]
    assert r1["padding_mask"].tolist() == [[False, False, False, True, False, False]]
    assert r0["loss_mask"].tolist() == [[1.0, 1.0, 0.0, 0.0, 1.0, 0.0]]
    assert (
        r0["input_ids"].dtype,
        r0["labels"].dtype,
        r0["position_ids"].dtype,
        r0["padding_mask"].dtype,
        r0["loss_mask"].dtype,
    ) == (torch.int64, torch.int64, torch.int64, torch.bool, torch.float32)


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("policy", list(PadPolicy))
def test_seed_case_4026_tokens_tp2_is_sp_aligned(cp, policy):
    """verl #7702: one 4026-token sequence, TP=2 with SP, with and without CP=2."""
    layout = ParallelLayout(tp=2, cp=cp, pad_policy=policy)
    samples = make_samples([4026], topk=TOPK)
    for batch in collate_ranks(THDCollator, schema_for(TOPK), layout, samples):
        t_local = batch["input_ids"].shape[1]
        assert t_local % 2 == 0 and t_local * cp == int(batch["cu_seqlens_padded"][-1]) >= 4026
        assert batch["teacher_topk_log_probs"].shape == (1, t_local, TOPK)
        assert batch["teacher_topk_ids"].shape == (1, t_local, TOPK)
        assert validate_batch(batch, schema_for(TOPK), layout) == []


def test_sample_labels_and_loss_mask_are_shifted_like_the_tokens():
    """A sample's own labels / loss_mask are aligned with its tokens: output label j is the sample's
    label j+1, and the loss mask is (label != ignore) * sample mask j+1."""
    samples = [
        {
            "input_ids": torch.tensor([1, 2, 3, 4]),
            "labels": torch.tensor([-100, -100, 3, 4]),
            "loss_mask": torch.tensor([1.0, 1.0, 1.0, 0.0]),
        },
        {
            "input_ids": torch.tensor([5, 6, 7]),
            "labels": torch.tensor([5, 6, 7]),
            "loss_mask": torch.tensor([1.0, 0.0, 1.0]),
        },
    ]
    out = THDCollator(schema=causal_lm_schema(), layout=ParallelLayout(tp=2))(samples)
    assert out["labels"].tolist() == [[-100, 3, 4, -100, 6, 7, -100, -100]]
    assert out["loss_mask"].tolist() == [[0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]]
    assert samples[0]["labels"].tolist() == [-100, -100, 3, 4]  # inputs are not mutated


@pytest.mark.parametrize("cp_layout", list(CPLayout))
def test_deferred_cp_shard_is_the_whole_batch_plus_this_ranks_rows(cp_layout):
    samples = make_samples([7, 30, 1, 12], topk=TOPK)
    layout = ParallelLayout(tp=2, cp=4, cp_layout=cp_layout)
    schema = schema_for(TOPK)
    whole = THDCollator(schema=schema, layout=layout)(samples)
    for rank, shard in enumerate(collate_ranks(THDCollator, schema, layout, samples)):
        deferred = THDCollator(schema=schema, layout=layout, cp_rank=rank, defer_cp_shard=True)(
            samples
        )
        idx = deferred["cp_gather_index"]
        assert idx.dtype == torch.int64 and idx.shape == (whole["input_ids"].shape[1] // 4,)
        for name in ("input_ids", "labels", "position_ids", "padding_mask", *SAMPLE_FIELDS[1:]):
            assert torch.equal(deferred[name], whole[name]), name
            assert torch.equal(deferred[name].index_select(1, idx), shard[name]), name


def test_collator_is_picklable_and_rejects_a_bad_rank():
    coll = THDCollator(schema=schema_for(TOPK), layout=ParallelLayout(tp=2, cp=2), cp_rank=1)
    again = pickle.loads(pickle.dumps(coll))
    samples = make_samples([3, 9], topk=TOPK)
    assert again == coll and torch.equal(again(samples)["input_ids"], coll(samples)["input_ids"])
    with pytest.raises(
        ArgumentError, match=r"cp_rank: expected None or an int in \[0, 2\) \(cp=2\), got 2"
    ):
        THDCollator(schema=causal_lm_schema(), layout=ParallelLayout(cp=2), cp_rank=2)


@pytest.mark.parametrize("collator", [THDCollator, BSHDCollator])
def test_rl_fields_are_aligned_with_the_tokens_and_rewards_stacked(collator):
    """RL per-token fields are taken as given (not shifted like labels); per-sequence rewards are
    stacked [N]; every rank's batch validates."""
    samples = [
        {
            **s,
            "old_log_probs": -s["input_ids"].float(),
            "advantages": s["input_ids"].float() / 2,
            "response_mask": s["input_ids"] % 2 == 0,
            "rewards": torch.tensor(float(i)),
        }
        for i, s in enumerate(make_samples([5, 12, 1]))
    ]
    layout, schema = ParallelLayout(tp=2, cp=2), rl_schema()
    for rank in (None, 0, 1):
        b = collator(schema=schema, layout=layout, cp_rank=rank)(samples)
        assert validate_batch(b, schema, layout) == []
        assert b["rewards"].tolist() == [0.0, 1.0, 2.0]
        real = ~b["padding_mask"]
        assert torch.equal(b["old_log_probs"][real], -b["input_ids"][real].float())
        assert torch.equal(b["advantages"][real], b["input_ids"][real].float() / 2)
        assert torch.equal(b["response_mask"], (b["input_ids"] % 2 == 0) & real)
        assert not bool(b["old_log_probs"][~real].any())
