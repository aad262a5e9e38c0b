"""The ResumeError of a state nested too deep says how deep a saved state nests: what it says holds
for the states the loaders save, counted as the bound is (the state itself at level 0, so that a
list or object at level ``MAX_DEPTH`` is taken, one more refused): a streaming mixture's cursors
reach level 10."""

from __future__ import annotations

import copy
import re

import pytest

from prealign.loaders.errors import ResumeError
from prealign.loaders.state import MAX_DEPTH, LoaderState
from tests.loaders.test_state_hostile import SCENARIOS, scenario


def _levels(value) -> int:
    """Levels of objects and lists in ``value``, its own included (0: a number or a string)."""
    if isinstance(value, dict):
        return 1 + max(map(_levels, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_levels, value), default=0)
    return 0


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("depth"))


def test_what_the_message_says_of_saved_states_holds(root):
    deepest = max(_levels(scenario(root, name)[0]) for name in SCENARIOS) - 1  # (its level)
    assert deepest < MAX_DEPTH
    state = copy.deepcopy(scenario(root, "packed")[0])
    node = state["data"]
    for _ in range(MAX_DEPTH + 2):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(ResumeError, match="nested more than 32 levels") as err:
        LoaderState.from_dict(state)
    said = re.search(r"a saved state nests (under|up to) (\d+) levels", str(err.value))
    assert said, str(err.value)
    bound = int(said.group(2))
    assert deepest < bound if said.group(1) == "under" else deepest <= bound, (deepest, said[0])
