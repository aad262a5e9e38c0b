"""Leftovers of the hostile validation pass: an unsharded batch's ``cp_size`` is checked like a
sharded one's (it was read only when ``cp_rank`` named a rank, so a str, 0, a negative or another
group's size passed)."""

from __future__ import annotations

import pytest

from prealign.collate import BSHDCollator, THDCollator
from prealign.schemas import ParallelLayout, validate_batch
from tests.conftest import make_samples, schema_for

SCHEMA = schema_for(None)


@pytest.mark.parametrize("collator", [THDCollator, BSHDCollator], ids=lambda c: c.__name__)
@pytest.mark.parametrize("unsharded", [-1, None], ids=repr)
@pytest.mark.parametrize("size", ["2", 0, -2, 4, 2.0, True, None], ids=repr)
def test_an_unsharded_batch_with_a_wrong_cp_size_is_a_violation(collator, unsharded, size):
    layout = ParallelLayout(tp=2, cp=2)
    batch = collator(schema=SCHEMA, layout=layout, cp_rank=None)(make_samples((5, 9, 2)))
    assert validate_batch(batch, SCHEMA, layout, raise_on_error=False) == []
    violations = validate_batch(
        dict(batch, cp_rank=unsharded, cp_size=size), SCHEMA, layout, raise_on_error=False
    )
    assert [(v.path, v.expected, v.actual) for v in violations] == [("cp_size", "2", repr(size))]


def test_an_unsharded_batch_of_one_rank_keeps_passing():
    layout = ParallelLayout()
    batch = THDCollator(schema=SCHEMA, layout=layout)(make_samples((5, 9, 2)))
    assert batch["cp_rank"] == -1 and batch["cp_size"] == 1
    assert validate_batch(batch, SCHEMA, layout, raise_on_error=False) == []
    del batch["cp_size"]  # (a batch without one: the layout's)
    assert validate_batch(batch, SCHEMA, layout, raise_on_error=False) == []
