"""Shared fixtures for the loader tests: tiny webdataset shards and HF datasets written on the
fly."""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np


def sample_lengths(n: int, seed: int = 0, low: int = 3, high: int = 60) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(low, high, n).tolist()


def token_ids(i: int, length: int) -> np.ndarray:
    """Deterministic ids of sample ``i``: the first token encodes the sample id (for coverage
    checks)."""
    ids = (np.arange(length, dtype=np.int64) * 7 + i) % 1000 + 1
    ids[0] = 10_000 + i
    return ids


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def add_member(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def write_shards(root: str, lengths: list[int], *, num_shards: int = 3, extra=None) -> list[str]:
    """Write samples ``i`` (``{i:06d}.input_ids.npy`` + ``.json``) round-robin... in contiguous runs
    over ``num_shards`` tar files; ``extra(i, tf)`` may add or replace members. Returns the
    paths."""
    os.makedirs(root, exist_ok=True)
    paths = []
    per = -(-len(lengths) // num_shards)
    for s in range(num_shards):
        path = os.path.join(root, f"shard-{s:03d}.tar")
        with tarfile.open(path, "w") as tf:
            for i in range(s * per, min(len(lengths), (s + 1) * per)):
                if extra is not None and extra(i, tf):
                    continue
                add_member(tf, f"{i:06d}.input_ids.npy", _npy(token_ids(i, lengths[i])))
                add_member(tf, f"{i:06d}.json", json.dumps({"id": i}).encode())
        paths.append(path)
    return paths


def hf_rows(lengths: list[int]) -> dict:
    return {
        "input_ids": [token_ids(i, n).tolist() for i, n in enumerate(lengths)],
        "id": list(range(len(lengths))),
    }


def sample_id(batch_ids_row) -> int:
    return int(batch_ids_row) - 10_000


def npz_meta(path: str) -> tuple[dict, dict]:
    """``(arrays, meta)`` of a sidecar or merged index file (``meta`` its JSON), to edit in a
    test."""
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    return arrays, json.loads(arrays.pop("meta").tobytes())


def save_npz_meta(path: str, arrays: dict, meta: dict) -> None:
    """Write ``arrays`` and the JSON ``meta`` back as the file ``path`` (:func:`npz_meta`'s
    inverse)."""
    buf = io.BytesIO()
    np.savez(buf, **arrays, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    with open(path, "wb") as f:
        f.write(buf.getvalue())
