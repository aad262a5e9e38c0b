"""plan_microbatches / ChunkedPlan given a seed that is no seed or an option PlannerConfig does not
have: a PlanError naming it, not numpy's ValueError or a TypeError."""

from __future__ import annotations

import pytest

from prealign.loaders import plan_microbatches
from prealign.loaders.errors import PlanError
from prealign.schemas import ParallelLayout


@pytest.mark.parametrize("seed", [-1, 1.5, "0", True], ids=repr)
def test_a_seed_that_is_no_seed_is_a_plan_error(seed):
    with pytest.raises(PlanError, match="seed: expected an int >= 0"):
        plan_microbatches([3, 4, 5], layout=ParallelLayout(), token_budget=64, seed=seed)


def test_an_unknown_option_is_a_plan_error_naming_it():
    with pytest.raises(PlanError, match=r"options: unknown key\(s\) \['bogus'\]; expected some of"):
        plan_microbatches([3, 4, 5], layout=ParallelLayout(), token_budget=64, bogus=1)


def test_seeds_and_options_in_use_keep_working():
    plan = plan_microbatches(
        [3, 4, 5], layout=ParallelLayout(), token_budget=64, seed=2**70, buffer_size=4
    )
    assert sorted(i for mbs in plan.microbatches for mb in mbs for i in mb) == [0, 1, 2]
