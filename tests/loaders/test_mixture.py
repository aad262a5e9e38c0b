"""Mixtures (issue #30): components weighted by tokens or samples, interleaved so that every stretch
of global steps holds the weights, packed together, resumable through resizes and weight changes."""

from __future__ import annotations

import json
from collections import Counter
from itertools import islice

import datasets
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prealign.loaders import (
    BadDataPolicy,
    BadSampleError,
    HFSource,
    PackedLoader,
    PlannerConfig,
    ResumeError,
)
from prealign.loaders.conformance import assert_resumes_exactly
from prealign.loaders.index.sample_index import SampleIndex
from prealign.loaders.mixture import Component, Mixture, steps_served
from prealign.loaders.plan.mixing import MixSpec, mixed_order, window_shares
from prealign.loaders.plan.planner import ChunkedPlan
from prealign.loaders.plan.schedule import Schedule
from prealign.loaders.policy import BadDataReport, PackStrategy
from prealign.schemas import ParallelLayout, causal_lm_schema
from prealign.schemas.errors import ConfigError, PrealignError
from tests.loader_helpers import hf_rows, sample_lengths
from tests.loaders.plan.test_planner import check_plan

SCHEMA = causal_lm_schema()
WEIGHTS = (0.6, 0.3, 0.1)
BUDGET, DP, WINDOW = 8192, 2, 16


class _Nothing(HFSource):
    """A source the pure tests never read (they plan on index lengths only)."""

    def __init__(self):
        pass

    num_shards = 1


def _part(lengths) -> SampleIndex:
    n = len(lengths)
    return SampleIndex(
        lengths=np.asarray(lengths, np.int64),
        locations=np.arange(n, dtype=np.int64)[:, None],
        shards=np.zeros(n, np.int64),
        report=BadDataReport(),
    )


def _lengths(seed=0, sizes=(20000, 2000, 500)):
    """Mean lengths 100 / 1,000 / 4,000 tokens (uniform within +-50%), 2M tokens per component."""
    rng = np.random.default_rng(seed)
    return [
        rng.integers(50, 151, sizes[0]),
        rng.integers(500, 1501, sizes[1]),
        rng.integers(3000, 5001, sizes[2]),
    ]


def _mixture(lengths, by="tokens", weights=WEIGHTS, **kw) -> Mixture:
    mix = Mixture(
        {n: (_Nothing(), w) for n, w in zip(("web", "code", "math"), weights)}, by=by, **kw
    )
    mix.merged([_part(x) for x in lengths])
    return mix


def _schedule(mix: Mixture, dp=DP, budget=BUDGET, strategy=PackStrategy.STEP_FIT) -> Schedule:
    index = mix.merged(mix.parts)
    sch = Schedule(
        index,
        layout=ParallelLayout(),
        token_budget=budget,
        dp_size=dp,
        planner=PlannerConfig(strategy=strategy),
        seed=0,
        shuffle=True,
        sequential=False,
        window=1,
        step_window=1,
        order_of=lambda e, served: mix.epoch_order(
            e, seed=0, shuffle=True, window=1, served=served
        ),
    )
    return sch


def _served(sch: Schedule, epoch=0):
    return steps_served(sch, epoch)


def _shares(mix: Mixture, ids, bounds, by):
    comp = mix.component_of()[ids]
    units = mix.merged(mix.parts).lengths[ids] if by == "tokens" else np.ones(ids.size, np.int64)
    epoch = window_shares(comp, units, np.array([0]), np.array([ids.size]), 3)[0]
    n = bounds.size - 1
    windows = window_shares(comp, units, bounds[: n - WINDOW + 1], bounds[WINDOW:], 3)
    return epoch, windows


@pytest.mark.parametrize("by", ["tokens", "samples"])
def test_shares_hold_over_the_epoch_and_every_16_steps(by):
    mix = _mixture(_lengths(), by=by)
    ids, bounds = _served(_schedule(mix))
    epoch, windows = _shares(mix, ids, bounds, by)
    assert np.abs(epoch - WEIGHTS).max() <= 0.005, epoch
    assert np.abs(windows - WEIGHTS).max() <= 0.025, np.abs(windows - WEIGHTS).max(axis=0)
    assert windows.shape[0] > 100  # (not vacuous: hundreds of windows)
    # each component's samples served evenly: counts of any two samples of one component differ by
    # at most 1
    counts = np.bincount(ids, minlength=sum(len(p) for p in mix.parts))
    comp_of = mix.component_of()
    for c in range(3):
        got = counts[comp_of == c]
        assert got.max() - got.min() <= 1, (c, got.min(), got.max())


def test_the_planners_buffered_best_fit_would_not_hold_the_shares_locally():
    """Why mixtures plan with STEP_FIT: BFD's buffer moves samples by many steps (the window test
    fails)."""
    mix = _mixture(_lengths())
    ids, bounds = _served(_schedule(mix, strategy=PackStrategy.BFD))
    epoch, windows = _shares(mix, ids, bounds, "tokens")
    assert np.abs(epoch - WEIGHTS).max() <= 0.005
    assert np.abs(windows - WEIGHTS).max() > 0.025


def test_megatron_blended_dataset_on_the_same_lengths():
    """Megatron's BlendedDataset given sample weights hand-converted from the token weights (by the
    mean lengths), its order packed the same way: ours holds the token shares as tightly with no
    conversion."""
    try:
        from megatron.core.datasets import helpers
    except ImportError:  # pragma: no cover - a megatron-core without its compiled helpers
        pytest.skip("platform: megatron-core's dataset helpers cannot be imported")
    lengths = _lengths()
    mix = _mixture(lengths)
    ours_ids, ours_bounds = _served(_schedule(mix))
    ours = np.abs(_shares(mix, ours_ids, ours_bounds, "tokens")[1] - WEIGHTS).max()
    sample_w = np.array(WEIGHTS) / np.array([x.mean() for x in lengths])
    sample_w /= sample_w.sum()
    size = int(ours_ids.size)
    dataset_index = np.zeros(size, np.int16)
    dataset_sample_index = np.zeros(size, np.int64)
    helpers.build_blending_indices(dataset_index, dataset_sample_index, sample_w, 3, size, False)
    streams = [
        mixed_order(
            MixSpec(names=("x",), weights=(1.0,), by="samples", length=size),
            [x],
            epoch=0,
            seed=0,
            shuffle=True,
        ).ids
        for x in lengths
    ]  # each dataset's own shuffled passes
    offsets = np.cumsum([0] + [len(x) for x in lengths])
    theirs_order = np.array(
        [offsets[d] + streams[d][j] for d, j in zip(dataset_index, dataset_sample_index)]
    )
    theirs_mix = _mixture(lengths)
    sch = _schedule(theirs_mix)
    sch.order_of = lambda e, served: theirs_order
    ids, bounds = _served(sch)
    theirs_epoch, theirs_windows = _shares(theirs_mix, ids, bounds, "tokens")
    theirs = np.abs(theirs_windows - WEIGHTS).max()
    assert ours <= 0.025 and ours <= theirs + 0.005, (ours, theirs, theirs_epoch)


@pytest.mark.parametrize(
    "length,expect", [("first_exhausted", None), ("all_exhausted", None), (3000, 3000)]
)
def test_epoch_lengths_by_samples(length, expect):
    sizes = (300, 60, 40)
    mix = MixSpec(names=("a", "b", "c"), weights=WEIGHTS, by="samples", length=length)
    mo = mixed_order(mix, [np.ones(n, np.int64) for n in sizes], epoch=0, seed=1, shuffle=True)
    counts = np.bincount(mo.component, minlength=3)
    if (
        length == "first_exhausted"
    ):  # the largest epoch repeating nothing: one component exactly used up
        assert (counts <= np.array(sizes)).all() and (counts == np.array(sizes)).any()
    elif length == "all_exhausted":  # the smallest in which every one is seen whole
        assert (counts >= np.array(sizes)).all() and (counts == np.array(sizes)).any()
    else:
        assert counts.sum() == expect
    assert np.abs(counts / counts.sum() - WEIGHTS).max() < 0.01


def test_down_sampling_is_a_different_subset_each_epoch_and_up_sampling_whole_passes():
    lengths = [np.full(100, 10), np.full(1000, 10)]
    mix = MixSpec(names=("small", "big"), weights=(0.5, 0.5), by="tokens")
    e0, e1 = (mixed_order(mix, lengths, epoch=e, seed=0, shuffle=True) for e in (0, 1))
    small = np.bincount(e0.ids[e0.component == 0], minlength=100)
    assert (
        set(small.tolist()) == {5, 6}
        or set(small.tolist()) == {5}
        or small.max() - small.min() <= 1
    )
    assert small.sum() == 550  # up-sampled 5.5x: five whole passes and half of one
    big0, big1 = (set(e.ids[e.component == 1].tolist()) for e in (e0, e1))
    assert (
        len(big0) == 550 and len(big1) == 550 and big0 != big1
    )  # down-sampled: another subset each epoch


def test_repeat_gives_exact_counts():
    lengths = [np.full(50, 7), np.full(30, 9), np.full(20, 3)]
    mix = MixSpec(
        names=("a", "b", "c"), weights=(None, None, 1.0), repeats=(2, 0.5, None), by="tokens"
    )
    mo = mixed_order(mix, lengths, epoch=0, seed=0, shuffle=True)
    counts = np.bincount(mo.component, minlength=3)
    assert counts.tolist() == [100, 15, 20]
    assert np.bincount(mo.ids[mo.component == 0]).tolist() == [2] * 50


# ---- the loader
# ------------------------------------------------------------------------------------
def _hf(n, lo, hi, seed, start=0):
    rows = hf_rows(sample_lengths(n, seed, lo, hi))
    rows["input_ids"] = [[10_000 + start + i] + r[1:] for i, r in enumerate(rows["input_ids"])]
    return HFSource(datasets.Dataset.from_dict(rows))


@pytest.fixture(scope="module")
def sources():
    return {
        "web": _hf(240, 4, 20, 0, 0),
        "code": _hf(60, 20, 60, 1, 1000),
        "math": _hf(30, 40, 90, 2, 2000),
    }


def _loader(mix, *, dp=2, rank=0, k=1, seed=0, **kw):
    return PackedLoader(
        mix,
        schema=SCHEMA,
        layout=ParallelLayout(cp=2),
        token_budget=256,
        cp_rank=0,
        dp_size=dp,
        dp_rank=rank,
        seed=seed,
        planner=PlannerConfig(microbatches_per_step=k, chunk_size=64),
        **kw,
    )


def _mix(sources, weights=WEIGHTS, **kw):
    return Mixture({n: (s, w) for (n, s), w in zip(sources.items(), weights)}, **kw)


def test_batches_carry_sample_component_and_resume_exactly(sources):
    mix = _mix(sources)
    loader = _loader(mix)
    batches = list(loader)
    assert loader.planner.strategy is PackStrategy.STEP_FIT
    comp_of = mix.component_of()
    for b in batches:
        assert b["sample_component"].dtype == b["sample_index"].dtype
        assert b["sample_component"].tolist() == comp_of[b["sample_index"].numpy()].tolist()
        first = b["input_ids"][0]  # cp rank 0's shard starts with the first sequence's first token
        assert int(first[0]) // 1000 - 10 == int(b["sample_component"][0])
    assert {int(c) for b in batches for c in b["sample_component"]} == {0, 1, 2}
    for mid in (1, 5, len(batches) - 1):
        assert_resumes_exactly(lambda: _loader(mix), midpoint=mid)
    assert len(json.dumps(loader.state_dict())) < 2000


def test_pack_within_component_keeps_each_micro_batch_to_one_component(sources):
    mix = _mix(sources, pack_within_component=True)
    loaders = [_loader(mix, rank=r) for r in range(2)]
    batches = [b for loader in loaders for b in loader]
    assert all(len(set(b["sample_component"].tolist())) == 1 for b in batches if not b["is_filler"])
    assert {int(b["sample_component"][0]) for b in batches} == {0, 1, 2}
    served = Counter(i for b in batches for i in b["sample_index"].tolist())
    assert sum(served.values()) == loaders[0].plan(0).stats.num_samples  # every planned draw, once


def _epoch_ids(make, configs):
    """Sample ids served over one epoch in segments: ``configs[i] = (dp, k, stop)``."""
    got, state = Counter(), None
    for dp, k, stop in configs:
        states = []
        for r in range(dp):
            loader = make(dp=dp, rank=r, k=k)
            if state is not None:
                loader.load_state_dict(json.loads(json.dumps(state)))
            n = stop(loader) if callable(stop) else stop
            got.update(i for b in islice(iter(loader), n) for i in b["sample_index"].tolist())
            states.append(loader.state_dict())
        assert all(s == states[0] for s in states)
        state = states[0]
    return got, state


def test_elastic_resume_dp_4_3_5_serves_the_uninterrupted_epoch(sources):
    mix = _mix(sources)

    def make(**kw):
        return _loader(mix, **kw)

    want, _ = _epoch_ids(make, [(4, 1, None)])
    got, _ = _epoch_ids(make, [(4, 1, 3), (3, 2, 2), (5, 1, None)])
    assert got == want


@pytest.mark.slow
def test_elastic_resume_with_dataloader_workers_2_then_1(sources):
    """The plan does not depend on the workers: a state of 2 workers per rank resumes under 1 (and
    DP 4 -> 3)."""
    mix = _mix(sources)

    def make(*, workers, **kw):
        return _loader(mix, num_workers=workers, **kw)

    want, _ = _epoch_ids(lambda **kw: make(workers=0, **kw), [(4, 1, None)])
    first, state = _epoch_ids(lambda **kw: make(workers=2, **kw), [(4, 1, 3)])
    rest = Counter()
    for r in range(3):
        loader = make(workers=1, dp=3, rank=r)
        loader.load_state_dict(state)
        rest.update(i for b in loader for i in b["sample_index"].tolist())
    assert first + rest == want


def test_changed_weights_at_resume_serve_nothing_twice_and_follow_the_new_weights():
    big = {
        "web": _hf(3000, 4, 20, 0, 0),
        "code": _hf(600, 20, 60, 1, 1000),
        "math": _hf(300, 40, 90, 2, 2000),
    }
    old, new = (0.6, 0.3, 0.1), (0.2, 0.3, 0.5)

    def ids_and_comps(loader, n=None):
        out = list(islice(iter(loader), n))
        return [
            (i, c)
            for b in out
            for i, c in zip(b["sample_index"].tolist(), b["sample_component"].tolist())
        ]

    first = _loader(_mix(big, old, length="first_exhausted"), dp=1)
    before = ids_and_comps(first, 40)
    state = first.state_dict()
    second = _loader(_mix(big, new, length="first_exhausted"), dp=1)
    second.load_state_dict(state)
    after = ids_and_comps(second)
    ids = [i for i, _ in before + after]
    assert len(ids) == len(set(ids))  # no sample twice in the epoch
    lens = second.index.lengths

    def share(pairs):
        tok = np.bincount([c for _, c in pairs], weights=[lens[i] for i, _ in pairs], minlength=3)
        return tok / tok.sum()

    assert np.abs(share(before) - old).max() < 0.05
    assert np.abs(share(after[: len(after) * 3 // 4]) - new).max() < 0.05
    resumed = second.state_dict()
    assert resumed["mixture"]["phases"] == [] or resumed["epoch"] == 1  # (the epoch ran to its end)
    # a resume of the resumed run, mid-way, yields the same batches as going on
    third = _loader(_mix(big, new, length="first_exhausted"), dp=1)
    third.load_state_dict(state)
    it = iter(third)
    head = list(islice(it, 7))
    mid = third.state_dict()
    assert mid["mixture"]["phases"] and mid["position"] == 7
    fourth = _loader(_mix(big, new, length="first_exhausted"), dp=1)
    fourth.load_state_dict(mid)
    rest = list(fourth)
    again = [i for b in head + rest for i in b["sample_index"].tolist()]
    assert again == [i for i, _ in after]


def test_added_or_removed_component_is_refused_unless_opted_in(sources):
    loader = _loader(_mix(sources))
    list(islice(iter(loader), 2))
    state = loader.state_dict()
    two = {k: sources[k] for k in ("web", "code")}
    with pytest.raises(ResumeError, match=r"removed \['math'\]"):
        _loader(_mix(two, (0.5, 0.5))).load_state_dict(state)
    opted = _loader(_mix(two, (0.5, 0.5), on_component_change="next_epoch"))
    opted.load_state_dict(state)
    assert opted.epoch == 1 and next(iter(opted))["microbatch"] == 0


def test_an_empty_or_all_bad_component_is_an_error_naming_it(sources):
    mix = Mixture(
        {
            "web": (sources["web"], 0.9),
            "broken": (HFSource(datasets.Dataset.from_dict({"input_ids": [[], []]})), 0.1),
        }
    )
    with pytest.raises(PrealignError, match="broken"):
        _loader(mix, bad_data=BadDataPolicy(on_error="skip", warn=False)).prepare()
    with pytest.raises(PrealignError, match="broken"):
        _loader(mix).prepare()


def test_a_component_whose_samples_do_not_fit_the_schema_is_named_with_the_field(sources):
    wrong = HFSource(datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]], "labels": [[1, 2]]}))
    mix = Mixture({"web": (sources["web"], 0.9), "odd": (wrong, 0.1)})
    with pytest.raises(BadSampleError, match=r"odd.*labels|labels.*odd") as err:
        _loader(mix).prepare()
    assert "odd" in str(err.value)


def test_bad_mixture_arguments_are_config_errors(sources):
    with pytest.raises(ConfigError, match="weight"):
        Mixture({"a": (sources["web"], -1)})
    with pytest.raises(ConfigError, match="by"):
        Mixture({"a": (sources["web"], 1)}, by="bytes")
    with pytest.raises(ConfigError, match="not both|weight or a repeat"):
        Mixture({"a": Component(sources["web"], weight=1, repeat=2)})


def test_mixture_file_resolves_paths_against_the_file(tmp_path, sources):
    folder = tmp_path / "data"
    folder.mkdir()
    for name in ("web", "code"):
        sources[name].dataset.to_json(str(folder / f"{name}.jsonl"))
    spec = {
        "by": "samples",
        "components": {
            "web": {"hf": "data/web.jsonl", "weight": 0.7},
            "code": {"hf": "data/code.jsonl", "repeat": 1},
        },
    }
    path = tmp_path / "mix.json"
    path.write_text(json.dumps(spec))
    mix = Mixture.from_file(str(path))
    assert (
        mix.names == ("web", "code") and mix.spec.by == "samples" and mix.spec.repeats == (None, 1)
    )
    assert len(list(_loader(mix))) > 0
    path.write_text(json.dumps({**spec, "weights": 1}))
    with pytest.raises(ConfigError, match="weights"):
        Mixture.from_file(str(path))


def test_mixture_report_counts_planned_served_and_bad_per_component(sources):
    rows = hf_rows(sample_lengths(20, 5, 4, 20))
    rows["input_ids"][3] = []  # bad: empty
    mix = Mixture(
        {"web": (sources["web"], 0.7), "flaky": (HFSource(datasets.Dataset.from_dict(rows)), 0.3)}
    )
    loader = _loader(mix, dp=2, bad_data=BadDataPolicy(on_error="skip", warn=False))
    before = loader.mixture_report()
    assert before["web"]["samples_served"] == 0 and sum(before["flaky"]["bad"].values()) == 1
    assert before["web"]["bad"] == {} and len(before["flaky"]["bad_examples"]) == 1
    batches = list(islice(iter(loader), 4))
    rep = loader.mixture_report(0)
    served = Counter(
        int(c) for b in batches for c in b["sample_component"]
    )  # rank 0's only: a lower bound
    assert rep["web"]["samples_served"] >= served[0] and rep["flaky"]["samples_served"] >= served[1]
    whole = loader.mixture_report(1)  # a later epoch: planned, nothing served yet
    assert whole["web"]["samples_served"] == 0
    assert abs(whole["web"]["share_planned"] - 0.7) < 0.02 and whole["web"]["weight_share"] == 0.7
    assert json.loads(json.dumps(rep)) == rep


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    weights=st.lists(st.floats(0.05, 1.0), min_size=2, max_size=3),
    by=st.sampled_from(["tokens", "samples"]),
    stops=st.lists(st.floats(0.05, 0.6), min_size=2, max_size=2),
    seed=st.integers(0, 50),
)
def test_random_mixtures_resumed_at_random_points_dp_4_3_5_serve_the_uninterrupted_epoch(
    sources, weights, by, stops, seed
):
    names = list(sources)[: len(weights)]
    mix = Mixture({n: (sources[n], w) for n, w in zip(names, weights)}, by=by)

    def make(**kw):
        return _loader(mix, seed=seed, **kw)

    want, _ = _epoch_ids(make, [(4, 1, None)])
    got, _ = _epoch_ids(
        make,
        [
            (4, 1, lambda lo: max(1, int(stops[0] * len(lo)))),
            (3, 2, lambda lo: max(1, int(stops[1] * len(lo)))),
            (5, 1, None),
        ],
    )
    assert got == want and sum(want.values()) > 0


def test_components_of_different_kinds_webdataset_hf_map_and_hf_streaming(tmp_path, sources):
    from prealign.loaders import WebDatasetSource
    from tests.loader_helpers import write_shards

    wds = WebDatasetSource(
        write_shards(str(tmp_path), sample_lengths(40, seed=3, low=4, high=30), num_shards=2)
    )
    stream = HFSource(
        datasets.Dataset.from_dict(hf_rows(sample_lengths(30, 4, 4, 30))).to_iterable_dataset(
            num_shards=3
        )
    )
    mix = Mixture({"tar": (wds, 0.4), "map": (sources["code"], 0.3), "stream": (stream, 0.3)})
    loader = _loader(mix, dp=1)
    batches = list(loader)
    per = Counter(int(c) for b in batches for c in b["sample_component"])
    assert set(per) == {0, 1, 2}
    assert sum(per.values()) == loader.plan(0).stats.num_samples
    assert_resumes_exactly(lambda: _loader(mix, dp=1), midpoint=3)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=0, max_size=200),
    dp=st.integers(1, 4),
    k=st.integers(1, 3),
    groups=st.one_of(st.none(), st.integers(1, 3)),
    chunk=st.sampled_from([7, 40, 16384]),
    max_seqs=st.sampled_from([None, 3]),
    budget=st.sampled_from([256, 300, 1000]),
)
def test_step_fit_plans_keep_every_plan_invariant(lengths, dp, k, groups, chunk, max_seqs, budget):
    """STEP_FIT plans as every strategy does: each sample once, every micro-batch within the budget
    and ``max_seqs``, the same count on every rank; with groups, a micro-batch holds one group
    only."""
    layout = ParallelLayout(cp=2, max_seqs=max_seqs) if max_seqs else ParallelLayout(cp=2)
    label = None if groups is None else np.arange(len(lengths)) % groups
    plan = ChunkedPlan(
        lengths,
        layout=layout,
        token_budget=budget,
        dp_size=dp,
        groups=label,
        oversize="skip",
        config=PlannerConfig(strategy="step_fit", microbatches_per_step=k, chunk_size=chunk),
    ).full()
    check_plan(plan, lengths, layout, budget, dp)
    for rank in plan.microbatches:
        for mb in rank:
            assert max_seqs is None or len(mb) <= max_seqs
            assert label is None or len({int(label[i]) for i in mb}) <= 1


def test_changed_weights_and_dp_size_together_then_a_resume_in_the_new_phase():
    """DP 2 under the old weights, DP 3 under the new ones from a state, and that run resumed
    mid-way (its phase replays the DP-2 part): no sample twice, and the resumed run goes on
    exactly."""
    big = {
        "web": _hf(1500, 4, 20, 0, 0),
        "code": _hf(300, 20, 60, 1, 1000),
        "math": _hf(150, 40, 90, 2, 2000),
    }
    old, new = (0.6, 0.3, 0.1), (0.3, 0.3, 0.4)

    def make(weights, dp, rank):
        return _loader(_mix(big, weights, length="first_exhausted"), dp=dp, rank=rank)

    served = Counter()
    state = None
    for r in range(2):
        loader = make(old, 2, r)
        served.update(i for b in islice(iter(loader), 6) for i in b["sample_index"].tolist())
        state = loader.state_dict()
    goes_on, mid = [], None
    for r in range(3):
        loader = make(new, 3, r)
        loader.load_state_dict(state)
        it = iter(loader)
        head = [b["sample_index"].tolist() for b in islice(it, 4)]
        if r == 0:
            mid = loader.state_dict()
        tail = [b["sample_index"].tolist() for b in it]
        goes_on.append(tail)
        served.update(i for mb in head + tail for i in mb)
    assert max(served.values()) == 1  # nothing twice across the phases and ranks
    assert mid["mixture"]["phases"] and mid["mixture"]["phases"][0]["segments"][0]["dp_size"] == 2
    for r in range(3):
        again = make(new, 3, r)
        again.load_state_dict(mid)
        assert [b["sample_index"].tolist() for b in again] == goes_on[r]
