"""Bad input -> a typed error naming the sample, the field, what was expected and what came,
raised alike by THD and BSHD collators and on every CP rank (a rank that did not raise would go on
into the next collective and hang the others)."""

from __future__ import annotations

import pytest
import torch

from prealign.collate import BSHDCollator, THDCollator
from prealign.schemas import (
    FieldSpec,
    LayoutError,
    ParallelLayout,
    PrealignError,
    Role,
    SampleError,
)
from tests.conftest import TOPK, make_samples, schema_for, to_nested

LAYOUT = ParallelLayout(tp=2, cp=2)
LENGTHS = (5, 9, 30)  # sample 2's tail lives on rank 0 (chunk 3), its middle on rank 1


def with_field(sample_index: int, name: str, value, lengths=LENGTHS) -> list[dict]:
    samples = make_samples(lengths, topk=TOPK)
    samples[sample_index] = {**samples[sample_index], name: value}
    return samples


def without_field(sample_index: int, name: str) -> list[dict]:
    samples = make_samples(LENGTHS, topk=TOPK)
    samples[sample_index] = {k: v for k, v in samples[sample_index].items() if k != name}
    return samples


def log_probs_with(sample_index: int, token: int, value: float) -> list[dict]:
    samples = make_samples(LENGTHS, topk=TOPK)
    lp = samples[sample_index]["teacher_topk_log_probs"].clone()
    lp[token, 1] = value
    samples[sample_index] = {**samples[sample_index], "teacher_topk_log_probs": lp}
    return samples


LP, IDS = "teacher_topk_log_probs", "teacher_topk_ids"
CASES = {
    # name: (batch, sample, field, text in the message)
    "empty batch": ([], None, None, "an empty batch"),
    "not a list": ("abc", None, None, "str"),
    "not a dict": ([*make_samples([3]), [1, 2]], 1, None, "list"),
    "zero-length sample": (
        with_field(1, "input_ids", torch.zeros(0, dtype=torch.int64)),
        1,
        "input_ids",
        "(0,)",
    ),
    "2-D input_ids": (
        with_field(1, "input_ids", torch.ones(1, 9, dtype=torch.int64)),
        1,
        "input_ids",
        "(1, 9)",
    ),
    "top-k shorter than its tokens": (with_field(2, LP, -torch.ones(29, TOPK)), 2, LP, "(29, 3)"),
    "labels longer, next one shorter": (
        [
            {"input_ids": torch.arange(1, 4), "labels": torch.arange(1, 5)},
            {"input_ids": torch.arange(1, 4), "labels": torch.arange(1, 3)},
        ],
        0,
        "labels",
        "(4,)",
    ),
    "float input_ids": (with_field(1, "input_ids", torch.ones(9)), 1, "input_ids", "float32"),
    # (int32 / uint16 token ids among int64 are widened to int64, as an HF column's lists are)
    "bf16 among float32": (
        with_field(2, LP, -torch.ones(LENGTHS[2], TOPK, dtype=torch.bfloat16)),
        2,
        LP,
        "bfloat16",
    ),
    "float64 log-probs": (
        with_field(0, LP, -torch.ones(5, TOPK, dtype=torch.float64)),
        0,
        LP,
        "float64",
    ),
    "K differs across samples": (with_field(1, LP, -torch.ones(9, TOPK + 1)), 1, LP, "(9, 4)"),
    "K differs across fields": (
        [
            {**s, IDS: torch.zeros(len(s["input_ids"]), TOPK + 1, dtype=torch.int64)}
            for s in make_samples(LENGTHS, topk=TOPK)
        ],
        0,
        IDS,
        "(5, 4)",
    ),
    "NaN log-prob (rank 0's token)": (
        log_probs_with(2, 29, float("nan")),
        2,
        LP,
        "nan at token 29",
    ),
    "NaN log-prob (rank 1's token)": (
        log_probs_with(2, 12, float("nan")),
        2,
        LP,
        "nan at token 12",
    ),
    "-inf log-prob": (log_probs_with(1, 0, float("-inf")), 1, LP, "-inf at token 0"),
    "positive log-prob": (log_probs_with(0, 4, 0.5), 0, LP, "0.5 at token 4"),
    "negative teacher id": (
        with_field(1, IDS, -torch.ones(9, TOPK, dtype=torch.int64)),
        1,
        IDS,
        "-1",
    ),
    "field missing in a later sample": (without_field(2, IDS), 2, IDS, "fields"),
    "optional field only in a later sample": (
        with_field(1, "loss_mask", torch.ones(9)),
        0,
        "loss_mask",
        "sample 1 has it",
    ),
    "None value": (with_field(0, LP, None), 0, LP, "missing"),
    "not a number": (with_field(1, IDS, "abc"), 1, IDS, "str"),
}


@pytest.mark.parametrize("collator", [THDCollator, BSHDCollator])
@pytest.mark.parametrize("case", list(CASES))
def test_bad_sample_is_named_on_every_cp_rank(case, collator):
    batch, sample, field, text = CASES[case]
    for rank in (None, 0, 1):
        with pytest.raises(SampleError) as err:
            collator(schema=schema_for(TOPK), layout=LAYOUT, cp_rank=rank)(batch)
        e = err.value
        assert (e.sample, e.field) == (sample, field), (case, rank, str(e))
        assert e.expected and e.actual and text in str(e), (case, str(e))
        assert isinstance(e, PrealignError) and isinstance(e, ValueError)


def test_nested_input_errors_name_the_field():
    samples = make_samples([3, 4], topk=TOPK)
    nested = to_nested(samples)
    coll = THDCollator(schema=schema_for(TOPK), layout=LAYOUT)
    other = torch.nested.nested_tensor(
        [-torch.ones(4, TOPK), -torch.ones(3, TOPK)], layout=torch.jagged
    )
    for batch, field in [
        ({**nested, LP: other}, LP),
        ({**nested, IDS: torch.zeros(7, TOPK, dtype=torch.int64)}, IDS),
        ({**nested, "input_ids": torch.arange(7)}, "input_ids"),
        ({k: v for k, v in nested.items() if k != LP}, LP),
    ]:
        with pytest.raises(SampleError) as err:
            coll(batch)
        assert (err.value.sample, err.value.field) == (None, field)
    with_reward = schema_for(TOPK).with_fields(
        FieldSpec(name="reward", role=Role.SEQUENCE, dtypes=("float32",))
    )
    for batch, sample in [
        (nested, None),
        ([*({**s, "reward": torch.tensor(1.0)} for s in samples[:1]), samples[1]], 1),
    ]:
        with pytest.raises(SampleError) as err:
            THDCollator(schema=with_reward, layout=LAYOUT)(batch)
        assert (err.value.sample, err.value.field) == (sample, "reward")
    bad = {
        **nested,
        LP: torch.nested.nested_tensor([s[LP] * -1 + 1 for s in samples], layout=torch.jagged),
    }
    with pytest.raises(SampleError) as err:
        coll(bad)
    assert (err.value.sample, err.value.field) == (0, LP)


@pytest.mark.parametrize(
    "kwargs", [dict(tp=0), dict(cp=9.0), dict(tp=2, cp=2, length_buckets=(12, 18))]
)
def test_bad_layout_is_a_layout_error(kwargs):
    with pytest.raises(LayoutError) as err:
        ParallelLayout(**kwargs)
    assert isinstance(err.value, PrealignError) and str(err.value).split(":")[0] in (
        "tp",
        "cp",
        "length_buckets",
    )


def test_error_message_format():
    e = SampleError(
        sample=3,
        field="labels",
        expected="shape (5,)",
        actual="shape (4,)",
        hint="fix the tokenizer",
    )
    assert (
        str(e) == "sample 3, field 'labels': expected shape (5,), got shape (4,). fix the tokenizer"
    )
    assert (
        str(SampleError(sample=None, field=None, expected="x", actual="y"))
        == "batch: expected x, got y"
    )
