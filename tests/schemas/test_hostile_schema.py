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
