"""Compressed shards read through counters capped by DecodeLimits, streamed member by member, never
held whole (issue #31): a gzip bomb is a typed corrupt_shard naming the shard, the member and the
byte; a truncated .tar.gz names the byte it stopped at; memory stays bounded (measured in a
subprocess)."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
import zlib

import pytest

from prealign.loaders import WebDatasetSource
from prealign.loaders.errors import CorruptShardError
from prealign.loaders.sources.tar_decode import DecodeLimits
from tests import ROOT as REPO
from tests.loader_helpers import sample_lengths, write_shards

ROOT = str(REPO)  # cwd and PYTHONPATH of the child processes
MiB = 1 << 20
_ZEROS = gzip.compress(
    b"\0" * MiB, compresslevel=9
)  # one gzip member of 1 MiB of zeros (about 1 KiB)


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    return gzip.compress(info.tobuf(format=tarfile.GNU_FORMAT))


def _npy(n: int) -> bytes:
    import numpy as np

    buf = io.BytesIO()
    np.save(buf, np.arange(n, dtype=np.int32))
    return buf.getvalue()


def _member(name: str, data: bytes) -> bytes:
    pad = -len(data) % 512
    return _header(name, len(data)) + gzip.compress(data + b"\0" * pad)


def bomb(path: str, *, members: int, member_mib: int) -> str:
    """A .tar.gz of ``members`` samples, each a small ``input_ids.npy`` and ``member_mib`` MiB of
    zeros (``pad.bin``), written as concatenated gzip members (a valid gzip stream) without ever
    holding it."""
    with open(path, "wb") as f:
        for i in range(members):
            f.write(_member(f"{i:06d}.input_ids.npy", _npy(8)))
            f.write(_header(f"{i:06d}.pad.bin", member_mib * MiB))
            for _ in range(member_mib):
                f.write(_ZEROS)
        f.write(gzip.compress(b"\0" * 1024))
    return path


def test_a_member_declaring_past_the_limit_is_refused_before_it_is_read(tmp_path):
    """A 1.5 MB .tar.gz whose member declares 1.5 GiB: a typed error at its header, nothing
    inflated."""
    path = bomb(str(tmp_path / "one.tar.gz"), members=1, member_mib=1536)
    assert os.path.getsize(path) < 2_000_000
    ((loc, err),) = list(WebDatasetSource([path]).scan(0))
    assert loc is None and isinstance(err, CorruptShardError)
    assert err.shard == path and err.offset == 1024  # the second member's header
    assert (
        "'000000.pad.bin' declares 1610612736 bytes" in err.cause
        and "max_member_bytes" in err.cause
    )


def test_a_bomb_past_the_ratio_is_a_typed_error_naming_member_and_byte(tmp_path):
    path = bomb(str(tmp_path / "many.tar.gz"), members=128, member_mib=1)
    events = [e for _, e in WebDatasetSource([path]).scan(0) if isinstance(e, Exception)]
    assert len(events) == 1 and isinstance(events[0], CorruptShardError)
    err = events[0]
    assert "max_ratio" in err.cause and "in member '" in err.cause and err.offset >= 64 * MiB
    with pytest.raises(CorruptShardError, match=r"unreadable at byte \d+: .*max_ratio"):
        WebDatasetSource([path]).read(
            (0, 0, 512 + 512)
        )  # a sample's read: the stream read whole, capped too
    small = DecodeLimits(max_shard_bytes=8 * MiB, max_ratio=10_000)
    with pytest.raises(CorruptShardError, match="max_shard_bytes"):
        WebDatasetSource([path], limits=small).read((0, 0, 1024))


def test_a_truncated_tar_gz_names_the_byte_it_stopped_at(tmp_path):
    """Issue #31: a truncated .tar.gz was unreadable 'at byte 0'."""
    plain = write_shards(str(tmp_path), sample_lengths(40, high=400), num_shards=1)[0]
    data = open(plain, "rb").read()
    packed = gzip.compress(data)
    path = str(tmp_path / "cut.tar.gz")
    with open(path, "wb") as f:
        f.write(packed[: len(packed) * 2 // 3])
    out = list(WebDatasetSource([path]).scan(0))
    good = [loc for loc, s in out if loc is not None]
    err = out[-1][1]
    assert isinstance(err, CorruptShardError) and "truncated gzip stream" in err.cause
    assert good and good[-1][2] <= err.offset < len(
        data
    )  # past the samples it served, inside the shard
    assert err.offset > 0


_MEASURE = """
import json, resource, sys
import torch  # (imported before the baseline: its own memory is not the stream's)
from prealign.loaders import IndexOptions, PackedLoader, WebDatasetSource, build_index
from prealign.loaders.sources.tar_decode import DecodeLimits
from prealign.schemas import ParallelLayout, causal_lm_schema

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

path, ratio = sys.argv[1], int(sys.argv[2])
base = peak()
source = WebDatasetSource([path], limits=DecodeLimits(max_ratio=ratio))
try:
    index = build_index(source, causal_lm_schema(), num_workers=0)
    loader = PackedLoader(source, schema=causal_lm_schema(), layout=ParallelLayout(),
                          token_budget=64, indexing=IndexOptions(prebuilt=index))
    served = sum(len(b["sample_index"]) for b in loader)
    error = None
except Exception as exc:
    served, error = 0, f"{type(exc).__name__}: {exc}"
print(json.dumps({"base": base, "peak": peak(), "served": served, "error": error}))
"""


def _measure(path: str, ratio: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, path, str(ratio)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_shard_of_1024_one_mib_members_streams_in_bounded_memory(tmp_path):
    """Issue #31: a 1.2 MB .tar.gz of 1,024 x 1 MiB members took 2.3 GiB at the first batch. Default
    limits: a typed error (its ratio); limits that let it through: every sample served, the peak
    under 300 MiB over the process's own (the shard decompressed to a temporary file, a member at a
    time)."""
    path = bomb(str(tmp_path / "wide.tar.gz"), members=1024, member_mib=1)
    assert os.path.getsize(path) < 2_000_000
    refused = _measure(path, 250)
    assert (
        refused["served"] == 0
        and "CorruptShardError" in refused["error"]
        and "max_ratio" in refused["error"]
    )
    served = _measure(path, 10_000)
    assert served["error"] is None and served["served"] == 1024, served
    assert served["peak"] - served["base"] < 300 * MiB, served
    print(
        f"1024 x 1 MiB .tar.gz: peak {(served['peak'] - served['base']) / MiB:.0f} MiB over the "
        f"process's {served['base'] / MiB:.0f} MiB"
    )


def test_gzip_bounded_reader_counts(tmp_path):
    """The counters: decompressed bytes past max_shard_bytes raise at the offset reached."""
    from prealign.loaders.sources.remote import BoundedGzip
    from prealign.loaders.sources.tar_reader import TarFormatError

    raw = io.BytesIO(gzip.compress(b"x" * (3 * MiB)))
    f = BoundedGzip(raw, "mem.tar.gz", DecodeLimits(max_shard_bytes=2 * MiB))
    got = 0
    with pytest.raises(TarFormatError, match="max_shard_bytes") as exc:
        while part := f.read(MiB // 2):
            got += len(part)
    assert got == 2 * MiB and exc.value.offset == 2 * MiB
    bad = BoundedGzip(
        io.BytesIO(b"\x1f\x8b\x08\x00" + zlib.compress(b"y")[2:] + b"junk" * 8),
        "x.tar.gz",
        DecodeLimits(),
    )
    with pytest.raises(TarFormatError, match="corrupt or truncated gzip stream"):
        while bad.read(100):
            pass
