"""An ``HFSource`` resumed inside a shard, or asked for a row of a streaming shard it has not
opened, makes no row before it: a map-style dataset's rows by index, a streaming dataset's shard
through ``IterableDataset.skip`` (Arrow batches dropped whole). The records are exactly those of a
scan that drops the rows before (differential, every shard and position)."""

from __future__ import annotations

import os
from itertools import islice

import datasets
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prealign.loaders import HFSource


def _rows(n: int) -> dict:
    return {"input_ids": [list(range(i % 7 + 1)) for i in range(n)], "k": list(range(n))}


def _records(it) -> list:
    return [(loc, dict(raw)) for loc, raw in it]


def _same_as_a_scan_that_drops(src: HFSource) -> None:
    for shard in range(src.num_shards):
        whole = _records(src.scan(shard))
        for k, (loc, _) in enumerate(whole):
            assert _records(src.scan_after(shard, k, loc)) == whole[k + 1 :]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), shards=st.integers(1, 5), per_shard=st.integers(1, 9))
def test_scan_after_is_the_scan_without_the_rows_before(n, shards, per_shard):
    """Property: every shard, every position: map-style (``rows_per_shard``) and streaming
    (``to_iterable_dataset(num_shards)``)."""
    ds = datasets.Dataset.from_dict(_rows(n))
    _same_as_a_scan_that_drops(HFSource(ds, rows_per_shard=per_shard))
    _same_as_a_scan_that_drops(HFSource(ds.to_iterable_dataset(num_shards=min(shards, n))))


@pytest.fixture
def parquet_stream(tmp_path):
    """A streaming dataset of 3 parquet files (3 shards, 1,000 rows each: Arrow batches)."""
    files = []
    for f in range(3):
        path = os.path.join(tmp_path, f"part-{f}.parquet")
        rows = _rows(1000)
        rows["k"] = [f * 1000 + i for i in range(1000)]
        datasets.Dataset.from_dict(rows).to_parquet(path)
        files.append(path)
    return datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)


def _counted(src: HFSource, monkeypatch) -> list:
    """The rows ``src``'s streaming shards make, counted as they are made."""
    made = [0]
    real = HFSource._shard

    def shard(self, *a, **k):
        for row in real(self, *a, **k):
            made[0] += 1
            yield row

    monkeypatch.setattr(HFSource, "_shard", shard)
    return made


def test_a_parquet_stream_resumed_in_a_shard_makes_no_row_before_it(parquet_stream, monkeypatch):
    src = HFSource(parquet_stream)
    assert src.num_shards == 3
    whole = _records(src.scan(1))
    made = _counted(src, monkeypatch)
    for k in (0, 255, 256, 900, 998, 999):
        made[0] = 0
        rest = _records(src.scan_after(1, k, whole[k][0]))
        assert rest == whole[k + 1 :] and made[0] == 999 - k
    assert [raw["k"] for _, raw in whole] == list(range(1000, 2000))


def test_a_row_of_a_streaming_shard_not_open_is_read_without_the_rows_before(
    parquet_stream, monkeypatch
):
    """``read`` of row 900 of a shard this process has not opened makes that row and the
    ``lookback`` rows before it (kept: a shuffled read near it opens nothing again), none before
    them; a later row goes on forward; an older one than those kept opens the shard again."""
    src = HFSource(parquet_stream, lookback=4)
    made = _counted(src, monkeypatch)
    assert src.read((2, 900))["k"] == 2900 and made[0] == 5
    assert src.read((2, 897))["k"] == 2897 and made[0] == 5  # (kept: the last 4 rows)
    assert src.read((2, 903))["k"] == 2903 and made[0] == 8
    assert src.read((2, 901))["k"] == 2901 and made[0] == 8
    assert src.read((2, 10))["k"] == 2010 and made[0] == 8 + 5
    assert [src.read((0, j))["k"] for j in (5, 3, 999)] == [5, 3, 999]


def test_a_resumed_hf_stream_drops_exactly_the_rows_it_served(parquet_stream):
    """``scan_after`` of the last row, and past the rows a shard holds: nothing."""
    src = HFSource(parquet_stream)
    assert list(src.scan_after(0, 999, (0, 999))) == []
    assert list(islice(src.scan_after(0, 998, (0, 998)), 5))[0][0] == (0, 999)


def test_a_row_past_a_streaming_shard_is_a_bad_sample_naming_where_it_ends(parquet_stream):
    """A location past its shard's rows (an index of other data): a BadSampleError naming the
    shard and a row it has not (the first missing going forward from where it opened)."""
    from prealign.loaders.errors import BadSampleError

    src = HFSource(parquet_stream)
    with pytest.raises(BadSampleError, match="shard 1 ends before its row 1000"):
        src.read((1, 5000))
    src.read((2, 998))
    with pytest.raises(BadSampleError, match="shard 2 ends before its row 1000"):
        src.read((2, 1001))
