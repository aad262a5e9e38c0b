"""Exact resume: the shared conformance harness on every source kind, with 0 and 2 workers, and the
refusal of incompatible states."""

from __future__ import annotations

import json

import datasets
import pytest

from prealign.loaders import (
    HFSource,
    IndexOptions,
    PackedLoader,
    PlannerConfig,
    ResumeError,
    WebDatasetSource,
    build_index,
)
from prealign.loaders.conformance import (
    ResumeConformanceError,
    assert_resumes_exactly,
    batches_equal,
)
from prealign.schemas import ParallelLayout, causal_lm_schema, rl_schema
from tests.loader_helpers import hf_rows, sample_lengths, write_shards

SCHEMA = causal_lm_schema()
LAYOUT = ParallelLayout(tp=2, cp=2)
LENGTHS = sample_lengths(90, seed=5)


@pytest.fixture(scope="module")
def wds(tmp_path_factory):
    src = WebDatasetSource(
        write_shards(str(tmp_path_factory.mktemp("shards")), LENGTHS, num_shards=3)
    )
    return src, build_index(src, SCHEMA)


@pytest.fixture(scope="module")
def hf_stream():
    src = HFSource(datasets.Dataset.from_dict(hf_rows(LENGTHS)).to_iterable_dataset(num_shards=3))
    return src, build_index(src, SCHEMA)


def _factory(src_idx, **kw):
    src, idx = src_idx
    kw = {"layout": LAYOUT, "token_budget": 192, "dp_size": 2, "dp_rank": 1, "cp_rank": 0, **kw}
    return lambda: PackedLoader(src, schema=SCHEMA, indexing=IndexOptions(prebuilt=idx), **kw)


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["webdataset", "hf_streaming"])
def test_resume_conformance(kind, workers, wds, hf_stream):
    result = assert_resumes_exactly(
        _factory(wds if kind == "webdataset" else hf_stream, num_workers=workers)
    )
    assert min(result["epoch_lengths"]) >= 4 and result["midpoint"] >= 2  # not vacuous


def test_resume_conformance_map_style_k_steps():
    src = HFSource(datasets.Dataset.from_dict(hf_rows(LENGTHS)))
    make = _factory(
        (src, build_index(src, SCHEMA)),
        planner=PlannerConfig(microbatches_per_step=3),
        dp_size=3,
        dp_rank=2,
    )
    assert assert_resumes_exactly(make, midpoint=1)["epoch_lengths"][0] >= 3


def test_the_harness_catches_a_loader_that_does_not_resume(wds):
    class Forgetful:  # restarts its epoch on load: loses nothing but repeats batches
        def __init__(self):
            self.inner = _factory(wds)()

        def __iter__(self):
            return iter(self.inner)

        def state_dict(self):
            return self.inner.state_dict()

        def load_state_dict(self, state):
            self.inner.load_state_dict({**state, "position": 0})

    with pytest.raises(ResumeConformanceError, match="mid-epoch"):
        assert_resumes_exactly(Forgetful)


def test_state_is_small_json_and_rank_independent(wds):
    a = _factory(wds, dp_rank=0)()
    b = _factory(wds, dp_rank=1)()
    it = iter(a)
    next(it), next(it)
    state = a.state_dict()
    assert len(json.dumps(state)) < 2048 and state["version"] == 2
    assert state["epoch"] == 0 and state["position"] == 2
    b.load_state_dict(
        json.loads(json.dumps(state))
    )  # rank 0's state resumes rank 1 at the same step
    ref = _factory(wds, dp_rank=1)()
    assert all(batches_equal(x, y) for x, y in zip(list(b), list(ref)[2:]))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"layout": ParallelLayout(tp=2, cp=4)}, "layout"),
        ({"token_budget": 256}, "token_budget"),
        ({"seed": 1}, "seed"),
        ({"planner": PlannerConfig(strategy="first_fit")}, "planner"),
        (
            {"planner": PlannerConfig(strategy="first_fit", microbatches_per_step=2)},
            "strategy",
        ),  # k changes, not only k
    ],
)
def test_incompatible_resume_is_refused(wds, change, message):
    state = _factory(wds)().state_dict()
    with pytest.raises(ResumeError, match=message):
        _factory(wds, **change)().load_state_dict(state)


def test_other_schema_data_or_version_is_refused(wds, tmp_path):
    state = _factory(wds)().state_dict()
    src, idx = wds
    other = PackedLoader(
        src,
        schema=rl_schema(),
        layout=LAYOUT,
        token_budget=192,
        dp_size=2,
        indexing=IndexOptions(prebuilt=idx),
    )
    with pytest.raises(ResumeError, match="schema"):
        other.load_state_dict(state)
    fewer = WebDatasetSource(write_shards(str(tmp_path), LENGTHS[:60], num_shards=2))
    with pytest.raises(ResumeError, match="data num_samples: saved 90, this run 60"):
        PackedLoader(
            fewer, schema=SCHEMA, layout=LAYOUT, token_budget=192, dp_size=2
        ).load_state_dict(state)
    with pytest.raises(
        ResumeError, match="version 1 is not supported"
    ):  # before chunked plans: another order
        _factory(wds)().load_state_dict({**state, "version": 1})
    with pytest.raises(ResumeError, match="not a prealign.PackedLoader state"):
        _factory(wds)().load_state_dict({"epoch": 0})


def test_named_dims_are_part_of_the_data_check():
    """Same lengths and locations, another top-k K: the index digest differs, so a state does not
    resume on the other data."""
    import torch

    schema = causal_lm_schema(topk="K")

    def source(k):
        def transform(row):
            n = len(row["input_ids"])
            return {
                "input_ids": torch.tensor(row["input_ids"]),
                "teacher_topk_ids": torch.zeros(n, k, dtype=torch.long),
                "teacher_topk_log_probs": -torch.ones(n, k),
            }

        return HFSource(datasets.Dataset.from_dict(hf_rows(LENGTHS[:30])), transform=transform)

    a, b = (PackedLoader(source(k), schema=schema, layout=LAYOUT, token_budget=192) for k in (4, 8))
    assert (a.index.dims["K"], b.index.dims["K"]) == (4, 8)
    assert a.index.lengths.tolist() == b.index.lengths.tolist() and a.index.digest != b.index.digest
    with pytest.raises(ResumeError, match="digest"):
        b.load_state_dict(a.state_dict())
