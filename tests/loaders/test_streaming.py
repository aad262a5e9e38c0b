"""StreamingPackedLoader (issue #7, item 4): packs a stream from a bounded buffer, every sample once
per epoch, the same number of micro-batches on every DP rank (2 real gloo ranks), exact resume."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import traceback

import datasets
import pytest
import torch

from prealign.loaders import BadDataPolicy, HFSource, WebDatasetSource, assert_resumes_exactly
from prealign.loaders.streaming import StreamingPackedLoader
from prealign.schemas import ParallelLayout
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import add_member, hf_rows, sample_lengths, write_shards

SCHEMA = causal_lm_schema()
BUDGET = 256


def _make(src, **kw):
    kw = {"token_budget": BUDGET, "buffer_size": 48, "seed": 2, "cp_rank": None, **kw}
    return StreamingPackedLoader(src, schema=SCHEMA, layout=ParallelLayout(), **kw)


def _first_tokens(batch) -> list[int]:
    if batch["is_filler"]:
        return []
    return [
        int(batch["input_ids"][0, s]) - 10_000
        for s in batch["cu_seqlens_padded"][:-1].tolist()
        if int(batch["input_ids"][0, s]) >= 10_000
    ]


class CountingSource(WebDatasetSource):
    reads = 0

    def scan(self, shard):
        for rec in super().scan(shard):
            type(self).reads += 1
            yield rec


def test_every_sample_once_budget_and_first_batch_after_the_buffer(tmp_path):
    lengths = sample_lengths(400)
    paths = write_shards(str(tmp_path), lengths, num_shards=4)
    src = CountingSource(paths)
    loader = _make(src)
    it = iter(loader)
    first = next(it)
    assert CountingSource.reads <= 48  # the buffer, whatever the dataset's size
    batches = [first, *it]
    seen = [i for b in batches for i in _first_tokens(b)]
    assert sorted(seen) == list(range(400))
    assert all(b["input_ids"].shape[1] <= BUDGET for b in batches)
    assert sorted(i for b in batches for i in b["sample_index"].tolist()) == sorted(
        (s << 32) | o for s in range(4) for o in range(100)
    )
    second = [i for b in loader for i in _first_tokens(b)]
    assert sorted(second) == list(range(400)) and second != seen  # epoch 1: another shard order


def test_layout_max_seqs_caps_every_streamed_batch(tmp_path):
    """The streaming bins respect ParallelLayout.max_seqs (static cu_seqlens of max_seqs + 1
    entries)."""
    paths = write_shards(str(tmp_path), sample_lengths(200), num_shards=2)
    loader = StreamingPackedLoader(
        WebDatasetSource(paths),
        schema=SCHEMA,
        layout=ParallelLayout(max_seqs=2),
        token_budget=BUDGET,
        buffer_size=48,
        seed=2,
        cp_rank=None,
    )
    batches = list(loader)
    assert all(
        b["cu_seqlens"].numel() == 3 and b["cu_seqlens_padded"].numel() == 3 for b in batches
    )
    assert sorted(i for b in batches for i in _first_tokens(b)) == list(range(200))


def test_hf_iterable_dataset_resumes_exactly():
    lengths = sample_lengths(160)
    ds = datasets.Dataset.from_dict(hf_rows(lengths)).to_iterable_dataset(num_shards=4)
    stats = assert_resumes_exactly(
        lambda: _make(HFSource(ds, transform=lambda r: {"input_ids": torch.tensor(r["input_ids"])}))
    )
    assert min(stats["epoch_lengths"]) > 4


def test_bad_samples_are_counted_not_dropped_silently(tmp_path):
    def extra(i, tf):
        if i in (5, 77):
            add_member(tf, f"{i:06d}.json", b"{not json")
            return True
        return False

    paths = write_shards(str(tmp_path), sample_lengths(100), num_shards=2, extra=extra)
    loader = _make(WebDatasetSource(paths), bad_data=BadDataPolicy(on_error="skip", warn=False))
    seen = [i for b in loader for i in _first_tokens(b)]
    assert sorted(seen) == [i for i in range(100) if i not in (5, 77)]
    assert loader.report.counts == {"bad_sample": 2}
    with pytest.raises(Exception, match="000005"):
        list(_make(WebDatasetSource(paths)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, shards: list[str], out_dir: str) -> None:
    try:
        torch.set_num_threads(1)
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )

        def make():
            return _make(WebDatasetSource(shards), dp_rank=rank, dp_size=2)

        loader = make()
        epochs = [[_first_tokens(b) for b in loader] for _ in range(2)]
        fillers = sum(1 for b in make() if b["is_filler"])
        stats = assert_resumes_exactly(
            make
        )  # collectives in lockstep: both ranks run the same cases
        with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
            json.dump(
                {
                    "epochs": epochs,
                    "state": loader.state_dict(),
                    "fillers": fillers,
                    "stats": stats,
                },
                f,
            )
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.mark.slow
def test_two_gloo_ranks_cover_every_sample_once_with_equal_counts(tmp_path):
    lengths = sample_lengths(180, seed=4)
    # 3 shards over 2 ranks: one rank reads 2, the other 1, runs dry first and yields fillers until
    # the other ends
    paths = write_shards(str(tmp_path), lengths, num_shards=3)
    ctx = mp.get_context("fork")
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, port, paths, str(tmp_path)), daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    errors = [
        (tmp_path / f"error-{r}.txt").read_text()
        for r in range(2)
        if (tmp_path / f"error-{r}.txt").exists()
    ]
    assert not errors, errors[0]
    assert not alive, "a rank did not finish (hang?)"
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    for epoch in range(2):
        counts = [len(r["epochs"][epoch]) for r in ranks]
        assert counts[0] == counts[1] > 2, counts
        a, b = (sum(r["epochs"][epoch], []) for r in ranks)
        assert sorted(a + b) == list(range(180))
    assert ranks[0]["state"] == ranks[1]["state"]
    assert ranks[0]["fillers"] + ranks[1]["fillers"] > 0
    assert all(min(r["stats"]["epoch_lengths"]) > 2 for r in ranks)


@pytest.mark.slow
def test_dataloader_workers_read_disjoint_shards(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(200), num_shards=5)
    loader = _make(WebDatasetSource(paths), num_workers=2)
    seen = [i for b in loader for i in _first_tokens(b)]
    assert sorted(seen) == list(range(200))
    one_shard = _make(
        WebDatasetSource(paths[:1]), num_workers=2, dp_size=2, dp_rank=1
    )  # fewer shards than readers
    assert 0 < len([i for b in one_shard for i in _first_tokens(b)]) < 40
