"""A :class:`Mixture` stream resumes by cursors (issue #28, item 4): each reader's cursor holds each
component stream's own cursor and the interleave's state (``used``, ``recent``, ``ended``), so a
resume seeks every component instead of replaying the mixed stream. Under the same topology the
batches are the uninterrupted run's; under another (a version-5 state) each component's consumed
shards are skipped and every sample of the epoch is served once; the work a resume does does not
grow with the position."""

from __future__ import annotations

import json
from itertools import islice

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prealign.loaders import Mixture, WebDatasetSource
from prealign.loaders.errors import ResumeError
from prealign.loaders.state import CURSOR_VERSION, PACKED_VERSION
from tests.loader_helpers import sample_lengths, write_shards
from tests.loaders.test_stream_cursors import (
    CountingSource,
    _make,
    _resumed,
    _same,
    _with_bad_data,
)
from tests.loaders.test_stream_elastic import (
    _check_once,
    _ids,
    _resume,
    _serve,
    _within_budget,
)


def _mixture(paths, by: str = "tokens", weights=(0.7, 0.3), kind=WebDatasetSource) -> Mixture:
    """Two components: ``paths[0]`` (short samples, bad data) and ``paths[1]`` (long ones)."""
    return Mixture(
        {name: (kind(p), w) for name, p, w in zip(("short", "long"), paths, weights)}, by=by
    )


def _source(by: str = "tokens", weights=(0.7, 0.3), kind=WebDatasetSource):
    return lambda paths: _mixture(paths, by, weights, kind)


@pytest.fixture(scope="module")
def mix_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixres")
    return (
        write_shards(
            str(root / "short"), sample_lengths(300, seed=4), num_shards=5, extra=_with_bad_data
        ),
        write_shards(
            str(root / "long"), sample_lengths(100, seed=5, low=30, high=90), num_shards=3
        ),
    )


@pytest.mark.parametrize("by, workers", [("tokens", 0), ("tokens", 2), ("samples", 0)])
def test_mixture_cursor_resume_is_the_uninterrupted_run(mix_paths, by, workers):
    """Golden: a 0.7 / 0.3 mixture (bad data in one component); resumed at the start, mid-epoch,
    near the end, and a resume of a resume: version 4 with a ``mix`` cursor per reader, the batches
    exactly the uninterrupted run's, and the next epoch a fresh one's."""
    kw = {"source": _source(by), "num_workers": workers}
    full = list(_make(mix_paths, **kw))
    assert len(full) > 30
    for stop in (1, 9, len(full) // 2, len(full) - 1):
        state, rest = _resumed(mix_paths, stop, cursors=True, **kw)
        assert state["version"] == CURSOR_VERSION
        mixes = [r["mix"] for r in state["cursors"]["readers"] if r is not None]
        assert mixes and all(len(m["streams"]) == 2 for m in mixes)
        _same(rest, full[stop:])
    a = _make(mix_paths, **kw)
    it = iter(a)
    list(islice(it, 5))
    b = _make(mix_paths, **kw)
    b.load_state_dict(a.state_dict(cursors=True))
    it = iter(b)
    list(islice(it, 6))
    c = _make(mix_paths, **kw)
    c.load_state_dict(json.loads(json.dumps(b.state_dict(cursors=True))))
    _same(list(c), full[11:])
    fresh = _make(mix_paths, **kw)
    fresh.set_epoch(1)
    _same(list(c), list(fresh))


@pytest.mark.parametrize("dp, workers, stop", [(2, 0, 5), (2, 2, 3), (3, 1, 4)])
def test_gathered_mixture_state_same_topology_is_exact(mix_paths, dp, workers, stop):
    """Differential over topologies: every rank's cursors merged into a version-5 state and
    loaded under the same ``dp_size`` / ``num_workers``: each rank's batches are exactly its
    uninterrupted rest."""
    src = _source()
    state, _, rests = _serve(mix_paths, dp, workers, stop, source=src)
    assert state["version"] == PACKED_VERSION and None not in state["stream"]["ranks"]
    again = _resume(mix_paths, state, dp, workers, source=src)
    for r in range(dp):
        _same(again[r], rests[r])


CASES = [  # (old dp, old workers, new dp, new workers, stop)
    (2, 0, 1, 0, 5),
    (2, 2, 3, 1, 4),
    (1, 2, 2, 0, 9),
    (4, 2, 1, 0, 3),  # 8 readers over 3 and 5 shards: both components split by sample
    (1, 0, 3, 2, 12),
]


@pytest.mark.parametrize("old_dp, old_w, new_dp, new_w, stop", CASES)
def test_elastic_mixture_resume_serves_the_rest_once(mix_paths, old_dp, old_w, new_dp, new_w, stop):
    """Saved by every rank of one topology and resumed under another: each component's consumed
    shards skipped (its readers' cursors folded on their own), the buffered samples read back: the
    samples served before and after are the epoch's, each once, every micro-batch within the
    budget."""
    src = _source()
    full = _ids(_make(mix_paths, source=src))
    state, served, _ = _serve(mix_paths, old_dp, old_w, stop, source=src)
    skip_free = _resume(mix_paths, state, new_dp, new_w, source=src)
    _check_once(full, served, *map(_ids, skip_free))
    assert all(map(_within_budget, skip_free))


def test_malformed_mixture_cursors_are_refused(mix_paths):
    """A mixture cursor without its ``mix`` or of another component count is a ResumeError naming
    the key; a plain (version 2) state of a mixture stream still replays exactly."""
    kw = {"source": _source()}
    full = list(_make(mix_paths, **kw))
    state, rest = _resumed(mix_paths, 4, cursors=False, **kw)
    assert state["version"] == 2
    _same(rest, full[4:])
    state, _ = _resumed(mix_paths, 4, cursors=True, **kw)
    no_mix = json.loads(json.dumps(state))
    del no_mix["cursors"]["readers"][0]["mix"]
    with pytest.raises(ResumeError, match=r"cursors.readers\[0\].mix"):
        _make(mix_paths, **kw).load_state_dict(no_mix)
    three = json.loads(json.dumps(state))
    three["cursors"]["readers"][0]["mix"]["streams"].append(None)
    with pytest.raises(ResumeError, match="2 component cursors"):
        _make(mix_paths, **kw).load_state_dict(three)
    merged, _, _ = _serve(mix_paths, 2, 0, 3, **kw)
    merged["stream"]["ranks"][1]["readers"][0]["mix"]["state"]["used"] = [0.0]
    with pytest.raises(ResumeError, match=r"stream.ranks\[1\].readers\[0\].mix"):
        _make(mix_paths, **kw).load_state_dict(merged)


@pytest.mark.slow
def test_mixture_resume_work_does_not_grow_with_the_position(tmp_path):
    """Counts the samples decoded from ``load_state_dict`` to the first batch at ~1k and ~8k
    samples served: with cursors, at most the buffer read back and one more buffer's worth either
    way; without them (the replay) the count grows with the position."""
    paths = (
        write_shards(str(tmp_path / "a"), sample_lengths(6_000, seed=1), num_shards=6),
        write_shards(str(tmp_path / "b"), sample_lengths(4_000, seed=2), num_shards=4),
    )
    kw = {"source": _source(weights=(0.6, 0.4), kind=CountingSource), "buffer_size": 64}
    a = _make(paths, **kw)
    it = iter(a)
    states, served = {}, 0
    for batch in it:
        served += int(batch["sample_index"].numel())
        if "1k" not in states and served >= 1_000:
            states["1k"] = (a.state_dict(cursors=True), a.state_dict())
        if served >= 8_000:
            states["8k"] = (a.state_dict(cursors=True), a.state_dict())
            break
    it.close()
    counts = {}
    for name, (with_cursors, without) in states.items():
        for how, state in (("seek", with_cursors), ("replay", without)):
            b = _make(paths, **kw)
            CountingSource.decoded = 0
            b.load_state_dict(state)
            next(iter(b))
            counts[name, how] = CountingSource.decoded
    assert counts["8k", "seek"] <= 2 * 64 + 2 * 32 and counts["1k", "seek"] <= 2 * 64 + 2 * 32
    assert counts["8k", "seek"] <= counts["1k", "seek"] + 64, counts
    assert counts["8k", "replay"] >= 7_000, counts
    assert counts["8k", "replay"] > 4 * counts["1k", "replay"], counts


@pytest.mark.slow
@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    shards=st.tuples(st.integers(1, 5), st.integers(1, 4)),
    weight=st.floats(0.05, 0.95),
    by=st.sampled_from(["tokens", "samples"]),
    old=st.tuples(st.integers(1, 3), st.sampled_from([0, 1, 2])),
    new=st.tuples(st.integers(1, 3), st.sampled_from([0, 1, 2])),
    stop=st.floats(0.0, 1.0),
    data_seed=st.integers(0, 2**32 - 1),
    buffer=st.sampled_from([8, 16, 40]),
)
def test_mixture_resume_at_any_cut(
    tmp_path_factory, shards, weight, by, old, new, stop, data_seed, buffer
):
    """Any component shard counts (fewer shards than readers included), weight, unit, topology
    and cut point: under the same topology each rank's batches are exactly its uninterrupted rest;
    under another, every sample of the epoch once across the two segments."""
    rng = np.random.default_rng(data_seed)
    root = tmp_path_factory.mktemp("mixcut")
    paths = tuple(
        write_shards(
            str(root / str(c)),
            np.clip(rng.lognormal(mu, 0.9, n), 1, 250).astype(int).tolist(),
            num_shards=k,
            extra=_with_bad_data if c == 0 else None,
        )
        for c, (mu, n, k) in enumerate(zip((2.5, 3.5), (90, 50), shards))
    )
    kw = {"source": _source(by, (weight, 1 - weight)), "buffer_size": buffer}
    full = _ids(_make(paths, **kw))
    shortest = min(
        len(list(_make(paths, dp_size=old[0], dp_rank=r, num_workers=old[1], **kw)))
        for r in range(old[0])
    )
    state, served, rests = _serve(paths, *old, int(stop * shortest), **kw)
    rest = _resume(paths, state, *new, **kw)
    _check_once(full, served, *map(_ids, rest))
    if new == old:
        assert [_ids(r) for r in rest] == [_ids(r) for r in rests]


# ---- two gloo ranks ----------------------------------------------------------------------------
def _gloo_rank(rank: int, world: int, port: int, results, paths, stop: int) -> None:
    """One gloo rank of a mixture stream: serve ``stop`` micro-batches at dp 2, gather the state
    (``cursors="all"``), then resume it on the same ranks (exact) with the agreement live."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    a = _make(paths, dp_size=world, dp_rank=rank, source=_source())
    it = iter(a)
    served = _ids(islice(it, stop))
    state = json.loads(json.dumps(a.state_dict(cursors="all")))
    rest = _ids(it)
    b = _make(paths, dp_size=world, dp_rank=rank, source=_source())
    b.load_state_dict(state)
    results[rank] = {"served": served, "state": state, "rest": rest, "again": _ids(b)}
    dist.destroy_process_group()


@pytest.mark.slow
def test_gathered_mixture_state_on_gloo_ranks(mix_paths):
    """Two real ranks: the gathered state is one, equal on both, with a ``mix`` cursor per reader;
    resumed on the same ranks each rank serves exactly its uninterrupted rest; on one rank, every
    sample once."""
    from tests.conftest import spawn_ranks

    got = spawn_ranks(_gloo_rank, 2, mix_paths, 4)
    assert got[0]["state"] == got[1]["state"]
    assert all(e["readers"][0]["mix"] for e in got[0]["state"]["stream"]["ranks"])
    for r in range(2):
        assert got[r]["again"] == got[r]["rest"]
    full = _ids(_make(mix_paths, source=_source()))
    one = _resume(mix_paths, got[0]["state"], 1, 0, source=_source())
    _check_once(full, got[0]["served"], got[1]["served"], _ids(one[0]))
