"""Differential: every kind of ``datasets.IterableDataset`` a user may hand ``HFSource`` resumes
(``scan_after``) and opens a shard at a row (``read``) with exactly the rows of a scan that drops
those before: shuffled (``shuffle(seed, buffer_size)``, also at epoch 1), ``from_generator``,
``map`` / ``filter`` (batched too), parquet and jsonl streamed by ``load_dataset``, node split.
(A shuffled parquet stream gives the same rows too, but waits 5 s on each open in datasets 5.2:
not here.)"""

from __future__ import annotations

import os

import datasets
import pytest
from datasets.distributed import split_dataset_by_node

from prealign.loaders import HFSource

N = 90


def _rows(lo: int = 0) -> dict:
    return {"input_ids": [[i % 5 + 1] for i in range(N)], "k": list(range(lo, lo + N))}


def _gen(parts):
    for k in (k for part in parts for k in part):
        yield {"input_ids": [k % 5 + 1], "k": k}


def _epoch1(ds):
    ds.set_epoch(1)
    return ds


def _files(root, kind: str) -> list:
    paths = []
    for f in range(3):
        path = os.path.join(root, f"part-{f}.{kind}")
        part = datasets.Dataset.from_dict(_rows(f * N))
        part.to_parquet(path) if kind == "parquet" else part.to_json(path)
        paths.append(path)
    return paths


def _stream(root, kind: str) -> datasets.IterableDataset:
    plain = datasets.Dataset.from_dict(_rows()).to_iterable_dataset(num_shards=3)
    if kind == "shuffled":
        return plain.shuffle(seed=3, buffer_size=10)
    if kind == "shuffled, epoch 1":
        return _epoch1(plain.shuffle(seed=3, buffer_size=10))
    if kind in ("generator", "generator shuffled"):
        ds = datasets.IterableDataset.from_generator(
            _gen, gen_kwargs={"parts": [list(range(a, a + 30)) for a in range(0, N, 30)]}
        )
        return ds.shuffle(seed=1, buffer_size=7) if kind.endswith("shuffled") else ds
    if kind == "map batched":
        return plain.map(lambda b: {k: v + v for k, v in b.items()}, batched=True, batch_size=4)
    if kind == "filter":
        return plain.filter(lambda r: r["k"] % 3 != 0)
    if kind == "filter batched, shuffled":
        return plain.shuffle(seed=2, buffer_size=5).filter(
            lambda b: [k % 4 != 1 for k in b["k"]], batched=True, batch_size=3
        )
    if kind in ("parquet", "json"):
        files = _files(root, kind)
        return datasets.load_dataset(kind, data_files=files, split="train", streaming=True)
    assert kind.startswith("node split")
    return split_dataset_by_node(plain, rank=1, world_size=2 if kind.endswith("2") else 4)


KINDS = [
    "shuffled",
    "shuffled, epoch 1",
    "generator",
    "generator shuffled",
    "map batched",
    "filter",
    "filter batched, shuffled",
    "parquet",
    "json",
    "node split 2",
    "node split 4",
]


@pytest.mark.parametrize("kind", KINDS)
def test_a_stream_of_any_kind_resumes_and_opens_at_the_rows_of_a_scan(kind, tmp_path):
    src = HFSource(_stream(tmp_path, kind))
    for shard in range(src.num_shards):
        whole = [(loc, raw["k"]) for loc, raw in src.scan(shard)]
        for o in sorted({0, 1, len(whole) // 2, len(whole) - 2}):
            if 0 <= o < len(whole):
                rest = [(loc, raw["k"]) for loc, raw in src.scan_after(shard, o, whole[o][0])]
                assert rest == whole[o + 1 :], (shard, o)
        for loc, k in whole[::-7]:  # (each a shard not open yet, or a row older than read)
            assert HFSource(_stream(tmp_path, kind)).read(loc)["k"] == k, loc
