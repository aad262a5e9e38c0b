"""A Hugging Face stream split by ``datasets.distributed.split_dataset_by_node`` resumes and
opens a shard at a row with exactly the rows a scan that drops those before it gives:
``IterableDataset.skip`` of such a dataset skips rows before the node's split (its rows are other
rows than the dropped scan's), so it must not be used there."""

from __future__ import annotations

import datasets
import pytest
from datasets.distributed import split_dataset_by_node

from prealign.loaders import HFSource


def _node_split(rank: int, world: int):
    rows = {"input_ids": [[i % 5 + 1] for i in range(40)], "k": list(range(40))}
    stream = datasets.Dataset.from_dict(rows).to_iterable_dataset(num_shards=4)
    return split_dataset_by_node(stream, rank=rank, world_size=world)


@pytest.mark.parametrize("rank,world", [(0, 3), (1, 3), (1, 2)])
def test_a_node_split_stream_resumes_at_the_row_after_the_cursors(rank, world):
    src = HFSource(_node_split(rank, world))
    for shard in range(src.num_shards):
        whole = [(loc, dict(raw)) for loc, raw in src.scan(shard)]
        for k, (loc, _) in enumerate(whole):
            rest = [(lc, dict(raw)) for lc, raw in src.scan_after(shard, k, loc)]
            assert rest == whole[k + 1 :], (shard, k)


@pytest.mark.parametrize("rank,world", [(0, 3), (1, 2)])
def test_a_node_split_stream_reads_the_row_its_scan_has_there(rank, world):
    """``read`` of a row of a shard not open yet: the row the shard's scan has at that place."""
    ks = {}
    for shard in range(HFSource(_node_split(rank, world)).num_shards):
        for loc, raw in HFSource(_node_split(rank, world)).scan(shard):
            ks[loc] = raw["k"]
    for loc, k in ks.items():
        assert HFSource(_node_split(rank, world)).read(loc)["k"] == k, loc
