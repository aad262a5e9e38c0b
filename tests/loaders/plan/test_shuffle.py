"""Shuffling (issue #7, item 5): micro-batch order seeded after planning, shard order and in-shard
windows new every epoch; epoch-to-epoch correlation of sample positions measured; open files
bounded."""

from __future__ import annotations

import os

import datasets
import numpy as np
import pytest

from prealign.loaders import HFSource, PackedLoader, WebDatasetSource
from prealign.loaders.plan.schedule import step_order
from prealign.schemas import ParallelLayout
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import hf_rows, sample_lengths, write_shards

SCHEMA = causal_lm_schema()


def _loader(src, **kw):
    kw = {"token_budget": 256, "seed": 5, **kw}
    return PackedLoader(src, schema=SCHEMA, layout=ParallelLayout(), **kw)


def _positions(loader, epoch: int) -> dict[int, int]:
    """sample id -> position of its micro-batch in the epoch (dp_size 1)."""
    return {s: i for i, mb in enumerate(loader.epoch_samples(epoch)) for s in mb}


def epoch_correlation(loader, epochs: int = 32) -> float:
    """Mean over consecutive epoch pairs of the Pearson correlation of sample positions."""
    rs = []
    for e in range(epochs):
        a, b = _positions(loader, e), _positions(loader, e + 1)
        common = sorted(a.keys() & b.keys())
        assert len(common) > 10
        rs.append(np.corrcoef([a[s] for s in common], [b[s] for s in common])[0, 1])
    return float(np.mean(rs))


@pytest.mark.parametrize(
    "n, shards", [(1200, 6), (60, 1)]
)  # a small dataset: smaller than the BFD window
def test_epoch_to_epoch_correlation_is_small(tmp_path, n, shards):
    lengths = sample_lengths(n)
    wds = _loader(
        WebDatasetSource(write_shards(str(tmp_path), lengths, num_shards=shards)), token_budget=128
    )
    hf = _loader(HFSource(datasets.Dataset.from_dict(hf_rows(lengths))), token_budget=128)
    for loader in (wds, hf):
        r = epoch_correlation(loader)
        assert abs(r) <= 0.1, (type(loader.source).__name__, r)
        firsts = {tuple(loader.epoch_samples(e)[0]) for e in range(6)}
        assert len(firsts) > 1  # the first micro-batch changes with the epoch


def test_small_dataset_is_not_served_longest_first(tmp_path):
    lengths = sample_lengths(60)
    loader = _loader(WebDatasetSource(write_shards(str(tmp_path), lengths, num_shards=1)))
    for epoch in range(4):
        loads = [sum(lengths[s] for s in mb) for mb in loader.epoch_samples(epoch)]
        assert loads != sorted(loads, reverse=True)
    rho = np.mean(
        [
            np.corrcoef(np.arange(len(mbs)), [-max(lengths[s] for s in mb) for mb in mbs])[0, 1]
            for mbs in (loader.epoch_samples(e) for e in range(8))
        ]
    )
    assert (
        abs(rho) < 0.3
    )  # BFD opens micro-batches longest-first; the served order does not follow it


def test_steps_are_shuffled_whole_and_every_rank_alike():
    order = step_order((3, 3, 3, 2), epoch=1, seed=0, shuffle=True, window=None)
    assert sorted(order.tolist()) == list(range(11))
    groups = [tuple(order[i : i + 3].tolist()) for i in (0, 3, 6)] + [tuple(order[9:].tolist())]
    assert all(
        g in {(0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10)}
        for g in groups
        if len(g) == 3 or g == (9, 10)
    ) or sorted(len(g) for g in groups) == [2, 3, 3, 3]
    windowed = step_order(tuple([1] * 200), epoch=0, seed=0, shuffle=True, window=8)
    assert all(set(windowed[i : i + 8].tolist()) == set(range(i, i + 8)) for i in range(0, 200, 8))


def test_dp_ranks_still_cover_every_sample_once(tmp_path):
    lengths = sample_lengths(300)
    paths = write_shards(str(tmp_path), lengths, num_shards=3)
    for epoch in (0, 1):
        seen = [
            s
            for r in range(2)
            for mb in _loader(WebDatasetSource(paths), dp_size=2, dp_rank=r).epoch_samples(epoch)
            for s in mb
        ]
        assert sorted(seen) == list(range(300))


def test_open_files_stay_bounded_over_1000_shards(tmp_path):
    paths = write_shards(str(tmp_path), [8] * 2000, num_shards=1000)
    loader = _loader(WebDatasetSource(paths, max_open_files=8), token_budget=64)
    fd_dir = "/proc/self/fd"
    if not os.path.isdir(fd_dir):
        pytest.skip("platform: no /proc/self/fd (not Linux)")
    base = len(os.listdir(fd_dir))
    peak, batches = 0, 0
    for batch in loader:
        batches += 1
        if batches % 25 == 0:
            peak = max(peak, len(os.listdir(fd_dir)) - base)
    assert batches > 100 and peak <= 8
