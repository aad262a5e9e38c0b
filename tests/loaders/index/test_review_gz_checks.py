"""Review: a gzip-compressed local shard with a sidecar (its ``size`` / ``probe`` are of the tar the
index pass read, not of the file on disk) passes its first-read check and ``verify_shards``, and is
still checked at its first read (a shard gone since indexing names itself)."""

from __future__ import annotations

import gzip
import os

import pytest

from prealign.loaders import WebDatasetSource
from prealign.loaders.errors import MissingShardError
from prealign.loaders.index.header_pass import write_sidecars
from tests.loader_helpers import sample_lengths, write_shards
from tests.loaders.index.test_sidecar_lazy import SCHEMA, _loader


def _gz_shards(folder) -> list[str]:
    paths = write_shards(str(folder), sample_lengths(60), num_shards=3)
    for p in paths:
        with open(p, "rb") as f:
            raw = f.read()
        with open(p + ".gz", "wb") as f:
            f.write(gzip.compress(raw, mtime=0))
        os.remove(p)
    return [p + ".gz" for p in paths]


def _served(loader) -> int:
    return sum(len(b["sample_index"]) for b in loader)


def test_a_gzip_shard_with_a_sidecar_is_served_and_verified(tmp_path):
    gz = _gz_shards(tmp_path)
    plain = _served(_loader(gz).prepare())  # (indexed in process)
    write_sidecars(WebDatasetSource(gz), SCHEMA)
    loader = _loader(gz).prepare()
    assert loader.verify_shards() == 3  # (failed before: "1655 bytes now, 51200 when indexed")
    assert _served(loader) == plain


def test_a_gzip_shard_gone_since_indexing_names_itself(tmp_path):
    gz = _gz_shards(tmp_path)
    write_sidecars(WebDatasetSource(gz), SCHEMA)
    loader = _loader(gz).prepare()
    os.remove(gz[1])
    with pytest.raises(MissingShardError, match="shard-001.tar.gz"):
        for _ in loader:
            pass
