"""Streaming resume by cursors (issue #28, item 4): ``state_dict(cursors=True)`` writes where each
reader of this rank goes on, so a resume seeks instead of replaying the stream: the batches after it
are the uninterrupted run's, and the work it does does not grow with the position it resumes at."""

from __future__ import annotations

import http.server
import json
import os
import re
import threading
import warnings
from itertools import islice

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prealign.loaders import BadDataPolicy, WebDatasetSource
from prealign.loaders.errors import ResumeError
from prealign.loaders.state import CURSOR_VERSION
from prealign.loaders.streaming import StreamingPackedLoader
from prealign.schemas import ParallelLayout
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import add_member, sample_lengths, write_shards

SCHEMA = causal_lm_schema()
BUDGET = 256


class CountingSource(WebDatasetSource):
    """Counts the samples it decodes (in the stream and read back by location); its scan is the
    parent's."""

    decoded = 0

    def _sample(self, *args, **kwargs):
        type(self).decoded += 1
        return super()._sample(*args, **kwargs)


def _make(paths, *, source=WebDatasetSource, **kw) -> StreamingPackedLoader:
    kw = {
        "token_budget": BUDGET,
        "seed": 3,
        "cp_rank": None,
        "num_workers": 0,
        "bad_data": BadDataPolicy(on_error="skip", max_consecutive=50, warn=False),
        **kw,
    }
    buffer = kw.pop("buffer_size", 16)
    from prealign.loaders.plan.planner import PlannerConfig

    return StreamingPackedLoader(
        source(paths),
        schema=SCHEMA,
        layout=ParallelLayout(),
        planner=PlannerConfig(buffer_size=buffer),
        **kw,
    )


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), i
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert torch.equal(x[k], y[k]), (i, k)
            else:
                assert x[k] == y[k], (i, k)


def _resumed(paths, stop: int, *, cursors: bool = True, **kw) -> tuple[dict, list[dict]]:
    """(the state after ``stop`` micro-batches, JSON round-tripped; the rest of the epoch after
    loading it)."""
    a = _make(paths, **kw)
    it = iter(a)
    list(islice(it, stop))
    state = json.loads(json.dumps(a.state_dict(cursors=cursors)))
    it.close()
    b = _make(paths, **kw)
    b.load_state_dict(state)
    return state, list(b)


def _with_bad_data(i: int, tf) -> bool:
    """Every 13th sample's ids are not an array (bad data, counted), every 29th has a member without
    extension."""
    if i % 29 == 0:
        add_member(tf, f"README{i}", b"x")
    if i % 13 == 5:
        add_member(tf, f"{i:06d}.input_ids.npy", b"not an npy")
        return True
    return False


@pytest.mark.parametrize("workers", [0, 2])
def test_cursor_resume_is_the_uninterrupted_run(tmp_path, workers):
    """Golden: 300 samples with bad data in 5 shards; resumed at the start, mid-epoch (twice in a
    row), near the end and past this rank's data: the batches are the uninterrupted run's, and so is
    the next epoch."""
    paths = write_shards(
        str(tmp_path), sample_lengths(300, seed=4), num_shards=5, extra=_with_bad_data
    )
    full = list(_make(paths, num_workers=workers))
    assert len(full) > 30
    for stop in (1, 7, 17, len(full) - 1):
        state, rest = _resumed(paths, stop, num_workers=workers)
        assert state["version"] == CURSOR_VERSION
        assert len(state["cursors"]["readers"]) == max(workers, 1)
        _same(rest, full[stop:])
    a = _make(paths, num_workers=workers)  # a resume of a resume
    b = _make(paths, num_workers=workers)
    list(islice(iter(a), 5))
    b.load_state_dict(a.state_dict(cursors=True))
    it = iter(b)
    list(islice(it, 6))
    c = _make(paths, num_workers=workers)
    c.load_state_dict(json.loads(json.dumps(b.state_dict(cursors=True))))
    _same(list(c), full[11:])
    _same(list(c), list(_epoch1(paths, workers)))  # and the next epoch


def _epoch1(paths, workers):
    fresh = _make(paths, num_workers=workers)
    fresh.set_epoch(1)
    return fresh


def test_resume_work_does_not_grow_with_the_position(tmp_path):
    """Counts the samples decoded from ``load_state_dict`` to the first batch: with cursors at ~1k
    and at ~10k samples served, at most two buffers' worth either way; without them (the replay) the
    count grows with the position (which is what this test would catch)."""
    paths = write_shards(str(tmp_path), sample_lengths(12_000, seed=1), num_shards=12)
    a = _make(paths, source=CountingSource, buffer_size=64)
    it = iter(a)
    states, served = {}, 0
    for position, batch in enumerate(it, 1):
        served += int(batch["sample_index"].numel())
        if not states.get("1k") and served >= 1_000:
            states["1k"] = (a.state_dict(cursors=True), a.state_dict(), served)
        if served >= 10_000:
            states["10k"] = (a.state_dict(cursors=True), a.state_dict(), served)
            break
    it.close()
    counts = {}
    for name, (with_cursors, without, _) in states.items():
        for kind, state in (("seek", with_cursors), ("replay", without)):
            b = _make(paths, source=CountingSource, buffer_size=64)
            CountingSource.decoded = 0
            b.load_state_dict(state)
            next(iter(b))
            counts[name, kind] = CountingSource.decoded
    assert counts["10k", "seek"] <= 2 * 64 + 32 and counts["1k", "seek"] <= 2 * 64 + 32, counts
    assert counts["10k", "seek"] <= counts["1k", "seek"] + 64, counts
    assert counts["10k", "replay"] >= 10_000, counts
    assert counts["10k", "replay"] > 5 * counts["1k", "replay"], counts


def test_state_versions(tmp_path):
    """Version 4 only with cursors; an older (version 2) state replays; cursors of another rank or
    worker count replay with a warning; malformed cursors and changed data are a ResumeError."""
    paths = write_shards(str(tmp_path), sample_lengths(120, seed=2), num_shards=3)
    full = list(_make(paths))
    state, rest = _resumed(paths, 4, cursors=False)
    assert state["version"] == 2 and "cursors" not in state
    _same(rest, full[4:])
    a = _make(paths)
    it = iter(a)
    list(islice(it, 4))
    state = a.state_dict(cursors=True)
    assert a.state_dict()["version"] == 2
    other = {**state, "cursors": {**state["cursors"], "dp_rank": 1}}
    b = _make(paths)
    with pytest.warns(UserWarning, match="replays its stream up to micro-batch 4"):
        b.load_state_dict(other)
    _same(list(b), full[4:])
    with pytest.raises(ResumeError, match="key 'cursors'"):
        _make(paths).load_state_dict({**state, "cursors": {**state["cursors"], "next": 7}})
    with pytest.raises(ResumeError, match="key 'cursors'"):
        _make(paths).load_state_dict({**state, "version": 2})
    edited = json.loads(json.dumps(state))
    edited["cursors"]["readers"][0]["buffer"][0][1] += 8  # a size the data does not have
    c = _make(paths)
    c.load_state_dict(edited)
    with pytest.raises(ResumeError, match="the data changed since the state was saved"):
        next(iter(c))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = _make(paths)
        d.load_state_dict(state)
        _same(list(d), full[4:])


def test_skip_reads_members_without_decoding(tmp_path):
    """``scan_after``: the records after a sample, the members before it read but not decoded."""
    paths = write_shards(str(tmp_path), sample_lengths(30, seed=5), num_shards=1)
    src = CountingSource(paths)
    records = list(src.scan(0))
    CountingSource.decoded = 0
    after = list(src.scan_after(0, 9, records[9][0]))
    assert CountingSource.decoded == 20
    assert [loc for loc, _ in after] == [loc for loc, _ in records[10:]]
    assert [s["__key__"] for _, s in after] == [s["__key__"] for _, s in records[10:]]


class _RangeHandler(http.server.BaseHTTPRequestHandler):
    """Serves ``server.root`` with ``Range`` support (a buffered sample is read back by a range
    read)."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        path = os.path.join(self.server.root, self.path.lstrip("/").split("?")[0])
        if not os.path.isfile(path):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        size = os.path.getsize(path)
        m = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        lo, hi = 0, size
        if m:
            lo, hi = int(m.group(1)), min(int(m.group(2)) + 1 if m.group(2) else size, size)
        self.send_response(206 if m else 200)
        if m:
            self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{size}")
        self.send_header("Content-Length", str(hi - lo))
        self.end_headers()
        with open(path, "rb") as f:
            f.seek(lo)
            self.wfile.write(f.read(hi - lo))

    def do_HEAD(self):
        path = os.path.join(self.server.root, self.path.lstrip("/").split("?")[0])
        self.send_response(200 if os.path.isfile(path) else 404)
        size = os.path.getsize(path) if os.path.isfile(path) else 0
        self.send_header("Content-Length", str(size))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()


def test_cursor_resume_over_http(tmp_path):
    """Shards on an HTTP server (127.0.0.1): the stream goes on by reading the current shard's
    members before the cursor without decoding them; the buffered samples come back by range reads;
    the batches are the uninterrupted run's."""
    paths = write_shards(str(tmp_path / "www"), sample_lengths(160, seed=7), num_shards=4)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RangeHandler)
    server.root, server.daemon_threads = str(tmp_path / "www"), True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        urls = [f"http://127.0.0.1:{server.server_address[1]}/{os.path.basename(p)}" for p in paths]
        full = list(_make(urls))
        for stop in (3, len(full) // 2):
            state, rest = _resumed(urls, stop)
            assert "cursors" in state
            _same(rest, full[stop:])
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    num_shards=st.integers(1, 5),
    workers=st.sampled_from([0, 2]),
    stop=st.floats(0.0, 1.0),
    data_seed=st.integers(0, 2**32 - 1),
    buffer=st.sampled_from([8, 16, 40]),
)
def test_cursor_resume_exact_at_any_stop(
    tmp_path_factory, num_shards, workers, stop, data_seed, buffer
):
    """Lognormal lengths, 1..5 shards (fewer shards than readers included), bad data, any stop
    point: the batches after a cursor resume are the uninterrupted run's."""
    drawn = np.random.default_rng(data_seed).lognormal(3.0, 0.9, 150)
    lengths = np.clip(drawn, 1, 250).astype(int).tolist()
    paths = write_shards(
        str(tmp_path_factory.mktemp("cur")), lengths, num_shards=num_shards, extra=_with_bad_data
    )
    kw = {"num_workers": workers, "buffer_size": buffer}
    full = list(_make(paths, **kw))
    at = int(stop * len(full))
    _, rest = _resumed(paths, at, **kw)
    _same(rest, full[at:])


def test_cursor_state_under_other_workers_takes_the_elastic_path(tmp_path):
    """A cursor state loaded under another worker count: the rest of the epoch re-split (the cursors
    unused), every sample served once."""
    paths = write_shards(str(tmp_path), sample_lengths(90, seed=8), num_shards=3)
    a = _make(paths, num_workers=2)
    it = iter(a)
    first = [i for b in islice(it, 5) for i in b["sample_index"].tolist()]
    state = json.loads(json.dumps(a.state_dict(cursors=True)))
    it.close()
    b = _make(paths, num_workers=0)
    b.load_state_dict(state)
    rest = [i for x in b for i in x["sample_index"].tolist()]
    assert sorted(first + rest) == sorted((s << 32) | o for s in range(3) for o in range(30))


def test_cursor_state_in_a_resized_epoch(tmp_path):
    """Cursors taken in the segment after a resize (version 4 with segments): the same rank goes on
    where the resized run stood, the earlier segment's samples still left out."""
    paths = write_shards(str(tmp_path), sample_lengths(90, seed=9), num_shards=3)
    a = _make(paths, num_workers=2)
    it = iter(a)
    list(islice(it, 4))
    resized = a.state_dict()
    it.close()
    b = _make(paths)
    b.load_state_dict(resized)
    rest = list(b)
    b = _make(paths)
    b.load_state_dict(resized)
    it = iter(b)
    list(islice(it, 3))
    state = json.loads(json.dumps(b.state_dict(cursors=True)))
    it.close()
    assert state["version"] == CURSOR_VERSION and state["segments"] and state["position"] == 3
    c = _make(paths)
    c.load_state_dict(state)
    _same(list(c), rest[3:])


def test_a_mixture_stream_has_cursors(tmp_path):
    """A Mixture stream's ``state_dict(cursors=True)`` is version 4 with each reader's ``mix``
    (its component streams' cursors and the interleave's state) and resumes exactly
    (``tests/loaders/test_mixture_stream_resume.py`` has the rest)."""
    from prealign.loaders import Mixture

    shards = {
        name: write_shards(str(tmp_path / name), sample_lengths(60, seed=s), num_shards=2)
        for s, name in enumerate(("a", "b"))
    }

    def make():
        parts = {name: (WebDatasetSource(p), 0.5) for name, p in shards.items()}
        return StreamingPackedLoader(
            Mixture(parts, by="tokens"),
            schema=SCHEMA,
            layout=ParallelLayout(),
            token_budget=BUDGET,
            cp_rank=None,
            seed=3,
            buffer_size=8,
        )

    full = list(make())
    a = make()
    it = iter(a)
    list(islice(it, 4))
    state = a.state_dict(cursors=True)
    assert state["version"] == CURSOR_VERSION and "mix" in state["cursors"]["readers"][0]
    b = make()
    b.load_state_dict(state)
    _same(list(b), full[4:])


def _cursor_rank(rank: int, world: int, port: int, results, paths: list[str], stop: int) -> None:
    """One gloo rank: the uninterrupted epoch's ids, then a run stopped ``-stop`` micro-batches
    before the end whose own cursor state a fresh loader resumes (the resume check and the fillers'
    agreement live)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )

    def ids(batches):
        return [(b["is_filler"], b["sample_index"].tolist()) for b in batches]

    full = ids(_make(paths, dp_size=world, dp_rank=rank))
    a = _make(paths, dp_size=world, dp_rank=rank)
    it = iter(a)
    list(islice(it, len(full) + stop))
    state = json.loads(json.dumps(a.state_dict(cursors=True)))
    it.close()
    b = _make(paths, dp_size=world, dp_rank=rank)
    b.load_state_dict(state)
    results[rank] = {"full": full, "rest": ids(b), "state": state}
    dist.destroy_process_group()


@pytest.mark.slow
def test_cursor_resume_on_gloo_ranks(tmp_path):
    """Two real ranks with unequal streams (one yields fillers at the end): each resumes from its
    own cursor state, past the point where the shorter rank ran out, to exactly its uninterrupted
    batches."""
    from tests.conftest import spawn_ranks

    lengths = sample_lengths(100, seed=11)
    paths = write_shards(str(tmp_path), lengths, num_shards=3)  # 3 shards on 2 ranks: unequal
    got = spawn_ranks(_cursor_rank, 2, paths, -2)
    for r in range(2):
        assert got[r]["state"]["cursors"]["dp_rank"] == r
        assert got[r]["rest"] == got[r]["full"][-2:]
    assert any(f for f, _ in got[0]["rest"] + got[1]["rest"])  # a rank ran out: it serves fillers


def _ids_tensor(row: dict) -> dict:
    return {"input_ids": torch.tensor(row["input_ids"])}


def test_cursor_resume_of_a_hugging_face_stream():
    """An ``HFSource`` over a ``datasets.IterableDataset`` (no byte offsets: ``scan_after`` goes on
    at the row after the cursor's through ``IterableDataset.skip``; the buffered rows come back by
    the source's forward read): the batches are the uninterrupted run's."""
    import datasets

    from prealign.loaders import HFSource
    from tests.loader_helpers import hf_rows

    ds = datasets.Dataset.from_dict(hf_rows(sample_lengths(160))).to_iterable_dataset(num_shards=4)
    full = list(_make(ds, source=lambda d: HFSource(d, transform=_ids_tensor)))
    for stop in (2, len(full) // 2):
        state, rest = _resumed(ds, stop, source=lambda d: HFSource(d, transform=_ids_tensor))
        assert "cursors" in state
        _same(rest, full[stop:])


@pytest.mark.parametrize("streaming", [True, False])
def test_a_hugging_face_cursor_located_in_another_shard_is_refused(streaming):
    """A reader's position whose location (a streaming ``(shard, row)``, a map-style ``(row,)``)
    lies in another shard than the one its position names: a ResumeError naming the key and both
    shards (``HFSource.shard_of``), never a resume from the other shard's rows."""
    import datasets

    from prealign.loaders import HFSource
    from prealign.loaders.errors import ResumeError
    from tests.loader_helpers import hf_rows

    ds = datasets.Dataset.from_dict(hf_rows(sample_lengths(160)))
    data = ds.to_iterable_dataset(num_shards=4) if streaming else ds

    def source(d):
        return HFSource(d, transform=_ids_tensor, rows_per_shard=40)

    a = _make(data, source=source)
    it = iter(a)
    list(islice(it, 2))
    state = json.loads(json.dumps(a.state_dict(cursors=True)))
    it.close()
    reader = state["cursors"]["readers"][0]
    shard = reader["at"][2][0] if streaming else reader["at"][2][0] // 40
    other = (shard + 1) % 4
    reader["at"][2] = [other, reader["at"][2][1]] if streaming else [other * 40]
    b = _make(data, source=source)
    with pytest.raises(ResumeError, match=rf"readers\[0\].at': a location in shard {other}; "):
        b.load_state_dict(state)
        list(b)
