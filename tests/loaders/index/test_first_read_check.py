"""A local shard is checked against its index on the file its first read opens (issue #28): an
``fstat`` and one read for a shard of up to 128 KiB (two above), no ``stat`` and no open of its own,
the same probe digest as the check by path, and every change it caught still caught."""

from __future__ import annotations

import os

import numpy as np
import pytest

from prealign.loaders import build_index
from prealign.loaders.errors import ChangedShardError
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.index.shard_checks import ShardChecks
from prealign.loaders.index.sidecar import PROBE, read_probe
from prealign.loaders.sources.shard_files import open_regular
from prealign.loaders.sources.webdataset import WebDatasetSource
from tests.loaders.index.test_start_complexity import SCHEMA, _shards


@pytest.mark.parametrize(
    "size",
    [1, 700, PROBE - 1, PROBE, PROBE + 1, 2 * PROBE - 1, 2 * PROBE, 2 * PROBE + 1, 5 * PROBE],
)
def test_the_check_on_the_open_file_agrees_with_the_check_by_path(tmp_path, size):
    path = str(tmp_path / "s.tar")
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(data)
    source = WebDatasetSource([path])
    probe = read_probe(source, 0, size)[0]
    checks = ShardChecks(1, {0: (size, probe, -1, -1)})
    with open_regular(path) as f:
        checks(source, 0, f)  # the same digest: passes
    checks(source, 0)
    for at in sorted({0, size // 2, size - 1}):  # a byte the probe covers, changed in place
        if PROBE <= at < size - PROBE:
            continue  # (between the probes: the sample's crc32 catches it, not this check)
        changed = bytearray(data)
        changed[at] ^= 0x5A
        with open(path, "wb") as f:
            f.write(bytes(changed))
        with open_regular(path) as f, pytest.raises(ChangedShardError):
            checks(source, 0, f)
        with pytest.raises(ChangedShardError):
            checks(source, 0)
    with open(path, "wb") as f:  # another size
        f.write(data + b"x")
    with open_regular(path) as f, pytest.raises(ChangedShardError, match="bytes now"):
        checks(source, 0, f)


def test_a_first_read_opens_a_small_shard_once_and_reads_it_once(tmp_path, monkeypatch):
    paths = _shards(str(tmp_path / "d"), 6)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    built = WebDatasetSource(paths)
    index = build_index(built, SCHEMA)  # (its signature check reads a sample: a fresh source below)
    assert isinstance(built.shard_check, ShardChecks)
    source = WebDatasetSource(paths)
    source.shard_check = built.shard_check
    calls = {"open": 0, "stat": 0, "pread": 0}
    for name in calls:
        real = getattr(os, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(os, name, counted)
    for row in range(len(index)):  # one sample per shard: each read is its shard's first
        source.load(tuple(index.locations[row]))
    assert calls == {"open": len(paths), "stat": 0, "pread": len(paths)}, calls
    source.load(tuple(index.locations[0]))  # checked already: no new check (no open, no stat)
    assert calls == {"open": len(paths), "stat": 0, "pread": len(paths) + 1}, calls  # (its read)
