"""The shared argument checks (``prealign.schemas.checks``): one int check and one "a dict of this
dataclass's fields" check for every layer, each raising the error class its caller passes with the
message that layer's tests pin."""

from __future__ import annotations

import numpy as np
import pytest

from prealign.collate.mrope import mrope_position_ids
from prealign.loaders.errors import PlanError
from prealign.loaders.plan.planner import PlannerConfig
from prealign.loaders.sources.source import check_positive_int
from prealign.schemas import FieldSpec, ParallelLayout
from prealign.schemas.checks import fields_of, int_at_least
from prealign.schemas.errors import ArgumentError, ConfigError, LayoutError, SchemaError


@pytest.mark.parametrize(
    "value, got",
    [
        (0, "got 0"),
        (True, "got True (bool)"),
        (2.0, "got 2.0 (float)"),
        ("3", "got '3' (str)"),
        (None, "got None (NoneType)"),
        (np.bool_(True), "(bool"),
    ],
    ids=repr,
)
def test_int_at_least_names_what_came(value, got):
    with pytest.raises(KeyError, match="n: expected an int >= 1, got") as info:
        int_at_least("n", value, 1, KeyError)
    assert got in str(info.value)


def test_int_at_least_takes_numpy_ints_as_ints():
    got = int_at_least("n", np.int32(4), 2, ValueError)
    assert got == 4 and type(got) is int
    lay = ParallelLayout(tp=np.int64(2), cp=np.int32(2), length_buckets=[np.int64(64)])
    assert (type(lay.tp), type(lay.cp), lay.length_buckets) == (int, int, (64,))
    assert ParallelLayout.from_dict(lay.to_dict()) == lay


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: ParallelLayout(tp=0), LayoutError, r"^tp: expected a positive int, got 0$"),
        (
            lambda: ParallelLayout(min_local_rows=-1),
            LayoutError,
            r"^min_local_rows: expected an int >= 0, got -1$",
        ),
        (
            lambda: PlannerConfig(buffer_size=1),
            PlanError,
            r"^buffer_size: expected an int >= 2, got 1$",
        ),
        (lambda: check_positive_int("rows", 0), ConfigError, r"^rows: expected an int >= 1, got 0"),
        (
            lambda: mrope_position_ids([0], [[1, 2, 2]], [0, 1], spatial_merge_size=0),
            ArgumentError,
            r"^spatial_merge_size: expected a positive int, got 0$",
        ),
    ],
)
def test_each_layer_keeps_its_error_class_and_message(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize(
    "call, error, where",
    [
        (lambda d: ParallelLayout.from_dict(d), LayoutError, "layout"),
        (lambda d: PlannerConfig.from_dict(d), PlanError, "planner"),
        (lambda d: FieldSpec.from_dict({"name": "x", **d}), SchemaError, "field 'x'"),
    ],
)
def test_an_unknown_key_is_named_with_every_field_expected(call, error, where):
    match = rf"^{where}: unknown key\(s\) \['bogus'\]; expected some of"
    with pytest.raises(error, match=match) as info:
        call({"bogus": 1})
    if error is LayoutError:  # (it listed to_dict()'s keys: no token_multiple, no max_seqs)
        assert "'max_seqs'" in str(info.value) and "'token_multiple'" in str(info.value)
    with pytest.raises(error, match="expected a dict of .* fields, got list"):
        call([1]) if error is not SchemaError else FieldSpec.from_dict([1])


def test_fields_of_reads_any_mapping():
    class Config(dict):  # (an OmegaConf DictConfig is a Mapping, not a dict)
        pass

    assert fields_of("layout", Config(tp=2), ParallelLayout, LayoutError) == {"tp": 2}
