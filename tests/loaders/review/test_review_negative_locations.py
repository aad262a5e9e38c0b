"""A streaming loader over a source whose locations hold negative ints (a ``Location`` is any
int64 tuple: :class:`~prealign.loaders.sources.source.Source` leaves their values to the source,
whose ``check_locations`` says which are its own) resumes from the state it saved itself: the same
topology from its cursors, and another (``stream.skip``: its ``partial`` and ``returns``) once each.
The hostile-state checks bound a location's ints to int64, not to >= 0."""

from __future__ import annotations

import json
from collections import Counter
from itertools import islice

import pytest
import torch

from prealign.loaders import WebDatasetSource
from prealign.loaders.sources.source import Source
from prealign.loaders.streaming import merge_rank_states
from tests.loader_helpers import sample_lengths, write_shards
from tests.loaders.test_stream_cursors import _make


class _Negated(Source):
    """A webdataset whose every location int ``x`` is given as ``-x - 1`` (a source's own keys)."""

    sequential = True

    def __init__(self, paths):
        self.inner = WebDatasetSource(paths)
        self.transform = self.inner.transform

    @property
    def num_shards(self) -> int:
        return self.inner.num_shards

    def scan(self, shard: int):
        for loc, item in self.inner.scan(shard):
            yield (None if loc is None else tuple(-int(x) - 1 for x in loc)), item

    def read(self, location) -> dict:
        return self.inner.read(tuple(-int(x) - 1 for x in location))

    def describe(self) -> dict:
        return {"kind": "negated", **self.inner.describe()}


def _ids(batches) -> list[int]:
    return [i for b in batches for i in b["sample_index"].tolist()]


def _plain(batches) -> list:
    return [
        {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in batches
    ]


@pytest.fixture
def paths(tmp_path):
    return write_shards(str(tmp_path), sample_lengths(120, seed=6), num_shards=5)


def test_the_same_topology_resumes_exactly(paths):
    a = _make(paths, source=_Negated)
    it = iter(a)
    list(islice(it, 3))
    state = json.loads(json.dumps(a.state_dict(cursors=True)))
    assert any(x < 0 for x in state["cursors"]["readers"][0]["at"][2])  # (what it tests)
    rest = _plain(it)
    b = _make(paths, source=_Negated)
    b.load_state_dict(state)
    assert _plain(b) == rest and rest


def _gathered(dp: int, make, stop: int) -> tuple[dict, list[int]]:
    """Every rank of a ``dp``-rank run serves ``stop`` micro-batches: their merged state (JSON
    round-tripped) and the ids they served."""
    states, served = [], []
    for r in range(dp):
        a = make(r)
        served += _ids(islice(iter(a), stop))
        states.append(json.loads(json.dumps(a.state_dict(cursors=True))))
    return json.loads(json.dumps(merge_rank_states(states))), served


@pytest.mark.parametrize("old_dp, new_dp", [(2, 1), (1, 2)])
def test_another_topology_serves_the_rest_once_also_chained(paths, old_dp, new_dp):
    """Saved under ``old_dp``, resumed under ``new_dp`` (the cursors become a ``stream.skip``),
    saved again (that skip in the state: its ``partial`` locations negative) and resumed under
    ``old_dp``: every sample of the epoch served once."""
    full = _ids(_make(paths, source=_Negated))
    state, served = _gathered(
        old_dp, lambda r: _make(paths, source=_Negated, dp_size=old_dp, dp_rank=r), 3
    )

    def resumed(r):
        b = _make(paths, source=_Negated, dp_size=new_dp, dp_rank=r)
        b.load_state_dict(state)
        return b

    again, more = _gathered(new_dp, resumed, 2)
    skip = again["stream"]["skip"]
    assert skip["partial"] and any(x < 0 for p in skip["partial"] for x in p[2]), skip
    rest = []
    for r in range(old_dp):
        c = _make(paths, source=_Negated, dp_size=old_dp, dp_rank=r)
        c.load_state_dict(again)
        rest += _ids(c)
    assert Counter(served + more + rest) == Counter(full)


@pytest.mark.parametrize("where", ["at", "buffer"])
def test_a_webdataset_location_before_byte_0_is_refused_naming_the_key(paths, where):
    """A location's ints are its source's to check: a webdataset's byte range starts at byte 0 or
    later (a crafted ``-512`` was an OSError at the read, or a silent resume from the cursor)."""
    from prealign.loaders.errors import ResumeError

    a = _make(paths)
    it = iter(a)
    list(islice(it, 3))
    state = json.loads(json.dumps(a.state_dict(cursors=True)))
    cursor = state["cursors"]["readers"][0]
    loc = cursor["at"][2] if where == "at" else cursor["buffer"][0][2:]
    assert len(loc) == 4 and loc[1] > 0  # (shard, start, end, checksum)
    if where == "at":
        cursor["at"][2][1] = -512
    else:
        cursor["buffer"][0][3] = -512
    with pytest.raises(ResumeError, match=r"readers\[0\].*not this source's.*before byte 0"):
        b = _make(paths)
        b.load_state_dict(state)
        list(b)


def test_a_streaming_hf_row_before_0_is_refused_naming_the_key():
    """The same for a streaming HF source's ``(shard, row)``: a crafted row ``-3`` was a KeyError
    at the read."""
    import datasets

    from prealign.loaders import HFSource
    from prealign.loaders.errors import ResumeError
    from tests.loader_helpers import hf_rows
    from tests.loaders.test_stream_cursors import _ids_tensor

    ds = datasets.Dataset.from_dict(hf_rows(sample_lengths(160))).to_iterable_dataset(num_shards=4)

    def make():
        return _make(ds, source=lambda d: HFSource(d, transform=_ids_tensor))

    a = make()
    list(islice(iter(a), 2))
    state = json.loads(json.dumps(a.state_dict(cursors=True)))
    cursor = state["cursors"]["readers"][0]
    assert cursor["buffer"] and len(cursor["buffer"][0]) == 4  # [id, size, shard, row]
    cursor["buffer"][0][3] = -3
    with pytest.raises(ResumeError, match=r"readers\[0\].*not this source's"):
        b = make()
        b.load_state_dict(state)
        list(b)
