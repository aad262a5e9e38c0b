"""The index pass streams a shard (issue #18): its peak memory is about one sample's, not the
shard's (it held the shard twice: a 390 MiB shard peaked at 1 GiB); a device or FIFO given as a
shard is refused."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import time

import numpy as np
import pytest

from prealign.loaders import WebDatasetSource
from prealign.loaders.cli.main import main
from prealign.loaders.errors import MissingShardError, NotRegularFileError
from prealign.loaders.index.header_pass import write_sidecars
from prealign.schemas.schema import causal_lm_schema

_PEAK = """
import resource, sys
from prealign.loaders import WebDatasetSource
from prealign.loaders.cli.main import main
from prealign.loaders.index.header_pass import write_sidecars
from prealign.schemas.schema import causal_lm_schema
write_sidecars(WebDatasetSource([sys.argv[1]]), causal_lm_schema(), force=True)
with open("/proc/self/status") as f:
    print(next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) * 1024)
"""


def _shard(path: str, members: int, tokens: int) -> int:
    """A shard of ``members`` samples, each one ``input_ids.npy`` of ``tokens`` int32 tokens but the
    first (10 tokens: the one sample the pass also transforms and collates in full, whose peak is
    the transform's, is small, so what is measured is the reading of the shard)."""
    rng = np.random.default_rng(0)
    with tarfile.open(path, "w") as tf:
        for i in range(members):
            buf = io.BytesIO()
            np.save(buf, rng.integers(0, 1000, 10 if i == 0 else tokens, dtype=np.int32))
            info = tarfile.TarInfo(f"s{i:04d}.input_ids.npy")
            info.size = buf.tell()
            buf.seek(0)
            tf.addfile(info, buf)
    return os.path.getsize(path)


def _peak(path: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, path], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


@pytest.mark.slow  # a child process (end to end)
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="platform: no /proc (VmHWM)")
def test_header_pass_peak_memory_is_a_sample_not_the_shard(tmp_path):
    small = _shard(str(tmp_path / "small.tar"), 2, 1000)
    big = _shard(str(tmp_path / "big.tar"), 9, 6_000_000)  # 8 members of 24 MB: a 192 MB shard
    base, peak = _peak(str(tmp_path / "small.tar")), _peak(str(tmp_path / "big.tar"))
    grown = peak - base
    print(
        f"shard {big / 2**20:.0f} MiB ({small} B baseline): peak {peak / 2**20:.0f} MiB, "
        f"{base / 2**20:.0f} MiB baseline, +{grown / 2**20:.0f} MiB"
    )
    # streamed: a few copies of the largest member (24 MB), never the shard (before: +2.6x the
    # shard)
    assert grown < 0.5 * big, f"indexing a {big} B shard grew the peak by {grown} B"


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_a_shard_that_is_not_a_regular_file_is_refused(tmp_path, kind):
    path = "/dev/zero" if kind == "device" else str(tmp_path / "fifo.tar")
    if kind == "fifo":
        os.mkfifo(path)
    t0 = time.monotonic()
    with pytest.raises(NotRegularFileError, match="not a regular file") as exc:
        write_sidecars(WebDatasetSource([path]), causal_lm_schema(), out_dir=str(tmp_path / "idx"))
    assert isinstance(exc.value, MissingShardError) and path in str(exc.value)
    assert time.monotonic() - t0 < 10


def test_index_command_refuses_dev_zero_and_a_fifo(tmp_path, capsys):
    fifo = str(tmp_path / "fifo.tar")
    os.mkfifo(fifo)
    for path in ("/dev/zero", fifo):
        t0 = time.monotonic()
        assert main(["index", path, "--text"]) != 0
        err = capsys.readouterr().err
        assert path in err and "not a regular file" in err and time.monotonic() - t0 < 30
