"""SharedMediaTransform: each sample transformed once per CP group, the same batches on every rank,
no deadlock when a peer dies, exact resume after a killed worker.

The CP ranks run as real separate processes (``python -c`` on :func:`rank_main`), each with its own
``PackedLoader`` and DataLoader worker, sharing a cache directory under ``tmp_path``.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from prealign.loaders.handoff.media_share import SharedMediaTransform, decode_sample, encode_sample
from prealign.schemas.errors import ConfigError
from tests import ROOT as REPO

ROOT = str(REPO)  # cwd and PYTHONPATH of the child processes


def _digest(batch: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(batch):
        value = batch[name]
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            v = value.contiguous()
            h.update(str(v.dtype).encode() + str(tuple(v.shape)).encode())
            h.update((v.view(torch.int16) if v.dtype == torch.bfloat16 else v).numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


def rank_main(
    shards: list[str],
    out: str,
    *,
    cp_rank: int,
    cp_size: int,
    share: bool,
    cache: str,
    num_workers: int = 1,
    kill_after: int = -1,
    timeout: float = 30.0,
) -> None:
    """One CP rank: index, load the epoch, write batch digests + CPU seconds (self and children) to
    ``out``.

    ``kill_after >= 0``: SIGKILL this rank's DataLoader worker after that many batches, then resume
    a fresh loader from the state saved at that point and finish the epoch."""
    import multiprocessing
    import resource

    from prealign.loaders import (
        BadDataPolicy,
        IndexOptions,
        PackedLoader,
        WebDatasetSource,
        WorkerError,
    )
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.media.vlm import VLMSampleTransform
    from prealign.schemas import ParallelLayout, vlm_schema

    torch.set_num_threads(
        1
    )  # as in DataLoader workers: no intra-op threads spinning on a shared machine
    tok = ByteTokenizer()
    transform = VLMSampleTransform(tokenizer=tok, topk=4)
    if share:
        transform = SharedMediaTransform(
            transform=transform,
            run="test",
            cp_rank=cp_rank,
            cp_size=cp_size,
            cache_dir=cache,
            timeout=timeout,
        )
    source = WebDatasetSource(shards, transform=transform, image="bytes")
    schema = vlm_schema(topk=4, vocab_size=tok.vocab_size)

    def loader():
        return PackedLoader(
            source,
            schema=schema,
            layout=ParallelLayout(cp=cp_size),
            token_budget=2048,
            cp_rank=cp_rank,
            num_workers=num_workers,
            indexing=IndexOptions(workers=0),
            bad_data=BadDataPolicy(on_error="skip", warn=False),
        )

    def cpu() -> float:
        usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        return sum(u.ru_utime + u.ru_stime for u in usage)

    transform.image_processor  # imports and the processor built before the CPU count starts
    _start_together(out, cp_rank, cp_size)
    start = cpu()
    first = (
        loader().prepare()
    )  # the index pass runs here, in this process: its sharing counts are visible
    stats = dataclasses.asdict(transform.stats) if share else {}
    digests, killed = [], False
    it = iter(first)
    while True:
        if len(digests) == kill_after and not killed:
            state = first.state_dict()
            workers = multiprocessing.active_children()
            assert workers, "no DataLoader worker to kill"
            # (torch's SIGCHLD handler may raise as soon as a worker dies, even inside the kill
            # loop)
            try:
                for w in workers:
                    os.kill(w.pid, signal.SIGKILL)
                while True:
                    next(
                        it
                    )  # batches already prefetched may still arrive; then the dead worker is seen
            except (
                WorkerError,
                RuntimeError,
                StopIteration,
                OSError,
            ):  # worker killed, or its socket reset mid-hand-off
                pass
            del it
            killed = True
            resumed = loader()
            resumed.load_state_dict(state)
            it = iter(resumed)
            continue
        try:
            batch = next(it)
        except StopIteration:
            break
        digests.append(_digest(batch))
    with open(out, "w") as f:
        json.dump({"digests": digests, "cpu": cpu() - start, "killed": killed, "stats": stats}, f)


def _start_together(out: str, cp_rank: int, cp_size: int, limit: float = 120.0) -> None:
    """The CP ranks of one run begin their index pass together, as torchrun's ranks do after
    ``init_process_group``: a rank's imports (compiling bytecode in a fresh clone) can take longer
    than a whole index pass, and ranks that do not overlap have nothing to share."""
    base = re.sub(
        r"\d+\.json$", "ready-", out
    )  # (the ranks' outputs differ only in their rank digit)
    open(f"{base}{cp_rank}", "w").close()
    deadline = time.monotonic() + limit
    while not all(os.path.exists(f"{base}{r}") for r in range(cp_size)):
        assert time.monotonic() < deadline, "a CP rank never started"
        time.sleep(0.01)


def _spawn(shards, out, **kw) -> subprocess.Popen:
    code = (
        f"from tests.loaders.handoff.test_media_share import rank_main; "
        f"rank_main({list(shards)!r}, {out!r}, **{kw!r})"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}
    )


def _run(procs, outs, limit=300.0) -> list[dict]:
    deadline = time.monotonic() + limit
    for p in procs:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert p.returncode == 0
    return [json.load(open(o)) for o in outs]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from prealign.loaders.cli.demo_data import build_demo_dataset

    return build_demo_dataset(
        str(tmp_path_factory.mktemp("share_wds")), num_samples=60, samples_per_shard=20, topk=4
    ).shards


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory):
    """Each CP rank's digests without sharing (cp=2), and the CPU seconds of one loader."""
    d = tmp_path_factory.mktemp("ref")
    outs = [str(d / f"r{r}.json") for r in range(2)]
    res = _run(
        [
            _spawn(shards, outs[r], cp_rank=r, cp_size=2, share=False, cache=str(d))
            for r in range(2)
        ],
        outs,
    )
    assert all(len(r["digests"]) >= 3 for r in res)
    return res


@pytest.mark.slow
def test_same_batches_on_every_cp_rank_and_less_cpu(shards, reference, tmp_path):
    cache = str(tmp_path / "cache")
    outs = [str(tmp_path / f"s{r}.json") for r in range(2)]
    res = _run(
        [_spawn(shards, outs[r], cp_rank=r, cp_size=2, share=True, cache=cache) for r in range(2)],
        outs,
    )
    for r in range(2):
        assert res[r]["digests"] == reference[r]["digests"]
    # the index pass (in each rank's main process) transformed every sample once per group: one rank
    # computed it, the other read it; a bad sample (3 planted) is computed by both (its error is
    # local)
    computed = sum(r["stats"]["computed"] for r in res)
    shared = sum(r["stats"]["shared"] for r in res)
    # sharing is first-come: how much depends on how the two ranks interleave (a rank that falls
    # behind by more than a sample computes some itself), so only a clear majority of the 57 good
    # samples is asserted
    stats = [r["stats"] for r in res]
    assert shared >= 30 and computed + shared == 2 * 60, stats
    assert min(r["stats"]["computed"] for r in res) > 0  # both ranks did part of the work
    group, alone = sum(r["cpu"] for r in res), sum(r["cpu"] for r in reference)
    print(
        f"CPU of the cp=2 group: {group:.2f} s with sharing, {alone:.2f} s without "
        f"({group / alone:.2f}x)"
    )
    assert not [
        f
        for f in os.listdir(cache)
        for d in [os.path.join(cache, f)]
        if os.path.isdir(d)
        for g in os.listdir(d)
        if g.endswith(".tmp")
    ]


@pytest.mark.slow
def test_killed_worker_resumes_exactly_and_the_peer_does_not_wait(shards, reference, tmp_path):
    cache = str(tmp_path / "cache")
    outs = [str(tmp_path / f"k{r}.json") for r in range(2)]
    t0 = time.monotonic()
    procs = [
        _spawn(
            shards,
            outs[0],
            cp_rank=0,
            cp_size=2,
            share=True,
            cache=cache,
            kill_after=2,
            timeout=120.0,
        ),
        _spawn(shards, outs[1], cp_rank=1, cp_size=2, share=True, cache=cache, timeout=120.0),
    ]
    res = _run(procs, outs)
    assert res[0]["killed"]
    for r in range(2):
        assert res[r]["digests"] == reference[r]["digests"]
    assert time.monotonic() - t0 < 110  # nobody sat out a 120 s claim timeout of the killed worker


def _raw(i: int) -> dict:
    return {"__key__": f"k{i}", "x": np.arange(4) + i}


class _Counting:
    calls = 0

    def identity_fields(
        self,
    ) -> dict:  # its call counter changes with use: not part of what it computes
        return {"transform": "_Counting"}

    def __call__(self, raw):
        type(self).calls += 1
        return {
            "__key__": raw["__key__"],
            "input_ids": torch.as_tensor(raw["x"]) * 2,
            "pixel_values": torch.ones(2, 3, dtype=torch.bfloat16) * int(raw["x"][0]),
        }


@pytest.mark.slow
def test_claim_of_a_dead_process_is_taken_over(tmp_path):
    """A claim whose process was SIGKILLed mid-transform: the peer computes at once (no timeout
    wait)."""
    share = SharedMediaTransform(
        transform=_Counting(), run="r", cp_rank=1, cp_size=2, cache_dir=str(tmp_path), timeout=60.0
    )
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    path = os.path.join(share.directory, share.key(_raw(0)))
    os.makedirs(share.directory, exist_ok=True)
    with open(path + ".claim", "w") as f:
        f.write(str(dead.pid))
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    t0 = time.monotonic()
    out = share(_raw(0))
    assert time.monotonic() - t0 < 5 and share.stats.took_over_dead == 1
    assert torch.equal(out["input_ids"], torch.tensor([0, 2, 4, 6]))
    # ... and it published the result for the other ranks
    peer = SharedMediaTransform(
        transform=_Counting(), run="r", cp_rank=0, cp_size=2, cache_dir=str(tmp_path)
    )
    calls = _Counting.calls
    again = peer(_raw(0))
    assert _Counting.calls == calls and peer.stats.shared == 1
    assert (
        torch.equal(again["pixel_values"], out["pixel_values"])
        and again["pixel_values"].dtype == torch.bfloat16
    )
    assert not os.listdir(share.directory)  # the last reader cleaned up


def test_stale_claim_of_a_live_process_times_out(tmp_path):
    share = SharedMediaTransform(
        transform=_Counting(), run="r", cp_rank=1, cp_size=2, cache_dir=str(tmp_path), timeout=0.3
    )
    path = os.path.join(share.directory, share.key(_raw(1)))
    os.makedirs(share.directory, exist_ok=True)
    with open(path + ".claim", "w") as f:
        f.write(str(os.getpid()))
    held = os.open(path + ".claim", os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # a live claimer holds its claim's lock, but never publishes
    t0 = time.monotonic()
    share(_raw(1))
    os.close(held)
    assert 0.2 < time.monotonic() - t0 < 5 and share.stats.took_over_timeout == 1


def test_encoding_never_pickles_and_round_trips(tmp_path):
    sample = {
        "__key__": "s1",
        "a": torch.arange(5),
        "b": torch.randn(2, 3).to(torch.bfloat16),
        "n": 3,
    }
    back = decode_sample(bytearray(b"".join(bytes(p) for p in encode_sample(sample))))
    assert back["__key__"] == "s1" and back["n"] == 3 and torch.equal(back["a"], sample["a"])
    assert torch.equal(back["b"].view(torch.int16), sample["b"].view(torch.int16))
    with pytest.raises(TypeError):
        encode_sample({"o": object()})
    with pytest.raises(ValueError):
        decode_sample(bytearray(b"\x80\x04pickle"))


def test_configuration_errors():
    with pytest.raises(ConfigError):
        SharedMediaTransform(transform=_Counting(), run="r", cp_rank=2, cp_size=2)
    with pytest.raises(ConfigError):
        SharedMediaTransform(transform=_Counting(), run="", cp_rank=0, cp_size=2)


def test_a_malformed_or_planted_result_is_never_served(tmp_path):
    """A record whose sizes disagree is a ValueError (the waiter then computes the sample itself); a
    cache folder that is not this user's private one is never used; a planted link is never written
    through."""
    sample = {"__key__": "s1", "a": torch.arange(6)}
    buf = bytearray(b"".join(bytes(p) for p in encode_sample(sample)))
    header_end = buf.index(b"}}") + 2
    lying = bytes(buf[:header_end]).replace(b"[6]", b"[9]")
    with pytest.raises(ValueError, match="do not hold"):
        decode_sample(bytearray(lying + bytes(buf[header_end:])))

    raw = {"__key__": "k", "x": [3, 4]}
    open_dir = tmp_path / "open"
    t = SharedMediaTransform(
        transform=_Counting(), run="r", cp_rank=0, cp_size=2, cache_dir=str(open_dir)
    )
    os.makedirs(t.directory)
    os.chmod(t.directory, 0o777)  # a folder others can write: results in it are never trusted
    assert torch.equal(t(raw)["input_ids"], torch.tensor([6, 8])) and t.stats.write_failed == 1
    assert os.listdir(t.directory) == []

    mine = SharedMediaTransform(
        transform=_Counting(), run="r", cp_rank=0, cp_size=2, cache_dir=str(tmp_path / "p")
    )
    os.makedirs(mine.directory, mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    from prealign.loaders.handoff.share_folder import _me

    os.symlink(
        victim, os.path.join(mine.directory, f"{mine.key(raw)}.{_me()}.tmp")
    )  # the name it writes to
    assert torch.equal(mine(raw)["input_ids"], torch.tensor([6, 8]))
    assert victim.read_text() == "keep me" and mine.stats.write_failed == 1


def test_a_published_record_that_cannot_be_read_is_waited_for_at_most_timeout(tmp_path):
    """The claim is free (its claimer let go) and the record's name is there but never opens (here a
    folder): the waiter loads the item itself after ``timeout`` instead of polling forever."""
    import time

    from prealign.loaders.handoff.share_folder import LOCAL, SharedFolder

    d = tmp_path / "f"
    d.mkdir(mode=0o700)
    (d / "k.claim").write_bytes(b"")
    (d / "k.bin").mkdir()
    t0 = time.monotonic()
    assert SharedFolder(str(d), 1, 2, timeout=0.2).acquire("k")[0] == LOCAL
    assert time.monotonic() - t0 < 5


class _Plus:
    """Adds ``c`` to the ids: one class, a configuration per instance (and no ``index_key``)."""

    def __init__(self, c: int):
        self.c = c

    def __call__(self, raw):
        return {"__key__": raw["__key__"], "input_ids": torch.as_tensor(raw["x"]) + self.c}


def test_one_run_with_other_transform_settings_never_reads_the_others_results(tmp_path):
    """Two jobs with one ``run``, the same transform class, other settings (issue #18): each
    computes its own results; the same settings (another instance) still share."""

    def share(c, rank, **kw):
        return SharedMediaTransform(
            transform=_Plus(c), run="r", cp_rank=rank, cp_size=2, cache_dir=str(tmp_path), **kw
        )

    first = share(1, 0)
    for i in range(4):
        first(_raw(i))
    other = share(2, 1)
    got = [other(_raw(i))["input_ids"].tolist() for i in range(4)]
    assert got == [(np.arange(4) + i + 2).tolist() for i in range(4)]
    assert (other.stats.shared, other.stats.computed) == (0, 4)
    same = share(1, 1)
    assert [same(_raw(i))["input_ids"].tolist() for i in range(4)] == [
        (np.arange(4) + i + 1).tolist() for i in range(4)
    ]
    assert (same.stats.shared, same.stats.computed) == (4, 0)


def test_a_transform_without_a_fingerprint_is_refused_unless_keyed(tmp_path):
    import threading

    lock = (
        threading.Lock()
    )  # (a lambda alone is fingerprinted by its code: issue #31; one holding a lock is not)
    with pytest.raises(
        ConfigError,
        match="<lambda> cannot be fingerprinted.*closure lock.*index_key.*transform_key",
    ):
        SharedMediaTransform(
            transform=lambda raw: lock and raw,
            run="r",
            cp_rank=0,
            cp_size=2,
            cache_dir=str(tmp_path),
        )
    keyed = [
        SharedMediaTransform(
            transform=lambda raw, c=c: {"input_ids": torch.as_tensor(raw["x"]) + c},
            run="r",
            cp_rank=rank,
            cp_size=2,
            cache_dir=str(tmp_path),
            transform_key=f"plus{c}",
        )
        for rank, c in ((0, 1), (1, 1), (1, 2))
    ]
    keyed[0](_raw(0))
    assert keyed[1](_raw(0))["input_ids"].tolist() == [1, 2, 3, 4] and keyed[1].stats.shared == 1
    assert keyed[2](_raw(0))["input_ids"].tolist() == [2, 3, 4, 5] and keyed[2].stats.shared == 0
    # a single rank never shares: nothing to fingerprint
    assert (
        SharedMediaTransform(transform=lambda raw: raw, run="r", cp_rank=0, cp_size=1)(_raw(0))[
            "__key__"
        ]
        == "k0"
    )
