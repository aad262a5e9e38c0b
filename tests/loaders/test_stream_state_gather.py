"""The gathered stream state at scale (issue #28): ``state_dict(cursors="all", dst=r)`` gathers
every DP rank's cursors to one global rank (a ``gather_object``, Energon's
``save_state_global(global_dst_rank)``), the others receive nothing and get ``None``; the state is
the all-gathered one, and every rank of the next run loads it. Its reader cursors are packed (one
int array per reader, version 6); version-5 states (lists) still load."""

from __future__ import annotations

import base64
import json
import zlib
from itertools import islice

import pytest
import torch

from prealign.loaders.errors import PlanError, ResumeError
from prealign.loaders.state import PACKED_VERSION, STREAM_VERSION, unpack_cursor
from tests.loader_helpers import sample_lengths, write_shards
from tests.loaders.test_stream_cursors import _make
from tests.loaders.test_stream_elastic import _check_once, _ids, _resume, _serve


def _gloo_rank(rank: int, world: int, port: int, results, paths: list[str], stop: int) -> None:
    """One gloo rank: serve ``stop`` micro-batches at dp ``world``; the state gathered to every
    rank and to rank 1 only; then resume rank 1's on every rank (the same topology: exact)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    a = _make(paths, dp_size=world, dp_rank=rank, num_workers=1)
    it = iter(a)
    served = _ids(islice(it, stop))
    every = a.state_dict(cursors="all")
    one = a.state_dict(cursors="all", dst=1)
    try:
        a.state_dict(cursors="all", dst=world)
        refused = None
    except PlanError as exc:
        refused = str(exc)
    rest = _ids(it)
    shared = [one]
    dist.broadcast_object_list(shared, src=1)  # (the file rank 1 wrote, read by every rank)
    b = _make(paths, dp_size=world, dp_rank=rank, num_workers=1)
    b.load_state_dict(json.loads(json.dumps(shared[0])))
    results[rank] = {
        "served": served,
        "every": every,
        "one": one,
        "refused": refused,
        "rest": rest,
        "again": _ids(b),
    }
    dist.destroy_process_group()


@pytest.mark.slow
def test_state_gathered_to_one_rank_on_gloo(tmp_path):
    """Two real ranks: ``dst=1`` gives rank 1 the all-gathered state and rank 0 ``None``; a
    ``dst`` outside the world is a PlanError (on every rank, before any collective); the state
    resumes every rank exactly, and under another topology every sample once."""
    from tests.conftest import spawn_ranks

    paths = write_shards(str(tmp_path), sample_lengths(200, seed=12), num_shards=5)
    got = spawn_ranks(_gloo_rank, 2, paths, 4)
    assert got[0]["one"] is None and got[1]["one"] == got[1]["every"] == got[0]["every"]
    assert None not in got[1]["one"]["stream"]["ranks"]
    assert all("not a rank of the world" in got[r]["refused"] for r in range(2))
    for r in range(2):
        assert got[r]["again"] == got[r]["rest"]
    full = _ids(_make(paths))
    one = _resume(paths, got[1]["one"], 1, 0)
    _check_once(full, got[0]["served"], got[1]["served"], _ids(one[0]))


def test_dst_needs_cursors_all(tmp_path):
    """``dst`` without ``cursors="all"``, or not a rank, is a PlanError; without a process group the
    state is returned (the only process)."""
    paths = write_shards(str(tmp_path), sample_lengths(40, seed=1), num_shards=2)
    a = _make(paths)
    list(islice(iter(a), 2))
    for kw in ({"cursors": True, "dst": 0}, {"cursors": "all", "dst": -1}, {"dst": 0}):
        with pytest.raises(PlanError, match="dst"):
            a.state_dict(**kw)
    assert a.state_dict(cursors="all", dst=0) == a.state_dict(cursors="all")


# ---- packed cursors (version 6) ----------------------------------------------------------------
def _as_version_5(state: dict) -> dict:
    """``state`` (version 6) as a version-5 prealign wrote it: every reader's samples as lists."""
    ranks = [
        None if e is None else {**e, "readers": [unpack_cursor(c, "r") for c in e["readers"]]}
        for e in state["stream"]["ranks"]
    ]
    return {**state, "version": STREAM_VERSION, "stream": {**state["stream"], "ranks": ranks}}


def test_packed_state_is_smaller_and_version_5_still_loads(tmp_path):
    """The merged state of 2 ranks x 2 workers (buffer 64) is version 6, its cursors at most half
    the same cursors with their samples as lists (version 5); both resume alike: exactly under the
    same topology, every sample once under another."""
    paths = write_shards(str(tmp_path), sample_lengths(600, seed=8), num_shards=6)
    state, served, rests = _serve(paths, 2, 2, 6, buffer_size=64)
    lists = _as_version_5(state)
    assert state["version"] == PACKED_VERSION and lists["version"] == STREAM_VERSION
    assert all("packed" in c for e in state["stream"]["ranks"] for c in e["readers"])
    sizes = [len(json.dumps(s["stream"]["ranks"])) for s in (state, lists)]
    assert 2 * sizes[0] <= sizes[1], sizes
    full = _ids(_make(paths, buffer_size=64))
    for saved in (state, lists):
        again = _resume(paths, saved, 2, 2, buffer_size=64)
        assert [_ids(r) for r in again] == [_ids(r) for r in rests]
        other = _resume(paths, saved, 1, 0, buffer_size=64)
        _check_once(full, served, _ids(other[0]))


def test_malformed_packed_cursor_is_refused(tmp_path):
    """A packed cursor with other sizes, bytes that are not base64 zlib, or more bytes than it
    says (a decompression bomb) is a ResumeError naming the key; an unknown version is refused."""
    paths = write_shards(str(tmp_path), sample_lengths(200, seed=9), num_shards=4)
    state, _, _ = _serve(paths, 2, 0, 3)
    packed = state["stream"]["ranks"][1]["readers"][0]["packed"]
    bomb = base64.b64encode(zlib.compress(b"\0" * (packed["rows"] * packed["width"] * 8 + 800)))
    for edit in (
        {"rows": packed["rows"] + 1},
        {"ints": "not base64!"},
        {"ints": base64.b64encode(b"not zlib").decode()},
        {"ints": bomb.decode()},
        {"split": [-1]},
    ):
        bad = json.loads(json.dumps(state))
        bad["stream"]["ranks"][1]["readers"][0]["packed"].update(edit)
        with pytest.raises(ResumeError, match=r"stream.ranks\[1\].readers\[0\].packed"):
            _make(paths).load_state_dict(bad)  # (another topology: every rank's cursors read)
    with pytest.raises(ResumeError, match="version 7"):
        _make(paths).load_state_dict({**state, "version": 7})


def _tp_dp_rank(rank: int, world: int, port: int, results, paths: list[str], stop: int) -> None:
    """One of 4 gloo ranks laid out as Megatron lays TP=2 x DP=2 (TP peers 0-1 and 2-3; DP groups
    {0, 2} and {1, 3}), the loader over this rank's DP group; every rank asks for the state
    gathered to global rank 0."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    a = _make(paths, dp_size=2, dp_rank=rank // 2, num_workers=1, group=groups[rank % 2])
    list(islice(iter(a), stop))
    got = {"one": a.state_dict(cursors="all", dst=0), "every": a.state_dict(cursors="all")}
    try:
        a.state_dict(cursors="all", dst=world)
        got["refused"] = None
    except PlanError as exc:
        got["refused"] = str(exc)
    results[rank] = got
    dist.destroy_process_group()


@pytest.mark.slow
def test_dst_under_megatron_dp_groups(tmp_path):
    """TP=2 x DP=2: every rank calls ``state_dict(cursors="all", dst=0)``; rank 0 gets the state
    (both DP ranks' cursors, the one every rank of its DP group gathers), every other rank
    ``None``, with no error on the ranks whose DP group does not hold rank 0 (their TP peers'
    group gathers the same streams); a ``dst`` outside the world is refused on every rank."""
    from tests.conftest import spawn_ranks

    paths = write_shards(str(tmp_path), sample_lengths(200, seed=13), num_shards=5)
    got = spawn_ranks(_tp_dp_rank, 4, paths, 3)
    assert got[0]["one"] == got[0]["every"] and None not in got[0]["one"]["stream"]["ranks"]
    assert [got[r]["one"] for r in (1, 2, 3)] == [None, None, None]
    assert all("not a rank of the world" in got[r]["refused"] for r in range(4))
