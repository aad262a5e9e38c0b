"""Collators built with a schema or layout of the wrong type (a dict read from a config, None, the
schema's name): an ArgumentError naming the argument at construction, not an AttributeError or a
TypeError at the first batch."""

from __future__ import annotations

import pytest

from prealign.collate import BSHDCollator, THDCollator
from prealign.loaders.errors import PlanError
from prealign.schemas import ParallelLayout, causal_lm_schema
from prealign.schemas.errors import ArgumentError

SCHEMA, LAYOUT = causal_lm_schema(), ParallelLayout(cp=2)


@pytest.mark.parametrize("collator", [THDCollator, BSHDCollator])
@pytest.mark.parametrize(
    "kw, match",
    [
        ({"schema": None}, "schema: expected a BatchSchema .*, got NoneType"),
        ({"schema": "causal_lm"}, "schema: expected a BatchSchema .*, got str"),
        ({"layout": {"cp": 2}}, r"layout: expected a ParallelLayout \(ParallelLayout.from_dict"),
        ({"layout": None}, "layout: expected a ParallelLayout .*, got NoneType"),
    ],
    ids=["schema-None", "schema-str", "layout-dict", "layout-None"],
)
def test_a_schema_or_layout_of_the_wrong_type_is_an_argument_error(collator, kw, match):
    with pytest.raises(ArgumentError, match=match):
        collator(**{"schema": SCHEMA, "layout": LAYOUT, **kw})([{"input_ids": [1, 2]}])


@pytest.mark.parametrize("kw", [{"schema": None}, {"layout": {"cp": 2}}], ids=["schema", "layout"])
def test_a_loader_with_its_own_collator_names_a_schema_or_layout_of_the_wrong_type(kw):
    """With ``collator=`` given no THDCollator checked them: an AttributeError (``fingerprint``)."""
    import datasets

    from prealign.loaders import HFSource, PackedLoader

    source = HFSource(datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]]}))
    collator = THDCollator(schema=SCHEMA, layout=LAYOUT)
    with pytest.raises(PlanError, match=f"{next(iter(kw))}: expected a"):
        PackedLoader(
            source, **{"schema": SCHEMA, "layout": LAYOUT, **kw}, token_budget=64, collator=collator
        )
