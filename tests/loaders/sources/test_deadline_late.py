"""A timed call that outlives its deadline and then returns a resource (review of issue #28): nobody
takes what it returns, so ``call_with_timeout(..., late=...)`` hands it to ``late`` in the abandoned
thread; a shard opened after its read deadline is closed there, not left open for good."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from prealign.loaders import WebDatasetSource
from prealign.loaders.errors import ShardTimeoutError
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.sources.deadline import Stalled, call_with_timeout
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import sample_lengths, write_shards
from tests.loaders.sources.test_read_ahead_deadline_race import _open_shards


class _Resource:
    def __init__(self):
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


def test_what_a_call_returns_after_its_deadline_goes_to_late():
    made = _Resource()

    def slow():
        time.sleep(0.4)
        return made

    with pytest.raises(Stalled):
        call_with_timeout(slow, 0.05, late=lambda r: r.close())
    assert made.closed.wait(5.0)


def test_a_call_that_returns_in_time_is_not_handed_to_late():
    made = _Resource()
    assert call_with_timeout(lambda: made, 5.0, late=lambda r: r.close()) is made
    time.sleep(0.1)
    assert not made.closed.is_set()


def test_a_call_that_raises_after_its_deadline_hands_nothing_to_late():
    seen = []

    def slow():
        time.sleep(0.3)
        raise OSError("late failure")

    with pytest.raises(Stalled):
        call_with_timeout(slow, 0.05, late=seen.append)
    time.sleep(0.6)
    assert seen == []
    assert call_with_timeout(lambda: 7, 5.0) == 7  # (the next call gets a fresh thread)


class _SlowOpen(WebDatasetSource):
    """A shard whose open blocks past the read deadline before it succeeds (a slow mount)."""

    def _open(self, shard, checking=False):
        time.sleep(0.5)
        return super()._open(shard, checking)


def test_a_shard_opened_after_its_read_deadline_is_closed(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(4, seed=3), num_shards=2)
    write_sidecars(WebDatasetSource(paths), causal_lm_schema())
    source = _SlowOpen(paths, read_timeout=0.1)
    records = source.scan(0)
    location = next(records)[0]
    records.close()
    gc.collect()
    before = _open_shards(paths)
    with pytest.raises(ShardTimeoutError):
        source.read(location)
    time.sleep(1.5)  # (the open has returned in the abandoned thread)
    gc.collect()
    assert _open_shards(paths) == before
