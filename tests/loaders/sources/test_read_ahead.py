"""A micro-batch's reads under one read deadline (issue #28): a batch over many one-sample shards
hands its opens, first-read checks and reads to the deadline's thread once, not once a shard; the
samples are the same bytes as one by one; a shard that stalls or is gone mid-batch raises what it
raises without the read-ahead (each row after the failure is read one by one)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from prealign.loaders import PackedLoader, WebDatasetSource
from prealign.loaders.errors import MissingShardError, ShardTimeoutError
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.sources import webdataset
from prealign.schemas import ParallelLayout
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import sample_lengths, write_shards

SCHEMA = causal_lm_schema()


def _loader(source) -> PackedLoader:
    return PackedLoader(source, schema=SCHEMA, layout=ParallelLayout(), token_budget=512, seed=1)


@pytest.fixture
def one_sample_shards(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(120), num_shards=120)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    return paths


class _Handoffs:
    """Counts the calls handed to the read deadline's thread by the webdataset source."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = webdataset.call_with_timeout

        def counted(fn, timeout, **kwargs):
            self.calls += 1
            return real(fn, timeout, **kwargs)

        monkeypatch.setattr(webdataset, "call_with_timeout", counted)


def _shards_read(batch) -> int:
    return len(set((batch["sample_index"][batch["sample_index"] >= 0]).tolist()))


def test_a_batch_over_many_shards_is_one_handoff_not_one_a_shard(one_sample_shards, monkeypatch):
    loader = _loader(WebDatasetSource(one_sample_shards)).prepare()
    handoffs = _Handoffs(monkeypatch)
    batch = next(iter(loader))
    shards = _shards_read(batch)  # (one sample a shard: a sample read is a shard opened)
    assert shards >= 10, shards
    assert handoffs.calls == 1, (handoffs.calls, shards)


def test_the_samples_are_those_read_one_by_one(one_sample_shards):
    ahead = list(_loader(WebDatasetSource(one_sample_shards)))
    direct = list(_loader(WebDatasetSource(one_sample_shards, read_timeout=None)))
    assert len(ahead) == len(direct) > 1
    for a, b in zip(ahead, direct):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert torch.equal(a[key], b[key]), key


def test_a_shard_that_stalls_mid_batch_is_a_timeout_naming_it(one_sample_shards, monkeypatch):
    loader = _loader(WebDatasetSource(one_sample_shards, read_timeout=0.5)).prepare()
    slow = set(range(len(one_sample_shards)))  # (which shard the batch reads 5th: found below)
    order = []
    real = webdataset.WebDatasetSource._open

    def opened(self, shard, check):
        order.append(shard)
        if shard in slow and len(order) == 5:
            slow.intersection_update({shard})
        if slow == {shard}:
            time.sleep(2.0)  # (a hung mount: every open of this shard blocks)
        return real(self, shard, check)

    monkeypatch.setattr(webdataset.WebDatasetSource, "_open", opened)
    t0 = time.monotonic()
    with pytest.raises(ShardTimeoutError) as exc:
        next(iter(loader))
    (stalled,) = slow
    assert exc.value.shard == one_sample_shards[stalled]
    assert time.monotonic() - t0 < 10


def test_a_shard_gone_mid_batch_raises_as_one_by_one(one_sample_shards):
    direct = _loader(WebDatasetSource(one_sample_shards, read_timeout=None)).prepare()
    ahead = _loader(WebDatasetSource(one_sample_shards)).prepare()
    first = next(iter(_loader(WebDatasetSource(one_sample_shards))))
    gone = one_sample_shards[int(first["sample_index"][3])]  # (one sample a shard: row = shard)
    os.remove(gone)
    errors = []
    for loader in (direct, ahead):
        with pytest.raises(MissingShardError) as exc:
            next(iter(loader))
        errors.append(str(exc.value))
    assert errors[0] == errors[1] and os.path.basename(gone) in errors[0]


def test_no_handoff_when_every_shard_of_the_batch_is_open(tmp_path, monkeypatch):
    paths = write_shards(str(tmp_path), sample_lengths(120), num_shards=2)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    loader = _loader(WebDatasetSource(paths)).prepare()
    it = iter(loader)
    next(it)  # (opens and checks both shards)
    handoffs = _Handoffs(monkeypatch)
    next(it)
    assert handoffs.calls == 0


def test_rows_past_the_byte_cap_are_read_one_by_one(one_sample_shards, monkeypatch):
    direct = list(_loader(WebDatasetSource(one_sample_shards, read_timeout=None)))
    monkeypatch.setattr(webdataset, "_AHEAD_BYTES", 4096)  # (a few samples of the batch)
    handoffs = _Handoffs(monkeypatch)
    capped = list(_loader(WebDatasetSource(one_sample_shards)))
    assert handoffs.calls > len(capped)  # (past the cap: a handoff a shard opened)
    for a, b in zip(capped, direct):
        assert torch.equal(a["input_ids"], b["input_ids"])
