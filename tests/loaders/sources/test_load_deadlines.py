"""Nothing hangs (issue #18): one read deadline (``read_timeout``) for the index pass and load time,
a stalled ``pipe:`` command killed, a shard gone since indexing a typed error, a peer that stops
iterating a :class:`CollectiveTimeoutError`, a resume position past the epoch a
:class:`ResumeError`. Real files, FIFOs,
processes and gloo ranks."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
import traceback

import pytest
import torch

from prealign.loaders import BadDataPolicy, PackedLoader, WebDatasetSource
from prealign.loaders.errors import (
    CollectiveTimeoutError,
    ResumeError,
    ShardGoneError,
    ShardTimeoutError,
)
from prealign.loaders.streaming import StreamingPackedLoader
from prealign.schemas import ParallelLayout
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import sample_lengths, write_shards
from tests.loaders.test_streaming import _free_port

SCHEMA = causal_lm_schema()
SKIP = BadDataPolicy(on_error="skip", warn=False)


def _packed(src, **kw):
    return PackedLoader(src, schema=SCHEMA, layout=ParallelLayout(), token_budget=256, seed=1, **kw)


def _stream(src, **kw):
    kw = {"token_budget": 256, "buffer_size": 16, "seed": 2, **kw}
    return StreamingPackedLoader(src, schema=SCHEMA, layout=ParallelLayout(), **kw)


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_shard_swapped_for_a_fifo_after_prepare_is_refused_without_waiting(tmp_path, workers):
    paths = write_shards(str(tmp_path), sample_lengths(60), num_shards=3)
    loader = _packed(WebDatasetSource(paths, read_timeout=1.0), num_workers=workers).prepare()
    os.remove(paths[1])
    os.mkfifo(paths[1])  # nobody ever writes it: a blocking open() would wait forever
    t0 = time.monotonic()
    with pytest.raises(ShardGoneError, match="shard-001.*FIFO"):
        list(loader)
    assert time.monotonic() - t0 < 20


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_streaming_over_a_fifo_shard_times_out(tmp_path, workers):
    """(The streaming loader scans with the index pass's deadline: a guard, this passed before #18
    too.)"""
    paths = write_shards(str(tmp_path), sample_lengths(60), num_shards=3)
    os.remove(paths[1])
    os.mkfifo(paths[1])
    t0 = time.monotonic()
    with pytest.raises(ShardTimeoutError, match="shard-001"):
        list(_stream(WebDatasetSource(paths, read_timeout=1.0), num_workers=workers))
    assert time.monotonic() - t0 < 20
    skipping = _stream(
        WebDatasetSource(paths, read_timeout=1.0), num_workers=workers, bad_data=SKIP
    )
    assert sum(len(b["sample_index"]) for b in skipping) == 40
    assert skipping.report.counts == {"shard_timeout": 1}


def _processes_with(marker: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    out.append(int(pid))
        except OSError:
            continue
    return out


def _stalling_pipe(tmp_path, marker: str) -> tuple[list[str], str]:
    """Shards whose first is a ``pipe:`` command that streams the tar until ``flag`` exists, then
    sleeps."""
    paths = write_shards(str(tmp_path), sample_lengths(40), num_shards=2)
    flag = str(tmp_path / "stall")
    urls = [f"pipe:if [ -e {flag} ]; then sleep {marker}; fi; cat {paths[0]}", paths[1]]
    return urls, flag


def test_a_pipe_command_that_stalls_at_load_time_is_a_timeout_and_is_killed(tmp_path):
    marker = "987651"
    urls, flag = _stalling_pipe(tmp_path, marker)
    loader = _packed(WebDatasetSource(urls, read_timeout=1.0)).prepare()
    open(flag, "w").close()
    t0 = time.monotonic()
    with pytest.raises(ShardTimeoutError, match="pipe:"):
        list(loader)
    assert time.monotonic() - t0 < 20
    deadline = time.monotonic() + 5
    while _processes_with(f"sleep {marker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _processes_with(f"sleep {marker}"), "the stalled pipe: command was left running"


def test_a_pipe_command_that_stalls_while_scanned_is_a_timeout_and_is_killed(tmp_path):
    marker = "987652"
    urls, flag = _stalling_pipe(tmp_path, marker)
    open(flag, "w").close()
    t0 = time.monotonic()
    with pytest.raises(ShardTimeoutError, match="pipe:"):
        list(_stream(WebDatasetSource(urls, read_timeout=1.0)))
    assert time.monotonic() - t0 < 20
    deadline = time.monotonic() + 5
    while _processes_with(f"sleep {marker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _processes_with(f"sleep {marker}"), "the stalled pipe: command was left running"


def test_a_shard_deleted_after_prepare_is_a_typed_error_or_counted(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(60), num_shards=3)
    raising = _packed(WebDatasetSource(paths)).prepare()
    skipping = _packed(WebDatasetSource(paths), bad_data=SKIP).prepare()
    os.remove(paths[2])
    with pytest.raises(ShardGoneError, match="shard-002") as exc:
        list(raising)
    assert exc.value.shard == paths[2] and exc.value.reason == "missing_shard"
    batches = list(skipping)
    assert sum(len(b["sample_index"]) for b in batches) == 40  # the other two shards' samples
    assert skipping.report.counts.get("missing_shard") == 20


def test_a_resume_position_past_the_end_of_the_epoch_is_refused(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(60), num_shards=2)
    n = len(list(_stream(WebDatasetSource(paths))))
    state = _stream(WebDatasetSource(paths)).state_dict()
    at_end = _stream(WebDatasetSource(paths))
    at_end.load_state_dict(
        {**state, "position": n}
    )  # saved after the last micro-batch: an empty rest
    assert list(at_end) == [] and at_end.epoch == 1
    past = _stream(WebDatasetSource(paths))
    past.load_state_dict({**state, "position": n + 1})
    with pytest.raises(ResumeError, match=f"position {n + 1} is past the end of epoch 0"):
        list(past)


def _rank_main(rank: int, port: int, shards: list[str], out_dir: str) -> None:
    try:
        torch.set_num_threads(1)
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        loader = _stream(WebDatasetSource(shards), dp_rank=rank, dp_size=2, collective_timeout=3.0)
        it = iter(loader)
        next(it)
        if rank == 1:  # stops iterating; the other rank must not wait for it past the timeout
            time.sleep(120)  # (killed by the test once rank 0 is done)
            os._exit(0)
        t0 = time.monotonic()
        try:
            for _ in it:
                pass
            result = {"error": None}
        except CollectiveTimeoutError as exc:
            result = {"error": str(exc)}
        result["seconds"] = time.monotonic() - t0
        with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
            json.dump(result, f)
        os._exit(0)
    except BaseException:
        with open(os.path.join(out_dir, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)


@pytest.mark.slow
def test_a_rank_that_stops_iterating_is_a_collective_timeout_on_the_other(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(120), num_shards=2)
    ctx = mp.get_context("fork")
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, port, paths, str(tmp_path)), daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    procs[0].join(timeout=60)
    alive = procs[0].is_alive()
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    errors = [
        (tmp_path / f"error-{r}.txt").read_text()
        for r in range(2)
        if (tmp_path / f"error-{r}.txt").exists()
    ]
    assert not errors, errors[0]
    assert not alive, "rank 0 hung in the end-of-epoch all_reduce"
    result = json.loads((tmp_path / "rank-0.json").read_text())
    assert (
        result["error"]
        and "collective_timeout=3 s" in result["error"]
        and "[0, 1]" in result["error"]
    )
    assert result["seconds"] < 15


def test_a_child_forked_during_a_timed_call_can_make_its_own():
    """A DataLoader worker forked while another thread of the main process waits in
    call_with_timeout starts with the lock free: its first sample read does not deadlock."""
    import threading

    from prealign.loaders.sources.deadline import call_with_timeout

    busy = threading.Thread(target=lambda: call_with_timeout(lambda: time.sleep(1.5), 5.0))
    busy.start()
    time.sleep(0.2)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only when its own call comes back
        os._exit(0 if call_with_timeout(lambda: 42, 3.0) == 42 else 1)
    _, status = os.waitpid(pid, 0)
    busy.join()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
