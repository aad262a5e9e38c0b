"""PlannerConfig.from_dict (a loader config read from a file) given a non-dict or unknown keys, and
a cost dict with unknown keys: a PlanError naming the key and the keys expected, not a TypeError."""

from __future__ import annotations

import pytest

from prealign.loaders import PlannerConfig
from prealign.loaders.errors import PlanError


@pytest.mark.parametrize(
    "data, match",
    [
        (None, "planner: expected a dict of PlannerConfig fields, got NoneType"),
        ([("strategy", "bfd")], "planner: expected a dict of PlannerConfig fields, got list"),
        ({"bogus": 1}, r"planner: unknown key\(s\) \['bogus'\]; expected some of .*'buffer_size'"),
        ({1: 2}, r"planner: unknown key\(s\) \['1'\]"),
        ({"cost": {"bogus": 1}}, r"cost: unknown key\(s\) \['bogus'\]; expected some of"),
    ],
    ids=["None", "list", "bogus", "int-key", "cost-bogus"],
)
def test_a_bad_planner_dict_is_a_plan_error(data, match):
    with pytest.raises(PlanError, match=match):
        PlannerConfig.from_dict(data)


def test_a_round_trip_keeps_working():
    config = PlannerConfig(strategy="first_fit", buffer_size=64, cost={"linear": 1, "quadratic": 2})
    assert PlannerConfig.from_dict(config.to_dict()) == config
