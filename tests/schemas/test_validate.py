"""validate_batch: clean batches pass (also in the collator property tests); corrupted ones report
every violation at once, each with its path, expected and actual."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate import BSHDCollator, THDCollator
from prealign.schemas import BatchValidationError, ParallelLayout, Violation, validate_batch
from tests.conftest import TOPK, examples, make_samples, schema_for

LAYOUT = ParallelLayout(tp=2, cp=2)
SCHEMA = schema_for(TOPK)


def thd_batch(rank=1, collator=THDCollator, lengths=(5, 9, 2)):
    return collator(schema=SCHEMA, layout=LAYOUT, cp_rank=rank)(make_samples(lengths, topk=TOPK))


def edited(batch: dict, name: str, edit) -> dict:
    """A copy of ``batch`` whose field ``name`` is ``edit(clone)`` (or the clone edited in
    place)."""
    out = dict(batch)
    t = batch[name].clone()
    result = edit(t)
    out[name] = t if result is None else result
    return out


def paths(violations) -> list[str]:
    assert all(isinstance(v, Violation) and v.path and v.expected and v.actual for v in violations)
    return [v.path for v in violations]


def test_every_field_corruption_is_reported_at_once():
    b = thd_batch()
    pad = int(torch.nonzero(b["padding_mask"][0])[0])
    real = int(torch.nonzero(~b["padding_mask"][0])[0])
    last = int(
        torch.nonzero(b["labels"][0] == -100)[0]
    )  # a sequence's last token (or a pad) on this rank
    c = edited(b, "input_ids", lambda t: t.to(torch.int32))
    c = edited(c, "labels", lambda t: t[0].__setitem__(last, 7))
    c = edited(c, "position_ids", lambda t: t + 1)
    c = edited(c, "padding_mask", lambda t: ~t)
    c = edited(c, "teacher_topk_log_probs", lambda t: t[0].__setitem__(pad, 5.0))
    c = edited(c, "teacher_topk_ids", lambda t: t[..., :2])
    c = edited(c, "loss_mask", lambda t: t.fill_(1.0))
    c = edited(c, "teacher_topk_log_probs", lambda t: t[0, real].__setitem__(1, float("nan")))
    v = validate_batch(c, SCHEMA, LAYOUT, raise_on_error=False)
    ignored = int(torch.nonzero(c["labels"][0] == -100)[0])
    assert sorted(paths(v)) == sorted(
        [
            "input_ids.dtype",
            f"labels[slot {last}]",
            "position_ids[slot 0]",
            "padding_mask",
            "teacher_topk_log_probs[pad slots]",
            f"teacher_topk_log_probs[slot {real}]",
            "teacher_topk_ids.shape[2]",
            "loss_mask[pad slots]",
            f"loss_mask[slot {ignored}]",
        ]
    )
    by_path = {x.path: x for x in v}
    assert (by_path["input_ids.dtype"].expected, by_path["input_ids.dtype"].actual) == (
        "int64",
        "int32",
    )
    assert by_path["teacher_topk_ids.shape[2]"].expected.startswith("3 ")
    assert by_path["teacher_topk_ids.shape[2]"].actual.startswith("2 ")
    assert by_path[f"teacher_topk_log_probs[slot {real}]"].actual == "nan"
    with pytest.raises(BatchValidationError) as err:
        validate_batch(c, SCHEMA, LAYOUT)
    assert err.value.violations == v and "9 batch schema violation(s)" in str(err.value)


def test_every_offsets_corruption_is_reported_at_once():
    b = thd_batch()
    c = dict(
        b,
        cu_seqlens=b["cu_seqlens"].long(),
        cu_seqlens_padded=torch.tensor([0, 8, 6, 22], dtype=torch.int32),
    )
    assert paths(validate_batch(c, SCHEMA, LAYOUT, raise_on_error=False)) == [
        "cu_seqlens",
        "cu_seqlens_padded",
    ]
    c = dict(
        b,
        cu_seqlens_padded=torch.tensor([0, 4, 18, 22], dtype=torch.int32),
        max_seqlen=torch.tensor([3]),
    )
    assert paths(validate_batch(c, SCHEMA, LAYOUT, raise_on_error=False)) == [
        "cu_seqlens_padded gap 0",
        "cu_seqlens_padded gap 1",
        "T (cu_seqlens_padded[-1])",
        "max_seqlen",
    ]
    c = dict(b, cu_seqlens_padded=torch.tensor([0, 8, 8, 12], dtype=torch.int32))
    assert paths(validate_batch(c, SCHEMA, LAYOUT, raise_on_error=False)) == ["cu_seqlens_padded"]


def test_layout_constraints_are_checked_against_the_given_layout():
    b = thd_batch(rank=None, lengths=(5, 3))  # T = 12 under tp=2 cp=2
    v = validate_batch(
        b,
        SCHEMA,
        ParallelLayout(tp=8, cp=2, min_local_rows=16, length_buckets=(64,)),
        raise_on_error=False,
    )
    assert paths(v) == ["T (cu_seqlens_padded[-1])"] * 3
    assert [x.actual for x in v] == ["12"] * 3
    assert "multiple of 16" in v[0].expected and "32" in v[1].expected and "64" in v[2].expected


@pytest.mark.parametrize(
    "rank, size, path", [(2, 2, "cp_rank"), (1, 4, "cp_size"), ("1", 2, "cp_rank")]
)
def test_a_bad_cp_rank_is_a_violation_not_a_crash(rank, size, path):
    for collator in (THDCollator, BSHDCollator):
        v = validate_batch(
            dict(thd_batch(collator=collator), cp_rank=rank, cp_size=size),
            SCHEMA,
            LAYOUT,
            raise_on_error=False,
        )
        assert paths(v) == [path]


def test_missing_and_unknown_structure():
    b = thd_batch()
    v = validate_batch(
        {k: x for k, x in b.items() if k not in ("position_ids", "labels")},
        SCHEMA,
        LAYOUT,
        raise_on_error=False,
    )
    assert paths(v) == ["labels", "position_ids"] and (v[1].expected, v[1].actual) == (
        "present",
        "missing",
    )
    v = validate_batch({"input_ids": b["input_ids"]}, SCHEMA, LAYOUT, raise_on_error=False)
    assert paths(v) == ["batch"]


def test_bshd_corruptions():
    b = thd_batch(collator=BSHDCollator)
    c = edited(b, "attention_mask", lambda t: t[0].__setitem__(0, False))
    assert paths(
        validate_batch(
            dict(c, cu_seqlens=torch.tensor([0, 5, 14], dtype=torch.int32)),
            SCHEMA,
            LAYOUT,
            raise_on_error=False,
        )
    ) == ["cu_seqlens"]  # 3 rows, 2 offsets: nothing else is read
    c = edited(c, "labels", lambda t: t.fill_(0))
    c = edited(c, "position_ids", lambda t: t.flip(1))
    v = paths(validate_batch(c, SCHEMA, LAYOUT, raise_on_error=False))
    assert (
        v[0] == "attention_mask"
        and {"labels[pad slots]", "position_ids[slot 0]"} <= set(v)
        and len(v) >= 4
    )
    odd = {k: (x[:, :3] if torch.is_tensor(x) and x.ndim >= 2 else x) for k, x in b.items()}
    assert paths(validate_batch(odd, SCHEMA, LAYOUT, raise_on_error=False)) == [
        "S (attention_mask.shape[1] * cp)",
        "S",
    ]


def detectable_slots(b: dict, field: str) -> torch.Tensor:
    """Slots where a change of ``field`` is visible without the other ranks' data: everything but a
    token (or its label) whose neighbour in the sequence lives in another chunk."""
    ids, labels, pad = b["input_ids"][0], b["labels"][0], b["padding_mask"][0]
    follows = torch.zeros_like(pad)
    follows[:-1] = labels[:-1] == ids[1:]  # the next slot holds this slot's next token
    if field == "labels":
        return pad | (labels == -100) | follows
    if field == "loss_mask":  # a sample may mask any trained label; only ignored labels must be 0
        return labels == -100
    if field == "input_ids":
        return pad | torch.cat((follows.new_zeros(1), follows[:-1]))
    return torch.ones_like(pad)


CORRUPT = {
    "teacher_topk_log_probs": lambda v: torch.ones_like(v),
    "teacher_topk_ids": lambda v: -torch.ones_like(v),
    "padding_mask": lambda v: ~v,
    "loss_mask": lambda v: 1 - v,
}


@given(
    field=st.sampled_from(
        [
            "labels",
            "position_ids",
            "padding_mask",
            "teacher_topk_log_probs",
            "teacher_topk_ids",
            "input_ids",
            "loss_mask",
        ]
    ),
    slot=st.integers(0, 10_000),
    rank=st.integers(0, 1),
)
@examples(100)
def test_any_single_detectable_corruption_is_found(field, slot, rank):
    b = thd_batch(rank=rank)
    slots = torch.nonzero(detectable_slots(b, field)).flatten()
    assert slots.numel() > 0
    k = int(slots[slot % slots.numel()])
    c = edited(
        b, field, lambda t: t[0].__setitem__(k, CORRUPT.get(field, lambda v: v + 1)(t[0, k]))
    )
    assert len(validate_batch(c, SCHEMA, LAYOUT, raise_on_error=False)) >= 1
