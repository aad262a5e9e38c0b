"""Leftovers of the hostile planner pass: a ``uint64`` length past int64 is named as it came (the
cast to int64 made 2**63 + 5 read ``-9223372036854775803`` in the error, and 2**64 - 1 ``-1``)."""

from __future__ import annotations

import numpy as np
import pytest

from prealign.loaders.errors import OversizeSampleError
from prealign.loaders.plan.planner import plan_microbatches
from prealign.schemas import ParallelLayout


@pytest.mark.parametrize("huge", [2**63, 2**63 + 5, 2**64 - 1], ids=repr)
@pytest.mark.parametrize("oversize", ["error", "truncate", "skip"])
def test_a_uint64_length_past_int64_is_named_as_it_came(huge, oversize):
    lengths = np.array([5, huge, 3, 2**64 - 1], dtype=np.uint64)  # the first one named
    with pytest.raises(OversizeSampleError) as info:
        plan_microbatches(lengths, layout=ParallelLayout(), token_budget=16, oversize=oversize)
    message = str(info.value)
    assert message.startswith("sample 1, field 'input_ids': expected length <= ")
    assert message.endswith(f"got {huge}") and "-" not in message.split("got")[-1]


def test_uint64_lengths_in_int64_keep_planning():
    lengths = np.array([5, 3, 7, 2**62], dtype=np.uint64)
    with pytest.raises(OversizeSampleError, match=f"got {2**62}"):  # plain oversize, as int64
        plan_microbatches(lengths, layout=ParallelLayout(), token_budget=16)
    plan = plan_microbatches(lengths[:3], layout=ParallelLayout(), token_budget=16)
    assert plan.stats.real_tokens == 15
