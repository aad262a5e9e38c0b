"""``read_npz``'s path for plain ``np.savez`` files (one ``struct`` call per entry, no ``zipfile``
objects: a start reads a sidecar per shard) accepts nothing the ``zipfile`` path refuses and reads
the same arrays: a differential test over valid files and files with a byte changed, cut or
added."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from prealign.loaders.sources import npy


def _savez(n: int, compressed: bool = False) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(
        buf,
        meta=np.frombuffer(b'{"a": 1}', np.uint8),
        spans=np.arange(3 * n, dtype=np.int64).reshape(n, 3),
        media=np.zeros(n, bool),
    )
    return buf.getvalue()


def _read(data: bytes, *, fast: bool, monkeypatch=None, **kw):
    """``("ok", {name: (dtype, shape, bytes)})`` or ``("error", type)``."""
    try:
        if fast:
            out = npy.read_npz(data, **kw)
        else:
            with pytest.MonkeyPatch.context() as m:
                m.setattr(npy, "_plain_stored_entries", lambda *a: None)
                out = npy.read_npz(data, **kw)
    except Exception as exc:  # noqa: BLE001 - compared by type
        return "error", type(exc)
    return "ok", {k: (str(v.dtype), v.shape, v.tobytes()) for k, v in out.items()}


def test_savez_takes_the_plain_path():
    data = _savez(4)
    assert npy._plain_stored_entries(data, memoryview(data), 1 << 20, None) is not None
    assert (
        npy._plain_stored_entries(data, memoryview(data), 10, None) is None
    )  # over max_bytes: zipfile says so
    compressed = _savez(4, compressed=True)
    assert npy._plain_stored_entries(compressed, memoryview(compressed), 1 << 20, None) is None
    assert _read(data, fast=True, max_bytes=1 << 20) == _read(data, fast=False, max_bytes=1 << 20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(
    n=5, edits=[(753, 64)], cut=0, tail=b"", names=False
)  # version needed 6.4: zipfile refuses
@example(n=1, edits=[(639, 0)], cut=0, tail=b"", names=False)  # a NUL in a name: zipfile cuts it
@given(
    n=st.integers(0, 5),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=3),
    cut=st.integers(0, 40),
    tail=st.binary(max_size=4),
    names=st.booleans(),
)
def test_plain_path_agrees_with_zipfile(n, edits, cut, tail, names):
    data = bytearray(_savez(n))
    for at, value in edits:
        data[at % len(data)] = value
    data = bytes(data[: len(data) - cut]) + tail
    kw = {
        "max_bytes": 1 << 20,
        "copy": False,
        **({"names": frozenset({"meta", "spans", "media"})} if names else {}),
    }
    plain = npy._plain_stored_entries(data, memoryview(data), kw["max_bytes"], kw.get("names"))
    slow = _read(data, fast=False, **kw)
    if plain is not None:  # taken: the zipfile path reads the same
        assert slow[0] == "ok"
        assert _read(data, fast=True, **kw) == slow
    else:
        assert _read(data, fast=True, **kw) == slow


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def _local(name: bytes, raw: bytes) -> bytes:
    """A local file header of a stored entry, then its bytes."""
    crc = zlib.crc32(raw)
    head = struct.pack(
        "<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 0, 0, 0, crc, len(raw), len(raw), len(name), 0
    )
    return head + name + raw


def _central(name: bytes, raw: bytes, at: int, *, extra=b"", comment=b"", version=20) -> bytes:
    """A central directory entry of a stored entry whose local header is at ``at``."""
    crc, n = zlib.crc32(raw), len(raw)
    fields = (
        b"PK\x01\x02",
        20,
        version,
        0,
        0,
        0,
        0,
        crc,
        n,
        n,
        len(name),
        len(extra),
        len(comment),
    )
    return struct.pack("<4sHHHHHHIIIHHHHHII", *fields, 0, 0, 0, at) + name + extra + comment


def _end(count: int, cd_size: int, cd_at: int) -> bytes:
    return struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, count, count, cd_size, cd_at, 0)


def _zip(name: bytes, raw: bytes, **central) -> bytes:
    """One stored entry, its directory and the end record, nothing else."""
    body = _local(name, raw)
    cd = _central(name, raw, 0, **central)
    return body + cd + _end(1, len(cd), len(body))


def _zip64_in_a_comment() -> bytes:
    """Entries ``a`` and ``b``; the end record lists only ``a``, whose directory comment holds a
    directory of ``b``, a zip64 end record pointing at it and a zip64 locator right before the end
    record, where ``zipfile`` looks: ``zipfile`` reads ``b``, the end record alone says ``a``."""
    ra, rb = _npy(np.arange(3)), _npy(np.full(3, 7))
    body = _local(b"a.npy", ra)
    at_b = len(body)
    body += _local(b"b.npy", rb)
    cd_b = _central(b"b.npy", rb, at_b)
    hidden = len(cd_b) + 56 + 20  # b's directory entry, the zip64 end record, the locator
    head = len(_central(b"a.npy", ra, 0))
    end_at = len(body) + head + hidden
    z64 = struct.pack(
        "<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, 1, 1, len(cd_b), len(body) + head
    )
    locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, end_at - 76, 1)
    cd_a = _central(b"a.npy", ra, 0, comment=cd_b + z64 + locator)
    return body + cd_a + _end(1, len(cd_a), len(body))


@pytest.mark.parametrize(
    "case", ["plain", "corrupt_extra", "nul_in_name", "version_6.4", "zip64_in_a_comment"]
)
def test_what_zipfile_reads_otherwise_is_left_to_it(case):
    """Files the directory walk alone would read as something else than ``zipfile`` does (or read
    where it refuses) take the ``zipfile`` path: an extra field (``zipfile`` parses it and refuses a
    corrupt one), a NUL in a name (``zipfile`` cuts the name there), a version ``zipfile`` does not
    implement, a zip64 locator before the end record (``zipfile`` follows it elsewhere)."""
    raw = _npy(np.arange(3))
    data = {
        "plain": lambda: _zip(b"a.npy", raw),
        "corrupt_extra": lambda: _zip(b"a.npy", raw, extra=struct.pack("<HH", 0x5455, 100)),
        "nul_in_name": lambda: _zip(b"a\x00b.npy", raw),
        "version_6.4": lambda: _zip(b"a.npy", raw, version=64),
        "zip64_in_a_comment": _zip64_in_a_comment,
    }[case]()
    kw = {"max_bytes": 1 << 20}
    plain = npy._plain_stored_entries(data, memoryview(data), kw["max_bytes"], None)
    assert (plain is not None) == (case == "plain")
    assert _read(data, fast=True, **kw) == _read(data, fast=False, **kw)
    if case == "zip64_in_a_comment":  # what np.load reads
        assert _read(data, fast=True, **kw)[1]["b"][2] == np.full(3, 7).tobytes()
    elif case != "plain":
        assert _read(data, fast=True, **kw)[0] == "error"
