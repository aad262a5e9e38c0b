"""BatchShare: each micro-batch loaded and collated once per CP group; every rank's batches equal
the unshared loader's; dead / slow claimers, resume, and hostile cache files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from prealign.collate import THDCollator
from prealign.collate.mrope import MRoPECollator
from prealign.loaders import (
    BatchShare,
    IndexOptions,
    LoadingOptions,
    PackedLoader,
    PlanError,
    WebDatasetSource,
)
from prealign.loaders.handoff.batch_share import CPShard
from prealign.schemas import CPLayout, ParallelLayout, causal_lm_schema
from prealign.schemas.errors import ConfigError, PrealignError
from tests import ROOT as REPO
from tests.conftest import TOPK, examples, make_samples, schema_for
from tests.loaders.handoff.test_media_share import _digest

ROOT = str(REPO)  # cwd and PYTHONPATH of the child processes
BUDGET = 1024


def assert_same_batch(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


# ---- the shard of a whole batch
# -------------------------------------------------------------------
@examples(40)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    cp=st.sampled_from([2, 4]),
    tp=st.sampled_from([1, 2]),
    cp_layout=st.sampled_from(list(CPLayout)),
    defer=st.booleans(),
)
def test_shard_of_the_whole_batch_is_the_ranks_batch(lengths, cp, tp, cp_layout, defer):
    schema = schema_for(TOPK)
    layout = ParallelLayout(tp=tp, cp=cp, cp_layout=cp_layout)
    samples = make_samples(lengths, topk=TOPK, loss_mask=True)
    whole = THDCollator(schema=schema, layout=layout)(samples)
    for rank in range(cp):
        want = THDCollator(schema=schema, layout=layout, cp_rank=rank, defer_cp_shard=defer)(
            samples
        )
        assert_same_batch(
            CPShard(schema=schema, layout=layout, cp_rank=rank, deferred=defer)(whole), want
        )


def test_shard_golden_case():
    """The worked example of collate/thd.py: L=[5, 3], cp=2, rank 1 keeps chunks 1 and 2 of each
    sequence."""
    layout = ParallelLayout(cp=2)
    whole = THDCollator(schema=causal_lm_schema(), layout=layout)(
        [{"input_ids": torch.tensor([1, 2, 3, 4, 5])}, {"input_ids": torch.tensor([6, 7, 8])}]
    )
    out = CPShard(schema=causal_lm_schema(), layout=layout, cp_rank=1)(whole)
    assert out["input_ids"].tolist() == [[3, 4, 5, 0, 7, 8]] and out["cp_rank"] == 1
    assert out["labels"].tolist() == [[4, 5, -100, -100, 8, -100]]
    assert out["position_ids"].tolist() == [[2, 3, 4, 5, 1, 2]]


def test_configuration_errors(tmp_path):
    for bad in (
        {"run": ""},
        {"run": "r", "timeout": 0},
        {"run": "r", "timeout": 5, "ttl": 5},
        {"run": "r", "cache_dir": 3},
    ):
        with pytest.raises(ConfigError):
            BatchShare(**bad)
    with pytest.raises(PlanError, match="share: expected a BatchShare"):
        PackedLoader(
            None,
            schema=causal_lm_schema(),
            layout=ParallelLayout(cp=2),
            token_budget=64,
            share="yes",
        )


# ---- loaders in one process
# -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from prealign.loaders import build_index
    from prealign.loaders.cli.demo_data import build_demo_dataset
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.media.vlm import VLMSampleTransform
    from prealign.schemas import vlm_schema

    d = tmp_path_factory.mktemp("batch_share")
    shards = build_demo_dataset(
        str(d / "wds"), num_samples=48, samples_per_shard=16, topk=4, bad=()
    ).shards
    tok = ByteTokenizer()
    source = WebDatasetSource(
        list(shards), transform=VLMSampleTransform(tokenizer=tok, topk=4), image="bytes"
    )
    schema = vlm_schema(topk=4, vocab_size=tok.vocab_size)
    index = build_index(source, schema, num_workers=0)
    path = str(d / "index.npz")
    index.save(path)
    return {
        "shards": list(shards),
        "source": source,
        "schema": schema,
        "index": index,
        "index_path": path,
    }


def make_loader(data, cp_rank, *, cp=2, share=None, collator=None, num_workers=0, persistent=False):
    return PackedLoader(
        data["source"],
        schema=data["schema"],
        layout=ParallelLayout(cp=cp),
        token_budget=BUDGET,
        cp_rank=cp_rank,
        num_workers=num_workers,
        indexing=IndexOptions(prebuilt=data["index"]),
        share=share,
        collator=collator,
        loading=LoadingOptions(persistent_workers=persistent),
    )


def stats(loader):
    return loader._loader.collate_fn.stats


@pytest.mark.parametrize("variant", ["plain", "deferred", "mrope"])
def test_every_cp_rank_gets_the_unshared_batches(data, tmp_path, variant):
    """cp=2 (and cp=4 for the plain collator): rank 0 publishes every micro-batch, the others read
    them all, and each rank's batches equal its unshared loader's, field for field."""
    cp = 4 if variant == "plain" else 2

    def collator(rank):
        if variant == "plain":
            return None
        inner = THDCollator(
            schema=data["schema"],
            layout=ParallelLayout(cp=cp),
            cp_rank=rank,
            defer_cp_shard=variant == "deferred",
        )
        return MRoPECollator(collator=inner) if variant == "mrope" else inner

    share = BatchShare(run="t", cache_dir=str(tmp_path))
    for rank in range(cp):
        want = list(make_loader(data, rank, cp=cp, collator=collator(rank)))
        shared = make_loader(data, rank, cp=cp, share=share, collator=collator(rank))
        got = list(shared)
        assert len(got) == len(want) >= 5
        for g, w in zip(got, want):
            assert_same_batch(g, w)
        s = stats(shared)
        assert (s.computed, s.shared) == ((len(want), 0) if rank == 0 else (0, len(want))), s
    assert os.listdir(share.directory()) == []  # the last reader cleaned up


def _share_mappings(directory: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if directory in line]


@pytest.mark.slow
@pytest.mark.skipif(
    not hasattr(os, "memfd_create"), reason="platform: slot files need memfd_create (Linux)"
)
def test_workers_hand_the_published_record_to_the_main_process_without_copying(
    data, tmp_path, monkeypatch
):
    """With workers, the claimer writes each whole micro-batch once into a slot file that is both
    published and sent to its own main process; a reader's worker sends the published file. Both
    main processes map it (no copy of the pixels) and shard it on arrival: every batch equals the
    unshared loader's, the batches map files of the share folder while held, and nothing is left
    once they are dropped."""
    import gc

    from prealign.loaders.handoff import transport

    monkeypatch.setattr(
        transport, "SMALL", 0
    )  # this data's fields are all small: none copied out here
    share = BatchShare(run="fd", cache_dir=str(tmp_path))
    # rank 0's workers live on while rank 1 reads (a worker's exit removes what nobody read)
    kept = []
    for rank in range(2):
        want = list(make_loader(data, rank))
        kept.append(make_loader(data, rank, share=share, num_workers=1, persistent=True))
        got = list(kept[-1])
        assert len(got) == len(want) >= 5
        for g, w in zip(got, want):
            assert_same_batch(g, w)
        assert _share_mappings(share.directory()), (
            "the batches should be views of the shared record files"
        )
        del got, g
        gc.collect()
        assert not _share_mappings(share.directory())
    assert [
        f for f in os.listdir(share.directory()) if not f.startswith("slot-")
    ] == []  # the last reader's work
    del kept
    gc.collect()
    assert not os.path.exists(
        share.directory()
    )  # the workers' exit: their slots, then the empty folder


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="platform: slot files need Linux")
def test_kept_metadata_of_shared_batches_pins_no_record_file(data, tmp_path):
    """Each rank keeps every batch's ``cu_seqlens``: no record file of the folder stays mapped
    (small fields are copied out on arrival; before, each kept one pinned its record's two
    mappings)."""
    import gc

    share = BatchShare(run="meta", cache_dir=str(tmp_path))
    for rank in range(2):
        kept = [b["cu_seqlens"] for b in make_loader(data, rank, share=share, num_workers=1)]
        gc.collect()
        assert len(kept) >= 5 and not _share_mappings(share.directory())


def test_dp_peers_and_other_runs_never_read_each_other(data, tmp_path):
    a = make_loader(data, 0, share=BatchShare(run="job1", cache_dir=str(tmp_path)))
    list(a)
    other_run = make_loader(data, 1, share=BatchShare(run="job2", cache_dir=str(tmp_path)))
    list(other_run)
    assert stats(other_run).shared == 0
    other_seed = PackedLoader(
        data["source"],
        schema=data["schema"],
        layout=ParallelLayout(cp=2),
        token_budget=BUDGET,
        cp_rank=1,
        seed=7,
        indexing=IndexOptions(prebuilt=data["index"]),
        share=BatchShare(run="job1", cache_dir=str(tmp_path)),
    )
    list(other_seed)
    assert stats(other_seed).shared == 0


def _keys(loader) -> list[str]:
    loader.prepare()
    return [loader._loader.dataset.key(r) for r in loader._schedule(0, 0)]


@pytest.mark.slow
def test_dead_and_slow_claimers_fall_back_without_waiting(data, tmp_path):
    share = BatchShare(run="t", cache_dir=str(tmp_path), timeout=0.5, ttl=60)
    want = list(make_loader(data, 1))
    loader = make_loader(data, 1, share=share)
    keys = _keys(loader)
    os.makedirs(share.directory(), mode=0o700)
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    for key, pid in (
        (keys[0], dead.pid),
        (keys[1], os.getpid()),
    ):  # a SIGKILLed claimer; a live one that stalls
        with open(os.path.join(share.directory(), key + ".claim"), "w") as f:
            f.write(str(pid))
    stalled = _hold_lock(
        os.path.join(share.directory(), keys[1] + ".claim")
    )  # the live one holds its lock
    t0 = time.monotonic()
    got = list(loader)
    os.close(stalled)
    assert time.monotonic() - t0 < 20
    for g, w in zip(got, want, strict=True):
        assert_same_batch(g, w)
    s = stats(loader)
    assert (s.took_over_dead, s.took_over_timeout) == (1, 1), s
    # the batch of the dead claimer was taken over and published for the peer
    assert os.path.exists(os.path.join(share.directory(), keys[0] + ".bin"))


def test_hostile_cache_files_are_refused(data, tmp_path):
    """Rank 0 publishes; then one record becomes a link, one lies about its sizes, one belongs to
    another user, one is writable by others: rank 1 refuses those four, loads them itself, reads the
    rest."""
    share = BatchShare(run="t", cache_dir=str(tmp_path / "c"))
    list(make_loader(data, 0, share=share))
    loader = make_loader(data, 1, share=share)
    keys, d = _keys(loader), share.directory()
    bins = [os.path.join(d, k + ".bin") for k in keys[:4]]
    outside = tmp_path / "planted.bin"
    os.rename(bins[0], outside)
    os.symlink(outside, bins[0])
    raw = bytearray(open(bins[1], "rb").read())
    end = raw.index(b'"values"')
    shape_at = raw.index(b'"input_ids": ["int64", [1, ') + len(b'"input_ids": ["int64", [1, ')
    raw[shape_at : shape_at + 1] = (
        b"8" if raw[shape_at] != ord("8") else b"7"
    )  # T's first digit: sizes disagree
    assert shape_at < end
    with open(bins[1], "wb") as f:
        f.write(raw)
    os.chown(bins[2], 4242, 4242)
    os.chmod(bins[3], 0o666)
    want = list(make_loader(data, 1))
    got = list(loader)
    for g, w in zip(got, want, strict=True):
        assert_same_batch(g, w)
    s = stats(loader)
    assert (s.refused, s.shared) == (4, len(want) - 4), s


def test_an_open_folder_is_never_used(data, tmp_path):
    share = BatchShare(run="t", cache_dir=str(tmp_path))
    os.makedirs(share.directory())
    os.chmod(share.directory(), 0o777)
    loader = make_loader(data, 0, share=share)
    assert len(list(loader)) == stats(loader).write_failed >= 5
    assert os.listdir(share.directory()) == []


def test_resume_is_exact_with_sharing(data, tmp_path):
    """Rank 0 publishes two epochs; rank 1 reads epoch 0, stops inside epoch 1 and resumes from its
    state: its batches are the unshared loader's, read from the peer under the keys of (epoch,
    position)."""
    share = BatchShare(run="t", cache_dir=str(tmp_path))
    plain = make_loader(data, 1)
    want = [_digest(b) for b in plain] + [_digest(b) for b in plain]
    peer = make_loader(data, 0, share=share)
    list(peer), list(peer)
    first = make_loader(data, 1, share=share)
    got = [_digest(b) for b in first]
    it = iter(first)
    got += [_digest(next(it)) for _ in range(2)]
    state = first.state_dict()
    resumed = make_loader(data, 1, share=share)
    resumed.load_state_dict(state)
    got += [_digest(b) for b in resumed]
    assert got == want and want[0] != want[len(want) // 2]
    assert stats(first).shared + stats(resumed).shared == len(want)


# ---- real processes: cp=2, a SIGKILLed worker
# -----------------------------------------------------------
def rank_main(shards, index_path, out, *, cp_rank, cache, kill_after=-1, timeout=120.0):
    """One CP rank with one worker: digests of the epoch; ``kill_after``: SIGKILL the worker after
    that many batches and resume a fresh loader from the state saved then."""
    import multiprocessing

    from prealign.loaders import SampleIndex, WorkerError
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.media.vlm import VLMSampleTransform
    from prealign.schemas import vlm_schema

    torch.set_num_threads(1)
    tok = ByteTokenizer()
    source = WebDatasetSource(
        shards, transform=VLMSampleTransform(tokenizer=tok, topk=4), image="bytes"
    )
    index = SampleIndex.load(index_path)

    def loader():
        return PackedLoader(
            source,
            schema=vlm_schema(topk=4, vocab_size=tok.vocab_size),
            layout=ParallelLayout(cp=2),
            token_budget=BUDGET,
            cp_rank=cp_rank,
            num_workers=1,
            indexing=IndexOptions(prebuilt=index),
            share=BatchShare(run="proc", cache_dir=cache, timeout=timeout),
        )

    digests, killed, it, first = [], False, None, loader()
    it = iter(first)
    while True:
        if len(digests) == kill_after and not killed:
            state = first.state_dict()
            # (torch's SIGCHLD handler may raise as soon as the worker dies, even inside this loop)
            try:
                for w in multiprocessing.active_children():
                    os.kill(w.pid, signal.SIGKILL)
                while True:
                    next(it)
            except (WorkerError, RuntimeError, StopIteration, OSError):
                pass
            killed, it = True, None
            resumed = loader()
            resumed.load_state_dict(state)
            it = iter(resumed)
            continue
        try:
            digests.append(_digest(next(it)))
        except StopIteration:
            break
    with open(out, "w") as f:
        json.dump({"digests": digests, "killed": killed}, f)


@pytest.mark.slow
def test_cp2_processes_with_a_killed_worker_resume_exactly(data, tmp_path):
    want = [[_digest(b) for b in make_loader(data, r)] for r in range(2)]
    cache = str(tmp_path / "cache")
    outs = [str(tmp_path / f"r{r}.json") for r in range(2)]
    procs = []
    for r in range(2):
        # a claim timeout well above a loaded machine's run time (and below the share's ttl): a
        # finish well before it shows that nobody sat it out
        kw = {"cp_rank": r, "cache": cache, "kill_after": 2 if r == 0 else -1, "timeout": 240.0}
        code = (
            f"from tests.loaders.handoff.test_batch_share import rank_main; "
            f"rank_main({data['shards']!r}, {data['index_path']!r}, {outs[r]!r}, **{kw!r})"
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}
            )
        )
    t0 = time.monotonic()
    for p in procs:
        assert p.wait(timeout=600) == 0
    # nobody sat out the 240 s claim timeout of the killed worker
    assert time.monotonic() - t0 < 200
    res = [json.load(open(o)) for o in outs]
    assert res[0]["killed"]
    for r in range(2):
        assert res[r]["digests"] == want[r]


def lone_rank_main(shards, index_path, cache, num_workers, persistent=False):
    """CP rank 0 of 2 with no peer running: nobody reads what it publishes. Iterates an epoch, then
    exits normally (the loader and its persistent workers still alive, as at the end of a
    script)."""
    from prealign.loaders import LoadingOptions, SampleIndex
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.media.vlm import VLMSampleTransform
    from prealign.schemas import vlm_schema

    tok = ByteTokenizer()
    source = WebDatasetSource(
        shards, transform=VLMSampleTransform(tokenizer=tok, topk=4), image="bytes"
    )
    loader = PackedLoader(
        source,
        loading=LoadingOptions(persistent_workers=persistent),
        schema=vlm_schema(topk=4, vocab_size=tok.vocab_size),
        layout=ParallelLayout(cp=2),
        token_budget=BUDGET,
        cp_rank=0,
        num_workers=num_workers,
        indexing=IndexOptions(prebuilt=SampleIndex.load(index_path)),
        share=BatchShare(run="lone", cache_dir=cache),
    )
    n, published = 0, False
    for _ in loader:
        n += 1
        published = published or any(
            f.endswith(".bin") for f in os.listdir(loader.share.directory())
        )
    assert n >= 5 and published, (n, published)
    _KEPT.append(
        loader
    )  # alive until the interpreter exits, as a script's loader is: its exit hooks do the work
    print("batches", n, flush=True)


_KEPT: list = []


@pytest.mark.slow
@pytest.mark.parametrize("num_workers, persistent", [(0, False), (2, False), (2, True)])
def test_a_lone_rank_leaves_nothing_after_a_normal_exit(data, tmp_path, num_workers, persistent):
    """Issue #18: records nobody read, claims, markers and the run's folder are gone once a lone
    rank (cp=2, only rank 0 running) exits normally, whether its workers exit at the epoch's end or
    (persistent) are terminated with the process; a user's file in the cache folder stays."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "mine.txt").write_text("a user's file")
    code = (
        f"from tests.loaders.handoff.test_batch_share import lone_rank_main; "
        f"lone_rank_main({data['shards']!r}, {data['index_path']!r}, {str(cache)!r}, "
        f"{num_workers}, {persistent})"
    )
    path = os.pathsep.join(
        filter(None, [os.environ.get("PYTHONPATH"), ROOT])
    )  # (a PYTHONPATH naming prealign kept)
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and "batches" in out.stdout, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Error" not in out.stderr, out.stderr[-3000:]
    left = sorted(
        os.path.relpath(os.path.join(d, f), cache) for d, _, fs in os.walk(cache) for f in fs
    )
    assert left == ["mine.txt"] and os.listdir(cache) == ["mine.txt"], left


def test_a_rank_reading_its_own_result_leaves_it_for_the_peer(tmp_path):
    """A rank whose second request meets its own published result (its worker after its index pass)
    reads it without freeing it: the peer still finds it, and the last rank to read cleans up."""
    from prealign.loaders.handoff.share_folder import CLAIMED, HIT, SharedFolder

    own, again, peer = (SharedFolder(str(tmp_path / "f"), rank, 2) for rank in (0, 0, 1))
    assert own.acquire("k")[0] == CLAIMED and own.publish("k", {"a": torch.arange(3)})
    assert again.acquire("k")[0] == HIT
    state, record = peer.acquire("k")
    assert state == HIT and record["a"].tolist() == [0, 1, 2]
    assert os.listdir(tmp_path / "f") == []


# ---- regressions of the review fixes (commit 4bc9448)
# ------------------------------------------------------
# 1. the CP shard is the collator's
def _collator(data, cp_rank, **kw):
    return THDCollator(schema=data["schema"], layout=ParallelLayout(cp=2), cp_rank=cp_rank, **kw)


@pytest.mark.parametrize("loader_rank, collator_rank", [(1, None), (0, 1), (None, None)])
def test_a_collator_without_the_loaders_cp_rank_is_refused(
    data, tmp_path, loader_rank, collator_rank
):
    """A collator without cp_rank (it would make whole batches) or with another rank than the
    loader's: ConfigError at prepare, before any batch (else the rank would be served another rank's
    shard)."""
    loader = make_loader(
        data,
        loader_rank,
        share=BatchShare(run="t", cache_dir=str(tmp_path)),
        collator=_collator(data, collator_rank),
    )
    with pytest.raises(ConfigError, match="cp_rank"):
        loader.prepare()


@pytest.mark.parametrize("defer", [False, True])
def test_the_shard_follows_the_collators_cp_rank(data, tmp_path, defer):
    """Loader cp_rank=None, collator cp_rank=1: the shared loader is rank 1 (it reads rank 0's
    records and frees them) and its batches are the unshared loader's with that collator."""
    share = BatchShare(run="t", cache_dir=str(tmp_path))
    list(make_loader(data, 0, share=share, collator=_collator(data, 0, defer_cp_shard=defer)))
    want = list(make_loader(data, None, collator=_collator(data, 1, defer_cp_shard=defer)))
    loader = make_loader(data, None, share=share, collator=_collator(data, 1, defer_cp_shard=defer))
    got = list(loader)
    assert len(got) == len(want) >= 5
    for g, w in zip(got, want):
        assert_same_batch(g, w)
    assert stats(loader).shared == len(want)
    assert os.listdir(share.directory()) == []  # rank 1's reads completed every record


# 2. the key is scoped by the source and its transform
class _ZeroPixels:
    """The fixture's transform with every pixel zeroed: the same lengths (its index holds), other
    batches."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, sample):
        out = self.inner(sample)
        out["pixel_values"] = torch.zeros_like(out["pixel_values"])
        return out


def _copy(shards, folder) -> list[str]:
    """The shards copied byte for byte into ``folder``: the same data (the index fits) from another
    source."""
    import shutil

    os.makedirs(folder)
    return [shutil.copy(shard, folder) for shard in shards]


@pytest.mark.parametrize("differs", ["transform", "source"])
def test_another_source_or_transform_never_reads_the_records(data, tmp_path, differs):
    """Two loaders of one run over the same index: one with another transform (or the same data from
    other files) publishes its own records instead of reading the first one's, and its batches are
    its unshared loader's (with another transform, they differ from the first loader's)."""
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.media.vlm import VLMSampleTransform

    share = BatchShare(run="t", cache_dir=str(tmp_path / "cache"))

    def records() -> int:
        return sum(f.endswith(".bin") for f in os.listdir(share.directory()))

    n = len(list(make_loader(data, 0, share=share)))
    assert records() == n >= 5
    base = VLMSampleTransform(tokenizer=ByteTokenizer(), topk=4)
    if differs == "transform":
        source = WebDatasetSource(data["shards"], transform=_ZeroPixels(base), image="bytes")
    else:
        source = WebDatasetSource(
            _copy(data["shards"], str(tmp_path / "copy")), transform=base, image="bytes"
        )
    other = {**data, "source": source}
    want = list(make_loader(other, 1))
    if differs == "transform":  # other batches indeed
        assert [_digest(b) for b in want] != [_digest(b) for b in make_loader(data, 1)]
    loader = make_loader(other, 1, share=share)
    got = list(loader)
    for g, w in zip(got, want, strict=True):
        assert_same_batch(g, w)
    assert (stats(loader).shared, stats(loader).computed) == (0, n)
    assert records() == 2 * n  # the first loader's records are untouched, the other's are its own


class _Plus:
    """The fixture's transform with ``c`` added to the pixels: one class (no ``index_key``), a
    configuration per instance, the same lengths (its index holds)."""

    def __init__(self, inner, c: float):
        self.inner, self.c = inner, c

    def __call__(self, sample):
        out = self.inner(sample)
        out["pixel_values"] = out["pixel_values"] + self.c
        return out


def test_one_run_with_other_transform_settings_never_reads_the_records(data, tmp_path):
    """Two jobs with one ``run``, the same transform class with other settings (issue #18: 18 of 40
    micro-batches were read across): the second computes its own batches, its unshared loader's; a
    loader with the same settings (another instance) reads them all."""
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.media.vlm import VLMSampleTransform

    share = BatchShare(run="t", cache_dir=str(tmp_path / "cache"))

    def plus(c):
        transform = _Plus(VLMSampleTransform(tokenizer=ByteTokenizer(), topk=4), c)
        return {
            **data,
            "source": WebDatasetSource(data["shards"], transform=transform, image="bytes"),
        }

    n = len(list(make_loader(plus(1.0), 0, share=share)))
    want = list(make_loader(plus(2.0), 1))
    other = make_loader(plus(2.0), 1, share=share)
    for g, w in zip(list(other), want, strict=True):
        assert_same_batch(g, w)
    assert (stats(other).shared, stats(other).computed) == (0, n)
    same = make_loader(plus(1.0), 1, share=share)
    list(same)
    assert (stats(same).shared, stats(same).computed) == (n, 0)


def test_a_transform_without_a_fingerprint_is_refused_unless_keyed(data, tmp_path):
    import threading

    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.media.vlm import VLMSampleTransform

    inner, lock = VLMSampleTransform(tokenizer=ByteTokenizer(), topk=4), threading.Lock()
    transform = lambda s: lock and inner(s)  # noqa: E731 (a lambda holding a lock: no stable form, issue #31)
    other = {**data, "source": WebDatasetSource(data["shards"], transform=transform, image="bytes")}
    with pytest.raises(ConfigError, match="closure lock.*index_key.*transform_key"):
        make_loader(other, 0, share=BatchShare(run="t", cache_dir=str(tmp_path))).prepare()
    keyed = make_loader(
        other, 0, share=BatchShare(run="t", cache_dir=str(tmp_path), transform_key="vlm-topk4")
    )
    assert len(list(keyed)) >= 5
    with pytest.raises(ConfigError, match="transform_key"):
        BatchShare(run="t", transform_key="")


# 3. publish order: the claimer's marker exists before its record does
def test_a_peer_reading_right_after_the_rename_frees_the_record(tmp_path, monkeypatch):
    """The peer (cp_size=2) reads the record the moment it appears: it must find the claimer's
    marker and delete every file of the key (else they would linger until ttl)."""
    from prealign.loaders.handoff.share_folder import CLAIMED, HIT, SharedFolder

    d = str(tmp_path / "f")
    claimer, peer = SharedFolder(d, 0, 2), SharedFolder(d, 1, 2)
    replace, seen = os.replace, []

    def replace_then_read(src, dst, *args, **kw):
        replace(src, dst, *args, **kw)
        if str(dst).endswith(".bin"):
            seen.append(peer.acquire("k"))

    monkeypatch.setattr(os, "replace", replace_then_read)
    assert claimer.acquire("k")[0] == CLAIMED and claimer.publish("k", {"a": torch.arange(3)})
    assert len(seen) == 1 and seen[0][0] == HIT and seen[0][1]["a"].tolist() == [0, 1, 2]
    assert os.listdir(d) == []


# 4. a claimer failing at load releases the waiting peer at once
class _LoadFailure(PrealignError):
    """Stands for any error of a claimer's load (a shard gone, a worker's I/O error...)."""


def test_a_claimer_failing_at_load_releases_the_peer_at_once(data, tmp_path):
    share = BatchShare(run="t", cache_dir=str(tmp_path), timeout=8, ttl=60)
    claimer = make_loader(data, 0, share=share)
    keys = _keys(claimer)

    def fails(request):
        raise _LoadFailure("the shard is gone")

    claimer._loader.dataset.planned.__getitems__ = fails
    with pytest.raises(_LoadFailure):
        next(iter(claimer))
    want = next(iter(make_loader(data, 1)))
    peer = make_loader(data, 1, share=share)
    peer.prepare()
    t0 = time.monotonic()
    got = next(iter(peer))
    assert time.monotonic() - t0 < 2  # far less than the 8 s a claim is honoured
    assert_same_batch(got, want)
    s = stats(peer)
    assert (s.shared, s.took_over_timeout, s.took_over_dead) == (0, 0, 0), s
    assert os.path.exists(
        os.path.join(share.directory(), keys[0] + ".err")
    )  # what released the peer


# 5. a dead claim is retaken by one waiter only
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _dead_claim(d: str, key: str) -> None:
    from prealign.loaders.handoff.share_folder import private_dir

    private_dir(d)
    with open(os.path.join(d, key + ".claim"), "w") as f:
        f.write(str(_dead_pid()))


def _hold_lock(path: str) -> int:
    """An fd holding ``path``'s flock, as a live claimer does (any other open of the file is refused
    it)."""
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_a_dead_claim_is_retaken_by_one_waiter(tmp_path, monkeypatch):
    """Waiter A finds the claim unlocked (its claimer died) and retakes it; waiter B, arriving while
    A retakes, finds it locked: it waits and reads what A publishes."""
    import threading

    from prealign.loaders.handoff import share_folder as share_cache
    from prealign.loaders.handoff.share_folder import CLAIMED, HIT, SharedFolder

    d = str(tmp_path / "f")
    _dead_claim(d, "k")
    a, b = SharedFolder(d, 0, 2), SharedFolder(d, 1, 2)
    real, got = share_cache._retake, {}

    def retake(path, fd):  # B arrives while A holds the dead claim's lock
        waiter = threading.Thread(target=lambda: got.setdefault("b", b.acquire("k")))
        waiter.start()
        time.sleep(0.2)
        got["waiter"] = waiter
        return real(path, fd)

    monkeypatch.setattr(share_cache, "_retake", retake)
    assert a.acquire("k") == (CLAIMED, None) and a.stats.took_over_dead == 1
    time.sleep(0.2)
    assert got["waiter"].is_alive()  # B waits for the retaken (live) claim
    a.publish("k", {"a": torch.arange(3)})
    got["waiter"].join(10)
    assert (
        got["b"][0] == HIT
        and got["b"][1]["a"].tolist() == [0, 1, 2]
        and b.stats.took_over_dead == 0
    )


def test_many_waiters_of_a_dead_claim_claim_once(tmp_path):
    """Eight waiters (threads, each its own folder object and open file) find one dead claim at
    once: exactly one takes it over, the others read its record."""
    import threading

    from prealign.loaders.handoff.share_folder import CLAIMED, HIT, SharedFolder

    d = str(tmp_path / "f")
    _dead_claim(d, "k")
    folders = [SharedFolder(d, r, 9) for r in range(8)]
    start, got = threading.Barrier(8), {}

    def run(f):
        start.wait()
        got[f.cp_rank] = state = f.acquire("k")[0]
        if state == CLAIMED:
            time.sleep(0.1)
            f.publish("k", {"a": torch.arange(2)})

    threads = [threading.Thread(target=run, args=(f,)) for f in folders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(got.values()) == [CLAIMED] + [HIT] * 7, got


@pytest.mark.slow
def test_a_locked_claim_naming_a_dead_pid_is_honoured(tmp_path):
    """The claim's lock decides, never the pid written in it: a claim whose pid is dead (another PID
    namespace, a pid reused) but whose lock a live process holds is waited on until ``timeout``; a
    claim naming a live pid (ours) that nobody holds is taken over at once."""
    from prealign.loaders.handoff.share_folder import CLAIMED, LOCAL, SharedFolder

    d = str(tmp_path / "f")
    _dead_claim(d, "held")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time; fd = os.open(sys.argv[1], "
            "os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); print(flush=True); time.sleep(60)",
            os.path.join(d, "held.claim"),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        holder.stdout.readline()  # it holds the lock
        waiter = SharedFolder(d, 1, 2, timeout=2.0)
        os.utime(
            os.path.join(d, "held.claim")
        )  # the claim's age counts from now (not from a slow start)
        t0 = time.monotonic()
        assert waiter.acquire("held") == (LOCAL, None) and time.monotonic() - t0 >= 1.0
        assert (waiter.stats.took_over_dead, waiter.stats.took_over_timeout) == (0, 1)
    finally:
        holder.kill()
        holder.wait()
    with open(os.path.join(d, "free.claim"), "w") as f:
        f.write(str(os.getpid()))  # a live pid, but nobody holds the claim: its claimer is gone
    waiter = SharedFolder(d, 1, 2, timeout=30.0)
    t0 = time.monotonic()
    assert waiter.acquire("free") == (CLAIMED, None) and time.monotonic() - t0 < 5
    assert waiter.stats.took_over_dead == 1


# 6. malformed records are ShareRecordError, nothing else
def _record(
    tensors: dict, payload: bytes = b"\0" * 64, *, header: bytes | None = None
) -> bytearray:
    from prealign.loaders.handoff.share_folder import _MAGIC

    head = json.dumps({"tensors": tensors, "values": {}}).encode() if header is None else header
    return bytearray(_MAGIC + len(head).to_bytes(4, "little") + head + payload)


MALFORMED = {
    "int64 overflow": {"a": ["int8", [2**40, 2**40], 0, 0]},
    "int64 overflow, float": {"a": ["float32", [2**32, 2**32, 3], 0, 0]},
    "foreign byte order": {"a": [">f4", [2], 0, 8]},
    "object": {"a": ["O", [1], 0, 8]},
    "negative offset": {"a": ["int8", [2], -1, 2]},
    "nbytes not the shape's": {"a": ["int32", [2], 0, 4]},
}


@pytest.mark.parametrize("case", [*MALFORMED, "nested 100k deep"])
def test_malformed_records_are_share_record_errors(case):
    from prealign.loaders.errors import ShareRecordError
    from prealign.loaders.handoff.share_folder import decode_record

    if case == "nested 100k deep":
        buf = _record(
            {}, header=b'{"tensors": ' + b"[" * 100_000 + b"]" * 100_000 + b', "values": {}}'
        )
    else:
        buf = _record(MALFORMED[case])
    with pytest.raises(ShareRecordError):
        decode_record(buf)


def test_a_well_formed_record_decodes():
    """The golden case next to the refusals: the same header shape, consistent, decodes."""
    from prealign.loaders.handoff.share_folder import decode_record

    rec = decode_record(
        _record(
            {"a": ["<f4", [2], 4, 8], "b": ["int8", [0, 3], 0, 0]},
            b"\0" * 4 + torch.tensor([1.5, -2.0]).numpy().tobytes(),
        )
    )
    assert rec["a"].tolist() == [1.5, -2.0] and rec["b"].shape == (0, 3)


_DIMS = st.one_of(st.integers(-2, 6), st.sampled_from([2**31, 2**32, 2**40, 2**62, 2**63, 2**64]))


@examples(200)
@given(
    dtype=st.sampled_from(
        [
            "int8",
            "uint8",
            "<i4",
            ">i4",
            "=i8",
            "float32",
            ">f4",
            "<f8",
            "e",
            "bfloat16",
            "bool",
            "c8",
            "O",
            "S4",
            "U2",
            "V8",
            "M8",
            "f4,f4",
            "(2,)i2",
            "nonsense",
            "int",
        ]
    ),
    shape=st.lists(_DIMS, max_size=40),
    offset=st.integers(-4, 80),
    nbytes=st.one_of(st.integers(-4, 80), st.integers(-4, 2**70)),
)
def test_any_header_decodes_or_is_a_share_record_error(dtype, shape, offset, nbytes):
    """Whatever a header says, decode_record returns tensors inside the buffer or raises
    ShareRecordError. (Shapes with a 0 whose other dims overflow int64 have their own test
    below.)"""
    from prealign.loaders.errors import ShareRecordError
    from prealign.loaders.handoff.share_folder import decode_record

    assume(not _empty_but_huge(shape))
    buf = _record({"a": [dtype, shape, offset, nbytes]})
    try:
        rec = decode_record(buf)
    except ShareRecordError:
        return
    assert rec["a"].numel() * rec["a"].element_size() == nbytes <= 64 - offset


def _empty_but_huge(shape) -> bool:
    """A shape with a 0 (so no bytes) whose other dims overflow int64 (so torch cannot hold the
    shape)."""
    rest = 1
    for d in shape:
        rest *= d or 1
    return 0 in shape and min(shape) >= 0 and rest >= 2**63


@pytest.mark.parametrize("shape", [[2**31, 2**40, 0], [0, 2**63]])
def test_an_empty_shape_with_huge_dims_is_refused(shape):
    from prealign.loaders.errors import ShareRecordError
    from prealign.loaders.handoff.share_folder import decode_record

    assert _empty_but_huge(shape)
    with pytest.raises(ShareRecordError):
        decode_record(_record({"a": ["int8", shape, 0, 0]}))


def test_a_longdouble_record_is_refused():
    import numpy as np

    from prealign.loaders.errors import ShareRecordError
    from prealign.loaders.handoff.share_folder import decode_record

    with pytest.raises(ShareRecordError):
        decode_record(_record({"a": ["longdouble", [1], 0, np.dtype("longdouble").itemsize]}))


def test_an_infinite_dim_is_refused():
    from prealign.loaders.errors import ShareRecordError
    from prealign.loaders.handoff.share_folder import decode_record

    with pytest.raises(ShareRecordError):
        decode_record(
            _record({}, header=b'{"tensors": {"a": ["int8", [Infinity], 0, 1]}, "values": {}}')
        )


@pytest.mark.slow
def test_a_killed_unreaped_claimer_is_dead(tmp_path):
    """A SIGKILLed worker stays a zombie until its parent reaps it (a busy parent may take long);
    the kernel dropped its claim's lock when it died: the claim is taken over at once, not after the
    claim timeout."""
    from prealign.loaders.handoff.share_folder import CLAIMED, SharedFolder

    d = str(tmp_path / "f")
    code = (
        "import sys, time; from prealign.loaders.handoff.share_folder import SharedFolder; "
        "print(SharedFolder(sys.argv[1], 0, 2).acquire('k')[0], flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code, d], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"claimed"
        os.kill(child.pid, signal.SIGKILL)
        time.sleep(0.2)
        assert os.path.exists(f"/proc/{child.pid}")  # still a zombie: nobody reaped it
        waiter = SharedFolder(d, 1, 2, timeout=60.0)
        t0 = time.monotonic()
        assert waiter.acquire("k") == (CLAIMED, None) and time.monotonic() - t0 < 5
        assert waiter.stats.took_over_dead == 1
    finally:
        child.kill()
        child.wait()
