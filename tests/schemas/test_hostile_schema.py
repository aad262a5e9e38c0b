"""Hostile schema and layout declarations (JSON text, dicts): each is a typed error naming what was
expected and what came, never a RecursionError, a raw ValueError/TypeError or a silent accept."""

from __future__ import annotations

import json

import pytest

from prealign.schemas import BatchSchema, FieldSpec, causal_lm_schema
from prealign.schemas.errors import SchemaError


def _schema_json(**top) -> str:
    d = json.loads(causal_lm_schema().to_json())
    d.update(top)
    return json.dumps(d)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000,  # nesting deeper than the interpreter's recursion limit
        '{"a":' * 100_000,
        "1" * 5_000,  # an int past Python's int-from-str digit limit
        b"\xff\xfe{",  # bytes that are not text in any JSON encoding
    ],
    ids=["deep-array", "deep-object", "huge-int", "invalid-utf"],
)
def test_from_json_of_hostile_text_is_a_schema_error(text):
    with pytest.raises(SchemaError, match="schema JSON: not JSON"):
        BatchSchema.from_json(text)


@pytest.mark.parametrize("fields", ["abc", {"a": 1}, ["ab"], [None], [5]])
def test_from_json_with_fields_not_dicts_is_a_schema_error(fields):
    with pytest.raises(SchemaError, match="expected"):
        BatchSchema.from_json(_schema_json(fields=fields))


@pytest.mark.parametrize("d", [None, [1, 2], "input_ids", {1: 2}])
def test_field_spec_from_dict_of_a_non_dict_is_a_schema_error(d):
    with pytest.raises(SchemaError, match="field"):
        FieldSpec.from_dict(d)


_INT64_OVER = 2**63


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("pad_value", "x", "pad_value: expected a bool, int or float"),
        ("pad_value", [0], "pad_value: expected a bool, int or float"),
        ("pad_value", _INT64_OVER, "pad_value: expected .* int64"),
        ("min_value", "x", "min_value: expected None, an int or a float"),
        ("max_value", float("nan"), "max_value: expected None, an int or a float"),
        ("required", "false", "required: expected a bool"),
        ("cp_sharded", "no", "cp_sharded: expected a bool"),
        ("finite", 1, "finite: expected a bool"),
        ("sample_keys", "input_ids", "sample_keys must be a tuple of sample keys"),
        ("sample_keys", [1], "sample_keys: expected non-empty str keys"),
        ("dense_shape", "KL", "dense_shape must be a tuple of dims"),
        ("leading_shape", "3", "leading_shape must be a tuple of dims"),
    ],
)
def test_field_values_of_the_wrong_kind_are_schema_errors(key, value, match):
    """Each was accepted (a str flag read as True, a str iterated into one key per character) or
    failed later inside torch (``full()`` of a str, an int past int64) at the first batch."""
    with pytest.raises(SchemaError, match=f"field 'input_ids': {match}"):
        FieldSpec(name="input_ids", **{key: value})


def test_an_empty_value_interval_is_a_schema_error():
    """min_value > max_value rejected every sample as bad data (a skip policy dropped them all)."""
    with pytest.raises(SchemaError, match=r"min_value 5 > max_value 1"):
        FieldSpec(name="input_ids", min_value=5, max_value=1)


@pytest.mark.parametrize("value", ["x", 1.5, True, None, _INT64_OVER, -_INT64_OVER - 1], ids=repr)
def test_ignore_index_must_be_an_int64(value):
    with pytest.raises(SchemaError, match="ignore_index: expected an int in int64"):
        BatchSchema.from_json(_schema_json(ignore_index=value))


def test_schema_name_must_be_a_str():
    with pytest.raises(SchemaError, match="schema name: expected a str, got 5"):
        BatchSchema.from_json(_schema_json(name=5))


def test_valid_values_keep_working():
    spec = FieldSpec(
        name="input_ids",
        pad_value=True,
        min_value=0,
        max_value=2.5,
        sample_keys=["input_ids", "ids"],
        dense_shape=["K"],
        required=False,
        finite=True,
    )
    assert spec.sample_keys == ("input_ids", "ids") and spec.dense_shape == ("K",)
    schema = BatchSchema(name="s", fields=(spec,), ignore_index=-(2**63))
    assert BatchSchema.from_json(schema.to_json()) == schema


@pytest.mark.parametrize("vocab_size", [0, -5, "x", 1.5, True], ids=repr)
def test_vocab_size_must_be_a_positive_int(vocab_size):
    """A str was a TypeError, 1.5 bounded ids to 0.5 and True to 0, 0 named a min/max clash."""
    with pytest.raises(SchemaError, match="vocab_size: expected a positive int or None, got"):
        causal_lm_schema(vocab_size=vocab_size, topk=4)
    assert causal_lm_schema(vocab_size=1)["input_ids"].max_value == 0


@pytest.mark.parametrize(
    "schema, layout, match",
    [
        (None, "layout", "schema: expected a BatchSchema .*, got NoneType"),
        ("causal_lm", "layout", "schema: expected a BatchSchema .*, got str"),
        ("schema", {"cp": 1}, r"layout: expected a ParallelLayout \(ParallelLayout.from_dict"),
    ],
    ids=["schema-None", "schema-str", "layout-dict"],
)
def test_validate_and_check_startup_name_a_schema_or_layout_of_the_wrong_type(
    schema, layout, match
):
    """Each was an AttributeError or a TypeError from inside the checker."""
    from prealign.collate import THDCollator
    from prealign.schemas import ParallelLayout, check_startup, validate_batch
    from prealign.schemas.errors import ArgumentError

    good_schema, good_layout = causal_lm_schema(), ParallelLayout()
    batch = THDCollator(schema=good_schema, layout=good_layout)([{"input_ids": [1, 2]}])
    schema = good_schema if schema == "schema" else schema
    layout = good_layout if layout == "layout" else layout
    for check in (validate_batch, check_startup):
        with pytest.raises(ArgumentError, match=match):
            check(batch, schema, layout)
