"""``to_verl_thd`` gives verl's engine forward what its own ``preprocess_thd_engine`` (verl 0.9.1)
would: the same rows on every CP rank, the same ``PackedSeqParams`` and the same positions on real
tokens, so verl can take prealign's batch and skip its per-sequence preprocess."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate import THDCollator, to_verl_thd
from prealign.schemas import ConfigError, PadPolicy, ParallelLayout
from tests.collate.test_reference_verl import run_verl, verl_util  # noqa: F401  (the fixture loads verl without ray)
from tests.conftest import TOPK, TOPK_FIELDS, examples, make_samples, schema_for, to_nested

PARAM_FIELDS = (
    "qkv_format",
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
    "max_seqlen_q",
    "max_seqlen_kv",
)


def _same(a, b) -> bool:
    return torch.equal(a, b) and a.dtype == b.dtype if torch.is_tensor(a) else a == b


@given(
    lengths=st.lists(st.one_of(st.integers(1, 16), st.integers(1, 700)), min_size=1, max_size=5),
    tp=st.integers(1, 4),
    cp=st.integers(1, 4),
)
@examples(25)
def test_to_verl_thd_equals_preprocess_thd_engine(verl_util, lengths, tp, cp):
    layout = ParallelLayout(tp=tp, cp=cp, pad_policy=PadPolicy.PER_SEQUENCE)
    samples = make_samples(lengths, topk=TOPK)
    nested = to_nested(samples)
    compared = 0
    for rank in range(cp):
        batch = THDCollator(schema=schema_for(TOPK), layout=layout, cp_rank=rank)(samples)
        real = ~batch["padding_mask"][0]
        for name in ("input_ids", *TOPK_FIELDS):
            rows, params, positions = to_verl_thd(batch, name)
            theirs, their_params, their_positions = run_verl(
                verl_util, "preprocess_thd_engine", nested[name], tp=tp, cp=cp, rank=rank
            )
            assert _same(rows, theirs), (name, rank)
            assert all(_same(getattr(params, f), getattr(their_params, f)) for f in PARAM_FIELDS)
            assert (
                positions.shape == their_positions.shape
                and positions.dtype == their_positions.dtype
            )
            assert torch.equal(positions[0][real], their_positions[0][real])
            compared += int(real.sum())
    assert compared == 3 * sum(lengths)


def test_labels_are_verls_rolled_ids_but_on_each_sequence_end(verl_util):
    """The loss side: ``to_verl_thd(batch, "labels")`` equals verl's ``need_roll`` ids on every
    label inside a sequence (verl wraps each last token to the sequence's first, prealign ignores
    it)."""
    lengths, tp, cp = [5, 33, 17, 2], 2, 2
    layout = ParallelLayout(tp=tp, cp=cp, pad_policy=PadPolicy.PER_SEQUENCE)
    nested = to_nested(make_samples(lengths))
    inner_seen = 0
    for rank in range(cp):
        batch = THDCollator(schema=schema_for(None), layout=layout, cp_rank=rank)(nested)
        rolled, _, _ = run_verl(
            verl_util,
            "preprocess_thd_engine",
            nested["input_ids"],
            tp=tp,
            cp=cp,
            rank=rank,
            need_roll=True,
        )
        labels = to_verl_thd(batch, "labels").rows
        inner = ~batch["padding_mask"][0] & (labels[0] != -100)
        assert torch.equal(labels[0][inner], rolled[0][inner])
        inner_seen += int(inner.sum())
    assert inner_seen == sum(n - 1 for n in lengths)


def test_detects_a_batch_padded_by_another_rule(verl_util):
    """The comparison can fail: MINIMAL padding is not verl's rule, and the rows differ."""
    samples = make_samples([5, 33, 17])
    batch = THDCollator(schema=schema_for(None), layout=ParallelLayout(tp=2, cp=2), cp_rank=0)(
        samples
    )
    theirs, their_params, _ = run_verl(
        verl_util, "preprocess_thd_engine", to_nested(samples)["input_ids"], tp=2, cp=2, rank=0
    )
    rows, params, _ = to_verl_thd(batch)
    assert rows.shape != theirs.shape or not torch.equal(
        params.cu_seqlens_q, their_params.cu_seqlens_q
    )


def test_refuses_a_deferred_shard_and_a_non_token_field():
    samples = make_samples([5, 7])
    deferred = THDCollator(
        schema=schema_for(None), layout=ParallelLayout(cp=2), cp_rank=0, defer_cp_shard=True
    )(samples)
    with pytest.raises(ConfigError, match="defer_cp_shard"):
        to_verl_thd(deferred)
    with pytest.raises(ConfigError, match="cu_seqlens"):
        to_verl_thd(
            THDCollator(schema=schema_for(None), layout=ParallelLayout())(samples), "cu_seqlens"
        )
