"""A large token field sharded over CP ranks is gathered block by block (runs of whole sequences,
``assemble.BLOCK_BYTES`` of input rows each, so a block is still in the cache when it is checked
and gathered). Blocks are an optimisation only: forced on with blocks of a few rows, every batch is
bit-identical to the one-pass gather, and a bad value is named by the same sample and token."""

from __future__ import annotations

import pytest
import torch

import prealign.collate.assemble as assemble
from prealign.collate import BSHDCollator, THDCollator
from prealign.schemas import ParallelLayout, SampleError, causal_lm_schema
from prealign.schemas.layout import PadPolicy
from tests.conftest import make_samples

LENGTHS = [5, 9, 2, 7, 30, 1, 12]
LAYOUTS = [
    ParallelLayout(tp=2, cp=2, pad_policy=PadPolicy.PER_SEQUENCE),
    ParallelLayout(cp=3),
    ParallelLayout(tp=2, cp=2, cp_layout="contiguous"),
]
SCHEMA = causal_lm_schema(topk=3)


def _samples(own_labels: bool = True):
    samples = make_samples(LENGTHS, topk=3, loss_mask=True)
    for i, s in enumerate(samples):  # a sample's own labels: a next-token field gathered in blocks
        if own_labels:
            s["labels"] = s["input_ids"].clone()
            s["labels"][:: 2 + i % 3] = -100
    return samples


def _blocks(monkeypatch, block_bytes: int | None) -> None:
    """Blocks of ``block_bytes`` of input rows on every field, or (None) one pass on all."""
    monkeypatch.setattr(assemble, "BLOCK_MIN_BYTES", 1 << 60 if block_bytes is None else 0)
    monkeypatch.setattr(assemble, "BLOCK_BYTES", block_bytes or 1)


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == b[k].dtype and torch.equal(v, b[k]), k
        else:
            assert v == b[k], k


@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
@pytest.mark.parametrize("cls", [THDCollator, BSHDCollator])
@pytest.mark.parametrize("block_bytes", [1, 100, 1000])
@pytest.mark.parametrize("own_labels", [True, False], ids=["own-labels", "labels-of-ids"])
def test_blocks_give_the_one_pass_batch(monkeypatch, layout, cls, block_bytes, own_labels):
    """(Labels of input_ids: one pass copies them from the gathered ids, blocks gather them.)"""
    samples = _samples(own_labels)
    for rank in range(layout.cp):
        coll = cls(schema=SCHEMA, layout=layout, cp_rank=rank)
        _blocks(monkeypatch, None)
        whole = coll(samples)
        _blocks(monkeypatch, block_bytes)
        _equal(coll(samples), whole)


@pytest.mark.parametrize("field", ["teacher_topk_ids", "teacher_topk_log_probs", "labels"])
def test_a_bad_value_in_a_later_block_names_its_sample_and_token(monkeypatch, field):
    samples = _samples()
    bad = samples[4][field]
    bad[6] = 10**9 if field == "labels" else (-1 if bad.dtype == torch.int64 else float("nan"))
    schema = causal_lm_schema(topk=3, vocab_size=10**6)
    coll = THDCollator(schema=schema, layout=LAYOUTS[0], cp_rank=1)
    for block_bytes in (None, 1, 100, 1 << 60):
        _blocks(monkeypatch, block_bytes)
        with pytest.raises(SampleError) as err:
            coll(samples)
        assert err.value.sample == 4 and "at token 6" in str(err.value), str(err.value)
        assert field in str(err.value)
