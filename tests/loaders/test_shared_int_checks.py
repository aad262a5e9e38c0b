"""The loaders' int checks are ``prealign.schemas.checks.int_at_least``: each keeps its error class
and the message its tests pin, takes a numpy int as an ``int`` (stored as a Python int, so a state
or a key written from it stays JSON) and refuses a bool."""

from __future__ import annotations

import numpy as np
import pytest

from prealign.loaders.errors import PlanError
from prealign.loaders.plan.schedule import check_count


def test_check_count():
    got = check_count("epoch", np.int64(3))
    assert got == 3 and type(got) is int
    for bad, got in [(-1, "got -1$"), (True, r"got True \(bool\)$"), (1.0, r"got 1.0 \(float\)")]:
        with pytest.raises(PlanError, match=rf"^epoch: expected an int >= 0, {got}"):
            check_count("epoch", bad)
