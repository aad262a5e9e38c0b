"""Schemas are data: JSON round trip, a fingerprint stable across processes, validated
declarations."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.schemas import (
    BatchSchema,
    FieldSpec,
    ParallelLayout,
    Role,
    SchemaError,
    Source,
    causal_lm_schema,
    rl_schema,
    topk_fields,
)
from prealign.schemas.distributed import layout_fingerprint
from tests import ROOT as REPO

ROOT = str(REPO)  # cwd and PYTHONPATH of the child processes
MROPE = FieldSpec(name="mrope_position_ids", leading_shape=(3,), cp_sharded=False, pad_value=0)
CUSTOM = causal_lm_schema(pad_token_id=7, ignore_index=-1).with_fields(
    MROPE,
    FieldSpec(name="router", dtypes=("int32", "int64"), dense_shape=("layers", 8), required=False),
    FieldSpec(name="reward", role=Role.SEQUENCE, dtypes=("float32",), dense_shape=(2,)),
    name="custom",
)
SCHEMAS = {
    "causal_lm": causal_lm_schema(),
    "topk": causal_lm_schema(topk=64, vocab_size=32000),
    "topk_any_k": causal_lm_schema(topk="K"),
    "rl": rl_schema(),
    "custom": CUSTOM,
}
LAYOUT = ParallelLayout(
    tp=2,
    cp=4,
    fp8="mxfp8",
    pad_policy="per_sequence",
    length_buckets=(4096, 8192),
    min_local_rows=16,
    cp_layout="contiguous",
)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_round_trip(name):
    schema = SCHEMAS[name]
    text = schema.to_json()
    again = BatchSchema.from_json(text)
    assert (
        again == schema and again.to_json() == text and again.fingerprint() == schema.fingerprint()
    )
    assert [f.name for f in again.fields] == [
        f.name for f in schema.fields
    ]  # order is part of the schema
    assert json.loads(text)["name"] == schema.name


def test_fingerprints_tell_schemas_apart():
    prints = {n: s.fingerprint() for n, s in SCHEMAS.items()}
    assert len(set(prints.values())) == len(prints)
    assert all(len(p) == 16 and int(p, 16) >= 0 for p in prints.values())
    assert causal_lm_schema(pad_token_id=1).fingerprint() != causal_lm_schema().fingerprint()
    assert causal_lm_schema().fingerprint() == causal_lm_schema().fingerprint()


@pytest.mark.slow
def test_fingerprints_are_the_same_in_another_process(subprocess_env):
    code = (
        "import json; import tests.schemas.test_schema as t; "
        "from prealign.schemas.distributed import layout_fingerprint; "
        "print(json.dumps({n: s.fingerprint() for n, s in t.SCHEMAS.items()} | "
        "{'layout': layout_fingerprint(t.CUSTOM, t.LAYOUT)}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**subprocess_env, "PYTHONHASHSEED": "12345"},
        check=True,
    )
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    assert theirs == {
        **{n: s.fingerprint() for n, s in SCHEMAS.items()},
        "layout": layout_fingerprint(CUSTOM, LAYOUT),
    }


def test_layout_fingerprint_covers_the_layout():
    base = layout_fingerprint(CUSTOM, LAYOUT)
    assert layout_fingerprint(CUSTOM, ParallelLayout.from_dict(LAYOUT.to_dict())) == base
    assert layout_fingerprint(CUSTOM, ParallelLayout(tp=2, cp=4)) != base
    assert layout_fingerprint(SCHEMAS["rl"], LAYOUT) != base


@given(
    name=st.text(min_size=1, max_size=8),
    pad=st.one_of(st.integers(-1000, 1000), st.booleans(), st.floats(-1e6, 0, allow_nan=False)),
    dense=st.lists(st.one_of(st.integers(1, 64), st.sampled_from(["K", "layers"])), max_size=2),
    dtypes=st.lists(
        st.sampled_from(["int64", "int32", "float32", "bfloat16", "bool"]),
        min_size=1,
        max_size=3,
        unique=True,
    ),
)
def test_any_field_round_trips(name, pad, dense, dtypes):
    def holds(dtype):  # (in range of every dtype; a float dtype may write a tiny one as 0)
        if dtype == "bool":
            return pad in (0, 1)
        if "float" in dtype:
            return pad == 0 or torch.tensor(float(pad), dtype=getattr(torch, dtype)).item() != 0
        return pad == int(pad)

    if not all(map(holds, dtypes)):  # padding would write another value: refused
        with pytest.raises(SchemaError, match="pad_value: expected a value each of its dtypes"):
            FieldSpec(name="f", dtypes=tuple(dtypes), pad_value=pad)
        return
    spec = FieldSpec(
        name=f"f_{name}",
        dtypes=tuple(dtypes),
        dense_shape=tuple(dense),
        pad_value=pad,
        min_value=-1.0,
        finite=True,
    )
    schema = causal_lm_schema().with_fields(spec)
    assert BatchSchema.from_json(schema.to_json()) == schema
    assert FieldSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: BatchSchema(name="x", fields=(FieldSpec(name="labels"),)), "needs an 'input_ids'"),
        (
            lambda: causal_lm_schema().with_fields(FieldSpec(name="labels")),
            r"duplicate field\(s\) \['labels'\]",
        ),
        (lambda: FieldSpec(name="x", dtypes=("int128",)), "unknown dtype 'int128'"),
        (lambda: FieldSpec(name="x", dtypes=()), "dtypes must not be empty"),
        (
            lambda: FieldSpec(name="x", dense_shape=(0,)),
            "a dim must be a positive int or a name, got 0",
        ),
        (lambda: FieldSpec(name="x", dense_shape=("",)), "a dim must be a positive int or a name"),
        (
            lambda: FieldSpec(name="x", dense_shape=(True,)),
            "a dim must be a positive int or a name, got True",
        ),
        (
            lambda: FieldSpec(name="x", dense_shape=(2,), leading_shape=(3,)),
            "leading_shape or dense_shape, not both",
        ),
        (
            lambda: FieldSpec(name="x", role=Role.SEQUENCE, source=Source.POSITIONS),
            "needs role token",
        ),
    ],
)
def test_bad_declarations_raise_schema_error(build, match):
    with pytest.raises(SchemaError, match=match):
        build()


def test_builtin_schemas_declare_megatron_dtypes():
    s = causal_lm_schema(topk=64, vocab_size=100)
    assert [(f.name, f.dtypes[0]) for f in s.fields] == [
        ("input_ids", "int64"),
        ("labels", "int64"),
        ("loss_mask", "float32"),
        ("position_ids", "int64"),
        ("padding_mask", "bool"),
        ("teacher_topk_log_probs", "float32"),
        ("teacher_topk_ids", "int64"),
    ]
    assert s["teacher_topk_ids"].max_value == 99 and s["teacher_topk_log_probs"].max_value == 0.0
    assert s["labels"].pad_value == -100 and s["padding_mask"].pad_value is True
    assert [f.name for f in topk_fields()] == ["teacher_topk_log_probs", "teacher_topk_ids"]
    assert (
        rl_schema()["rewards"].role is Role.SEQUENCE and not rl_schema()["ref_log_probs"].required
    )
