"""Hostile mixture weights, repeats and lengths: a PlanError naming the component and the draws it
asks for, never a planner that loops for hours over 10**12 passes (a bomb from one number) or an
epoch of zero draws when the weights overflow."""

from __future__ import annotations

import numpy as np
import pytest

from prealign.loaders.errors import PlanError
from prealign.loaders.plan import mixing
from prealign.loaders.plan.mixing import MixSpec, mixed_order

LENGTHS = [np.full(100, 10, np.int64), np.full(100, 10, np.int64)]


@pytest.mark.parametrize(
    "kw",
    [
        {"weights": (1, 1e-300), "length": "all_exhausted"},
        {"weights": (1, 1e-12), "length": "all_exhausted", "by": "samples"},
        {"weights": (1, None), "repeats": (None, 1e12)},
        {"weights": (1, 1), "length": 10**15},
        {"weights": (1, 1), "length": 10**15, "by": "samples"},
    ],
    ids=["tiny-weight", "tiny-weight-samples", "huge-repeat", "huge-length", "huge-length-samples"],
)
def test_an_epoch_past_the_draw_limit_is_a_plan_error_before_any_work(kw, monkeypatch):
    """Counts the passes built: none, where each of these built 10**10 and more (a hang)."""
    built = []
    real = mixing.component_stream
    monkeypatch.setattr(
        mixing, "component_stream", lambda n, count, **k: built.append(count) or real(n, count, **k)
    )
    with pytest.raises(
        PlanError, match=r"mixture component '[ab]': .* draws .* at most 2,147,483,648 draws"
    ):
        mixed_order(MixSpec(names=("a", "b"), **kw), LENGTHS, epoch=0, seed=0, shuffle=True)
    assert built == []


def test_an_epoch_below_the_limit_is_built():
    mo = mixed_order(
        MixSpec(names=("a", "b"), weights=(1, 1e-3), length="all_exhausted"),
        LENGTHS,
        epoch=0,
        seed=0,
        shuffle=True,
    )
    assert mo.ids.size == 100 * 1001  # b once whole, a 1000 times as much


def test_weights_whose_sum_overflows_are_a_plan_error():
    """Two weights of 1e308 summed to inf: every share NaN, an epoch of zero draws."""
    with pytest.raises(PlanError, match="weights: expected a finite sum"):
        MixSpec(names=("a", "b"), weights=(1e308, 1e308))
