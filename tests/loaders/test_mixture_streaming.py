"""StreamingPackedLoader over a Mixture (issue #30): the components' streams read forward and
interleaved by weight in each reader; exact resume, and elastic resume across workers 2 -> 1 (every
sample once)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from prealign.loaders import Mixture, StreamingPackedLoader, WebDatasetSource
from prealign.loaders.conformance import assert_resumes_elastically, assert_resumes_exactly
from prealign.schemas import ParallelLayout, causal_lm_schema
from tests.loader_helpers import sample_lengths, write_shards

SCHEMA = causal_lm_schema()
LAYOUT = ParallelLayout(cp=2)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    return {
        "short": write_shards(
            str(root / "short"), sample_lengths(200, seed=1, low=4, high=12), num_shards=2
        ),
        "long": write_shards(
            str(root / "long"), sample_lengths(40, seed=2, low=40, high=60), num_shards=2
        ),
    }


def _mixture(paths, by="tokens"):
    return Mixture(
        {name: (WebDatasetSource(p), w) for (name, p), w in zip(paths.items(), (0.5, 0.5))}, by=by
    )


def _make(paths, by="tokens"):
    def make(config: dict | None = None, rank: int = 0) -> StreamingPackedLoader:
        config = config or {"dp_size": 1}
        return StreamingPackedLoader(
            _mixture(paths, by),
            schema=SCHEMA,
            layout=LAYOUT,
            token_budget=128,
            cp_rank=0,
            seed=3,
            dp_size=config["dp_size"],
            dp_rank=rank,
            num_workers=config.get("num_workers", 0),
            buffer_size=8,
        )

    return make


def _component(sid: int) -> int:
    return 0 if (sid >> 32) < 2 else 1  # shards 0-1 short, 2-3 long


@pytest.mark.parametrize("by", ["tokens", "samples"])
def test_streams_are_interleaved_by_weight(paths, by):
    batches = list(_make(paths, by)())
    ids = [i for b in batches for i in b["sample_index"].tolist()]
    assert len(ids) == len(set(ids)) == 240  # every sample once
    # while both streams last, the first half of the served tokens (or samples) splits 0.5 / 0.5
    lengths = (
        [
            int(n)
            for b in batches
            for n in np.diff(b["cu_seqlens"][b["cu_seqlens"] >= 0].tolist())
            if n > 0
        ]
        if by == "tokens"
        else [1] * len(ids)
    )
    head = len(ids) // 3 if by == "tokens" else 60
    comp = np.array([_component(i) for i in ids[:head]])
    units = np.array(lengths[:head], float)
    share = units[comp == 1].sum() / units.sum()
    assert abs(share - 0.5) < 0.15, share
    assert Counter(_component(i) for i in ids) == {0: 200, 1: 40}


def test_stream_mixture_resumes_exactly(paths):
    out = assert_resumes_exactly(lambda: _make(paths)())
    assert out["epoch_lengths"][0] > 4


def test_stream_mixture_resumes_across_workers_2_to_1(paths):
    segments = [({"dp_size": 1, "num_workers": 2}, 5), ({"dp_size": 1, "num_workers": 1}, None)]
    result = assert_resumes_elastically(
        _make(paths), segments, budget=128, padded_length=lambda b: b["input_ids"].shape[-1] * 2
    )
    assert result["samples"] == 240
