"""A sample's own labels are token ids in the vocabulary or the ignore index, in the collator (a
``SampleError`` naming sample, field and token) and in the validator (independently of the
collator)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate import THDCollator
from prealign.schemas import ParallelLayout, validate_batch
from prealign.schemas.errors import BatchValidationError, SampleError
from prealign.schemas.schema import IGNORE_INDEX, causal_lm_schema
from tests.conftest import examples

VOCAB = 10
SCHEMA = causal_lm_schema(pad_token_id=0, vocab_size=VOCAB)


def collate(labels_per_sample, *, schema=SCHEMA, layout=ParallelLayout(), cp_rank=None):
    samples = [
        {
            "input_ids": torch.arange(1, len(lab) + 1) % VOCAB,
            "labels": torch.tensor(lab, dtype=torch.int64),
        }
        for lab in labels_per_sample
    ]
    return THDCollator(schema=schema, layout=layout, cp_rank=cp_rank)(samples)


@pytest.mark.parametrize("bad", [99, VOCAB, -5, -101])
def test_a_label_outside_the_vocabulary_is_refused_naming_sample_field_and_token(bad):
    with pytest.raises(SampleError) as caught:
        collate([[1, 2, 3], [4, bad, 5, 6]])
    err = caught.value
    assert err.sample == 1 and err.field == "labels" and f"{bad} at token 1" in err.actual
    assert f"or {IGNORE_INDEX} (the ignore index)" in err.expected


def test_ignored_and_in_range_labels_are_collated_with_weights_where_trained():
    batch = collate([[1, IGNORE_INDEX, 9], [0, 4]])
    trained = batch["labels"] != IGNORE_INDEX
    assert torch.equal(batch["loss_mask"] != 0, trained) and int(trained.sum()) > 0


def test_labels_without_a_declared_vocabulary_are_only_held_non_negative():
    schema = causal_lm_schema(pad_token_id=0)
    collate([[10**6, 3]], schema=schema)
    with pytest.raises(SampleError):
        collate([[-7, 3]], schema=schema)


@given(
    labels=st.lists(
        st.lists(st.integers(-120, VOCAB + 5), min_size=1, max_size=9), min_size=1, max_size=4
    ),
    tp=st.integers(1, 2),
    cp=st.integers(1, 2),
)
@examples(60)
def test_the_collator_accepts_labels_exactly_when_each_is_ignored_or_in_the_vocabulary(
    labels, tp, cp
):
    ok = all(v == IGNORE_INDEX or 0 <= v < VOCAB for lab in labels for v in lab)
    layout = ParallelLayout(tp=tp, cp=cp)
    if ok:
        for rank in range(
            cp
        ):  # every CP rank accepts: bounds are checked on every row, not one shard's
            collate(labels, layout=layout, cp_rank=rank)
    else:
        for rank in range(cp):  # and every CP rank refuses, whichever holds the bad token
            with pytest.raises(SampleError):
                collate(labels, layout=layout, cp_rank=rank)


@given(
    value=st.one_of(
        st.integers(VOCAB, 10**6), st.integers(-(10**6), -1).filter(lambda v: v != IGNORE_INDEX)
    ),
    at=st.integers(0, 5),
)
@examples(40)
def test_the_validator_finds_an_edited_label_outside_the_vocabulary(value, at):
    batch = collate([[1, 2, 3, 4], [5, 6, 7]])
    real = torch.nonzero(~batch["padding_mask"].reshape(-1)).reshape(-1)
    slot = int(real[at % real.numel()])
    batch["labels"].reshape(-1)[slot] = value
    with pytest.raises(BatchValidationError) as caught:
        validate_batch(batch, SCHEMA, ParallelLayout())
    assert any(v.path == f"labels[slot {slot}]" for v in caught.value.violations)


def test_the_validator_accepts_the_collators_batches():
    validate_batch(collate([[1, IGNORE_INDEX, 9], [0, 4]]), SCHEMA, ParallelLayout())


def test_declared_label_bounds_are_held_alike_by_the_collator_and_the_validator():
    import dataclasses

    fields = tuple(
        dataclasses.replace(f, max_value=15) if f.name == "labels" else f for f in SCHEMA.fields
    )
    schema = dataclasses.replace(SCHEMA, fields=fields)
    batch = collate(
        [[12, 3, 4]], schema=schema
    )  # 12 >= the vocabulary of 10, within the labels' own bounds
    validate_batch(batch, schema, ParallelLayout())
    with pytest.raises(SampleError):
        collate([[16, 3, 4]], schema=schema)
