"""Sidecars as prealign wrote them before the probe's version 2 (sidecar version 3): a written
sidecar's meta given version 3 and the probe of definition 1 (the first and last 64 KiB hashed
one after the other, overlapping for a shard under 128 KiB), its arrays kept, saved as
``write_sidecar`` saves (the same members in the same order)."""

from __future__ import annotations

import io
import json

import numpy as np

from prealign.loaders.index.sidecar import read_probe
from prealign.loaders.sources.shard_files import sidecar_path, write_atomically


def as_version_3(source, shards=None) -> list[str]:
    """Rewrite the sidecars of ``shards`` (default: all) of ``source`` as version 3; returns the
    probes (definition 1) they now record."""
    probes = []
    for shard in range(source.num_shards) if shards is None else shards:
        path = sidecar_path(source.urls[shard], getattr(source, "index_dir", None))
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(arrays["meta"].tobytes().decode())
        assert meta["version"] == 4, meta["version"]
        meta["version"] = 3
        meta["probe"] = read_probe(source, shard, meta["size"], 1)[0]
        probes.append(meta["probe"])
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        write_atomically(path, buf.getvalue())
    return probes
