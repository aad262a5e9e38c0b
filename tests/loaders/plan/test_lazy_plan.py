"""The plan is made chunk by chunk as batches are requested (issue #7: the first batch must not wait
for the whole epoch's plan): what the first batch costs, what the epoch covers, resume across
chunks, and the epoch order's vectorised shuffle."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prealign.loaders import HFSource, PackedLoader, PlannerConfig, WebDatasetSource
from prealign.loaders.conformance import assert_resumes_exactly
from prealign.loaders.plan.schedule import _window_shuffle
from prealign.schemas import ParallelLayout
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import hf_rows, sample_lengths, write_shards
from tests.loaders.plan.test_shuffle import epoch_correlation

SCHEMA = causal_lm_schema()
CHUNKED = PlannerConfig(chunk_size=150, buffer_size=32)


def _loader(src, **kw):
    kw = {"token_budget": 128, "seed": 3, "planner": CHUNKED, **kw}
    return PackedLoader(src, schema=SCHEMA, layout=ParallelLayout(cp=2), cp_rank=0, **kw)


def _planned(loader) -> tuple[int, int]:
    plan = loader._schedule._cached.plan
    return plan.planned, plan.num_chunks


def test_first_batch_plans_one_chunk_and_len_plans_all(tmp_path):
    loader = _loader(
        WebDatasetSource(write_shards(str(tmp_path), sample_lengths(1500), num_shards=5))
    )
    next(iter(loader))
    planned, chunks = _planned(loader)
    assert chunks == 10 and planned == 1
    assert len(loader) > 0 and _planned(loader) == (10, 10)


@pytest.mark.slow
def test_every_sample_once_per_epoch_across_chunks_and_ranks(tmp_path):
    lengths = sample_lengths(1200)
    paths = write_shards(str(tmp_path), lengths, num_shards=4)
    rows = []
    for rank in (0, 1):
        loader = _loader(WebDatasetSource(paths), dp_rank=rank, dp_size=2)
        for epoch in (0, 1):
            got = [b["sample_index"].tolist() for b in loader]
            assert [list(mb) for mb in loader.epoch_samples(epoch)] == got
            rows.append((rank, epoch, got))
        assert _planned(loader)[1] == 8
    for epoch in (0, 1):
        per_rank = [got for rank, e, got in rows if e == epoch]
        assert len(per_rank[0]) == len(per_rank[1])  # the same count on every DP rank
        ids = [i for got in per_rank for mb in got for i in mb]
        assert sorted(ids) == list(range(len(lengths)))  # nothing dropped or repeated
    # the plan's micro-batches equal those of one pass over the epoch (chunking changes only the
    # cost)
    one = _loader(
        WebDatasetSource(paths),
        dp_rank=0,
        dp_size=2,
        planner=PlannerConfig(chunk_size=10**6, buffer_size=32),
    )
    bins = lambda p: sorted(tuple(sorted(mb)) for rank in p.microbatches for mb in rank)  # noqa: E731
    assert bins(one.plan(0)) == bins(_loader(WebDatasetSource(paths), dp_rank=0, dp_size=2).plan(0))


@pytest.mark.slow
def test_resume_inside_a_later_chunk_is_exact_and_plans_only_up_to_it(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(900), num_shards=3)
    make = lambda: _loader(WebDatasetSource(paths))  # noqa: E731
    n = len(make())
    result = assert_resumes_exactly(make, midpoint=(3 * n) // 4)
    assert result["epoch_lengths"][0] == n > 8
    loader = make()
    loader.load_state_dict({**loader.state_dict(), "position": n // 2})
    planned, chunks = _planned(loader)
    assert 1 < planned < chunks  # the chunks up to the position, not the epoch


@pytest.mark.slow
def test_random_access_and_sequential_sources_stay_uncorrelated_when_chunked(tmp_path):
    lengths = sample_lengths(1500)
    wds = _loader(WebDatasetSource(write_shards(str(tmp_path), lengths, num_shards=6)))
    hf = _loader(HFSource(datasets.Dataset.from_dict(hf_rows(lengths))))
    for loader in (wds, hf):
        assert _planned(loader.prepare())[1] == 10
        assert abs(epoch_correlation(loader, epochs=8)) <= 0.1


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), window=st.integers(1, 40), seed=st.integers(0, 5))
def test_window_shuffle_is_a_permutation_within_windows(n, window, seed):
    p = _window_shuffle(n, window, np.random.default_rng(seed))
    assert sorted(p.tolist()) == list(range(n))
    if n:
        assert int(np.abs(p - np.arange(n)).max()) < window


def test_a_window_far_larger_than_the_data_costs_the_data():
    p = _window_shuffle(100, 10**9, np.random.default_rng(0))  # was a 7.5 GiB arange
    assert sorted(p.tolist()) == list(range(100))


def test_the_tail_spreads_like_one_pass_when_the_pass_ends_early():
    from prealign.loaders import plan_microbatches

    kw = dict(layout=ParallelLayout(), token_budget=128, dp_size=2)
    lengths = np.full(25, 50)  # two a micro-batch; the first window reads the whole stream
    chunked = plan_microbatches(lengths, **kw, config=PlannerConfig(chunk_size=16))
    whole = plan_microbatches(lengths, **kw, config=PlannerConfig(chunk_size=10**6))
    assert chunked.stats.num_empty == whole.stats.num_empty == 0
    assert sorted(map(sorted, chunked.microbatches[0] + chunked.microbatches[1])) == sorted(
        map(sorted, whole.microbatches[0] + whole.microbatches[1])
    )


def test_a_loader_keeps_no_planned_epoch_it_left(tmp_path):
    from prealign.loaders.plan.planner import Screening

    loader = _loader(
        WebDatasetSource(write_shards(str(tmp_path), sample_lengths(900), num_shards=3))
    )
    list(loader)
    list(loader)
    assert isinstance(loader._oversize, Screening)  # not epoch 0's ChunkedPlan with its chunks
    plan = loader._schedule._cached.plan
    assert (
        plan.planned == plan.num_chunks and plan._fit is None
    )  # the packing pass let go at the stream's end
