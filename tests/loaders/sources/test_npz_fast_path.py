"""``read_npz``'s path for plain ``np.savez`` files (one ``struct`` call per entry, no ``zipfile``
objects: a start reads a sidecar per shard) accepts nothing the ``zipfile`` path refuses and reads
the same arrays: a differential test over valid files and files with a byte changed, cut or
added."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
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
