"""Streaming elastic resume without replay (issue #28, item 4): a version-5 state holds every DP
rank's reader cursors (``state_dict(cursors="all")``, or ``merge_rank_states`` of every rank's
``state_dict(cursors=True)``); a run under another ``dp_size`` / ``num_workers`` learns from them
which shards were consumed whole (never opened again), where each partly consumed shard goes on (a
seek, an HTTP ``Range`` read) and which read samples were not served (read back by location).

The promise: every sample of the epoch is served exactly once across the segments (the same
multiset of not-yet-served samples as the uninterrupted run, in another order), every micro-batch
within the budget; under the same topology the batches are exactly the uninterrupted run's."""

from __future__ import annotations

import http.server
import json
import os
import re
import threading
from collections import Counter
from itertools import islice

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prealign.loaders.errors import ResumeError
from prealign.loaders.state import PACKED_VERSION
from prealign.loaders.streaming import merge_rank_states
from tests.loader_helpers import sample_lengths, write_shards
from tests.loaders.test_stream_cursors import (
    BUDGET,
    CountingSource,
    _make,
    _RangeHandler,
    _with_bad_data,
)


def _ids(batches) -> list[int]:
    return [i for b in batches for i in b["sample_index"].tolist()]


def _within_budget(batches) -> bool:
    return all(
        int(b["cu_seqlens_padded"][-1]) <= BUDGET and b["input_ids"].shape[-1] <= BUDGET
        for b in batches
    )


def _serve(paths, dp: int, workers: int, stop: int, **kw) -> tuple[dict, list[int], list[list]]:
    """Every rank of a ``dp``-rank run (simulated in this process) serves ``stop`` micro-batches;
    returns (their merged version-5 state, JSON round-tripped; the ids served; each rank's
    uninterrupted rest of the epoch's batches)."""
    states, served, rests = [], [], []
    for r in range(dp):
        a = _make(paths, dp_size=dp, dp_rank=r, num_workers=workers, **kw)
        it = iter(a)
        served += _ids(islice(it, stop))
        states.append(json.loads(json.dumps(a.state_dict(cursors=True))))
        rests.append(list(it))
    return json.loads(json.dumps(merge_rank_states(states))), served, rests


def _resume(paths, state: dict, dp: int, workers: int, **kw) -> list[list]:
    """Each rank of a ``dp``-rank run loads ``state`` and serves the rest of the epoch."""
    out = []
    for r in range(dp):
        b = _make(paths, dp_size=dp, dp_rank=r, num_workers=workers, **kw)
        b.load_state_dict(state)
        out.append(list(b))
    return out


def _check_once(full: list[int], *parts: list[int]) -> None:
    got = Counter(i for p in parts for i in p)
    assert got == Counter(full), (
        f"lost {sorted((Counter(full) - got).elements())[:10]}, "
        f"repeated {sorted((got - Counter(full)).elements())[:10]}"
    )


CASES = [  # (old dp, old workers, new dp, new workers, stop)
    (2, 0, 1, 0, 5),  # a DP shrink
    (2, 2, 3, 1, 4),  # DP and workers
    (1, 2, 2, 0, 9),  # workers down, DP up
    (4, 1, 1, 3, 2),
    (4, 2, 1, 0, 3),  # 8 readers over 7 shards: split by sample
    (1, 0, 3, 2, 12),  # 6 new readers over what is left of 7 shards
]


@pytest.mark.parametrize("old_dp, old_w, new_dp, new_w, stop", CASES)
def test_elastic_resume_serves_the_rest_once(tmp_path, old_dp, old_w, new_dp, new_w, stop):
    """Golden: 300 samples with bad data in 7 shards; saved by every rank of one topology and
    resumed under another: the samples served before and after are the epoch's, each once, every
    micro-batch within the budget; the next epoch is a fresh run's."""
    paths = write_shards(
        str(tmp_path), sample_lengths(300, seed=4), num_shards=7, extra=_with_bad_data
    )
    full = _ids(_make(paths))
    state, served, _ = _serve(paths, old_dp, old_w, stop)
    assert state["version"] == PACKED_VERSION and None not in state["stream"]["ranks"]
    rest = _resume(paths, state, new_dp, new_w)
    _check_once(full, served, *map(_ids, rest))
    assert all(map(_within_budget, rest))
    b = _make(paths, dp_size=new_dp, dp_rank=0, num_workers=new_w)
    b.load_state_dict(state)
    list(b)
    fresh = _make(paths, dp_size=new_dp, dp_rank=0, num_workers=new_w)
    fresh.set_epoch(1)
    assert _ids(b) == _ids(fresh)


def test_same_topology_is_exact_and_other_topology_chains(tmp_path):
    """A version-5 state under its own topology: each rank's batches are exactly its
    uninterrupted rest. Resized twice in one epoch (2 -> 1 -> 3 ranks, other worker counts), each
    time from a merged state: still every sample once, and ``epoch_offset`` counts the earlier
    segments' micro-batches."""
    paths = write_shards(
        str(tmp_path), sample_lengths(300, seed=6), num_shards=9, extra=_with_bad_data
    )
    full = _ids(_make(paths))
    state, served0, rests = _serve(paths, 2, 2, 6)
    again = _resume(paths, state, 2, 2)
    for r in range(2):
        assert _ids(again[r]) == _ids(rests[r])
        assert [b["microbatch"] for b in again[r]] == [b["microbatch"] for b in rests[r]]
    b = _make(paths, dp_size=1, dp_rank=0, num_workers=0)
    b.load_state_dict(state)
    assert b.epoch_offset() == 6
    it = iter(b)
    served1 = _ids(islice(it, 7))
    second = json.loads(json.dumps(b.state_dict(cursors="all")))
    assert second["stream"]["offset"] == 6 and second["stream"]["skip"] is not None
    it.close()
    rest = _resume(paths, second, 3, 1)
    _check_once(full, served0, served1, *map(_ids, rest))
    c = _make(paths, dp_size=3, dp_rank=0, num_workers=1)
    c.load_state_dict(second)
    assert c.epoch_offset() == 13
    e = _make(paths, dp_size=1, dp_rank=0, num_workers=0)
    e.load_state_dict(state)
    tail = list(islice(iter(e), 7, None))  # the segment at 1 rank, uninterrupted
    d = _make(paths, dp_size=1, dp_rank=0, num_workers=0)
    d.load_state_dict(second)
    assert _ids(d) == _ids(tail)


@pytest.mark.slow
@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    num_shards=st.integers(1, 8),
    old=st.tuples(st.integers(1, 3), st.sampled_from([0, 1, 2])),
    new=st.tuples(st.integers(1, 3), st.sampled_from([0, 1, 2])),
    stop=st.floats(0.0, 1.0),
    data_seed=st.integers(0, 2**32 - 1),
    buffer=st.sampled_from([8, 16, 40]),
)
def test_elastic_resume_at_any_position(
    tmp_path_factory, num_shards, old, new, stop, data_seed, buffer
):
    """Lognormal lengths, 1..8 shards (fewer shards than readers included), bad data, any
    (old dp, old workers, new dp, new workers, position): every sample once across the two
    segments; the same topology: each rank's batches exactly its uninterrupted rest."""
    drawn = np.random.default_rng(data_seed).lognormal(3.0, 0.9, 120)
    lengths = np.clip(drawn, 1, 250).astype(int).tolist()
    paths = write_shards(
        str(tmp_path_factory.mktemp("el")), lengths, num_shards=num_shards, extra=_with_bad_data
    )
    kw = {"buffer_size": buffer}
    full = _ids(_make(paths, **kw))
    shortest = min(  # (simulated ranks have no fillers: stop within every rank's epoch)
        len(list(_make(paths, dp_size=old[0], dp_rank=r, num_workers=old[1], **kw)))
        for r in range(old[0])
    )
    at = int(stop * shortest)
    state, served, rests = _serve(paths, *old, at, **kw)
    rest = _resume(paths, state, *new, **kw)
    _check_once(full, served, *map(_ids, rest))
    if new == old:
        assert [_ids(r) for r in rest] == [_ids(r) for r in rests]


# ---- HTTP: a consumed shard is never read again ------------------------------------------------
class _CountingHandler(_RangeHandler):
    """:class:`_RangeHandler` that logs each request as ``(file, first byte, end)`` (``"HEAD"``
    for a HEAD)."""

    def do_GET(self):
        name = self.path.lstrip("/").split("?")[0]
        size = os.path.getsize(os.path.join(self.server.root, name))
        m = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        lo, hi = 0, size
        if m:
            lo, hi = int(m.group(1)), min(int(m.group(2)) + 1 if m.group(2) else size, size)
        self.server.log.append((name, lo, hi))
        super().do_GET()

    def do_HEAD(self):
        self.server.log.append((self.path.lstrip("/").split("?")[0], "HEAD", 0))
        super().do_HEAD()


@pytest.fixture
def http_shards(tmp_path):
    """``make(lengths, num_shards)``: shard URLs on a counting HTTP server on 127.0.0.1, and the
    server (``server.log``)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CountingHandler)
    server.root, server.daemon_threads, server.log = str(tmp_path / "www"), True, []
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def make(lengths, num_shards):
        paths = write_shards(server.root, lengths, num_shards=num_shards)
        port = server.server_address[1]
        return [f"http://127.0.0.1:{port}/{os.path.basename(p)}" for p in paths], server

    yield make
    server.shutdown()
    server.server_close()


def test_http_resume_reads_no_byte_of_a_consumed_shard(http_shards):
    """Shards on a real HTTP server: after a 2 -> 1 rank resume, a shard the old readers consumed
    is never read but for its samples the old readers held unserved (one range read each); a
    partly consumed one is read from the byte after its last consumed sample (a ``Range`` GET),
    plus those range reads; the rest is served once."""
    urls, server = http_shards(sample_lengths(400, seed=9), 10)
    full = _ids(_make(urls))
    state, served, _ = _serve(urls, 2, 0, 12)
    skip_state = _make(urls)
    skip_state.load_state_dict(state)
    skip = skip_state._skip[1]
    assert skip.done and skip.partial  # (the case has both)
    server.log.clear()
    b = _make(urls)
    b.load_state_dict(state)
    rest = list(b)
    _check_once(full, served, _ids(rest))
    names = [os.path.basename(u) for u in urls]
    returned = {(names[r[2]], r[3], r[4]) for r in skip.returns}
    gets = [x for x in server.log if x[1] != "HEAD"]
    for shard in skip.done:  # only its buffered (unserved) samples, each by its own range
        mine = [g for g in gets if g[0] == names[shard]]
        assert all(g in returned for g in mine), (names[shard], mine)
    assert any(g[0] == names[s] for g in gets for s in skip.done)  # (returns were read back)
    for shard, (_, loc) in skip.partial.items():
        mine = [g for g in gets if g[0] == names[shard]]
        assert [g for g in mine if g[1] == loc[2]], (names[shard], mine)  # the Range GET
        assert all(g[1] >= loc[2] or g in returned for g in mine), (names[shard], loc, mine)


# ---- the cost does not grow with the position --------------------------------------------------
def _resume_cost(urls, server, stop: int) -> tuple[int, int, int]:
    """(samples decoded, bytes read over HTTP, samples served before) of a 2 -> 1 rank resume at
    micro-batch ``stop`` of each old rank, from ``load_state_dict`` to the first batch."""
    state, served, _ = _serve(urls, 2, 0, stop, source=CountingSource, buffer_size=32)
    CountingSource.decoded = 0
    server.log.clear()
    b = _make(urls, source=CountingSource, buffer_size=32)
    b.load_state_dict(state)
    next(iter(b))
    read = sum(hi - lo for _, lo, hi in server.log if lo != "HEAD")
    return CountingSource.decoded, read, len(served)


@pytest.mark.slow
def test_elastic_resume_cost_does_not_grow_with_the_position(http_shards):
    """About 1k and 10k samples served by two ranks, resumed on one: the samples decoded and the
    bytes read up to the first batch are the same at both positions (the old readers' buffers
    read back and one new buffer), not the served prefix (a replay decodes all of it)."""
    urls, server = http_shards(sample_lengths(11_000, seed=3, low=3, high=20), 40)
    small = _resume_cost(urls, server, 20)
    large = _resume_cost(urls, server, 200)
    assert 800 <= small[2] < 2_000 and 8_000 <= large[2] < 11_000, (small, large)
    assert large[0] <= small[0] + 64 and large[0] <= 4 * 32 * 3, (small, large)
    assert large[1] <= 2 * small[1] + 65_536, (small, large)


# ---- two gloo ranks --------------------------------------------------------------------------
def _gloo_rank(rank: int, world: int, port: int, results, paths: list[str], stop: int) -> None:
    """One gloo rank: serve ``stop`` micro-batches at dp 2 and take the gathered state; then, on the
    same ranks, resume it under 2 ranks of 1 worker each (the end-of-epoch agreement live)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    a = _make(paths, dp_size=world, dp_rank=rank)
    it = iter(a)
    served = _ids(islice(it, stop))
    state = json.loads(json.dumps(a.state_dict(cursors="all")))
    it.close()
    b = _make(paths, dp_size=world, dp_rank=rank, num_workers=1)
    b.load_state_dict(state)
    rest = list(b)
    results[rank] = {"served": served, "state": state, "rest": _ids(rest), "n": len(rest)}
    dist.destroy_process_group()


@pytest.mark.slow
def test_gathered_state_on_gloo_ranks(tmp_path):
    """Two real ranks: ``state_dict(cursors="all")`` is one state, equal on both, with both
    ranks' cursors; resumed on the same two ranks with another worker count, and on one rank:
    every sample once, both ranks serving the same number of micro-batches."""
    from tests.conftest import spawn_ranks

    paths = write_shards(str(tmp_path), sample_lengths(200, seed=12), num_shards=5)
    full = _ids(_make(paths))
    got = spawn_ranks(_gloo_rank, 2, paths, 4)
    assert got[0]["state"] == got[1]["state"]
    assert None not in got[0]["state"]["stream"]["ranks"]
    assert got[0]["n"] == got[1]["n"]
    _check_once(full, got[0]["served"], got[1]["served"], got[0]["rest"], got[1]["rest"])
    one = _resume(paths, got[0]["state"], 1, 0)
    _check_once(full, got[0]["served"], got[1]["served"], _ids(one[0]))


# ---- states ------------------------------------------------------------------------------------
def test_state_shapes_and_refusals(tmp_path):
    """A rank's own ``cursors=True`` state is still version 4 (it loads as before); a version-5
    state missing a rank's cursors resumes under its own topology (that rank replays, warned) and
    is refused under another with the way out; a malformed one is refused naming the key."""
    paths = write_shards(str(tmp_path), sample_lengths(120, seed=2), num_shards=4)
    a = _make(paths, dp_size=2, dp_rank=0)
    it = iter(a)
    list(islice(it, 3))
    own = a.state_dict(cursors=True)
    assert own["version"] == 4
    part = merge_rank_states([own])
    assert part["stream"]["ranks"][1] is None
    with pytest.raises(ResumeError, match=r"dp_rank\(s\) \[1\].*cursors='all'"):
        _make(paths).load_state_dict(part)
    b = _make(paths, dp_size=2, dp_rank=1)
    with pytest.warns(UserWarning, match="replays"):
        b.load_state_dict(part)
    bad = json.loads(json.dumps(part))
    bad["stream"]["offset"] = -1
    with pytest.raises(ResumeError, match="key 'stream'"):
        _make(paths).load_state_dict(bad)
    bad = json.loads(json.dumps(part))
    bad["stream"]["skip"] = {"done": [99], "partial": [], "extra": [], "returns": []}
    with pytest.raises(ResumeError, match="stream.skip.done"):
        _make(paths, dp_size=2).load_state_dict(bad)
    bad = {**part, "segments": [{"dp_size": 1}]}
    with pytest.raises(ResumeError, match="key 'stream'"):
        _make(paths).load_state_dict(bad)
    with pytest.raises(ResumeError, match="not of the same run"):
        other = _make(paths, dp_size=2, dp_rank=1)
        it2 = iter(other)
        list(islice(it2, 2))
        merge_rank_states([own, other.state_dict(cursors=True)])


def test_seek_reads_nothing_before_the_consumed_sample(tmp_path):
    """``WebDatasetSource.scan_after(..., seek=)``: the shard entered after the consumed sample;
    no member before it decoded, the records after it the same as a full scan's."""
    paths = write_shards(str(tmp_path), sample_lengths(30, seed=5), num_shards=1)
    src = CountingSource(paths)
    records = list(src.scan(0))
    CountingSource.decoded = 0
    after = list(src.scan_after(0, 19, records[19][0], seek=records[9][0]))
    assert [loc for loc, _ in after] == [loc for loc, _ in records[20:]]
    assert CountingSource.decoded == 10


# ---- the fold, by hand ---------------------------------------------------------------------------
def _cursor(at, k=0, done=False, buffer=(), bins=()):
    return {"at": at, "k": k, "done": done, "buffer": list(buffer), "bins": list(bins)}


def test_fold_golden():
    """Split by shard: a reader's shards before its cursor are done, the one it is in partial up to
    its last record, its buffer and unserved micro-batches returned; a reader that served nothing
    consumed nothing. Split by sample (3 readers, 1 shard of 10 records, each reader kept every
    third): everything up to the slowest reader's record is partial, the records read past it are
    listed (walked once), the others left."""
    from prealign.loaders.plan.stream_skip import Skip, fold

    def records(shard, after, base):
        first = -1 if after is None else after[0]
        return ((o, (shard, o, o + 1, 0), None) for o in range(first + 1, 10))

    def sid(shard, o):
        return shard << 32 | o

    order = [2, 0, 3, 1]  # reader 0: shards [2, 3]; reader 1: [0, 1]
    c0 = _cursor(
        [1, 4, [3, 4, 5, 0]],
        buffer=[[sid(3, 2), 8, 3, 2, 3, 0]],
        bins=[[[sid(3, 1), 8, 3, 1, 2, 0]]],
    )
    skip = fold(None, order, [c0, None], records)
    assert skip.done == {2} and skip.partial == {3: (4, (3, 4, 5, 0))}
    assert skip.returns == ((sid(3, 1), 8, 3, 1, 2, 0), (sid(3, 2), 8, 3, 2, 3, 0))
    assert skip.remaining(order) == [0, 3, 1] and not skip.extra.size
    again = Skip.from_dict(json.loads(json.dumps(skip.to_dict())), 4)
    assert again.to_dict() == skip.to_dict()
    # the next segment, 3 readers over [0, 3, 1]: reader 1 (shard 3) read on to ordinal 6, served
    # its returns; reader 0 finished shard 0; reader 2 served nothing
    c = [_cursor([0, 9, [0, 9, 10, 0]], done=True), _cursor([0, 6, [3, 6, 7, 0]]), None]
    skip2 = fold(skip, order, c, records)
    assert skip2.done == {2, 0} and skip2.partial == {3: (6, (3, 6, 7, 0))} and not skip2.returns
    # split by sample
    ks = [4, 8, 3]  # reader 0 read j = 1, 4; reader 1: 2, 5, 8; reader 2: 3
    cs = [_cursor([0, k - 1, [0, k - 1, k, 0]], k=k) for k in ks]
    skip3 = fold(None, [0], cs, records)
    assert skip3.partial == {0: (2, (0, 2, 3, 0))} and not skip3.done
    assert skip3.extra.tolist() == [sid(0, 3), sid(0, 4), sid(0, 7)]


def test_http_server_that_ignores_range(tmp_path):
    """A server that ignores ``Range`` (``http.server``'s own handler): a partly consumed shard
    cannot be entered mid-way, so it is read from its start without decoding; every sample is
    still served once."""
    import functools
    import warnings

    root = tmp_path / "www"
    paths = write_shards(str(root), sample_lengths(150, seed=13), num_shards=4)
    handler = functools.partial(_QuietFiles, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        urls = [f"http://127.0.0.1:{port}/{os.path.basename(p)}" for p in paths]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the loader's warning that the server ignores Range)
            full = _ids(_make(urls))
            state, served, _ = _serve(urls, 2, 0, 3)
            assert state["version"] == PACKED_VERSION
            rest = _resume(urls, state, 1, 0)
        _check_once(full, served, _ids(rest[0]))
    finally:
        server.shutdown()
        server.server_close()


class _QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass
