"""Elastic resume (issue #21): a state saved under one DP size / number of workers / micro-batches
per step resumes under another. Across the segments of the epoch every sample is served exactly
once, every micro-batch is within budget and the ranks of a segment yield as many micro-batches
each. Ranks are simulated in one process (one loader per ``dp_rank``); the streaming loader's DP
resize runs on real gloo ranks."""

from __future__ import annotations

import json
from itertools import islice

import datasets
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prealign.loaders import (
    HFSource,
    IndexOptions,
    PackedLoader,
    PlannerConfig,
    ResumeError,
    StreamingPackedLoader,
    WebDatasetSource,
    build_index,
)
from prealign.loaders.conformance import (
    ResumeConformanceError,
    assert_resumes_elastically,
    assert_resumes_exactly,
    batches_equal,
)
from prealign.loaders.plan.elastic import MAX_SEGMENTS, round_robin
from prealign.schemas import ParallelLayout, causal_lm_schema
from tests.conftest import spawn_ranks
from tests.loader_helpers import hf_rows, sample_lengths, write_shards

SCHEMA = causal_lm_schema()
CP = 2
LAYOUT = ParallelLayout(cp=CP)
BUDGET = 128


def _padded(batch) -> int:
    """The micro-batch's global padded length T (each CP rank holds T / cp tokens)."""
    return batch["input_ids"].shape[-1] * CP


def _packed_maker(src, index, *, seed=3, chunk_size=40, oversize="error"):
    def make(config: dict, rank: int) -> PackedLoader:
        planner = PlannerConfig(
            microbatches_per_step=config.get("k", 1),
            chunk_size=chunk_size,
            buffer_size=16,
            oversize=oversize,
        )
        return PackedLoader(
            src,
            schema=SCHEMA,
            layout=LAYOUT,
            token_budget=BUDGET,
            cp_rank=0,
            seed=seed,
            dp_size=config["dp_size"],
            dp_rank=rank,
            num_workers=config.get("num_workers", 0),
            planner=planner,
            indexing=IndexOptions(prebuilt=index),
        )

    return make


def _hf(lengths):
    src = HFSource(datasets.Dataset.from_dict(hf_rows(lengths)))
    return src, build_index(src, SCHEMA)


@pytest.fixture(scope="module")
def wds(tmp_path_factory):
    src = WebDatasetSource(
        write_shards(
            str(tmp_path_factory.mktemp("shards")), sample_lengths(150, seed=8), num_shards=3
        )
    )
    return src, build_index(src, SCHEMA)


def _fraction(f: float):
    return lambda loader: int(f * len(loader))


# ---- PackedLoader
# --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_golden_dp_4_3_5_with_other_workers_and_k(wds):
    make = _packed_maker(*wds)
    segments = [
        ({"dp_size": 4, "num_workers": 0}, 5),
        ({"dp_size": 3, "num_workers": 2, "k": 2}, 3),  # a stop inside a step of k=2
        ({"dp_size": 5, "num_workers": 1}, None),
    ]
    result = assert_resumes_elastically(make, segments, budget=BUDGET, padded_length=_padded)
    assert result == {"counts": [5, 3, 2], "samples": 150}
    # the chained state: the two earlier segments, four integers each, then this run's position
    a = make({"dp_size": 4}, 0)
    it = iter(a)
    list(islice(it, 5))
    b = make({"dp_size": 3, "k": 2}, 1)
    b.load_state_dict(a.state_dict())
    list(islice(iter(b), 3))
    state = b.state_dict()
    assert state["version"] == 3 and (state["epoch"], state["position"]) == (0, 3)
    assert state["segments"] == [
        {"dp_size": 4, "microbatches_per_step": 1, "num_workers": None, "position": 5}
    ]
    c = make({"dp_size": 5}, 4)
    c.load_state_dict(state)
    assert c.state_dict()["segments"][1] == {
        "dp_size": 3,
        "microbatches_per_step": 2,
        "num_workers": None,
        "position": 3,
    }
    assert c.state_dict()["position"] == 0 and len(c) == 2


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=100),
    configs=st.lists(
        st.tuples(st.integers(1, 5), st.integers(1, 3), st.floats(0, 0.99)), min_size=2, max_size=3
    ),
    seed=st.integers(0, 2**16),
    chunk_size=st.sampled_from([8, 40, 16384]),
)
def test_any_resizes_serve_every_sample_once(lengths, configs, seed, chunk_size):
    make = _packed_maker(*_hf(lengths), seed=seed, chunk_size=chunk_size)
    # (a segment with more DP ranks than samples is refused: test_malformed_segments_are_refused)
    segments = [
        ({"dp_size": min(dp, len(lengths)), "k": k}, _fraction(f)) for dp, k, f in configs[:-1]
    ]
    segments.append(({"dp_size": configs[-1][0], "k": configs[-1][1]}, None))
    result = assert_resumes_elastically(make, segments, budget=BUDGET, padded_length=_padded)
    assert result["samples"] == len(lengths)


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data_seed=st.integers(0, 2**32 - 1),
    stops=st.tuples(st.floats(0, 0.99), st.floats(0, 0.99)),
    oversize=st.sampled_from(["skip", "truncate"]),
)
def test_lognormal_data_4_3_5(data_seed, stops, oversize):
    """Lengths drawn independently of the test (lognormal, a seed hypothesis picks), some longer
    than the budget allows (left out or cut, the same in every segment)."""
    lengths = (
        np.clip(np.random.default_rng(data_seed).lognormal(3.3, 0.9, 160), 1, 300)
        .astype(int)
        .tolist()
    )
    make = _packed_maker(*_hf(lengths), oversize=oversize)
    segments = [
        ({"dp_size": 4}, _fraction(stops[0])),
        ({"dp_size": 3, "k": 2}, _fraction(stops[1])),
        ({"dp_size": 5}, None),
    ]
    result = assert_resumes_elastically(make, segments, budget=BUDGET, padded_length=_padded)
    placed = len(lengths) if oversize == "truncate" else sum(n <= BUDGET for n in lengths)
    assert result["samples"] == placed


def test_a_resized_run_resumes_exactly_within_its_segment(wds):
    """After a resize the state (with its segments) resumes exactly like any other, later epoch
    included."""
    make = _packed_maker(*wds)
    a = make({"dp_size": 4}, 0)
    list(islice(iter(a), 4))
    state = a.state_dict()

    def resized():
        b = make({"dp_size": 3}, 1)
        b.load_state_dict(json.loads(json.dumps(state)))
        return b

    result = assert_resumes_exactly(resized)
    assert min(result["epoch_lengths"]) >= 4


# written by prealign at commit b520df4 (before elastic resume): rank 2 of dp 3 after 2
# micro-batches of the ``wds`` data, and the sample ids of the rest of its epoch
_B520DF4_STATE = {
    "version": 2,
    "kind": "prealign.PackedLoader",
    "epoch": 0,
    "position": 2,
    "config": {
        "seed": 3,
        "dp_size": 3,
        "token_budget": 128,
        "layout": {
            "tp": 1,
            "cp": 2,
            "sp": False,
            "fp8": 1,
            "pad_policy": "minimal",
            "cp_layout": "zigzag",
            "length_buckets": None,
            "min_local_rows": 0,
        },
        "schema": "4c765cb695b0bb87",
        "planner": {
            "strategy": "bfd",
            "buffer_size": 16,
            "oversize": "error",
            "microbatches_per_step": 1,
            "max_age": 4,
            "step_pool": 8,
            "chunk_size": 40,
        },
        "shuffle": True,
        "shuffle_window": 1024,
    },
    "data": {"source": "webdataset", "num_samples": 150, "digest": "3c1d854290833665"},
}
_B520DF4_REST = [
    [66, 9, 51],
    [105, 94, 58, 23],
    [56, 142, 116],
    [104, 138, 22, 17],
    [139, 77, 121],
    [14, 126, 4, 88, 20],
    [15, 149, 60, 70, 69, 7, 112],
    [1, 96, 64, 79, 3, 92],
    [42],
    [37, 31, 47, 33, 32, 24, 49],
    [41, 48, 25],
]


def test_same_config_resume_is_unchanged(wds):
    """A version-2 state as prealign wrote it before elastic resume (a literal) resumes as then: the
    micro-batches that code served next, and the state it writes is still that version-2 state."""
    make = _packed_maker(*wds)
    b = make({"dp_size": 3}, 2)
    b.load_state_dict(json.loads(json.dumps(_B520DF4_STATE)))
    assert b.state_dict() == _B520DF4_STATE
    got = list(b)
    assert [x["sample_index"].tolist() for x in got] == _B520DF4_REST
    assert [x["microbatch"] for x in got] == list(range(2, 2 + len(_B520DF4_REST)))


def test_resize_at_the_start_or_the_end_of_an_epoch(wds):
    make = _packed_maker(*wds)
    fresh = make({"dp_size": 4}, 0).state_dict()
    b = make({"dp_size": 3}, 0)
    b.load_state_dict(fresh)  # nothing served: no segment, the epoch planned for dp 3
    assert (
        "segments" not in b.state_dict()
        and [r for r in b.epoch_samples()] == make({"dp_size": 3}, 0).epoch_samples()
    )
    a = make({"dp_size": 4}, 0)
    list(a)  # the epoch finished: the state is the start of the next one
    c = make({"dp_size": 3}, 1)
    c.load_state_dict(a.state_dict())
    assert c.epoch == 1 and all(
        batches_equal(x, y) for x, y in zip(list(c), list(_epoch(make({"dp_size": 3}, 1), 1)))
    )


def test_fewer_samples_left_than_new_ranks_gives_fillers():
    """dp 1 stopped before its last micro-batch, resumed at dp 5: the few samples left are spread,
    every rank gets one micro-batch, the ranks with none get a filler (pads only)."""
    make = _packed_maker(*_hf([60, 61, 62, 63, 5, 6]), chunk_size=16384)
    n = len(make({"dp_size": 1}, 0))
    result = assert_resumes_elastically(
        make,
        [({"dp_size": 1}, n - 1), ({"dp_size": 5}, None)],
        budget=BUDGET,
        padded_length=_padded,
    )
    assert result == {"counts": [n - 1, 1], "samples": 6}
    a = make({"dp_size": 1}, 0)
    list(islice(iter(a), n - 1))
    rest = []
    for r in range(5):
        b = make({"dp_size": 5}, r)
        b.load_state_dict(a.state_dict())
        rest += list(b)
    assert sum(b["is_filler"] for b in rest) >= 3 and all(_padded(b) <= BUDGET for b in rest)


def _epoch(loader, epoch):
    loader.set_epoch(epoch)
    return loader


def test_state_stays_small_whatever_the_data_size():
    sizes = []
    for n in (200, 2000):
        make = _packed_maker(*_hf(sample_lengths(n, seed=1)))
        state = None
        for dp in (4, 3, 5, 2):
            c = make({"dp_size": dp}, 0)
            if state:
                c.load_state_dict(state)
            list(islice(iter(c), 1))
            state = c.state_dict()
        assert len(state["segments"]) == 3
        sizes.append(len(json.dumps({k: v for k, v in state.items() if k != "data"})))
    assert sizes[0] == sizes[1] < 1024


@pytest.mark.parametrize(
    "change, message",
    [
        ({"token_budget": 256}, "token_budget"),
        ({"layout": ParallelLayout(cp=4)}, "layout"),
        ({"seed": 9}, "seed"),
    ],
)
def test_budget_layout_and_seed_changes_stay_refused(wds, change, message):
    src, idx = wds
    a = _packed_maker(src, idx)({"dp_size": 4}, 0)
    list(islice(iter(a), 2))
    kw = {"layout": LAYOUT, "token_budget": BUDGET, "seed": 3, **change}
    other = PackedLoader(
        src,
        schema=SCHEMA,
        cp_rank=0,
        dp_size=3,
        indexing=IndexOptions(prebuilt=idx),
        planner=PlannerConfig(chunk_size=40, buffer_size=16),
        **kw,
    )
    with pytest.raises(ResumeError, match=message):
        other.load_state_dict(a.state_dict())


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda s: {**s, "segments": [{**s["segments"][0], "position": 0}]},
            r"segments\[0\].position",
        ),
        (
            lambda s: {
                **s,
                "segments": [
                    {"dp_size": "4", "microbatches_per_step": 1, "num_workers": None, "position": 5}
                ],
            },
            r"segments\[0\].dp_size",
        ),
        (lambda s: {**s, "segments": [{"dp_size": 4}]}, "segments"),
        (lambda s: {**s, "segments": []}, "segments"),
        (lambda s: {k: v for k, v in s.items() if k != "segments"}, "segments"),
        (lambda s: {**s, "version": 2}, "segments"),
        (
            lambda s: {**s, "segments": [{**s["segments"][0], "position": 10_000}]},
            "past the end of epoch 0",
        ),
        (lambda s: {**s, "config": {**s["config"], "dp_size": True}}, "dp_size"),
        # a segment no run writes: wider than the data, with workers (no PackedLoader batch depends
        # on them), or with the configuration of the next one (a resume under the same configuration
        # goes on in one segment)
        (
            lambda s: {**s, "segments": [{**s["segments"][0], "dp_size": 151}]},
            r"segments\[0\].dp_size: expected at most the 150 samples of the data, got 151",
        ),
        (
            lambda s: {**s, "segments": [{**s["segments"][0], "num_workers": 5}]},
            r"segments\[0\].num_workers: expected None .*got 5",
        ),
        (
            lambda s: {**s, "segments": [s["segments"][0]] * 2},
            r"segments\[0\]: dp_size 4, microbatches_per_step 1 as in segments\[1\]",
        ),
        (
            lambda s: {**s, "segments": [{**s["segments"][0], "dp_size": 3}]},
            r"segments\[0\]: dp_size 3, .* the state's config",
        ),
        (
            lambda s: {
                **s,
                "segments": [
                    {**s["segments"][0], "dp_size": 1 + i % 2, "position": 1} for i in range(65)
                ],
            },
            "65 segments .* at most 64",
        ),
    ],
)
def test_malformed_segments_are_refused(wds, edit, message):
    make = _packed_maker(*wds)
    a = make({"dp_size": 4}, 0)
    list(islice(iter(a), 3))
    b = make({"dp_size": 3}, 0)
    b.load_state_dict(a.state_dict())
    state = b.state_dict()
    c = make({"dp_size": 5}, 0)
    with pytest.raises(ResumeError, match=message):
        c.load_state_dict(edit(state))
    assert (
        c.state_dict()["position"] == 0 and "segments" not in c.state_dict()
    )  # a refused state changes nothing


@pytest.mark.slow
def test_at_most_max_segments_are_resumed():
    """MAX_SEGMENTS resizes in one epoch resume (every sample served once); one more is refused."""
    make = _packed_maker(*_hf(sample_lengths(600, seed=4)))
    segments = [({"dp_size": 1 + i % 2}, 1) for i in range(MAX_SEGMENTS)] + [({"dp_size": 3}, None)]
    result = assert_resumes_elastically(make, segments, budget=BUDGET, padded_length=_padded)
    assert result["samples"] == 600 and result["counts"][:MAX_SEGMENTS] == [1] * MAX_SEGMENTS
    chain = [
        {"dp_size": 1 + i % 2, "microbatches_per_step": 1, "num_workers": None, "position": 1}
        for i in range(MAX_SEGMENTS + 1)
    ]
    base = make({"dp_size": 3}, 0).state_dict()
    with pytest.raises(ResumeError, match=f"{MAX_SEGMENTS + 1} segments"):
        make({"dp_size": 3}, 0).load_state_dict({**base, "version": 3, "segments": chain})


def test_a_resize_and_back_at_its_start_goes_on_in_the_same_segment(wds):
    """dp 4 -> 3 (saved before its first micro-batch) -> 4: the run at 4 goes on where the first
    stopped, as if never resized (no segment, the batches of the uninterrupted run)."""
    make = _packed_maker(*wds)
    ref = list(make({"dp_size": 4}, 1))
    a = make({"dp_size": 4}, 1)
    list(islice(iter(a), 3))
    b = make({"dp_size": 3}, 1)
    b.load_state_dict(a.state_dict())
    assert b.state_dict()["segments"] and b.state_dict()["position"] == 0
    c = make({"dp_size": 4}, 1)
    c.load_state_dict(b.state_dict())
    assert c.state_dict() == a.state_dict() and c.epoch_offset() == 0
    assert all(batches_equal(x, y) for x, y in zip(list(c), ref[3:], strict=True))


def test_epoch_offset_counts_micro_batches_from_the_start_of_the_epoch(wds):
    """After resizes ``microbatch`` restarts at 0 in each segment; ``microbatch +
    epoch_offset(epoch)`` does not: each (epoch, micro-batch in epoch) of a rank once, in order,
    across dp 4 -> 3 -> 5."""
    make = _packed_maker(*wds)

    def keys(loader, stop=None):
        return [
            (x["epoch"], x["microbatch"] + loader.epoch_offset(x["epoch"]))
            for x in islice(iter(loader), stop)
        ]

    a = make({"dp_size": 4}, 0)
    got = keys(a, 5)
    b = make({"dp_size": 3, "k": 2}, 0)
    b.load_state_dict(a.state_dict())
    assert b.epoch_offset() == 5 and b.epoch_offset(1) == 0
    got += keys(b, 3)
    c = make({"dp_size": 5}, 0)
    c.load_state_dict(b.state_dict())
    assert c.epoch_offset() == 8 and len(c) == 2
    got += keys(c)
    assert got == [(0, i) for i in range(10)]
    assert c.epoch == 1 and c.epoch_offset() == 0 and keys(c)[0] == (1, 0)


def test_the_harness_catches_a_loader_that_ignores_the_resize(wds):
    """Planted bug: a loader that resumes a resized state at its position as if nothing changed
    (Megatron's failure mode) repeats and loses samples; a budget overrun and unequal counts are
    caught too."""
    make = _packed_maker(*wds)

    class Unaware:
        def __init__(self, config, rank):
            self.inner, self.config = make(config, rank), config

        def __iter__(self):
            return iter(self.inner)

        def state_dict(self):
            return self.inner.state_dict()

        def load_state_dict(self, state):
            self.inner.load_state_dict(
                {**state, "config": {**state["config"], "dp_size": self.config["dp_size"]}}
            )

    segments = [({"dp_size": 4}, 3), ({"dp_size": 3}, None)]
    with pytest.raises(ResumeConformanceError, match="more than once|lost"):
        assert_resumes_elastically(Unaware, segments, budget=BUDGET, padded_length=_padded)
    with pytest.raises(ResumeConformanceError, match="over the budget"):
        assert_resumes_elastically(
            make, segments, budget=BUDGET, padded_length=lambda b: BUDGET + 1
        )

    class Uneven(Unaware):
        def __iter__(self):
            it = iter(self.inner)
            return it if self.inner.dp_rank else islice(it, 1)

        load_state_dict = property(lambda self: self.inner.load_state_dict)

    with pytest.raises(ResumeConformanceError, match="ranks yielded"):
        assert_resumes_elastically(Uneven, segments, budget=BUDGET, padded_length=_padded)


# ---- StreamingPackedLoader
# -----------------------------------------------------------------------------
def _stream_maker(paths):
    def make(config: dict, rank: int) -> StreamingPackedLoader:
        return StreamingPackedLoader(
            WebDatasetSource(paths),
            schema=SCHEMA,
            layout=LAYOUT,
            token_budget=BUDGET,
            cp_rank=0,
            seed=5,
            dp_size=config["dp_size"],
            dp_rank=rank,
            num_workers=config.get("num_workers", 0),
            buffer_size=16,
        )

    return make


@pytest.mark.slow
def test_streaming_other_num_workers_serves_every_sample_once(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(160, seed=6), num_shards=5)
    segments = [
        ({"dp_size": 1, "num_workers": 2}, 7),
        ({"dp_size": 1, "num_workers": 0}, 4),
        ({"dp_size": 1, "num_workers": 3}, None),
    ]
    result = assert_resumes_elastically(
        _stream_maker(paths), segments, budget=BUDGET, padded_length=_padded
    )
    assert result == {"counts": [7, 4, 33], "samples": 160}  # golden


@pytest.mark.slow
@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    num_shards=st.integers(1, 6),
    configs=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), min_size=2, max_size=3),
    data_seed=st.integers(0, 2**32 - 1),
)
def test_streaming_any_worker_counts(tmp_path_factory, num_shards, configs, data_seed):
    """Lognormal lengths (a seed hypothesis draws), 1..6 shards (fewer shards than readers
    included), any chain of worker counts and stops."""
    lengths = (
        np.clip(np.random.default_rng(data_seed).lognormal(3.0, 0.7, 120), 1, 120)
        .astype(int)
        .tolist()
    )
    paths = write_shards(str(tmp_path_factory.mktemp("any")), lengths, num_shards=num_shards)
    segments = [({"dp_size": 1, "num_workers": w}, stop) for w, stop in configs[:-1]]
    segments.append(({"dp_size": 1, "num_workers": configs[-1][0]}, None))
    result = assert_resumes_elastically(
        _stream_maker(paths), segments, budget=BUDGET, padded_length=_padded
    )
    assert result["samples"] == len(lengths)


def test_streaming_fewer_shards_than_readers(tmp_path):
    """Two shards, three readers: every reader scans both and keeps every third sample of what is
    left."""
    paths = write_shards(str(tmp_path), sample_lengths(90, seed=2), num_shards=2)
    segments = [({"dp_size": 1, "num_workers": 3}, 5), ({"dp_size": 1, "num_workers": 0}, None)]
    assert (
        assert_resumes_elastically(
            _stream_maker(paths), segments, budget=BUDGET, padded_length=_padded
        )["samples"]
        == 90
    )


def _stream_resized(paths, first: dict, stop: int, then: dict, rank: int = 0, **kwargs):
    """(state after ``stop`` micro-batches of rank 0 under ``first``, a rank of ``then`` loaded with
    it)."""
    a = _stream_maker(paths)(first, 0)
    list(islice(iter(a), stop))
    b = StreamingPackedLoader(
        WebDatasetSource(paths),
        schema=SCHEMA,
        layout=LAYOUT,
        token_budget=BUDGET,
        cp_rank=0,
        seed=5,
        dp_size=then["dp_size"],
        dp_rank=rank,
        num_workers=then.get("num_workers", 0),
        buffer_size=16,
        **kwargs,
    )
    b.load_state_dict(a.state_dict())
    return a.state_dict(), b


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda s: {**s, "segments": [{**s["segments"][0], "dp_size": 21}]},
            r"segments\[0\]: dp_size 21 \* num_workers 2 readers; expected at most the 40 samples",
        ),
        (
            lambda s: {**s, "segments": [{**s["segments"][0], "microbatches_per_step": 2}]},
            r"segments\[0\].microbatches_per_step: expected 1 .*got 2",
        ),
        (
            lambda s: {**s, "segments": [{**s["segments"][0], "num_workers": None}]},
            r"segments\[0\].num_workers: expected an int, got null",
        ),
    ],
)
def test_streaming_refuses_segments_no_run_writes(tmp_path, edit, message):
    """At load_state_dict, before any replay: more readers than the stream has samples (counted: 2
    shards), a field a stream's batches do not depend on, an elastic one null."""
    paths = write_shards(str(tmp_path), sample_lengths(40, seed=3), num_shards=2)
    _, b = _stream_resized(paths, {"dp_size": 1, "num_workers": 2}, 2, {"dp_size": 1})
    state = b.state_dict()
    assert state["segments"] == [
        {"dp_size": 1, "microbatches_per_step": 1, "num_workers": 2, "position": 2}
    ]
    c = _stream_maker(paths)({"dp_size": 1, "num_workers": 3}, 0)
    with pytest.raises(ResumeError, match=message):
        c.load_state_dict(edit(state))
    assert "segments" not in c.state_dict()


@pytest.mark.slow
def test_streaming_served_ids_are_one_shared_sorted_array(tmp_path):
    """The ids earlier segments served: one sorted int64 tensor (8 bytes a sample), built once, in
    shared memory for the workers; a spawned worker gets it and the epoch is served exactly once."""
    from prealign.loaders import LoadingOptions

    paths = write_shards(str(tmp_path), sample_lengths(60, seed=9), num_shards=3)
    first = [
        i
        for x in islice(iter(_stream_maker(paths)({"dp_size": 1, "num_workers": 2}, 0)), 4)
        for i in x["sample_index"].tolist()
    ]
    _, b = _stream_resized(
        paths,
        {"dp_size": 1, "num_workers": 2},
        4,
        {"dp_size": 1, "num_workers": 1},
        loading=LoadingOptions(multiprocessing_context="spawn"),
    )
    served = b._served_before(0)
    assert served.dtype == torch.int64 and served.tolist() == sorted(first) and served.is_shared()
    assert b._served_before(0) is served  # built once per epoch
    rest = [i for x in b for i in x["sample_index"].tolist()]
    assert sorted(first + rest) == sorted(
        i for shard in range(3) for i in range(shard << 32, (shard << 32) + 20)
    )


@pytest.mark.slow
def test_round_robin_is_the_dataloader_order():
    """What the streaming replay assumes: a DataLoader over W iterable readers serves them in turn,
    a reader that ran out left out (unequal lengths)."""

    class Readers(torch.utils.data.IterableDataset):
        def __iter__(self):
            w = torch.utils.data.get_worker_info().id
            return iter([(w, i) for i in range((5, 2, 8)[w])])

    loader = torch.utils.data.DataLoader(
        Readers(), num_workers=3, batch_size=None, prefetch_factor=2
    )
    got = [tuple(int(x) for x in item) for item in loader]
    assert got == round_robin([[(w, i) for i in range(n)] for w, n in enumerate((5, 2, 8))], 100)
    assert len(got) == 15


def _stream_rank(
    rank: int, world: int, port: int, results, config: dict, stop, paths: list[str], state
) -> None:
    """One gloo rank of a segment (:func:`tests.conftest.spawn_ranks`): its micro-batches' ids and
    padded lengths, and the state it takes."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    loader = _stream_maker(paths)(config, rank)
    if state is not None:
        loader.load_state_dict(state)
    it = iter(loader)
    batches = list(it) if stop is None else list(islice(it, stop))
    results[rank] = {
        "ids": [b["sample_index"].tolist() for b in batches],
        "padded": [_padded(b) for b in batches],
        "state": loader.state_dict(),
    }
    it.close()
    dist.destroy_process_group()


@pytest.mark.slow
def test_streaming_dp_4_3_5_on_gloo_ranks(tmp_path):
    """Real ranks (gloo on 127.0.0.1, the end-of-epoch agreement live): dp 4 (2 workers) -> 3 (none)
    -> 5 (1 worker); 7 shards, so the readers' shard split changes at each resize."""
    paths = write_shards(str(tmp_path / "shards"), sample_lengths(210, seed=12), num_shards=7)
    state, served, counts = None, [], []
    for config, stop in [
        ({"dp_size": 4, "num_workers": 2}, 3),
        ({"dp_size": 3, "num_workers": 0}, 4),
        ({"dp_size": 5, "num_workers": 1}, None),
    ]:
        got = spawn_ranks(_stream_rank, config["dp_size"], config, stop, paths, state)
        ranks = [got[r] for r in range(config["dp_size"])]
        counts.append([len(r["ids"]) for r in ranks])
        assert len(set(counts[-1])) == 1, (
            counts
        )  # equal micro-batch counts across the ranks of the segment
        assert all(t <= BUDGET for r in ranks for t in r["padded"])
        assert all(r["state"] == ranks[0]["state"] for r in ranks)
        served += [i for r in ranks for mb in r["ids"] for i in mb]
        state = ranks[0]["state"]
    assert counts[0][0] == 3 and counts[1][0] == 4 and counts[2][0] > 0
    assert sorted(served) == sorted(
        i for shard in range(7) for i in range(shard << 32, (shard << 32) + 30)
    )
    assert (state["epoch"], state["position"]) == (1, 0) and "segments" not in state
