"""Differential tests against megatron-core: its own CP split of a BSHD batch, and
PackedSeqParams."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate import BSHDCollator, PackedSeqConvention, THDCollator, to_packed_seq_params
from prealign.schemas import ArgumentError, CPLayout, PadPolicy, ParallelLayout
from tests.conftest import TOPK, collate_ranks, examples, make_samples, schema_for

mcore_utils = pytest.importorskip("megatron.core.utils")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402


def megatron_cp_shard(batch: dict, cp: int, rank: int) -> dict:
    """megatron-core's ``get_batch_on_this_cp_rank`` with its parallel_state getters pointed at
    (cp, rank). Our bool [B, S] mask goes in under another key: Megatron splits ``attention_mask``
    on dim 2 (its [B, 1, S, S] mask)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp)
        mp.setattr(parallel_state, "get_context_parallel_rank", lambda: rank)
        out = mcore_utils.get_batch_on_this_cp_rank({k: v.clone() for k, v in batch.items()})
    return out


TOKEN_KEYS = (
    "input_ids",
    "labels",
    "loss_mask",
    "position_ids",
    "padding_mask",
    "teacher_topk_log_probs",
    "teacher_topk_ids",
)


@given(
    lengths=st.lists(st.integers(1, 700), min_size=1, max_size=5),
    tp=st.integers(1, 4),
    cp=st.integers(2, 8),
    policy=st.sampled_from(list(PadPolicy)),
    topk=st.sampled_from([None, TOPK]),
)
@examples(50)
def test_bshd_shards_equal_get_batch_on_this_cp_rank(lengths, tp, cp, policy, topk):
    layout = ParallelLayout(tp=tp, cp=cp, pad_policy=policy)
    samples, schema = make_samples(lengths, topk=topk), schema_for(topk)
    whole = BSHDCollator(schema=schema, layout=layout)(samples)
    theirs_in = {k: whole[k] for k in TOKEN_KEYS if k in whole} | {
        "mask_bs": whole["attention_mask"]
    }
    shards = collate_ranks(BSHDCollator, schema, layout, samples)
    compared = 0
    for rank, ours in enumerate(shards):
        theirs = megatron_cp_shard(theirs_in, cp, rank)
        assert torch.equal(theirs.pop("mask_bs"), ours["attention_mask"])
        for k, v in theirs.items():
            assert v.dtype == ours[k].dtype and torch.equal(v, ours[k]), (k, rank)
            compared += 1
    assert compared >= cp * 5


def test_megatron_split_of_a_thd_single_sequence_is_ours():
    """With one sequence a THD batch [1, T] is also a BSHD batch: Megatron's split agrees with
    THD's."""
    samples = make_samples([37], topk=TOPK)
    layout = ParallelLayout(tp=2, cp=4)
    whole = THDCollator(schema=schema_for(TOPK), layout=layout)(samples)
    for rank, ours in enumerate(collate_ranks(THDCollator, schema_for(TOPK), layout, samples)):
        theirs = megatron_cp_shard({k: whole[k] for k in TOKEN_KEYS}, 4, rank)
        assert all(torch.equal(theirs[k], ours[k]) for k in TOKEN_KEYS)


@pytest.mark.parametrize("convention", list(PackedSeqConvention))
@pytest.mark.parametrize("rank", [None, 0, 1])
def test_packed_seq_params_conventions(convention, rank):
    batch = THDCollator(schema=schema_for(None), layout=ParallelLayout(tp=2, cp=2), cp_rank=rank)(
        make_samples([5, 3, 11])
    )
    params = to_packed_seq_params(batch, convention=convention.value)
    assert isinstance(params, PackedSeqParams) and params.qkv_format == "thd"
    padded, true = [0, 8, 12, 24], [0, 5, 8, 19]
    q = padded if convention is PackedSeqConvention.PADDED else true
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == q
    assert params.cu_seqlens_q_padded.tolist() == params.cu_seqlens_kv_padded.tolist() == padded
    for t in (
        params.cu_seqlens_q,
        params.cu_seqlens_kv,
        params.cu_seqlens_q_padded,
        params.cu_seqlens_kv_padded,
    ):
        assert t.dtype == torch.int32 and t.ndim == 1
    assert params.max_seqlen_q == params.max_seqlen_kv == 12


def test_packed_seq_params_contiguous_needs_a_newer_megatron():
    layout = ParallelLayout(cp=2, cp_layout=CPLayout.CONTIGUOUS)
    batch = THDCollator(schema=schema_for(None), layout=layout, cp_rank=0)(make_samples([5, 3]))
    if "cp_partition_mode" in PackedSeqParams.__dataclass_fields__:
        assert to_packed_seq_params(batch, cp_layout="contiguous").cp_partition_mode == "contiguous"
    else:
        with pytest.raises(ArgumentError, match="cp_partition_mode"):
            to_packed_seq_params(batch, cp_layout="contiguous")
    single = THDCollator(schema=schema_for(None), layout=ParallelLayout(cp_layout="contiguous"))(
        make_samples([5])
    )
    assert to_packed_seq_params(single, cp_layout="contiguous").cu_seqlens_q.tolist() == [0, 5]
