"""End-to-end loader benchmark: PackedLoader batches/s from webdataset shards with 2 workers,
against a raw webdataset iteration over the same shards in the same run, and the share of time in
collate.

Data: synthetic shards written to a temporary folder: ``N`` samples (``<key>.input_ids.npy`` int64
tokens + ``<key>.json``), lengths lognormal(5.0, 1.0) clipped to 16..4096, 8 shards.
Loader: tp=2, cp=2, this rank is (dp 0 of 1, cp 0), budget 8192, BFD, 2 workers.
Raw: ``webdataset.WebDataset(shards)`` in a DataLoader with 2 workers, each sample's ``.npy``
decoded to a tensor (the same decoding work, no planning, no collation).
Raw is run in-process and with the workers (handing over lists of 32 samples); the ratio compares
samples/s of the loader with the faster of the two (target >= 0.9). Every run reads every sample
once. Megatron-Energon (``--no-energon`` to leave it out): ``energon prepare`` of the same shards
once (untimed, like the index pass), then a fresh ``get_loader(get_train_dataset(...))`` with the
same workers reading as many samples, decoded, in lists of 32 (no packing, no collation). Every
contender starts fresh workers in its first epoch in every round; the rounds interleave the
contenders (the order rotating); samples/s, wall and CPU seconds of each epoch (this process and
its joined workers, ``RUSAGE_SELF + RUSAGE_CHILDREN``) are given as median [min..max] over the
rounds, with the per-round ratios. The loader reads and decodes every sample of each micro-batch and
collates CP rank 0's half of its tokens; the raw and Energon contenders decode the same samples and
collate nothing (their lists of 32 are what they hand over).
The collate share is measured in-process (``num_workers=0``): time in the collator / time per epoch.
The one-off index pass (lengths + byte offsets) is timed separately and not part of the epoch.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import resource
import statistics
import sys
import tarfile
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from prealign.collate import THDCollator  # noqa: E402
from prealign.loaders import IndexOptions, LoadingOptions, PackedLoader, WebDatasetSource  # noqa: E402
from prealign.schemas import ParallelLayout, causal_lm_schema  # noqa: E402


def write_shards(root: str, n: int, num_shards: int = 8, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5.0, 1.0, n).astype(np.int64), 16, 4096)
    paths = []
    per = -(-n // num_shards)
    for s in range(num_shards):
        path = os.path.join(root, f"bench-{s:04d}.tar")
        with tarfile.open(path, "w") as tf:
            for i in range(s * per, min(n, (s + 1) * per)):
                for name, data in (
                    (f"{i:08d}.input_ids.npy", _npy(rng.integers(1, 50_000, lengths[i]))),
                    (f"{i:08d}.json", json.dumps({"id": i}).encode()),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def _npy(arr) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _raw_decode(sample: dict) -> dict:
    return {
        "input_ids": torch.from_numpy(
            np.load(io.BytesIO(sample["input_ids.npy"]), allow_pickle=False)
        )
    }


class TimedCollator:
    """Wraps a collator; adds ``_collate_s`` (seconds spent collating this batch) to the batch."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, samples):
        t0 = time.perf_counter()
        out = self.inner(samples)
        out["_collate_s"] = time.perf_counter() - t0
        return out


def cpu_seconds() -> float:
    """CPU seconds of this process and its joined children (workers)."""
    usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def timed(epoch, *args) -> tuple[int, float, float]:
    """(samples, wall s, CPU s) of ``epoch(*args)``, which returns (samples, ...); its workers are
    joined (garbage collected) before the CPU is read."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    samples = epoch(*args)[0]
    gc.collect()
    return samples, time.perf_counter() - t0, cpu_seconds() - c0


def _as_list(samples):
    return list(samples)


def raw_epoch(paths: list[str], workers: int) -> tuple[int, float]:
    """Samples and seconds of one raw pass; workers hand over lists of 32 samples (cheaper IPC)."""
    import webdataset as wds

    ds = wds.WebDataset(paths, shardshuffle=False, empty_check=False).map(_raw_decode)
    if workers:
        ds = ds.batched(32, collation_fn=_as_list, partial=True)
    t0 = time.perf_counter()
    n = sum(
        len(x) if workers else 1
        for x in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    )
    return n, time.perf_counter() - t0


def loader_epoch(loader) -> tuple[int, int, float, float]:
    t0 = time.perf_counter()
    samples = batches = 0
    collate = 0.0
    for b in loader:
        batches += 1
        samples += b["sample_index"].numel()
        collate += b["_collate_s"]
    return batches, samples, time.perf_counter() - t0, collate


class _EnergonEncoder:
    """A task encoder whose batches are lists of samples (variable lengths: Energon's default
    stacks)."""

    def __new__(cls):
        from megatron.energon import DefaultTaskEncoder

        class Encoder(DefaultTaskEncoder):
            def batch(self, samples):
                return samples

        return Encoder()


def energon_prepare(root: str, paths: list[str], workers: int) -> float:
    """``energon prepare`` of the shards (once, like prealign's index pass): seconds."""
    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors import BaseWebdatasetFactory

    t0 = time.perf_counter()
    BaseWebdatasetFactory.prepare_dataset(
        EPath(root),
        [os.path.basename(p) for p in paths],
        split_parts_ratio=[("train", 1.0)],
        workers=workers,
        shuffle_seed=None,
    )
    with open(os.path.join(root, ".nv-meta", "dataset.yaml"), "w") as f:
        f.write(
            "sample_type:\n  __module__: megatron.energon\n  __class__: TextSample\n"
            "field_map:\n  text: input_ids.npy\n"
        )
    return time.perf_counter() - t0


def energon_epoch(root: str, n: int, workers: int) -> tuple[int, float]:
    """Samples and seconds of a fresh Energon loader (``workers`` fresh workers) reading ``n``
    samples (its train dataset loops: read until ``n``), batches of 32 samples as lists."""
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    t0 = time.perf_counter()
    wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    loader = get_loader(
        get_train_dataset(
            root,
            batch_size=32,
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
            worker_config=wc,
            task_encoder=_EnergonEncoder(),
        )
    )
    got = 0
    it = iter(loader)
    while got < n:
        got += len(next(it))
    del it, loader
    return got, time.perf_counter() - t0


def _spread(xs: list[float], fmt: str = "{:,.0f}") -> str:
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}..{fmt.format(max(xs))}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="4k samples instead of 40k")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-energon", action="store_true", help="leave Megatron-Energon out")
    args = ap.parse_args(argv)
    n = 4_000 if args.quick else 40_000
    energon = not args.no_energon
    layout, schema = ParallelLayout(tp=2, cp=2), causal_lm_schema()
    with tempfile.TemporaryDirectory() as root:
        paths = write_shards(root, n)
        src = WebDatasetSource(paths)
        coll = TimedCollator(THDCollator(schema=schema, layout=layout, cp_rank=0))
        t0 = time.perf_counter()
        index = (
            PackedLoader(
                src,
                schema=schema,
                layout=layout,
                token_budget=8192,
                cp_rank=0,
                indexing=IndexOptions(workers=args.workers),
            )
            .prepare()
            .index
        )
        index_s = time.perf_counter() - t0
        prepare_s = energon_prepare(root, paths, args.workers) if energon else None

        # fresh workers, epoch 0, every round: what the raw DataLoader and Energon get
        def loader():
            return PackedLoader(
                src,
                schema=schema,
                layout=layout,
                token_budget=8192,
                cp_rank=0,
                num_workers=args.workers,
                collator=coll,
                indexing=IndexOptions(prebuilt=index),
                loading=LoadingOptions(persistent_workers=False, prefetch_factor=4),
            )

        runs = {
            "raw0": lambda: timed(raw_epoch, paths, 0),
            "raw": lambda: timed(raw_epoch, paths, args.workers),
            "loader": lambda: timed(lambda: loader_epoch(loader())[1:]),
        }
        if energon:
            runs["energon"] = lambda: timed(energon_epoch, root, n, args.workers)
        rows = []
        contenders = list(runs)
        for r in range(args.rounds):  # interleaved: page cache and machine load favour no contender
            order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
            rows.append({k: runs[k]() for k in order})
        inproc = PackedLoader(
            src,
            schema=schema,
            layout=layout,
            token_budget=8192,
            cp_rank=0,
            num_workers=0,
            collator=coll,
            indexing=IndexOptions(prebuilt=index),
        )
        ib, isamp, it, icoll = loader_epoch(inproc)
    for row in rows:
        assert row["raw0"][0] == row["raw"][0] == row["loader"][0] == n, row
    keys = [k for k in ("raw0", "raw", "energon", "loader") if k in rows[0]]
    sps = {k: [r[k][0] / r[k][1] for r in rows] for k in keys}
    wall = {k: [r[k][1] for r in rows] for k in keys}
    cpu = {k: [r[k][2] for r in rows] for k in keys}
    print(
        f"{n} samples in 8 shards, tp=2 cp=2 budget 8192, {args.workers} workers, {args.rounds} "
        f"interleaved "
        f"rounds, every contender on fresh workers in its first epoch; index pass {index_s:.2f} s"
        + (f", energon prepare {prepare_s:.2f} s" if energon else "")
        + " (once, not timed below)\n"
    )
    print(
        "| run | samples/s | wall s | CPU s | PackedLoader / it, samples/s per round | "
        "its CPU / PackedLoader's, per round |\n|---|---|---|---|---|---|"
    )
    names = {
        "raw0": "raw webdataset, 0 workers",
        "raw": f"raw webdataset, {args.workers} workers",
        "energon": f"Megatron-Energon loader, {args.workers} workers (decode only, lists of 32)",
        "loader": f"PackedLoader, {args.workers} workers (packed, collated tp=2 cp=2)",
    }
    for k, name in names.items():
        if k in sps:
            ratio = (
                "-"
                if k == "loader"
                else _spread([a / b for a, b in zip(sps["loader"], sps[k])], "{:.2f}")
            )
            cpu_ratio = (
                "-"
                if k == "loader"
                else _spread([a / b for a, b in zip(cpu[k], cpu["loader"])], "{:.2f}")
            )
            print(
                f"| {name} | {_spread(sps[k])} | {_spread(wall[k], '{:.2f}')} | "
                f"{_spread(cpu[k], '{:.2f}')} | {ratio} | {cpu_ratio} |"
            )
    faster = [lo / max(a, b) for lo, a, b in zip(sps["loader"], sps["raw0"], sps["raw"])]
    print(
        f"\nPackedLoader / faster raw (samples/s), per round: {_spread(faster, '{:.3f}')}   "
        f"(target >= 0.9)"
    )
    print(
        f"PackedLoader, 0 workers: {isamp / it:,.0f} samples/s; collate share of its per-batch "
        f"work {icoll / it:.3f} ({1000 * icoll / ib:.2f} ms per batch of ~{isamp / ib:.0f} samples)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
