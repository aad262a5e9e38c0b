"""PackedLoader across simulated ranks in one process: coverage, disjointness, complementary CP
shards, identical TP batches, equal micro-batch counts, the budget as a hard cap."""

from __future__ import annotations

import time

import datasets
import pytest
import torch

from prealign.collate import unshard_cp
from prealign.loaders import (
    BadDataPolicy,
    BadSampleError,
    BadSampleWarning,
    HFSource,
    IndexOptions,
    LoadingOptions,
    PackedLoader,
    PlanError,
    PlannerConfig,
    ShuffleOptions,
    WebDatasetSource,
    build_index,
)
from prealign.loaders.errors import LoaderUsageError
from prealign.schemas import ParallelLayout, causal_lm_schema, validate_batch
from prealign.schemas.errors import SampleError
from tests.loader_helpers import hf_rows, sample_lengths, token_ids, write_shards

SCHEMA = causal_lm_schema()
BUDGET = 256


@pytest.fixture(scope="module")
def wds(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    lengths = sample_lengths(150, seed=3)
    src = WebDatasetSource(write_shards(str(root), lengths, num_shards=4))
    return src, build_index(src, SCHEMA), lengths


def _loader(wds, **kw):
    src, idx, _ = wds
    kw.setdefault("layout", ParallelLayout(tp=2, cp=2))
    return PackedLoader(
        src,
        schema=SCHEMA,
        token_budget=kw.pop("token_budget", BUDGET),
        indexing=IndexOptions(prebuilt=idx),
        **kw,
    )


def _ids(batch) -> list[int]:
    return batch["sample_index"].tolist()


@pytest.mark.parametrize("dp_size, cp", [(1, 1), (2, 2), (3, 1), (4, 2)])
def test_dp_ranks_cover_the_data_once_disjointly(wds, dp_size, cp):
    _, idx, lengths = wds
    layout = ParallelLayout(tp=2, cp=cp)
    per_rank, counts = [], set()
    for epoch in (0, 1):
        seen = []
        for r in range(dp_size):
            loader = _loader(wds, layout=layout, dp_rank=r, dp_size=dp_size)
            loader.set_epoch(epoch)
            batches = list(loader)
            counts.add(len(batches))
            for b in batches:
                assert b["input_ids"].shape[1] == int(b["cu_seqlens_padded"][-1]) <= BUDGET
                validate_batch(
                    {
                        k: v
                        for k, v in b.items()
                        if k not in ("sample_index", "is_filler", "epoch", "microbatch")
                    },
                    SCHEMA,
                    layout,
                )
                # the tokens are the samples': the first token of each sequence encodes its id
                starts = b["cu_seqlens_padded"][:-1].long()
                assert [int(b["input_ids"][0, s]) - 10_000 for s in starts] == _ids(b)
                seen.extend(_ids(b))
            per_rank.append(batches)
        assert sorted(seen) == list(range(len(lengths))), "every sample exactly once per epoch"
    assert len(counts) == 1, "the same number of micro-batches on every DP rank"


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_ranks_get_complementary_shards_of_the_same_batch(wds, cp):
    layout = ParallelLayout(tp=2, cp=cp)
    for dp_rank in range(2):
        whole = list(_loader(wds, layout=layout, dp_rank=dp_rank, dp_size=2))
        shards = [
            list(_loader(wds, layout=layout, dp_rank=dp_rank, dp_size=2, cp_rank=r))
            for r in range(cp)
        ]
        assert {len(s) for s in shards} == {len(whole)} and len(whole) > 1
        for i, full in enumerate(whole):
            parts = [s[i] for s in shards]
            assert all(
                torch.equal(p["cu_seqlens_padded"], full["cu_seqlens_padded"]) for p in parts
            )
            assert [p["cp_rank"] for p in parts] == list(range(cp))
            for key in ("input_ids", "labels", "position_ids", "loss_mask", "padding_mask"):
                assert parts[0][key].shape[1] * cp == full[key].shape[1]
                back = unshard_cp(
                    [p[key] for p in parts], cu_seqlens_padded=full["cu_seqlens_padded"]
                )
                assert torch.equal(back, full[key]), key


@pytest.mark.slow
def test_tp_ranks_and_worker_counts_give_identical_batches(wds):
    a = list(_loader(wds, dp_rank=1, dp_size=2, cp_rank=1))
    b = list(
        _loader(wds, dp_rank=1, dp_size=2, cp_rank=1)
    )  # another TP rank of the same DP/CP position
    c = list(
        _loader(
            wds,
            dp_rank=1,
            dp_size=2,
            cp_rank=1,
            num_workers=2,
            loading=LoadingOptions(prefetch_factor=3),
        )
    )
    assert len(a) > 3
    for x, y, z in zip(a, b, c):
        for key in x:
            if not isinstance(x[key], torch.Tensor):  # ints, flags, names (e.g. the CP layout)
                assert x[key] == y[key] == z[key], key
                continue
            assert torch.equal(x[key], y[key]) and torch.equal(x[key], z[key]), key


def test_epochs_set_epoch_and_len(wds):
    loader = _loader(wds, dp_size=2)
    n = len(loader)
    e0 = [_ids(b) for b in loader]
    assert loader.epoch == 1 and len(e0) == n
    e1 = [_ids(b) for b in loader]
    assert e0 != e1 and sorted(sum(e0, [])) != [] and loader.epoch == 2
    loader.set_epoch(0)
    it = iter(loader)
    first = [_ids(next(it)) for _ in range(2)]
    assert first == e0[:2]
    loader.set_epoch(0)  # the epoch in progress keeps its position
    assert [_ids(b) for b in loader] == e0[2:]
    assert loader.epoch_samples(0) == [tuple(x) for x in e0]
    loader.set_epoch(1)
    assert [_ids(b) for b in loader] == e1


def test_only_one_live_iterator(wds):
    loader = _loader(wds)
    it = iter(loader)
    next(it)
    it2 = iter(loader)
    next(it2)
    with pytest.raises(LoaderUsageError, match="newer iterator"):
        next(it)


def test_sequential_source_keeps_shard_locality(wds):
    loader = _loader(wds, shuffle=ShuffleOptions(window=8), planner=PlannerConfig(buffer_size=16))
    src, idx, _ = wds
    shards_in_order = [int(idx.shards[i]) for b in loader for i in _ids(b)]
    changes = sum(1 for a, b in zip(shards_in_order, shards_in_order[1:]) if a != b)
    assert changes < len(shards_in_order) // 4  # mostly shard after shard, not a global shuffle


def test_filler_microbatches_when_ranks_outnumber_samples(tmp_path):
    src = WebDatasetSource(write_shards(str(tmp_path), [5, 9], num_shards=1))
    batches = [
        list(
            PackedLoader(
                src,
                schema=SCHEMA,
                layout=ParallelLayout(cp=2),
                token_budget=64,
                dp_rank=r,
                dp_size=4,
                cp_rank=0,
            )
        )
        for r in range(4)
    ]
    assert [len(b) for b in batches] == [1, 1, 1, 1]
    flags = [b[0]["is_filler"] for b in batches]
    assert flags.count(True) == 2
    for b in (b[0] for b in batches if b[0]["is_filler"]):
        assert b["sample_index"].numel() == 0 and float(b["loss_mask"].sum()) == 0
        assert bool((b["labels"] == SCHEMA.ignore_index).all())


def test_oversize_truncation_in_the_loader(tmp_path):
    lengths = [10, 300, 20, 40]
    src = WebDatasetSource(write_shards(str(tmp_path), lengths, num_shards=1))
    with pytest.raises(ValueError, match="length <= 128"):
        PackedLoader(src, schema=SCHEMA, layout=ParallelLayout(cp=2), token_budget=128).prepare()
    with pytest.warns(BadSampleWarning, match="1 sample\\(s\\) truncated"):
        loader = PackedLoader(
            src,
            schema=SCHEMA,
            layout=ParallelLayout(cp=2),
            token_budget=128,
            planner=PlannerConfig(oversize="truncate"),
        ).prepare()
    assert loader.report.counts == {"oversize_truncated": 1}
    batches = list(loader)
    cut = next(b for b in batches if 1 in _ids(b))
    assert int(cut["cu_seqlens"][-1]) == 128 and cut["input_ids"].shape[1] <= 128
    assert cut["input_ids"][0, :128].tolist() == token_ids(1, 300)[:128].tolist()
    with pytest.warns(BadSampleWarning, match="1 skipped"):
        skipper = PackedLoader(
            src,
            schema=SCHEMA,
            layout=ParallelLayout(cp=2),
            token_budget=128,
            planner=PlannerConfig(oversize="skip"),
        ).prepare()
    assert sorted(i for b in skipper for i in _ids(b)) == [0, 2, 3]
    assert skipper.report.counts == {"oversize_skipped": 1}


@pytest.mark.slow
def test_bad_data_counts_are_exposed_on_the_loader(tmp_path):
    def transform(s):
        if s["json"]["id"] % 5 == 0:
            raise ValueError("unreadable")
        return {"input_ids": torch.from_numpy(s["input_ids.npy"])}

    src = WebDatasetSource(
        write_shards(str(tmp_path), sample_lengths(20), num_shards=2), transform=transform
    )
    with pytest.warns(BadSampleWarning):
        loader = PackedLoader(
            src,
            schema=SCHEMA,
            layout=ParallelLayout(),
            token_budget=128,
            bad_data=BadDataPolicy(on_error="skip"),
            num_workers=2,
        ).prepare()
    assert loader.report.counts == {"bad_sample": 4} and len(loader.index) == 16
    assert sorted(
        int(src.load(tuple(loader.index.locations[i]))["input_ids"][0]) - 10_000
        for b in loader
        for i in _ids(b)
    ) == [i for i in range(20) if i % 5]


class _UnreadableText(SampleError):
    """A transform's own typed error carrying a cause (like loaders.vlm.MediaError)."""

    reason = "unreadable_text"


@pytest.mark.slow
def test_transform_errors_are_counted_by_their_reason(tmp_path):
    def transform(s):
        i = s["json"]["id"]
        if i % 5 == 0:
            raise _UnreadableText(sample=i, field="json", expected="text", actual="garbage")
        if i % 7 == 0:
            raise ValueError("unreadable")
        return {"input_ids": torch.from_numpy(s["input_ids.npy"])}

    paths = write_shards(str(tmp_path), sample_lengths(20), num_shards=2)
    src = WebDatasetSource(paths, transform=transform)
    idx = build_index(src, SCHEMA, policy=BadDataPolicy(on_error="skip", warn=False), num_workers=2)
    assert (
        idx.report.counts == {"unreadable_text": 4, "bad_sample": 2} and len(idx) == 14
    )  # 0,5,10,15 | 7,14
    first = idx.report.examples[0]
    assert (first.where, first.reason) == (f"{paths[0]}:000000", "unreadable_text")
    assert first.message.startswith(
        f"unreadable_text: sample {paths[0]}:000000, field 'json': expected text"
    )
    with pytest.raises(
        BadSampleError
    ) as err:  # under RAISE the typed error keeps the cause and names the sample
        build_index(src, SCHEMA)
    assert err.value.reason == "unreadable_text" and f"{paths[0]}:000000" in str(err.value)
    saved = str(tmp_path / "index.npz")
    idx.save(saved)
    loader = PackedLoader(
        src,
        schema=SCHEMA,
        layout=ParallelLayout(),
        token_budget=128,
        indexing=IndexOptions(prebuilt=saved),
    )
    assert loader.report.counts == {
        "unreadable_text": 4,
        "bad_sample": 2,
    }  # through save / load and the loader
    assert sorted(
        int(src.load(tuple(loader.index.locations[i]))["input_ids"][0]) - 10_000
        for b in loader
        for i in _ids(b)
    ) == [i for i in range(20) if i % 5 and i % 7]


def test_hf_map_style_loader_and_rank_checks():
    lengths = sample_lengths(60)
    src = HFSource(datasets.Dataset.from_dict(hf_rows(lengths)))
    seen = []
    for r in range(3):
        seen += [
            i
            for b in PackedLoader(
                src,
                schema=SCHEMA,
                layout=ParallelLayout(cp=2),
                token_budget=128,
                dp_rank=r,
                dp_size=3,
            )
            for i in _ids(b)
        ]
    assert sorted(seen) == list(range(60))
    with pytest.raises(PlanError, match="dp_rank"):
        PackedLoader(
            src, schema=SCHEMA, layout=ParallelLayout(), token_budget=128, dp_rank=3, dp_size=3
        )
    one = PackedLoader.from_parallel_state(
        src, schema=SCHEMA, token_budget=128
    )  # no process group: one rank
    assert one.dp_size == 1 and one.cp_rank is None


@pytest.mark.slow
def test_index_workers_and_saved_index(wds, tmp_path):
    src, idx, _ = wds
    path = str(tmp_path / "index.npz")
    idx.save(path)
    a = PackedLoader(
        src,
        schema=SCHEMA,
        layout=ParallelLayout(),
        token_budget=BUDGET,
        indexing=IndexOptions(prebuilt=path),
    )
    b = PackedLoader(
        src,
        schema=SCHEMA,
        layout=ParallelLayout(),
        token_budget=BUDGET,
        indexing=IndexOptions(workers=2),
    )
    assert a.index.digest == b.index.digest == build_index(src, SCHEMA).digest


@pytest.mark.slow
def test_collate_errors_name_the_dataset_sample():
    """A sample the loader's collator rejects (here a stricter collator than the index schema) is
    named by its source location and index row, not by its position inside the micro-batch."""
    from prealign.collate import THDCollator

    rows = [{"n": 5 + i % 9, "bad": i == 13} for i in range(20)]

    def transform(r):
        n = r["n"]
        return {
            "input_ids": torch.arange(1, n + 1),
            "teacher_topk_ids": torch.full((n, 2), 5000 if r["bad"] else 1),
            "teacher_topk_log_probs": -torch.ones(n, 2),
        }

    src = HFSource(datasets.Dataset.from_list(rows), transform=transform)
    strict = causal_lm_schema(topk=2, vocab_size=1000)
    loader = PackedLoader(
        src,
        schema=causal_lm_schema(topk=2),
        layout=ParallelLayout(cp=2),
        token_budget=64,
        collator=THDCollator(schema=strict, layout=ParallelLayout(cp=2), cp_rank=1),
    )
    mb = next(mb for mb in loader.epoch_samples() if 13 in mb)
    assert len(mb) > 1 and mb.index(13) != 13  # its position in the micro-batch is not its id
    with pytest.raises(SampleError) as err:
        list(loader)
    e = err.value
    assert (
        type(e) is SampleError
        and e.sample == "hf[13] (index row 13)"
        and e.field == "teacher_topk_ids"
    )
    assert e.expected == "values in [0, 999]" and e.actual.startswith("5000 at token 0")
    assert str(e).startswith(
        "sample hf[13] (index row 13), field 'teacher_topk_ids': expected values in [0, 999]"
    )
    with pytest.raises(
        Exception, match=r"sample hf\[13\] \(index row 13\)"
    ):  # through a worker process too
        list(
            PackedLoader(
                src,
                schema=causal_lm_schema(topk=2),
                layout=ParallelLayout(cp=2),
                token_budget=64,
                collator=THDCollator(schema=strict, layout=ParallelLayout(cp=2)),
                num_workers=1,
            )
        )


def test_filler_copies_a_planned_sample_not_a_left_out_one():
    """The epoch's first sample is oversize and carries media (left out under TRUNCATE): the filler
    micro-batches copy a sample the plan places, loaded whole, media emptied, then cut."""
    from prealign.schemas import FieldSpec, Role

    schema = SCHEMA.with_fields(
        FieldSpec(name="pixel_values", role=Role.MEDIA, dtypes=("float32",), dense_shape=(4,))
    )
    rows = [
        {"input_ids": list(range(1, 200)), "npix": 3},
        {"input_ids": list(range(1, 100)), "npix": 2},
        {"input_ids": [4, 5], "npix": 0},
    ]
    src = HFSource(
        datasets.Dataset.from_list(rows),
        transform=lambda r: {
            "input_ids": torch.tensor(r["input_ids"]),
            "pixel_values": torch.zeros(r["npix"], 4),
        },
    )
    with pytest.warns(BadSampleWarning, match="oversize_media"):
        loaders_ = [
            PackedLoader(
                src,
                schema=schema,
                layout=ParallelLayout(),
                token_budget=128,
                dp_size=4,
                dp_rank=r,
                shuffle=ShuffleOptions(enabled=False),
                planner=PlannerConfig(oversize="truncate"),
            ).prepare()
            for r in range(4)
        ]
    assert loaders_[0].report.counts == {"oversize_media": 1}
    placed = {i for mb in loaders_[0].plan().microbatches for b in mb for i in b}
    assert placed == {1, 2}
    batches = [b for loader in loaders_ for b in loader]
    fillers = [b for b in batches if b["is_filler"]]
    assert len(batches) == 4 and len(fillers) == 2
    for b in fillers:
        assert b["sample_index"].numel() == 0 and float(b["loss_mask"].sum()) == 0
        assert tuple(b["pixel_values"].shape) == (0, 4) and not bool(b["input_ids"].any())
    assert sorted(i for b in batches for i in _ids(b)) == [1, 2]


# ---- issue 8: typed errors across workers, a worker killed mid-epoch
# ------------------------------
class _SlowInWorkers:
    """numpy_fields, sleeping in DataLoader workers only (so the main process waits on them);
    raises ValueError for every sample once ``flag`` exists (data changed after indexing)."""

    def __init__(self, delay: float, flag: str | None = None):
        self.delay, self.flag = delay, flag

    def __call__(self, sample):
        import os

        from torch.utils.data import get_worker_info

        from prealign.loaders.sources.webdataset import numpy_fields

        if self.flag is not None and os.path.exists(self.flag):
            raise ValueError("the data changed")
        if get_worker_info() is not None:
            time.sleep(self.delay)
        return numpy_fields(sample)


@pytest.mark.slow
def test_a_sample_error_in_a_worker_reaches_the_caller_as_its_own_type(tmp_path):
    flag = tmp_path / "changed"
    src = WebDatasetSource(
        write_shards(str(tmp_path), sample_lengths(20), num_shards=2),
        transform=_SlowInWorkers(0.0, str(flag)),
    )
    loader = PackedLoader(
        src, schema=SCHEMA, layout=ParallelLayout(), token_budget=BUDGET, num_workers=2
    )
    flag.write_text("")
    with pytest.raises(BadSampleError, match="transform to succeed") as exc:
        next(iter(loader))
    assert type(exc.value) is BadSampleError and exc.value.field is None
    assert exc.value.sample.startswith(src.urls[0]) or exc.value.sample.startswith(src.urls[1])
    assert "Caught" not in str(exc.value)


@pytest.mark.slow
def test_a_worker_killed_with_sigkill_leaves_a_loader_that_continues_exactly(tmp_path):
    """persistent_workers=True, a worker SIGKILLed mid-epoch: the iteration raises WorkerError; the
    next iteration starts fresh workers and yields exactly the rest of the epoch, then the next
    epoch."""
    import os
    import signal
    import threading

    from prealign.loaders.errors import WorkerError

    src = WebDatasetSource(
        write_shards(str(tmp_path), sample_lengths(60, seed=4), num_shards=2),
        transform=_SlowInWorkers(0.03),
    )
    kw = {"schema": SCHEMA, "layout": ParallelLayout(), "token_budget": 128}
    ref = PackedLoader(src, **kw)
    expected = [[_ids(b) for b in ref] for _ in range(2)]  # epochs 0 and 1
    assert len(expected[0]) >= 8
    loader = PackedLoader(
        src,
        **kw,
        indexing=IndexOptions(prebuilt=ref.index),
        num_workers=2,
        loading=LoadingOptions(persistent_workers=True),
    )
    it = iter(loader)
    got = [_ids(next(it)) for _ in range(3)]
    victim = loader._loader._iterator._workers[0]
    threading.Timer(0.05, os.kill, (victim.pid, signal.SIGKILL)).start()
    with pytest.raises(WorkerError, match="iterate the loader again"):
        for b in it:
            got.append(_ids(b))
    assert 3 <= len(got) < len(expected[0]) and loader.state_dict()["position"] == len(got)
    got.extend(_ids(b) for b in loader)  # fresh workers, the rest of epoch 0
    assert got == expected[0]
    assert [_ids(b) for b in loader] == expected[1]
    assert all(w.is_alive() for w in loader._loader._iterator._workers)


@pytest.mark.slow
def test_a_worker_timeout_is_a_worker_error_and_the_loader_stays_usable(tmp_path):
    from prealign.loaders.errors import WorkerError

    src = WebDatasetSource(
        write_shards(str(tmp_path), sample_lengths(12, seed=1), num_shards=1),
        transform=_SlowInWorkers(0.6),
    )
    kw = {"schema": SCHEMA, "layout": ParallelLayout(), "token_budget": 64}
    ref = PackedLoader(src, **kw)
    expected = [_ids(b) for b in ref]
    loader = PackedLoader(
        src,
        **kw,
        indexing=IndexOptions(prebuilt=ref.index),
        num_workers=1,
        loading=LoadingOptions(timeout=0.5),
    )
    with pytest.raises(WorkerError, match="timed out"):
        next(iter(loader))
    assert loader.state_dict()["position"] == 0 and loader._loader._iterator is None
    loader._loader.timeout = 0  # the cause fixed: the same loader iterates the whole epoch
    assert [_ids(b) for b in loader] == expected


@pytest.mark.slow
def test_a_persistent_worker_killed_between_epochs_is_replaced(tmp_path):
    import os
    import signal

    src = WebDatasetSource(write_shards(str(tmp_path), sample_lengths(30, seed=6), num_shards=2))
    kw = {"schema": SCHEMA, "layout": ParallelLayout(), "token_budget": 128}
    ref = PackedLoader(src, **kw)
    expected = [[_ids(b) for b in ref] for _ in range(2)]
    loader = PackedLoader(
        src,
        **kw,
        indexing=IndexOptions(prebuilt=ref.index),
        num_workers=2,
        loading=LoadingOptions(persistent_workers=True),
    )
    assert [_ids(b) for b in loader] == expected[0]
    victim = loader._loader._iterator._workers[1]
    try:  # torch's SIGCHLD handler may raise in whatever the main thread runs when the worker dies
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
    except RuntimeError as exc:
        assert "DataLoader worker" in str(exc)
    assert [_ids(b) for b in loader] == expected[1]
    assert all(w.is_alive() for w in loader._loader._iterator._workers)
