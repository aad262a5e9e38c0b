"""``bench_scale.py --floor`` takes the crc32 of each zip entry of every sidecar ("the integrity
check a sidecar's format asks for"): the bytes it hashes are each entry's stored bytes, those its
recorded crc32 covers. numpy writes each entry's local header with a zip64 extra field that the
central directory's copy of the header lacks, so the entry's data starts after the LOCAL header's
extra field."""

from __future__ import annotations

import zipfile
import zlib

from prealign.loaders import WebDatasetSource
from prealign.loaders.index.header_pass import write_sidecars
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import sample_lengths, write_shards
from tests.test_benchmark_scripts import load


def test_the_floor_hashes_each_entry_s_stored_bytes(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(20, seed=3), num_shards=2)
    write_sidecars(WebDatasetSource(paths), causal_lm_schema())
    code = load("bench_scale")._FLOOR.format(root=str(tmp_path))
    found: dict = {}
    exec(compile(code, "floor", "exec"), found)  # (the floor's own setup and timings, 2 files)
    recorded = []
    for path in sorted(p + ".prealign-index.npz" for p in paths):
        with zipfile.ZipFile(path) as z:
            recorded += [info.CRC for info in z.infolist()]
    assert found["result"]["entries"] == len(recorded) == 12
    assert [zlib.crc32(e) for e in found["entries"]] == recorded
