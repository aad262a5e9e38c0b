"""A start reads the sidecars of all shards at once (issue #28:
:mod:`~prealign.loaders.index.sidecar_bulk`): files of one layout are compared with one read alone,
a few numpy calls for all of them. These tests hold it to the one-by-one reader: the same index and
shard checks from the same sidecars, and for any byte changed in one sidecar among many alike, the
same error (naming that shard) or the same index."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import struct
import tarfile
import tempfile
import threading
import time
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prealign.loaders import BadDataPolicy, WebDatasetSource
from prealign.loaders.index import build, sidecar_bulk
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.sources.npy import plain_npz_entries
from prealign.loaders.sources.shard_files import SUFFIX
from prealign.schemas.errors import PrealignError
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import _npy, add_member, sample_lengths, token_ids

SCHEMA = causal_lm_schema()
SHARDS = 12
PER = 6


def _extra(i: int, tf: tarfile.TarFile) -> bool:
    """Sample 13 undecodable (a bad record: its shard's sidecar has an event), samples 30..32 of
    int32 ids (their shard has two data signatures)."""
    if i == 13:
        add_member(tf, f"{i:06d}.input_ids.npy", b"not an npy file")
        return True
    if 30 <= i <= 32:
        add_member(tf, f"{i:06d}.input_ids.npy", _npy(token_ids(i, 5).astype(np.int32)))
        return True
    return False


def _write(root: str) -> list[str]:
    """``SHARDS`` shards of ``PER`` samples (the last one 3) named ``shard-NNN.tar``."""
    lengths = sample_lengths(SHARDS * PER - 3, seed=3)
    os.makedirs(root, exist_ok=True)
    paths = []
    for s in range(SHARDS):
        path = os.path.join(root, f"shard-{s:03d}.tar")
        with tarfile.open(path, "w") as tf:
            for i in range(s * PER, min(len(lengths), (s + 1) * PER)):
                if not _extra(i, tf):
                    add_member(tf, f"{i:06d}.input_ids.npy", _npy(token_ids(i, lengths[i])))
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """``(paths, folder of their sidecars)``."""
    root = str(tmp_path_factory.mktemp("bulk"))
    paths = _write(os.path.join(root, "data"))
    index_dir = os.path.join(root, "index")
    os.makedirs(index_dir)
    write_sidecars(WebDatasetSource(paths), SCHEMA, out_dir=index_dir)
    return paths, index_dir


def _start(paths, index_dir, *, bulk: bool):
    """What a loader's start gives: ``("index", fields...)`` or ``("error", type, message)``."""
    real = build.sidecars_merged
    build.sidecars_merged = real if bulk else (lambda *a: None)
    try:
        source = WebDatasetSource(paths, index_dir=index_dir)
        index = build.build_index(source, SCHEMA, policy=BadDataPolicy(on_error="skip", warn=False))
    except PrealignError as exc:  # (less the address of an object a message may name)
        return ("error", type(exc).__name__, re.sub(" at 0x[0-9a-f]+", "", str(exc)))
    finally:
        build.sidecars_merged = real
    checks = source.shard_check
    return (
        "index",
        index.lengths.tolist(),
        index.locations.tolist(),
        index.shards.tolist(),
        index.media.tolist(),
        index.dims,
        index.report.to_dict(),
        index.source_shards,
        checks.sizes.tolist(),
        checks.first.tolist(),
        checks.last.tolist(),
        [str(p) for p in checks.probes],
        sorted((getattr(checks, "regions", None) or {}).items()),
    )


@pytest.mark.parametrize("at_once", [256, 3])
def test_the_sidecars_read_at_once_give_the_index_read_one_by_one(shards, monkeypatch, at_once):
    """(``at_once``: files read, and compared, at a time: 3 makes parts of a layout's files.)"""
    paths, index_dir = shards
    monkeypatch.setattr(sidecar_bulk, "_AT_ONCE", at_once)
    for where in (index_dir, None):
        if where is None:  # the sidecars beside their shards
            for p in paths:
                name = os.path.basename(p) + SUFFIX
                shutil.copy(os.path.join(index_dir, name), p + SUFFIX)
        one_by_one = _start(paths, where, bulk=False)
        assert one_by_one[0] == "index" and one_by_one[6]["counts"], one_by_one
        parsed = []
        real = sidecar_bulk.parse_sidecar
        monkeypatch.setattr(
            sidecar_bulk, "parse_sidecar", lambda *a, **k: parsed.append(1) or real(*a, **k)
        )
        assert _start(paths, where, bulk=True) == one_by_one
        monkeypatch.setattr(sidecar_bulk, "parse_sidecar", real)
        # the shard with a bad record, the one with two signatures, the short last one, a template
        assert len(parsed) <= 5, len(parsed)


@pytest.mark.parametrize("latency", [0.0, 0.003])
def test_sidecars_on_a_slow_file_system_are_read_on_threads(shards, monkeypatch, latency):
    """A file system whose opens take ``latency`` s (a parallel or network file system's round
    trips): past the first files, timed, the sidecars are read on a few threads at once, the same
    index as one by one; on a fast one they are read in the calling thread."""
    paths, index_dir = shards
    one_by_one = _start(paths, index_dir, bulk=False)
    monkeypatch.setattr(sidecar_bulk, "_TIMED", 2)
    monkeypatch.setattr(sidecar_bulk, "_THREAD_FILES", 2)
    monkeypatch.setattr(sidecar_bulk, "_SLOW_FILE", 1e-3 if latency else 10.0)
    threads = []
    real = os.open

    def open_(path, *a, **k):
        if str(path).endswith(SUFFIX):
            threads.append(threading.current_thread().name)
            time.sleep(latency)
        return real(path, *a, **k)

    monkeypatch.setattr(os, "open", open_)
    assert _start(paths, index_dir, bulk=True) == one_by_one
    workers = {t for t in threads if t.startswith("prealign-sidecars")}
    assert len(threads) >= SHARDS
    if latency:
        assert threads[:2] == ["MainThread"] * 2 and len(workers) >= 2, threads
    else:
        assert not workers, threads


def _interesting(data: bytes) -> list[int]:
    """Offsets of the structure of a sidecar: its zip records, npy headers, meta JSON."""
    entries = plain_npz_entries(data, 1 << 30, None)
    out = list(range(len(data) - 22, len(data)))  # the end record
    for e in entries:
        out += range(e.local, e.start + 130)  # local header, name, extra, npy header
        out += range(e.directory, e.directory + 46 + len(e.name))
    meta = next(e for e in entries if e.name == "meta.npy")
    out += range(meta.start, meta.end)
    return sorted(set(o for o in out if o < len(data)))


def _values(data: bytes) -> list[int]:
    """Offsets of the values that differ from sidecar to sidecar (and the bytes around them)."""
    out = []
    for key in (b'"shard": "', b'"size": ', b'"hash": "', b'"probe": "'):
        at = data.find(key) + len(key)
        out += range(at - 2, at + 34)
    return out


MUTATED = 7
"""A shard of the common layout (no bad record, one signature)."""


@pytest.mark.slow
@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_any_byte_changed_in_one_sidecar_among_many_reads_as_one_by_one(shards, tmp_path, data):
    """The bulk reader accepts nothing the one-by-one reader refuses, and reads what it reads:
    one byte of one sidecar changed (anywhere, most often in its structure), the start gives the
    same error (naming that shard) or the same index either way."""
    paths, index_dir = shards
    with open(os.path.join(index_dir, os.path.basename(paths[MUTATED]) + SUFFIX), "rb") as f:
        original = f.read()
    at = data.draw(
        st.one_of(
            st.sampled_from(_values(original)),
            st.sampled_from(_interesting(original)),
            st.integers(0, len(original) - 1),
        )
    )
    value = data.draw(st.one_of(st.sampled_from(b'"\\09 {}\x00\xff'), st.integers(0, 255)))
    crafted = data.draw(st.booleans())
    _assert_as_one_by_one(paths, index_dir, str(tmp_path), at, bytes([value]), crafted)


def _assert_as_one_by_one(paths, index_dir, tmp, at: int, value: bytes, crafted: bool) -> None:
    """The bytes of shard ``MUTATED``'s sidecar from ``at`` set to ``value`` (``crafted``: its
    crc32s made right again), in a copy of ``index_dir``: the start reads it as the one-by-one
    reader does."""
    name = os.path.basename(paths[MUTATED]) + SUFFIX
    with open(os.path.join(index_dir, name), "rb") as f:
        original = f.read()
    folder = tempfile.mkdtemp(dir=tmp)
    for p in paths:
        shutil.copy(os.path.join(index_dir, os.path.basename(p) + SUFFIX), folder)
    changed = bytearray(original)
    changed[at : at + len(value)] = value
    if crafted:
        for e in plain_npz_entries(original, 1 << 30, None):
            crc = struct.pack("<I", zlib.crc32(changed[e.start : e.end]))
            changed[e.local + 14 : e.local + 18] = crc
            changed[e.directory + 16 : e.directory + 20] = crc
    with open(os.path.join(folder, name), "wb") as f:
        f.write(changed)
    one_by_one = _start(paths, folder, bulk=False)
    assert _start(paths, folder, bulk=True) == one_by_one, (at, value)
    if one_by_one[0] == "error":
        assert paths[MUTATED] in one_by_one[2]


@pytest.mark.parametrize(
    "key,offset,char",
    [
        ("size", 0, "09999"),  # a leading zero: not JSON (below the sample's ends, caught so)
        ("size", 1, "a"),
        ("size", 0, "-"),
        ("hash", 3, '"'),  # a string ended early
        ("hash", 3, "\\"),  # an escape
        ("probe", 0, "\x7f"),
        ("shard", 2, "\x1f"),  # a control character
        ("hash", 2, "\x01"),
        ("shard", 0, "\xe9"),  # not ASCII (not UTF-8)
        ("hash", 0, "\xe9"),
        ("probe", 5, "z"),  # (a probe of other letters: read, then checked at the first read)
    ],
)
def test_a_crafted_value_in_one_sidecar_among_many_reads_as_one_by_one(
    shards, tmp_path, key, offset, char
):
    paths, index_dir = shards
    with open(os.path.join(index_dir, os.path.basename(paths[MUTATED]) + SUFFIX), "rb") as f:
        at = f.read().find(b'"%s": ' % key.encode()) + len(key) + 4 + (key != "size") + offset
    _assert_as_one_by_one(paths, index_dir, str(tmp_path), at, char.encode("latin-1"), True)


def _rewrite(path: str, edit) -> None:
    """The sidecar at ``path`` with its meta dict edited by ``edit(meta)`` (same byte length or
    not), written as np.savez writes it."""
    with np.load(path) as z:
        arrays = {k: z[k].copy() for k in z.files}
    meta = json.loads(arrays.pop("meta").tobytes())
    edit(meta)
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    with open(path, "wb") as f:
        f.write(buf.getvalue())


def _hash_escaped(meta):
    meta["hash"] = '"' + meta["hash"][1:]


def _shard_of_another(meta):
    meta["shard"] = "shard-008.tar"


def _size_plus_one(meta):
    meta["size"] = meta["size"] + 1


def _config(meta):
    meta["config"] = "0" * len(meta["config"])


@pytest.mark.parametrize(
    "edit",
    [_hash_escaped, _shard_of_another, _size_plus_one, _config],
    ids=lambda f: f.__name__,
)
def test_a_sidecar_with_other_values_among_many_reads_as_one_by_one(shards, tmp_path, edit):
    paths, index_dir = shards
    folder = str(tmp_path / "index")
    shutil.copytree(index_dir, folder)
    _rewrite(os.path.join(folder, os.path.basename(paths[MUTATED]) + SUFFIX), edit)
    one_by_one = _start(paths, folder, bulk=False)
    assert _start(paths, folder, bulk=True) == one_by_one
    if edit in (_shard_of_another, _config):
        assert one_by_one[0] == "error" and paths[MUTATED] in one_by_one[2], one_by_one[:3]
    elif edit is _size_plus_one:  # (checked at the shard's first read: its own size read)
        assert one_by_one[8][MUTATED] == os.path.getsize(paths[MUTATED]) + 1


def test_a_meta_field_is_taken_from_its_top_level_key_only():
    """The values that may differ between sidecars of one layout are found in the template's JSON
    only where they are top-level keys: a nested key of the same name and value is refused."""
    meta = {"shard": "a.tar", "size": 12, "hash": "ab", "probe": "cd"}
    text = json.dumps(meta).encode()
    fields = sidecar_bulk._meta_fields(text, meta)
    assert {k: text[a:b] for k, (a, b) in fields.items()} == {
        "shard": b"a.tar",
        "size": b"12",
        "hash": b"ab",
        "probe": b"cd",
    }
    nested = b'{"transform": {"shard": "a.tar"}, "shard":"a.tar", "size": 12}'
    assert sidecar_bulk._meta_fields(nested, json.loads(nested)) is None


def _directory(data: bytes, name: str) -> int:
    return next(e.directory for e in plain_npz_entries(data, 1 << 30, None) if e.name == name)


@pytest.mark.parametrize(
    "where,value",
    [
        # the cases the one-by-one reader leaves to zipfile (review of the npz fast path)
        (lambda d: _directory(d, "spans.npy") + 6, b"\xff"),  # a version zipfile lacks
        (lambda d: _directory(d, "lengths.npy") + 46 + 2, b"\x00"),  # a NUL in a name
        (lambda d: _directory(d, "media.npy") + 30, b"\x04"),  # an extra field (corrupt)
        (lambda d: len(d) - 22 - 20, b"PK\x06\x07"),  # a zip64 locator before the end record
        (lambda d: len(d) - 22 + 20, b"\x01"),  # a comment
    ],
    ids=["version", "nul-in-name", "extra-field", "zip64-locator", "comment"],
)
def test_a_sidecar_zipfile_reads_among_many_reads_as_one_by_one(shards, tmp_path, where, value):
    paths, index_dir = shards
    with open(os.path.join(index_dir, os.path.basename(paths[MUTATED]) + SUFFIX), "rb") as f:
        at = where(f.read())
    for crafted in (False, True):
        _assert_as_one_by_one(paths, index_dir, str(tmp_path), at, value, crafted)


def _media_end(data: bytes) -> int:
    """The offset of the last byte of a sidecar's ``media`` array."""
    return next(e.end for e in plain_npz_entries(data, 1 << 30, None) if e.name == "media.npy") - 1


def test_an_array_alike_in_every_sidecar_costs_no_crc32_call(shards, monkeypatch):
    """``media`` and ``dim_ids`` of text samples are the template's bytes in every file of a
    layout: their crc32 is the template's, not computed again (4 calls a file, not 6); a file
    whose ``media`` differs has its crc32 computed."""
    paths, index_dir = shards
    source = WebDatasetSource(paths, index_dir=index_dir)
    same = list(range(MUTATED - 1, MUTATED + 3))  # (shards of the common layout)
    datas = [_read(index_dir, paths[s]) for s in same]
    key = sidecar_bulk.config_key(source, SCHEMA)
    meta, _ = sidecar_bulk._parse(source, same[0], datas[0], key)
    layout = sidecar_bulk._Layout.of(datas[0], meta)
    calls = []
    real = zlib.crc32
    counting = type("Z", (), {"crc32": staticmethod(lambda *a: calls.append(1) or real(*a))})
    monkeypatch.setattr(sidecar_bulk, "zlib", counting)

    def crc_ok(datas):
        calls.clear()
        rows = np.frombuffer(b"".join(datas), np.uint8).reshape(len(datas), -1)
        return layout.crc_ok(rows).tolist(), len(calls)

    assert crc_ok(datas) == ([True] * len(same), 4 * len(same))
    at = _media_end(datas[2])
    changed = bytearray(datas[2])
    changed[at] ^= 1
    assert crc_ok([*datas[:2], bytes(changed), datas[3]]) == ([True, True, False, True], 5 * 4)


def _read(index_dir: str, path: str) -> bytes:
    """The bytes of the sidecar of the shard at ``path`` in ``index_dir``."""
    with open(os.path.join(index_dir, os.path.basename(path) + SUFFIX), "rb") as f:
        return f.read()


@pytest.mark.parametrize("crafted", [False, True])
def test_a_byte_of_an_array_alike_in_every_sidecar_changed_reads_as_one_by_one(
    shards, tmp_path, crafted
):
    """One byte of one file's ``media`` (an array its crc32 is not computed for while every file
    has the template's bytes) changed: refused (a crc32 mismatch) or read (crafted: crc32s made
    right, a media kind refused by the values' checks) as the one-by-one reader does."""
    paths, index_dir = shards
    with open(os.path.join(index_dir, os.path.basename(paths[MUTATED]) + SUFFIX), "rb") as f:
        original = f.read()
    at = _media_end(original)
    changed = bytes([original[at] ^ 1])
    _assert_as_one_by_one(paths, index_dir, str(tmp_path), at, changed, crafted)


@pytest.mark.parametrize("slot", [8, 1 << 16])
def test_sidecars_of_any_length_read_in_slots_that_grow_give_the_index_read_one_by_one(
    shards, monkeypatch, slot
):
    """Each file is read into a slot of a buffer: one that fills its slot (the first files' slot
    too small) is read again, with the files after it, in a larger slot; a file longer than the
    slot fitted to the first ones (a shard with more samples, later) likewise. The same index as
    one by one, whatever the slots and blocks."""
    paths, index_dir = shards
    lengths = [len(_read(index_dir, p)) for p in paths]
    assert max(lengths[2:]) > max(lengths[:2])  # (a longer one after the first two)
    one_by_one = _start(paths, index_dir, bulk=False)
    slots = []
    real = sidecar_bulk._Reader._read

    def read(self, *a, **k):
        slots.append(self.slot)
        return real(self, *a, **k)

    monkeypatch.setattr(sidecar_bulk._Reader, "_read", read)
    monkeypatch.setattr(sidecar_bulk, "_SLOT", slot)
    monkeypatch.setattr(sidecar_bulk, "_TIMED", 2)
    monkeypatch.setattr(sidecar_bulk, "_BLOCK", 3 * max(lengths))  # (a few files a block)
    monkeypatch.setattr(sidecar_bulk, "_fit", lambda n: n + 1)  # (no room: a longer one regrows)
    assert _start(paths, index_dir, bulk=True) == one_by_one
    grew = [b for a, b in zip(slots, slots[1:]) if b > a]
    assert grew and slots[-1] > max(lengths), slots


def test_a_file_that_fills_its_slot_is_read_again_in_a_larger_one(tmp_path):
    """A read that fills its slot may not have read the whole file: a regular file (``fstat``)
    is read again, with the files after it, in a slot that holds it; anything else (a character
    device) is left to the reader of one file, which refuses it; a FIFO cannot be read from an
    offset (the step is read one by one)."""
    slot = 64
    sizes = {"short": slot - 1, "full": slot, "long": 3 * slot}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(b"x" * size)
    os.symlink("/dev/zero", tmp_path / "zero")
    os.mkfifo(tmp_path / "fifo")
    buf = bytearray(8 * slot)
    view = memoryview(buf)
    slots = [[view[i : i + slot]] for i in range(0, len(buf), slot)]

    def read(*names):
        got, need = sidecar_bulk._read_block([str(tmp_path / n) for n in names], slots)
        return got.tolist(), need

    assert read("short", "zero", "short") == ([slot - 1, 0, slot - 1], 0)
    with pytest.raises(OSError):
        read("short", "fifo")
    assert read("short", "full", "short") == ([slot - 1], slot + 1)
    assert read("long", "short") == ([], 3 * slot + 1)
    reader = sidecar_bulk._Reader(slot)
    blocks = list(reader.blocks([str(tmp_path / n) for n in ("short", "full", "long")], 5))
    found = [(b.first, b.lengths.tolist()) for b in blocks]
    assert found == [(5, [slot - 1]), (6, [slot, 3 * slot])]
    assert blocks[1].slot > 3 * slot and reader.slot == blocks[1].slot


def test_a_fifo_fed_a_valid_sidecar_is_refused_as_one_by_one(shards, tmp_path):
    """A sidecar that is a FIFO is refused unread, even with a writer that has put the shard's
    own valid sidecar in it (each file is read with ``preadv``, which a FIFO cannot: that step is
    read one by one, and the FIFO refused there as the one-by-one reader refuses it)."""
    paths, index_dir = shards
    folder = str(tmp_path / "index")
    shutil.copytree(index_dir, folder)
    side = os.path.join(folder, os.path.basename(paths[MUTATED]) + SUFFIX)
    with open(side, "rb") as f:
        data = f.read()
    os.remove(side)
    os.mkfifo(side)
    writer = os.open(side, os.O_RDWR | os.O_NONBLOCK)  # (holds the FIFO open, its data queued)
    try:
        os.write(writer, data)
        found = _start(paths, folder, bulk=True)
    finally:
        os.close(writer)
    assert found[:2] == ("error", "StaleIndexError") and "not a regular file" in found[2], found
    assert paths[MUTATED] in found[2] or side in found[2]
    assert found == _start(paths, folder, bulk=False)
