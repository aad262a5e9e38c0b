"""A merged index (version 5) or a sidecar whose probe definitions are hostile: a
``probe_versions`` column of another dtype, shape or value, a version of another type (a bool, a
string, a list, a huge int, a float past any), is a :class:`StaleIndexError` naming the file,
whichever path reads it (a merged file; sidecars in bulk, from 32 on, and one by one), never
another exception and never a shard checked by a probe definition its index did not record."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

from prealign.loaders import BadDataPolicy, WebDatasetSource
from prealign.loaders.errors import StaleIndexError
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.index.merged import NAME, merge_sidecars, merged_index, read_merged
from prealign.loaders.index.shard_checks import check_all_shards
from prealign.loaders.index.sidecar_bulk import sidecars_merged
from prealign.loaders.index.source_index import check_source
from prealign.loaders.sources.shard_files import SUFFIX
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import sample_lengths, write_shards
from tests.loaders.index.old_sidecars import as_version_3

SCHEMA = causal_lm_schema()
N = 34  # (>= 32 sidecars: read in bulk)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """``N`` small shards, every third sidecar of version 3, and their merged index (version 5,
    with ``probe_versions``)."""
    root = str(tmp_path_factory.mktemp("hostile-probes"))
    paths = write_shards(root, sample_lengths(10 * N, seed=5), num_shards=N)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    as_version_3(WebDatasetSource(paths), range(0, N, 3))
    folder = os.path.join(root, "merged")
    os.makedirs(folder)
    path = merge_sidecars(WebDatasetSource(paths), os.path.join(folder, NAME))["path"]
    return paths, folder, path


def _npz(data: bytes) -> tuple[dict, dict]:
    with np.load(io.BytesIO(data)) as z:
        arrays = {k: z[k] for k in z.files}
    return json.loads(arrays["meta"].tobytes()), arrays


def _save(meta: dict, arrays: dict) -> bytes:
    arrays = {**arrays, "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)}
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _column(value):
    return lambda meta, arrays: arrays.__setitem__("probe_versions", value)


def _version(value):
    return lambda meta, arrays: meta.__setitem__("version", value)


HOSTILE_MERGED = {
    "int64": _column(np.ones(N, np.int64)),
    "bool": _column(np.ones(N, bool)),
    "int8": _column(np.ones(N, np.int8)),
    "float": _column(np.ones(N)),
    "2d": _column(np.ones((N, 1), np.uint8)),
    "0d": _column(np.ones((), np.uint8)),
    "short": _column(np.ones(N - 1, np.uint8)),
    "zero": _column(np.zeros(N, np.uint8)),
    "three": _column(np.full(N, 3, np.uint8)),
    "255": _column(np.full(N, 255, np.uint8)),
    "version 4 with the column": _version(4),
    "version True": _version(True),
    "version '5'": _version("5"),
    "version [5]": _version([5]),
    "version 10**30": _version(10**30),
    "version null": _version(None),
}


@pytest.mark.parametrize("edit", list(HOSTILE_MERGED))
def test_a_hostile_merged_probe_definition_is_a_stale_index(data, edit):
    paths, folder, path = data
    with open(path, "rb") as f:
        good = f.read()
    meta, arrays = _npz(good)
    assert arrays["probe_versions"].tolist() == [2 - (s % 3 == 0) for s in range(N)]
    HOSTILE_MERGED[edit](meta, arrays)
    try:
        with open(path, "wb") as f:
            f.write(_save(meta, arrays))
        with pytest.raises(StaleIndexError, match="merged.npz: merged index unreadable"):
            read_merged(WebDatasetSource(paths, index_dir=folder), SCHEMA)
    finally:
        with open(path, "wb") as f:
            f.write(good)
    source = WebDatasetSource(paths, index_dir=folder)  # (restored: read as it was)
    merged_index(source, SCHEMA, BadDataPolicy(), found=read_merged(source, SCHEMA))
    assert check_all_shards(source) == N


@pytest.mark.parametrize("shard", [0, 1])  # (a version 3 sidecar, a version 4 one)
@pytest.mark.parametrize("value", [True, False, "4", [4], 10**30, None, 2, 5, -1, 1e400])
@pytest.mark.parametrize("path", ["bulk", "one by one"])
def test_a_hostile_sidecar_version_is_a_stale_index(data, shard, value, path):
    paths = data[0]
    with open(paths[shard] + SUFFIX, "rb") as f:
        good = f.read()
    meta, arrays = _npz(good)
    assert meta["version"] == (3 if shard == 0 else 4)
    meta["version"] = value
    try:
        with open(paths[shard] + SUFFIX, "wb") as f:
            f.write(_save(meta, arrays))
        source = WebDatasetSource(paths)
        with pytest.raises(StaleIndexError, match=f"shard-{shard:03d}.tar.*format version"):
            if path == "bulk":
                sidecars_merged(source, SCHEMA)
            else:
                check_source(source, SCHEMA)
    finally:
        with open(paths[shard] + SUFFIX, "wb") as f:
            f.write(good)
