"""``prealign index`` and a read error: an ``OSError`` of the file system in the middle of a shard
(EIO) is a system error (:data:`~prealign.loaders.errors.SYSTEM_ERRORS`): it propagates out of every
index pass (the bulk text pass, the reference tar reader, the full pass) and no sidecar is written,
never counted as a ``corrupt_shard``; a truncated or garbled tar stays ``corrupt_shard``.

The fault is injected below the index pass: the file object ``remote.open_stream`` opens for a shard
is the real file, wrapped so that a read crossing byte ``fail_at`` raises ``OSError(EIO)`` as a
failing disk does."""

from __future__ import annotations

import errno
import io
import os
import tarfile

import numpy as np
import pytest

from prealign.loaders import WebDatasetSource
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.sources import remote
from prealign.loaders.sources.shard_files import sidecar_path
from prealign.schemas.errors import PrealignError
from prealign.schemas.schema import causal_lm_schema

SCHEMA = causal_lm_schema()


def _npy(a) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def _shard(path, n: int, tokens: int, *, link_first: bool = False) -> str:
    """A tar of ``n`` samples of ``tokens`` int64 ids each (``link_first``: a symbolic link first,
    which the bulk walker leaves to the reference tar reader)."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        if link_first:
            info = tarfile.TarInfo("README")
            info.type, info.linkname = tarfile.SYMTYPE, "elsewhere"
            tf.addfile(info)
        for i in range(n):
            data = _npy(np.arange(1, tokens + 1, dtype=np.int64) + i)
            info = tarfile.TarInfo(f"{i:06d}.input_ids.npy")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return str(path)


class _FailingDisk:
    """A real shard file whose read crossing byte ``fault["at"]`` fails with ``EIO``, once (a
    transient media or network-mount error: the bytes before it read, then the error; a later read
    of the same bytes, by this open or another of the same shard, succeeds). ``fault["hit"]`` counts
    the errors raised."""

    def __init__(self, f, fault: dict):
        self.f, self.fault, self.pos = f, fault, 0

    def read(self, n: int = -1) -> bytes:
        want = os.fstat(self.f.fileno()).st_size - self.pos if n is None or n < 0 else n
        if not self.fault["hit"] and want and self.pos + want > self.fault["at"]:
            self.fault["hit"] += 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        data = self.f.read(n)
        self.pos += len(data)
        return data

    def __getattr__(self, name):  # fileno, close, ...
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.fixture
def failing_disk(monkeypatch):
    """``fail(path, at)``: the first read of shard ``path`` crossing byte ``at`` fails with EIO;
    returns the fault's record (``{"at", "hit"}``)."""
    real, faults = remote.open_stream, {}

    def open_stream(url, *args, **kwargs):
        f = real(url, *args, **kwargs)
        return _FailingDisk(f, faults[url]) if url in faults else f

    monkeypatch.setattr(remote, "open_stream", open_stream)
    return lambda path, at: faults.setdefault(path, {"at": at, "hit": 0})


def _raises_eio(call) -> OSError:
    with pytest.raises(OSError) as err:
        call()
    assert err.value.errno == errno.EIO and not isinstance(err.value, PrealignError), repr(
        err.value
    )
    return err.value


@pytest.mark.parametrize("where", ["first_block", "second_block"])
def test_a_read_error_in_the_bulk_text_pass_propagates(tmp_path, failing_disk, where):
    """The bulk pass reads 8 MiB blocks: an error in the first, or after a whole block was
    indexed."""
    path = _shard(tmp_path / "s-0.tar", 70, 16384)  # ~9 MiB: two blocks
    size = os.path.getsize(path)
    fault = failing_disk(path, size // 3 if where == "first_block" else size - 200_000)
    _raises_eio(lambda: write_sidecars(WebDatasetSource([path]), SCHEMA, force=True))
    assert fault["hit"] == 1
    assert not os.path.exists(sidecar_path(path))


@pytest.mark.parametrize("full", [False, True], ids=["reference_reader", "full_pass"])
def test_a_read_error_in_the_reference_reader_and_the_full_pass_propagates(
    tmp_path, failing_disk, full
):
    path = _shard(
        tmp_path / "s-0.tar", 40, 64, link_first=not full
    )  # (a link: the reference tar reader)
    fault = failing_disk(path, os.path.getsize(path) // 2)
    _raises_eio(lambda: write_sidecars(WebDatasetSource([path]), SCHEMA, force=True, full=full))
    assert fault["hit"] == 1
    assert not os.path.exists(sidecar_path(path))


@pytest.mark.parametrize("full", [False, True], ids=["header_pass", "full_pass"])
def test_a_truncated_shard_stays_corrupt_shard(tmp_path, full):
    """The other side of the line: a tar cut short is bad data, counted, its sidecar written."""
    path = _shard(tmp_path / "s-0.tar", 40, 64)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    stats = write_sidecars(WebDatasetSource([path]), SCHEMA, force=True, full=full)
    assert stats["bad"] == {"corrupt_shard": 1} and 0 < stats["samples"] < 40
    assert os.path.exists(sidecar_path(path))
