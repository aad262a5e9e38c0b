"""Review of the pad value rule (``FieldSpec``): a float pad value that is not zero but that a
declared float dtype writes as zero (it underflows: ``1e-8`` on float16) is refused like one that
overflows to inf; padding would write another value. Differential against ``torch.full``."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.schemas import SchemaError
from prealign.schemas.schema import FieldSpec

_FLOATS = ["float32", "bfloat16", "float16"]


def _accepted(dtype: str, pad) -> bool:
    try:
        FieldSpec(name="f", dtypes=(dtype,), pad_value=pad)
        return True
    except SchemaError:
        return False


@pytest.mark.parametrize(
    "dtype, pad", [("float16", 1e-8), ("float16", -2e-8), ("bfloat16", 1e-41), ("float32", 1e-46)]
)
def test_a_pad_value_a_float_dtype_writes_as_zero_is_refused(dtype, pad):
    assert torch.full((1,), pad, dtype=getattr(torch, dtype)).item() == 0
    with pytest.raises(SchemaError, match=f"field 'f': pad_value: .*{dtype}.*got {pad!r}"):
        FieldSpec(name="f", dtypes=(dtype,), pad_value=pad)


@pytest.mark.parametrize("dtype", _FLOATS)
def test_the_smallest_value_a_float_dtype_writes_is_accepted(dtype):
    info = torch.finfo(getattr(torch, dtype))
    tiny = info.smallest_normal * info.eps  # (the smallest subnormal)
    for pad in (tiny, -tiny, 0.0, -0.0, tiny * 0.75):
        assert torch.full((1,), pad, dtype=getattr(torch, dtype)).item() != 0 or pad == 0
        assert _accepted(dtype, pad), pad


@given(dtype=st.sampled_from(_FLOATS), pad=st.floats(allow_nan=False, allow_infinity=False))
def test_a_finite_float_pad_is_accepted_only_when_written_nonzero_and_finite(dtype, pad):
    torch_dtype = getattr(torch, dtype)
    try:
        written = torch.full((1,), pad, dtype=torch_dtype).item()
    except RuntimeError:  # (past the dtype's max: torch refuses it)
        written = math.inf
    assert _accepted(dtype, pad) == (
        abs(pad) <= torch.finfo(torch_dtype).max and (written != 0) == (pad != 0)
    ), (pad, written)
    if _accepted(dtype, pad):
        assert math.isfinite(written)
