"""``bench_scale.py --floor`` takes the crc32 of each zip entry of every sidecar ("the integrity
check a sidecar's format asks for"): the bytes it hashes are each entry's stored bytes, those its
recorded crc32 covers. numpy writes each entry's local header with a zip64 extra field that the
central directory's copy of the header lacks, so the entry's data starts after the LOCAL header's
extra field."""

from __future__ import annotations

import subprocess
import sys
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


_START_EPOCH = """
import sys
from prealign.loaders import PackedLoader, WebDatasetSource
from prealign.schemas import ParallelLayout, causal_lm_schema
loader = PackedLoader(WebDatasetSource({paths!r}), schema=causal_lm_schema(),
                      layout=ParallelLayout(tp=2, cp=2), token_budget=512, seed=1)
print(sum(1 for _ in loader))
"""


def _start(prelude: str, paths: list[str]) -> subprocess.CompletedProcess:
    code = prelude + _START_EPOCH.format(paths=paths)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_the_counterfactual_start_skips_exactly_the_sidecar_crc32_and_the_probe(tmp_path):
    """``--floor``'s "crc32 and probes unchecked" start switches off those two checks and nothing
    else: a sidecar whose recorded probe was edited in place (its meta entry's crc32 now wrong, the
    shard's probe no longer its own) is a StaleIndexError in a real start and reads in the
    counterfactual one (so a renamed check would not leave the benchmark measuring the checks it
    says it skips)."""
    paths = write_shards(str(tmp_path), sample_lengths(40, seed=5), num_shards=4)
    write_sidecars(WebDatasetSource(paths), causal_lm_schema())
    side = paths[2] + ".prealign-index.npz"
    data = bytearray(open(side, "rb").read())
    at = data.index(b'"probe": "') + len(b'"probe": "')
    data[at : at + 16] = b"0123456789abcdef" if data[at : at + 1] != b"0" else b"fedcba9876543210"
    with open(side, "wb") as f:
        f.write(bytes(data))
    real = _start("", paths)
    assert real.returncode != 0 and "StaleIndexError" in real.stderr, real.stderr[-2000:]
    unchecked = _start(load("bench_scale")._UNCHECKED, paths)
    assert unchecked.returncode == 0, unchecked.stderr[-2000:]
    assert int(unchecked.stdout.split()[-1]) > 0


_COUNT_READS = """
import collections, os
calls = collections.Counter()
def counted(name, real):
    def call(*a, **k):
        calls[name] += 1
        return real(*a, **k)
    return call
os.pread, os.fstat = counted("pread", os.pread), counted("fstat", os.fstat)
import atexit
atexit.register(lambda: print("calls", calls["pread"], calls["fstat"]))
"""


def test_the_counterfactual_start_reads_the_shards_as_the_real_one(tmp_path):
    """Switching the checks off must not change how the start reads the shards: the same preads
    and fstats as the real start (a check that skipped the probe by marking the shard unprobed
    also dropped the one read of a small shard that serves its samples, and the head and tail
    checks: an fstat more a shard, its samples read again)."""
    paths = write_shards(str(tmp_path), sample_lengths(40, seed=5), num_shards=4)
    write_sidecars(WebDatasetSource(paths), causal_lm_schema())
    real = _start(_COUNT_READS, paths)
    unchecked = _start(_COUNT_READS + load("bench_scale")._UNCHECKED, paths)
    assert real.returncode == 0 and unchecked.returncode == 0, real.stderr + unchecked.stderr
    counts = [r.stdout.split("calls")[-1].split() for r in (real, unchecked)]
    assert counts[0] == counts[1] and int(counts[0][0]) > 0, counts
