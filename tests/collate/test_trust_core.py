"""Issue 8, collate/schemas half: hostile inputs get a typed error naming what is wrong, never a
silently wrong batch (items 7-15, 17; 16 lives in test_layout.py, 18 in test_mutation.py)."""

from __future__ import annotations

import ast
import dataclasses

import numpy as np
import pytest
import torch

import prealign.collate.inverse
import prealign.collate.thd
import prealign.schemas.validate
from prealign.collate import (
    BSHDCollator,
    THDCollator,
    lengths_to_cu_seqlens,
    to_packed_seq_params,
    unpack_bshd,
    unpack_thd,
    unshard_bshd,
    unshard_cp,
)
from prealign.schemas import (
    ArgumentError,
    BatchSchema,
    ConfigError,
    FieldSpec,
    LayoutError,
    OffsetOverflowError,
    ParallelLayout,
    PrealignError,
    SampleError,
    SchemaError,
    causal_lm_schema,
    check_startup,
    rl_schema,
    validate_batch,
)
from tests import ROOT
from tests.conftest import SCHEMA, collate_ranks, make_samples, to_nested

LAYOUTS = [
    ParallelLayout(),
    ParallelLayout(tp=2, cp=2),
    ParallelLayout(cp=2, cp_layout="contiguous"),
    ParallelLayout(tp=2, cp=4, fp8="fp8"),
]


def rl_samples(lengths=(5, 3)):
    out = []
    for i, s in enumerate(make_samples(lengths)):
        n = s["input_ids"].numel()
        out.append(
            {
                **s,
                "old_log_probs": -torch.rand(n),
                "advantages": torch.randn(n),
                "response_mask": torch.ones(n, dtype=torch.bool),
                "rewards": torch.tensor(float(i)),
            }
        )
    return out


# ---- 7: the nested (verl) input runs the list input's checks on per-sequence fields
# -------------------
@pytest.mark.parametrize(
    "rewards, match",
    [
        (torch.tensor([1.0, 2.0, 3.0]), "one entry per sample"),  # 3 rewards for 2 samples
        (torch.tensor([1.0, 2.0], dtype=torch.float64), "float64"),
        (torch.tensor([[1.0], [2.0]]), "trailing dims"),
        ("high", "a dense tensor or a list"),
        ([1.0, 2.0], "float64"),  # a list of Python floats: float64, as the list input says too
    ],
)
def test_nested_per_sequence_fields_are_checked_like_the_list_input(rewards, match):
    coll = THDCollator(schema=rl_schema(), layout=ParallelLayout(cp=2))
    samples = rl_samples()
    nested = {
        **to_nested([{k: v for k, v in s.items() if k != "rewards"} for s in samples]),
        "rewards": rewards,
    }
    with pytest.raises(SampleError, match=match) as err:
        coll(nested)
    assert err.value.field == "rewards"
    if (
        isinstance(rewards, torch.Tensor) and rewards.ndim == 1 and rewards.numel() == 2
    ):  # list input agrees
        with pytest.raises(SampleError, match=match):
            coll([{**s, "rewards": r} for s, r in zip(samples, rewards)])
    good = {**nested, "rewards": torch.tensor([0.0, 1.0])}
    assert torch.equal(coll(good)["rewards"], coll(samples)["rewards"])


# ---- 8: a sample's own labels validate (still never across a boundary, pads ignored)
# -------------------
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("collator", [THDCollator, BSHDCollator])
def test_a_samples_own_labels_validate(layout, collator):
    samples = make_samples([7, 3, 12])
    for s in samples:  # labels that are not the tokens: a prompt masked out, then other ids
        n = s["input_ids"].numel()
        s["labels"] = torch.where(torch.arange(n) < 2, -100, 1000 + torch.arange(n))
    seen = caught = 0
    for batch in collate_ranks(collator, SCHEMA, layout, samples) + [
        collator(schema=SCHEMA, layout=layout)(samples)
    ]:
        assert batch["label_source"] == "labels"
        assert validate_batch(batch, SCHEMA, layout) == []
        seen += int((batch["labels"] >= 1000).sum())
        bad = dict(
            batch, label_source="input_ids"
        )  # the same labels claimed as the next tokens: caught
        caught += any(
            v.path.startswith("labels[slot")
            for v in validate_batch(bad, SCHEMA, layout, raise_on_error=False)
        )
    assert seen > 0 and caught > 0


def test_check_startup_accepts_a_batch_of_own_labels():
    samples = make_samples([6, 4])
    for s in samples:
        s["labels"] = torch.where(torch.arange(s["input_ids"].numel()) < 2, -100, 7)
    layout = ParallelLayout(tp=2, cp=2)
    assert (
        len(
            check_startup(
                THDCollator(schema=SCHEMA, layout=layout, cp_rank=1)(samples), SCHEMA, layout
            )
        )
        == 16
    )


def test_own_labels_still_may_not_cross_a_boundary():
    samples = make_samples([5, 3])
    for s in samples:
        s["labels"] = s["input_ids"] + 100
    batch = THDCollator(schema=SCHEMA, layout=ParallelLayout())(samples)
    assert batch["labels"][0, 4] == -100
    crossed = dict(batch, labels=batch["labels"].clone())
    crossed["labels"][0, 4] = 106
    assert [
        v.path for v in validate_batch(crossed, SCHEMA, ParallelLayout(), raise_on_error=False)
    ] == ["labels[slot 4]"]


# ---- 9: token ids are >= 0, < vocab_size when declared, never the ignore index
# --------------------------
@pytest.mark.parametrize(
    "bad_id, schema, match",
    [
        (-1, causal_lm_schema(), r"values in \[0"),
        (-100, causal_lm_schema(), r"values in \[0"),
        (50, causal_lm_schema(vocab_size=50), r"values in \[0, 49\]"),
        (77, causal_lm_schema(ignore_index=77), "other than 77"),
    ],
)
@pytest.mark.parametrize("nested", [False, True])
def test_bad_token_ids_are_refused(bad_id, schema, match, nested):
    samples = make_samples([4, 6])
    samples[1]["input_ids"][2] = bad_id
    coll = THDCollator(schema=schema, layout=ParallelLayout(tp=2, cp=2), cp_rank=0)
    with pytest.raises(SampleError, match=match) as err:
        coll(to_nested(samples) if nested else samples)
    assert (err.value.field, err.value.sample) == (
        "input_ids",
        1,
    ) and "at token 2" in err.value.actual


def test_an_ignore_index_token_in_a_batch_is_a_violation():
    batch = THDCollator(schema=SCHEMA, layout=ParallelLayout())(make_samples([4, 6]))
    batch["input_ids"][0, 1] = -100
    assert "input_ids[slot 1]" in [
        v.path for v in validate_batch(batch, SCHEMA, ParallelLayout(), raise_on_error=False)
    ]


# ---- 10: sample loss weights kept as given, bad ones refused
# ---------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=str)
def test_sample_loss_weights_are_kept_as_given(layout):
    samples = make_samples([5, 4])
    samples[0]["loss_mask"] = torch.tensor([1.0, 0.5, 0.25, 2.0, 1.0])
    samples[1]["loss_mask"] = torch.tensor([1.0, 0.0, 1.0, 1.0])
    batch = THDCollator(schema=SCHEMA, layout=layout)(samples)
    cu = batch["cu_seqlens_padded"].tolist()
    # weights are aligned with the tokens, so shifted like the labels; each sequence's last slot is
    # 0
    assert batch["loss_mask"][0, cu[0] : cu[0] + 5].tolist() == [0.5, 0.25, 2.0, 1.0, 0.0]
    assert batch["loss_mask"][0, cu[1] : cu[1] + 4].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert batch["loss_mask"].dtype == torch.float32 and validate_batch(batch, SCHEMA, layout) == []


@pytest.mark.parametrize("weight", [-1.0, float("nan"), float("inf")])
def test_bad_sample_loss_weights_are_refused(weight):
    samples = make_samples([5, 4])
    samples[1]["loss_mask"] = torch.tensor([1.0, weight, 1.0, 1.0])
    samples[0]["loss_mask"] = torch.ones(5)
    with pytest.raises(SampleError, match="finite values in") as err:
        THDCollator(schema=SCHEMA, layout=ParallelLayout())(samples)
    assert (err.value.sample, err.value.field) == (
        1,
        "loss_mask",
    ) and "at token 1" in err.value.actual


def test_a_negative_loss_weight_in_a_batch_is_a_violation():
    batch = THDCollator(schema=SCHEMA, layout=ParallelLayout())(make_samples([4, 6]))
    batch["loss_mask"][0, 0] = -0.5
    assert "loss_mask[slot 0]" in [
        v.path for v in validate_batch(batch, SCHEMA, ParallelLayout(), raise_on_error=False)
    ]


# ---- 11: the inverse maps check shard counts and offsets
# ---------------------------------------------------
def _shards(layout, lengths=(5, 3)):
    return collate_ranks(THDCollator, SCHEMA, layout, make_samples(lengths))


def test_one_shard_of_cp2_data_is_not_the_whole():
    shards = _shards(ParallelLayout(cp=2))
    with pytest.raises(ArgumentError, match="describes 12 rows, the 1 shard"):
        unshard_cp([shards[0]["input_ids"]], cu_seqlens_padded=shards[0]["cu_seqlens_padded"])
    with pytest.raises(ArgumentError, match="expected cp_size=2 shards"):
        unshard_cp(
            [shards[0]["input_ids"]], cu_seqlens_padded=shards[0]["cu_seqlens_padded"], cp_size=2
        )
    whole = unshard_cp(
        [s["input_ids"] for s in shards],
        cu_seqlens_padded=shards[0]["cu_seqlens_padded"],
        cp_size=2,
    )
    assert whole.shape == (1, 12)


def test_unpack_refuses_a_true_length_beyond_the_padded_one():
    batch = THDCollator(schema=SCHEMA, layout=ParallelLayout(cp=2))(
        make_samples([5, 3])
    )  # padded [8, 4]
    with pytest.raises(
        ArgumentError, match="true length 9 of sequence 0 exceeds its padded length 8"
    ):
        unpack_thd(
            batch["input_ids"],
            cu_seqlens=torch.tensor([0, 9, 12]),
            cu_seqlens_padded=batch["cu_seqlens_padded"],
        )
    bshd = BSHDCollator(schema=SCHEMA, layout=ParallelLayout(cp=2))(make_samples([5, 3]))  # S = 8
    with pytest.raises(ArgumentError, match="true length 9 of row 0 exceeds the row length S = 8"):
        unpack_bshd(bshd["input_ids"], cu_seqlens=torch.tensor([0, 9, 12]))
    with pytest.raises(ArgumentError, match="B\\+1 = 3 offsets"):
        unpack_bshd(bshd["input_ids"], cu_seqlens=torch.tensor([0, 5]))


def test_unshard_bshd_checks_the_shard_count():
    layout = ParallelLayout(cp=2)
    shards = collate_ranks(
        BSHDCollator, SCHEMA, layout, make_samples([5, 3])
    )  # S/cp = 4 columns each
    ids = [s["input_ids"] for s in shards]
    with pytest.raises(ArgumentError, match="expected cp_size=2 shards .* got 3"):
        unshard_bshd([*ids, ids[0]], cp_size=shards[0]["cp_size"])
    odd = [torch.zeros(2, 3)] * 2
    with pytest.raises(ArgumentError, match="even number of columns"):
        unshard_bshd(odd)
    assert (
        unshard_bshd(ids, cp_size=2).tolist()
        == BSHDCollator(schema=SCHEMA, layout=layout)(make_samples([5, 3]))["input_ids"].tolist()
    )


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: unshard_cp([torch.zeros(1, 6)] * 2, cu_seqlens_padded=None),
            "cu_seqlens_padded: expected an integer",
        ),
        (
            lambda: unshard_cp(
                [torch.zeros(1, 6)] * 2, cu_seqlens_padded=torch.tensor([0.0, 12.0])
            ),
            "integer tensor",
        ),
        (
            lambda: unshard_cp(
                [torch.zeros(1, 6)] * 2, cu_seqlens_padded=torch.tensor([0, 12]), dim=5
            ),
            "dim: expected",
        ),
        (
            lambda: unshard_cp(
                [torch.zeros(1, 6)] * 2, cu_seqlens_padded=torch.tensor([0, 12]), cp_layout="diag"
            ),
            "cp_layout: expected one of",
        ),
        (
            lambda: unshard_cp(torch.zeros(1, 6), cu_seqlens_padded=torch.tensor([0, 6])),
            "a list of one tensor per CP rank",
        ),
        (lambda: unshard_bshd([torch.zeros(2, 4)] * 2, cp_layout=3), "cp_layout: expected one of"),
        (
            lambda: unpack_thd(
                torch.zeros(1, 32),
                cu_seqlens=torch.tensor([0, -1, 3]),
                cu_seqlens_padded=torch.tensor([0, 16, 32]),
            ),
            "non-decreasing offsets from 0",
        ),
        (
            lambda: unpack_thd(
                torch.zeros(1, 32),
                cu_seqlens=torch.tensor([0, 3]),
                cu_seqlens_padded=torch.tensor([0, 16, 32]),
            ),
            "expected 2 offsets like cu_seqlens",
        ),
        (
            lambda: unpack_bshd(torch.zeros(4), cu_seqlens=torch.tensor([0, 3])),
            r"padded: expected a tensor \[B, S",
        ),
    ],
)
def test_inverse_arguments_fail_typed(call, match):
    with pytest.raises(ArgumentError, match=match):
        call()


# ---- 12: offsets claiming 2**31 rows: refused before allocating
# ---------------------------------------------
def _no_allocation(monkeypatch, module, name):
    def boom(*a, **k):
        raise AssertionError(
            f"{name} ran: something of size T was built before the size was checked"
        )

    monkeypatch.setattr(module, name, boom)


def test_validate_compares_the_claimed_length_before_allocating(monkeypatch):
    layout = ParallelLayout(cp=2)
    batch = THDCollator(schema=SCHEMA, layout=layout, cp_rank=0)(make_samples([5, 3]))
    huge = 2**31 - 4
    batch["cu_seqlens"] = torch.tensor([0, 5, 8], dtype=torch.int32)
    batch["cu_seqlens_padded"] = torch.tensor([0, 8, huge], dtype=torch.int32)
    batch["max_seqlen"] = torch.tensor([huge - 8], dtype=torch.int32)
    _no_allocation(monkeypatch, prealign.schemas.validate, "expected_slots")
    v = validate_batch(batch, SCHEMA, layout, raise_on_error=False)
    assert [x.path for x in v] == ["cu_seqlens_padded[-1]"] and str(huge // 2) in v[0].expected


def test_unpack_compares_the_claimed_length_before_allocating(monkeypatch):
    _no_allocation(monkeypatch, prealign.collate.inverse, "real_rows")
    packed = torch.zeros(1, 12)
    with pytest.raises(ArgumentError, match="describes 2147483640 rows, packed holds 12"):
        unpack_thd(
            packed,
            cu_seqlens=torch.tensor([0, 5, 8]),
            cu_seqlens_padded=torch.tensor([0, 8, 2**31 - 8]),
        )
    with pytest.raises(ArgumentError, match="describes"):
        unshard_cp([packed, packed], cu_seqlens_padded=torch.tensor([0, 8, 2**31 - 8]))


def test_a_packed_length_past_int32_is_refused(monkeypatch):
    with pytest.raises(OffsetOverflowError, match="2147483648 rows does not fit int32"):
        lengths_to_cu_seqlens(torch.tensor([2**30, 2**30]))
    assert (
        lengths_to_cu_seqlens(torch.tensor([2**30, 2**30]), torch.int64)[-1] == 2**31
    )  # int64 is fine
    # a collator whose layout pads past int32 refuses before building the gather plan
    monkeypatch.setattr(
        prealign.collate.thd, "padded_lengths", lambda layout, lengths: np.array([2**31, 8])
    )
    _no_allocation(monkeypatch, prealign.collate.thd, "gather_plan")
    with pytest.raises(OffsetOverflowError):
        THDCollator(schema=SCHEMA, layout=ParallelLayout())(make_samples([5, 3]))


@pytest.mark.parametrize(
    "kwargs", [dict(length_buckets=(2**31,)), dict(cp=2, min_local_rows=2**30)]
)
def test_layouts_that_would_overflow_int32_are_refused(kwargs):
    with pytest.raises(LayoutError, match="int32"):
        ParallelLayout(**kwargs)


# ---- 14: one error family in collate/ and schemas/
# -----------------------------------------------------------
BUILTIN = {
    "ValueError",
    "TypeError",
    "RuntimeError",
    "KeyError",
    "IndexError",
    "AttributeError",
    "AssertionError",
    "Exception",
    "NotImplementedError",
    "OverflowError",
}
OWN = [
    *sorted((ROOT / "collate").glob("*.py")),
    *[p for p in sorted((ROOT / "schemas").glob("*.py")) if p.name != "distributed.py"],
]


def test_no_builtin_exception_is_raised_in_collate_or_schemas():
    seen, offenders = 0, []
    for path in OWN:
        tree = ast.parse(path.read_text())
        protocol = {
            id(n)
            for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"
            for n in ast.walk(f)
        }  # a module's __getattr__ must raise AttributeError (PEP 562)
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and node.exc is not None and id(node) not in protocol:
                seen += 1
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in BUILTIN:
                    offenders.append(f"{path.name}:{node.lineno} raise {exc.id}")
    assert seen > 30 and offenders == []


# ---- 15: typed errors naming the argument
# ---------------------------------------------------------------------
def test_strided_nested_tensors_are_refused():
    nt = torch.nested.nested_tensor([torch.arange(1, 4), torch.arange(4, 6)])  # strided layout
    with pytest.raises(SampleError, match="layout=torch.jagged") as err:
        THDCollator(schema=SCHEMA, layout=ParallelLayout())({"input_ids": nt})
    assert err.value.field == "input_ids"


def test_nested_offsets_past_the_end_are_refused():
    nt = torch.nested.nested_tensor_from_jagged(torch.arange(1, 6), torch.tensor([0, 3, 10]))
    with pytest.raises(SampleError, match="offsets ending at the 5 value rows") as err:
        THDCollator(schema=SCHEMA, layout=ParallelLayout())({"input_ids": nt})
    assert err.value.field == "input_ids"


@pytest.mark.parametrize(
    "make",
    [
        lambda: [{"input_ids": torch.arange(1, 4, device="meta")}],
        lambda: [
            {"input_ids": torch.arange(1, 4)},
            {"input_ids": torch.arange(1, 4, device="meta")},
        ],
        lambda: [{"input_ids": torch.arange(1, 4), "loss_mask": torch.ones(3, device="meta")}],
    ],
)
def test_meta_and_mixed_devices_are_refused(make):
    with pytest.raises(SampleError, match="a CPU tensor"):
        THDCollator(schema=SCHEMA, layout=ParallelLayout())(make())


@pytest.mark.parametrize(
    "batch, match",
    [
        ({}, "cu_seqlens"),
        ({"cu_seqlens": torch.tensor([0, 3])}, "cu_seqlens_padded"),
        ([1, 2], "a dict"),
    ],
)
def test_packed_seq_params_of_a_non_batch_is_typed(batch, match):
    with pytest.raises(ArgumentError, match=match):
        to_packed_seq_params(batch)


def test_packed_seq_params_bad_convention_is_typed():
    batch = THDCollator(schema=SCHEMA, layout=ParallelLayout())(make_samples([3]))
    with pytest.raises(ArgumentError, match="convention: expected one of"):
        to_packed_seq_params(batch, convention="sideways")


@pytest.mark.parametrize("collator", [THDCollator, BSHDCollator])
def test_cp_rank_any_integer_but_never_a_bool(collator):
    layout = ParallelLayout(tp=2, cp=2)
    samples = make_samples([5, 3])
    numpy_rank = collator(schema=SCHEMA, layout=layout, cp_rank=np.int64(1))
    assert numpy_rank.cp_rank == 1 and type(numpy_rank.cp_rank) is int
    batch = numpy_rank(samples)
    assert torch.equal(
        batch["input_ids"], collator(schema=SCHEMA, layout=layout, cp_rank=1)(samples)["input_ids"]
    )
    assert validate_batch(dict(batch, cp_rank=np.int64(1)), SCHEMA, layout) == []
    for bad in (True, np.bool_(True), 1.0, "1", torch.tensor(True)):
        with pytest.raises(ArgumentError, match="cp_rank") as err:
            collator(schema=SCHEMA, layout=layout, cp_rank=bad)
        assert isinstance(err.value, ConfigError)
    assert [
        v.path
        for v in validate_batch(dict(batch, cp_rank=True), SCHEMA, layout, raise_on_error=False)
    ] == ["cp_rank"]


# ---- 17: PackedSeqParams of a newer megatron-core
# ------------------------------------------------------------
@dataclasses.dataclass
class NewerPackedSeqParams:  # the fields a newer megatron-core has (total_tokens, pad_between_seqs)
    qkv_format: str = None
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_kv: torch.Tensor = None
    cu_seqlens_q_padded: torch.Tensor = None
    cu_seqlens_kv_padded: torch.Tensor = None
    max_seqlen_q: int = None
    max_seqlen_kv: int = None
    cp_partition_mode: str = None
    total_tokens: int = None
    pad_between_seqs: bool = None


def test_packed_seq_params_fields_follow_the_installed_megatron(monkeypatch):
    import megatron.core.packed_seq_params as psp

    batch = THDCollator(schema=SCHEMA, layout=ParallelLayout(cp=2), cp_rank=0)(
        make_samples([5, 3])
    )  # P = [8, 4]
    installed = {f.name for f in dataclasses.fields(psp.PackedSeqParams)}
    params = to_packed_seq_params(batch)
    for name in (
        "total_tokens",
        "pad_between_seqs",
    ):  # set exactly when the installed class has the field
        assert (getattr(params, name, None) is not None) == (name in installed)
    monkeypatch.setattr(psp, "PackedSeqParams", NewerPackedSeqParams)
    padded = to_packed_seq_params(batch, convention="padded")
    unpadded = to_packed_seq_params(batch, convention="unpadded")
    assert (
        isinstance(padded, NewerPackedSeqParams)
        and padded.total_tokens == unpadded.total_tokens == 12
    )
    assert padded.pad_between_seqs is False and unpadded.pad_between_seqs is True
    assert padded.cp_partition_mode == "zigzag"
    exact = THDCollator(schema=SCHEMA, layout=ParallelLayout())(
        make_samples([4, 4])
    )  # nothing padded
    assert to_packed_seq_params(exact, convention="unpadded").pad_between_seqs is False


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: FieldSpec(name="x", role="tokn"), SchemaError, "role: expected one of"),
        (lambda: FieldSpec(name="x", source="nope"), SchemaError, "source: expected one of"),
        (lambda: FieldSpec(name="x", dtypes="int64"), SchemaError, "got the str"),
        (lambda: FieldSpec(name=3), SchemaError, "field name"),
        (lambda: BatchSchema.from_json("{not json"), SchemaError, "not JSON"),
        (lambda: BatchSchema.from_json('{"name": "a"}'), SchemaError, "missing key 'ignore_index'"),
        (lambda: BatchSchema.from_json("[1]"), SchemaError, "expected"),
        (lambda: BatchSchema(name="a", fields=[1, 2]), SchemaError, "FieldSpec objects"),
        (
            lambda: ParallelLayout.from_dict({"tp": 2, "zz": 1}),
            LayoutError,
            r"unknown key\(s\) \['zz'\]",
        ),
        (lambda: ParallelLayout.from_dict([1]), LayoutError, "expected a dict"),
        (lambda: ParallelLayout(length_buckets=5), LayoutError, "length_buckets"),
    ],
)
def test_schema_and_layout_declarations_fail_typed(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize("batch", [None, [1], "batch"])
def test_validate_reports_a_non_batch(batch):
    assert [
        v.path for v in validate_batch(batch, SCHEMA, ParallelLayout(), raise_on_error=False)
    ] == ["batch"]


def test_every_error_here_is_a_prealign_error():
    assert issubclass(ArgumentError, ConfigError) and issubclass(OffsetOverflowError, ConfigError)
    assert issubclass(ConfigError, PrealignError) and not issubclass(ArgumentError, SampleError)
