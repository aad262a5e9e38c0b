"""BatchShare: each micro-batch loaded and collated once per CP group; every rank's batches equal the
unshared loader's; dead / slow claimers, resume, and hostile cache files."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate import THDCollator
from prealign.collate.mrope import MRoPECollator
from prealign.loaders import BatchShare, IndexOptions, PackedLoader, PlanError, WebDatasetSource
from prealign.loaders.batch_share import CPShard
from prealign.schemas import CPLayout, ParallelLayout, causal_lm_schema
from prealign.schemas.errors import ConfigError
from tests.conftest import TOPK, examples, make_samples, schema_for
from tests.test_media_share import _digest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET = 1024


def assert_same_batch(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


# ---- the shard of a whole batch -------------------------------------------------------------------
@examples(40)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6), cp=st.sampled_from([2, 4]),
       tp=st.sampled_from([1, 2]), cp_layout=st.sampled_from(list(CPLayout)), defer=st.booleans())
def test_shard_of_the_whole_batch_is_the_ranks_batch(lengths, cp, tp, cp_layout, defer):
    schema = schema_for(TOPK)
    layout = ParallelLayout(tp=tp, cp=cp, cp_layout=cp_layout)
    samples = make_samples(lengths, topk=TOPK, loss_mask=True)
    whole = THDCollator(schema=schema, layout=layout)(samples)
    for rank in range(cp):
        want = THDCollator(schema=schema, layout=layout, cp_rank=rank, defer_cp_shard=defer)(samples)
        assert_same_batch(CPShard(schema=schema, layout=layout, cp_rank=rank, deferred=defer)(whole), want)


def test_shard_golden_case():
    """The worked example of collate/thd.py: L=[5, 3], cp=2, rank 1 keeps chunks 1 and 2 of each sequence."""
    layout = ParallelLayout(cp=2)
    whole = THDCollator(schema=causal_lm_schema(), layout=layout)(
        [{"input_ids": torch.tensor([1, 2, 3, 4, 5])}, {"input_ids": torch.tensor([6, 7, 8])}])
    out = CPShard(schema=causal_lm_schema(), layout=layout, cp_rank=1)(whole)
    assert out["input_ids"].tolist() == [[3, 4, 5, 0, 7, 8]] and out["cp_rank"] == 1
    assert out["labels"].tolist() == [[4, 5, -100, -100, 8, -100]]
    assert out["position_ids"].tolist() == [[2, 3, 4, 5, 1, 2]]


def test_configuration_errors(tmp_path):
    for bad in ({"run": ""}, {"run": "r", "timeout": 0}, {"run": "r", "timeout": 5, "ttl": 5}, {"run": "r", "cache_dir": 3}):
        with pytest.raises(ConfigError):
            BatchShare(**bad)
    with pytest.raises(PlanError, match="share: expected a BatchShare"):
        PackedLoader(None, schema=causal_lm_schema(), layout=ParallelLayout(cp=2), token_budget=64, share="yes")


# ---- loaders in one process -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from prealign.loaders import build_index
    from prealign.loaders.cli.demo_data import build_demo_dataset
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.vlm import VLMSampleTransform
    from prealign.schemas import vlm_schema

    d = tmp_path_factory.mktemp("batch_share")
    shards = build_demo_dataset(str(d / "wds"), num_samples=48, samples_per_shard=16, topk=4, bad=()).shards
    tok = ByteTokenizer()
    source = WebDatasetSource(list(shards), transform=VLMSampleTransform(tokenizer=tok, topk=4), image="bytes")
    schema = vlm_schema(topk=4, vocab_size=tok.vocab_size)
    index = build_index(source, schema, num_workers=0)
    path = str(d / "index.npz")
    index.save(path)
    return {"shards": list(shards), "source": source, "schema": schema, "index": index, "index_path": path}


def make_loader(data, cp_rank, *, cp=2, share=None, collator=None, num_workers=0):
    return PackedLoader(data["source"], schema=data["schema"], layout=ParallelLayout(cp=cp), token_budget=BUDGET,
                        cp_rank=cp_rank, num_workers=num_workers, indexing=IndexOptions(prebuilt=data["index"]),
                        share=share, collator=collator)


def stats(loader):
    return loader._loader.collate_fn.stats


@pytest.mark.parametrize("variant", ["plain", "deferred", "mrope"])
def test_every_cp_rank_gets_the_unshared_batches(data, tmp_path, variant):
    """cp=2 (and cp=4 for the plain collator): rank 0 publishes every micro-batch, the others read them all,
    and each rank's batches equal its unshared loader's, field for field."""
    cp = 4 if variant == "plain" else 2

    def collator(rank):
        if variant == "plain":
            return None
        inner = THDCollator(schema=data["schema"], layout=ParallelLayout(cp=cp), cp_rank=rank,
                            defer_cp_shard=variant == "deferred")
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


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="slot files need Linux")
def test_workers_hand_the_published_record_to_the_main_process_without_copying(data, tmp_path):
    """With workers, the claimer writes each whole micro-batch once into a slot file that is both published
    and sent to its own main process; a reader's worker sends the published file. Both main processes map
    it (no copy of the pixels) and shard it on arrival: every batch equals the unshared loader's, the
    batches map files of the share folder while held, and nothing is left once they are dropped."""
    import gc

    share = BatchShare(run="fd", cache_dir=str(tmp_path))
    for rank in range(2):
        want = list(make_loader(data, rank))
        got = list(make_loader(data, rank, share=share, num_workers=1))
        assert len(got) == len(want) >= 5
        for g, w in zip(got, want):
            assert_same_batch(g, w)
        assert _share_mappings(share.directory()), "the batches should be views of the shared record files"
        del got, g
        gc.collect()
        assert not _share_mappings(share.directory())
    assert os.listdir(share.directory()) == []  # the last reader removed every name


def test_dp_peers_and_other_runs_never_read_each_other(data, tmp_path):
    a = make_loader(data, 0, share=BatchShare(run="job1", cache_dir=str(tmp_path)))
    list(a)
    other_run = make_loader(data, 1, share=BatchShare(run="job2", cache_dir=str(tmp_path)))
    list(other_run)
    assert stats(other_run).shared == 0
    other_seed = PackedLoader(data["source"], schema=data["schema"], layout=ParallelLayout(cp=2), token_budget=BUDGET,
                              cp_rank=1, seed=7, indexing=IndexOptions(prebuilt=data["index"]),
                              share=BatchShare(run="job1", cache_dir=str(tmp_path)))
    list(other_seed)
    assert stats(other_seed).shared == 0


def _keys(loader) -> list[str]:
    loader.prepare()
    return [loader._loader.dataset.key(r) for r in loader._schedule(0, 0)]


def test_dead_and_slow_claimers_fall_back_without_waiting(data, tmp_path):
    share = BatchShare(run="t", cache_dir=str(tmp_path), timeout=0.5, ttl=60)
    want = list(make_loader(data, 1))
    loader = make_loader(data, 1, share=share)
    keys = _keys(loader)
    os.makedirs(share.directory(), mode=0o700)
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    for key, pid in ((keys[0], dead.pid), (keys[1], os.getpid())):  # a SIGKILLed claimer; a live one that stalls
        with open(os.path.join(share.directory(), key + ".claim"), "w") as f:
            f.write(str(pid))
    t0 = time.monotonic()
    got = list(loader)
    assert time.monotonic() - t0 < 20
    for g, w in zip(got, want, strict=True):
        assert_same_batch(g, w)
    s = stats(loader)
    assert (s.took_over_dead, s.took_over_timeout) == (1, 1), s
    # the batch of the dead claimer was taken over and published for the peer
    assert os.path.exists(os.path.join(share.directory(), keys[0] + ".bin"))


def test_hostile_cache_files_are_refused(data, tmp_path):
    """Rank 0 publishes; then one record becomes a link, one lies about its sizes, one belongs to another
    user, one is writable by others: rank 1 refuses those four, loads them itself, reads the rest."""
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
    raw[shape_at:shape_at + 1] = b"8" if raw[shape_at] != ord("8") else b"7"  # T's first digit: sizes disagree
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
    """Rank 0 publishes two epochs; rank 1 reads epoch 0, stops inside epoch 1 and resumes from its state:
    its batches are the unshared loader's, read from the peer under the keys of (epoch, position)."""
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


# ---- real processes: cp=2, a SIGKILLed worker -----------------------------------------------------------
def rank_main(shards, index_path, out, *, cp_rank, cache, kill_after=-1, timeout=120.0):
    """One CP rank with one worker: digests of the epoch; ``kill_after``: SIGKILL the worker after that many
    batches and resume a fresh loader from the state saved then."""
    import multiprocessing

    from prealign.loaders import SampleIndex, WorkerError
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.vlm import VLMSampleTransform
    from prealign.schemas import vlm_schema

    torch.set_num_threads(1)
    tok = ByteTokenizer()
    source = WebDatasetSource(shards, transform=VLMSampleTransform(tokenizer=tok, topk=4), image="bytes")
    index = SampleIndex.load(index_path)

    def loader():
        return PackedLoader(source, schema=vlm_schema(topk=4, vocab_size=tok.vocab_size), layout=ParallelLayout(cp=2),
                            token_budget=BUDGET, cp_rank=cp_rank, num_workers=1, indexing=IndexOptions(prebuilt=index),
                            share=BatchShare(run="proc", cache_dir=cache, timeout=timeout))

    digests, killed, it, first = [], False, None, loader()
    it = iter(first)
    while True:
        if len(digests) == kill_after and not killed:
            state = first.state_dict()
            for w in multiprocessing.active_children():
                os.kill(w.pid, signal.SIGKILL)
            try:
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


def test_cp2_processes_with_a_killed_worker_resume_exactly(data, tmp_path):
    want = [[_digest(b) for b in make_loader(data, r)] for r in range(2)]
    cache = str(tmp_path / "cache")
    outs = [str(tmp_path / f"r{r}.json") for r in range(2)]
    procs = []
    for r in range(2):
        kw = {"cp_rank": r, "cache": cache, "kill_after": 2 if r == 0 else -1}
        code = (f"from tests.test_batch_share import rank_main; "
                f"rank_main({data['shards']!r}, {data['index_path']!r}, {outs[r]!r}, **{kw!r})")
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}))
    t0 = time.monotonic()
    for p in procs:
        assert p.wait(timeout=300) == 0
    assert time.monotonic() - t0 < 110  # nobody sat out the 120 s claim timeout of the killed worker
    res = [json.load(open(o)) for o in outs]
    assert res[0]["killed"]
    for r in range(2):
        assert res[r]["digests"] == want[r]


def test_a_rank_reading_its_own_result_leaves_it_for_the_peer(tmp_path):
    """A rank whose second request meets its own published result (its worker after its index pass) reads
    it without freeing it: the peer still finds it, and the last rank to read cleans up."""
    from prealign.loaders.share_cache import CLAIMED, HIT, SharedFolder

    own, again, peer = (SharedFolder(str(tmp_path / "f"), rank, 2) for rank in (0, 0, 1))
    assert own.acquire("k")[0] == CLAIMED and own.publish("k", {"a": torch.arange(3)})
    assert again.acquire("k")[0] == HIT
    state, record = peer.acquire("k")
    assert state == HIT and record["a"].tolist() == [0, 1, 2]
    assert os.listdir(tmp_path / "f") == []
