"""Review: a hostile version-5 stream state (``stream.skip`` values past int64, a location that is
not a byte range of the shard) is a :class:`ResumeError` naming the key, never an
``OverflowError`` out of numpy or a seek."""

from __future__ import annotations

import json
from itertools import islice

import pytest

from prealign.loaders.errors import ResumeError
from prealign.loaders.streaming import merge_rank_states
from tests.loader_helpers import sample_lengths, write_shards
from tests.loaders.test_stream_cursors import _make


def _state(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(120, seed=2), num_shards=4)
    states = []
    for r in range(2):
        a = _make(paths, dp_size=2, dp_rank=r)
        list(islice(iter(a), 3))
        states.append(a.state_dict(cursors=True))
    return paths, json.loads(json.dumps(merge_rank_states(states)))


def _skip_refused(tmp_path, skip: dict) -> None:
    """A state whose ``stream.skip`` is ``skip`` is a ResumeError naming it when loaded and read."""
    paths, state = _state(tmp_path)
    state["stream"]["skip"] = skip
    with pytest.raises(ResumeError, match="stream.skip"):
        b = _make(paths, dp_size=1)
        b.load_state_dict(state)
        list(b)


@pytest.mark.parametrize(
    "skip",
    [
        {"done": [], "partial": [], "extra": [2**64], "returns": []},
        {"done": [], "partial": [[0, 2**70, [0, 0, 512, 0]]], "extra": [], "returns": []},
        {"done": [], "partial": [[0, 1, [0, 0, 2**70, 0]]], "extra": [], "returns": []},
        {"done": [], "partial": [], "extra": [], "returns": [[2**70, 8, 0, 0, 512, 0]]},
    ],
)
def test_a_stream_skip_past_int64_is_a_resume_error(tmp_path, skip):
    _skip_refused(tmp_path, skip)


def test_a_reader_cursor_past_int64_is_a_resume_error(tmp_path):
    paths, state = _state(tmp_path)
    cursor = state["stream"]["ranks"][0]["readers"][0]
    cursor["at"][2] = [int(x) for x in cursor["at"][2][:1]] + [0, 2**70, 0]
    with pytest.raises(ResumeError, match="stream"):
        b = _make(paths, dp_size=1)
        b.load_state_dict(state)
        list(b)


@pytest.mark.parametrize(
    "skip",
    [
        {"done": [], "partial": [[0, 1, [0, 512]]], "extra": [], "returns": []},
        {"done": [], "partial": [[0, 1, [9, 0, 512, 0]]], "extra": [], "returns": []},
        {"done": [], "partial": [], "extra": [], "returns": [[5, 8, 0, 512]]},
    ],
    ids=["partial-width", "partial-shard", "returns-width"],
)
def test_a_stream_skip_location_not_of_this_source_is_a_resume_error(tmp_path, skip):
    _skip_refused(tmp_path, skip)
