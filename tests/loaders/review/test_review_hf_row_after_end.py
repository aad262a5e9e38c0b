"""A row asked for past a streaming shard's end is a bad sample; the rows of that shard read
on the way to it are still read afterwards (the shard's cursor keeps where it stands)."""

from __future__ import annotations

import datasets
import pytest

from prealign.loaders import HFSource
from prealign.loaders.errors import BadSampleError


def test_a_row_past_the_end_leaves_the_rows_read_on_the_way_readable():
    rows = {"input_ids": [[i + 1] for i in range(10)], "k": list(range(10))}
    src = HFSource(datasets.Dataset.from_dict(rows).to_iterable_dataset(num_shards=1))
    assert src.read((0, 3))["k"] == 3
    with pytest.raises(BadSampleError, match="shard 0 ends before its row 10"):
        src.read((0, 12))
    assert [src.read((0, j))["k"] for j in (8, 9, 4)] == [8, 9, 4]
    with pytest.raises(BadSampleError, match="shard 0 ends before its row 10"):
        src.read((0, 10))
