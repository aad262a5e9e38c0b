"""End-to-end loader benchmark: PackedLoader batches/s from webdataset shards with 2 workers, against
a raw webdataset iteration over the same shards in the same run, and the share of time in collate.

Data: synthetic shards written to a temporary folder: ``N`` samples (``<key>.input_ids.npy`` int64
tokens + ``<key>.json``), lengths lognormal(5.0, 1.0) clipped to 16..4096, 8 shards.
Loader: tp=2, cp=2, this rank is (dp 0 of 1, cp 0), budget 8192, BFD, 2 workers.
Raw: ``webdataset.WebDataset(shards)`` in a DataLoader with 2 workers, each sample's ``.npy`` decoded
to a tensor (the same decoding work, no planning, no collation).
Raw is run in-process and with the workers (handing over lists of 32 samples); the ratio compares
samples/s of the loader with the faster of the two (target >= 0.9). Every run reads every sample once.
The collate share is measured in-process (``num_workers=0``): time in the collator / time per epoch.
The one-off index pass (lengths + byte offsets) is timed separately and not part of the epoch.
"""
from __future__ import annotations

import argparse
import io
import json
import os
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
                for name, data in ((f"{i:08d}.input_ids.npy", _npy(rng.integers(1, 50_000, lengths[i]))),
                                   (f"{i:08d}.json", json.dumps({"id": i}).encode())):
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
    return {"input_ids": torch.from_numpy(np.load(io.BytesIO(sample["input_ids.npy"]), allow_pickle=False))}


class TimedCollator:
    """Wraps a collator; adds ``_collate_s`` (seconds spent collating this batch) to the batch."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, samples):
        t0 = time.perf_counter()
        out = self.inner(samples)
        out["_collate_s"] = time.perf_counter() - t0
        return out


def _as_list(samples):
    return list(samples)


def raw_epoch(paths: list[str], workers: int) -> tuple[int, float]:
    """Samples and seconds of one raw pass; workers hand over lists of 32 samples (cheaper IPC)."""
    import webdataset as wds

    ds = wds.WebDataset(paths, shardshuffle=False, empty_check=False).map(_raw_decode)
    if workers:
        ds = ds.batched(32, collation_fn=_as_list, partial=True)
    t0 = time.perf_counter()
    n = sum(len(x) if workers else 1 for x in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers))
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4k samples instead of 40k")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    n = 4_000 if args.quick else 40_000
    layout, schema = ParallelLayout(tp=2, cp=2), causal_lm_schema()
    with tempfile.TemporaryDirectory() as root:
        paths = write_shards(root, n)
        src = WebDatasetSource(paths)
        coll = TimedCollator(THDCollator(schema=schema, layout=layout, cp_rank=0))
        t0 = time.perf_counter()
        loader = PackedLoader(src, schema=schema, layout=layout, token_budget=8192, cp_rank=0,
                              num_workers=args.workers, collator=coll, indexing=IndexOptions(workers=args.workers),
                              loading=LoadingOptions(persistent_workers=True, prefetch_factor=4))
        index_s = time.perf_counter() - t0
        rows = []
        for rep in range(2):  # alternate so that page cache and warm-up favour neither
            raw = [raw_epoch(paths, w) for w in (0, args.workers)]
            lb, ls, lt, _ = loader_epoch(loader)
            rows.append((raw, lb, ls, lt))
        inproc = PackedLoader(src, schema=schema, layout=layout, token_budget=8192, cp_rank=0, num_workers=0,
                              collator=coll, indexing=IndexOptions(prebuilt=loader.index))
        ib, isamp, it, icoll = loader_epoch(inproc)
    raw, lb, ls, lt = rows[-1]
    (rn0, rs0), (rn, rs) = raw
    assert rn0 == rn == ls == n, (rn0, rn, ls, n)
    raw_sps, our_sps = max(rn / rs, rn0 / rs0), ls / lt
    stats = loader.plan(0).stats
    print(f"{n} samples in 8 shards, tp=2 cp=2 budget 8192, {args.workers} workers; "
          f"index pass {index_s:.2f}s (once); utilisation {stats.utilisation:.4f}")
    head = f"{'run':<28} {'samples':>8} {'batches':>8} {'seconds':>8} {'samples/s':>10} {'batches/s':>10}"
    print(head + "\n" + "-" * len(head))
    print(f"{'raw webdataset, 0 workers':<28} {rn0:>8} {'-':>8} {rs0:>8.3f} {rn0 / rs0:>10.0f} {'-':>10}")
    print(f"{f'raw webdataset, {args.workers} workers':<28} {rn:>8} {'-':>8} {rs:>8.3f} {rn / rs:>10.0f} {'-':>10}")
    print(f"{f'PackedLoader, {args.workers} workers':<28} {ls:>8} {lb:>8} {lt:>8.3f} {our_sps:>10.0f} {lb / lt:>10.1f}")
    print(f"{'PackedLoader, 0 workers':<28} {isamp:>8} {ib:>8} {it:>8.3f} {isamp / it:>10.0f} {ib / it:>10.1f}")
    print(f"\nratio loader / faster raw (samples/s): {our_sps / raw_sps:.3f}   (target >= 0.9)")
    print(f"collate share of the per-batch work (0 workers): {icoll / it:.3f}  "
          f"({1000 * icoll / ib:.2f} ms per batch of ~{isamp / ib:.0f} samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
