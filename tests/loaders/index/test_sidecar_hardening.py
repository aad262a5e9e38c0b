"""Sidecars read with bounds (issue #18): only regular files of a size the format allows; a sidecar
of many members parses in linear time; a consistent but edited sidecar (rows removed or repeated,
counts adjusted) is refused at load, never silently fewer or more samples."""

from __future__ import annotations

import io
import json
import os
import threading
import time
import zipfile

import numpy as np
import pytest

from prealign.loaders import IndexOptions, PackedLoader, WebDatasetSource
from prealign.loaders.errors import StaleIndexError
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.index.sidecar import parse_sidecar, sidecar_limit
from prealign.schemas import ParallelLayout
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import sample_lengths, write_shards

SCHEMA = causal_lm_schema()


def _prepare(paths):
    return PackedLoader(
        WebDatasetSource(paths),
        schema=SCHEMA,
        layout=ParallelLayout(),
        token_budget=128,
        dp_size=1,
        dp_rank=0,
        seed=3,
        indexing=IndexOptions(),
    ).prepare()


def _in_thread(fn, timeout: float):
    """``fn()``'s exception (or None), or "hung" when it has not returned within ``timeout`` s."""
    out = {}

    def run():
        try:
            fn()
            out["exc"] = None
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return out.get("exc", "hung")


@pytest.mark.parametrize("shards", [1, 40])
@pytest.mark.parametrize("kind", ["dev_zero", "dev_null", "fifo"])
def test_a_sidecar_that_is_not_a_regular_file_is_refused_without_reading_it(tmp_path, kind, shards):
    """(40 shards: the odd sidecar among many read at once, past the first files timed.)"""
    paths = write_shards(str(tmp_path), sample_lengths(4 * shards), num_shards=shards)
    if shards > 1:
        write_sidecars(WebDatasetSource(paths), SCHEMA)
    side = paths[-3 if shards > 1 else 0] + ".prealign-index.npz"
    if shards > 1:
        os.remove(side)
    if kind == "fifo":
        os.mkfifo(side)
    else:
        os.symlink("/" + kind.replace("_", "/"), side)
    try:
        exc = _in_thread(lambda: _prepare(paths), 20)
        assert isinstance(exc, StaleIndexError) and "not a regular file" in str(exc), exc
    finally:
        if kind == "fifo":  # let a reader still blocked on the FIFO go
            try:
                os.close(os.open(side, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass


def test_a_sidecar_larger_than_its_shard_allows_is_refused(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(10), num_shards=1)
    side = paths[0] + ".prealign-index.npz"
    with open(side, "wb") as f:
        f.truncate(sidecar_limit(os.path.getsize(paths[0])) + 1)  # sparse: costs no disk
    with pytest.raises(StaleIndexError, match="more than the"):
        _prepare(paths)


def _sidecar_arrays(paths):
    write_sidecars(WebDatasetSource(paths), SCHEMA, force=True)
    side = paths[0] + ".prealign-index.npz"
    with np.load(side) as z:
        arrays = {k: z[k] for k in z.files}
    return side, arrays, json.loads(arrays["meta"].tobytes())


def _save(side, arrays, meta, rows):
    out = {k: arrays[k][rows] for k in ("spans", "lengths", "media", "dim_ids")}
    meta = dict(meta, num_events=len(rows) + len(meta["events"]))
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **out)
    with open(side, "wb") as f:
        f.write(buf.getvalue())
    return buf.getvalue()


@pytest.mark.parametrize(
    "edit", ["removed", "repeated", "last_removed", "first_removed", "swapped", "past_the_end"]
)
def test_an_edited_but_consistent_sidecar_is_refused(tmp_path, edit):
    paths = write_shards(str(tmp_path), sample_lengths(10), num_shards=1)
    side, arrays, meta = _sidecar_arrays(paths)
    n = len(arrays["lengths"])
    assert not meta["events"] and n == 10
    rows = {
        "removed": [i for i in range(n) if i != 4],
        "repeated": list(range(n)) + [3],
        "last_removed": list(range(n - 1)),
        "first_removed": list(range(1, n)),
        "swapped": [1, 0, *range(2, n)],
        "past_the_end": list(range(n)),
    }[edit]
    if edit == "past_the_end":
        arrays["spans"][-1, 1] = meta["size"] + 512
    data = _save(side, arrays, meta, rows)
    if edit not in (
        "last_removed",
        "first_removed",
    ):  # (found only against the shard's first / last bytes)
        with pytest.raises(StaleIndexError, match="shard-000.tar"):
            parse_sidecar(data, shard=paths[0])
    with pytest.raises(
        StaleIndexError, match="shard-000.tar"
    ):  # at the shard's first read at the latest
        list(_prepare(paths))


def test_an_unedited_sidecar_with_bad_samples_still_loads(tmp_path):
    """Gaps where bad samples were (the last one too) are explained by their events: a real sidecar
    passes."""
    from prealign.loaders import BadDataPolicy
    from tests.loader_helpers import add_member

    def extra(i, tf):
        if i in (3, 9):
            add_member(tf, f"{i:06d}.input_ids.npy", b"not an npy")

    paths = write_shards(str(tmp_path), sample_lengths(10), num_shards=1, extra=extra)
    side, arrays, meta = _sidecar_arrays(paths)
    assert len(meta["events"]) == 2 and len(arrays["lengths"]) == 8
    parse_sidecar(open(side, "rb").read(), shard=paths[0])
    loader = PackedLoader(
        WebDatasetSource(paths),
        schema=SCHEMA,
        layout=ParallelLayout(),
        token_budget=128,
        dp_size=1,
        dp_rank=0,
        seed=3,
        bad_data=BadDataPolicy(on_error="skip", max_consecutive=50),
    )
    assert len(loader.prepare().index) == 8


def test_a_sidecar_of_many_members_parses_in_linear_time():
    """16k stored members (a crafted sidecar): refused from the zip end record, before its directory
    is parsed (was 6.2 s)."""
    one = io.BytesIO()
    np.save(one, np.zeros(0, np.uint8))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for i in range(16_000):
            zf.writestr(f"m{i}.npy", one.getvalue())
    data = buf.getvalue()
    t0 = time.perf_counter()
    with pytest.raises(StaleIndexError, match="x.tar"):
        parse_sidecar(data, shard="x.tar")
    assert time.perf_counter() - t0 < 0.1


def test_a_prebuilt_index_bomb_is_refused_before_it_is_inflated(tmp_path):
    """A small ``.npz`` whose ``lengths`` inflate to 256 MiB (a bomb: 1 MB of it inflated 2 GiB) is
    an IndexFileError before anything is inflated (its declared size is past what the file can
    hold)."""
    import tracemalloc

    from prealign.loaders.errors import IndexFileError
    from prealign.loaders.index.sample_index import SampleIndex

    n = 1 << 25  # int64: 256 MiB
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        head, {"descr": "<i8", "fortran_order": False, "shape": (n,)}
    )
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        with zf.open("lengths.npy", "w", force_zip64=True) as f:
            f.write(head.getvalue())
            zero = bytes(16 << 20)
            for _ in range(n * 8 // len(zero)):
                f.write(zero)
        for key in ("locations", "shards", "report"):
            zf.writestr(f"{key}.npy", b"")
    assert os.path.getsize(path) < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(IndexFileError, match="bomb.npz"):
            SampleIndex.load(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, peak


def test_a_shard_that_opens_with_a_folder_entry_still_loads_from_its_sidecar(tmp_path):
    """``tar cf x.tar dir/`` puts the folder's entry first: bytes before the first sample the index
    pass skips, which the check of what precedes the first sample allows."""
    import tarfile

    path = str(tmp_path / "shard-000.tar")
    with tarfile.open(path, "w") as tf:
        tf.addfile(_dir("d"))
        for i in range(4):
            buf = io.BytesIO()
            np.save(buf, np.arange(5 + i, dtype=np.int32))
            info = tarfile.TarInfo(f"d/{i:06d}.input_ids.npy")
            info.size = buf.tell()
            buf.seek(0)
            tf.addfile(info, buf)
    side, arrays, meta = _sidecar_arrays([path])
    assert int(arrays["spans"][0, 0]) == 512 and not meta["events"]
    assert len(_prepare([path]).index) == 4


def _dir(name):
    import tarfile

    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    return info


def _tar_variant(path: str, kind: str) -> None:
    """Shards as real tools write them: folders first (with pax headers for a float mtime), a pax
    global header (git archive), a trailing folder, GNU long names, pax headers per member, one zero
    block at the end."""
    import tarfile

    from tests.loader_helpers import _npy, token_ids

    def add(tf, name, data=None, folder=False, mtime=None):
        ti = tarfile.TarInfo(name)
        if folder:
            ti.type = tarfile.DIRTYPE
        else:
            ti.size = len(data)
        if mtime is not None:
            ti.mtime = mtime
        tf.addfile(ti, None if folder else io.BytesIO(data))

    def samples(tf, prefix="", mtime=None):
        for i in range(4):
            add(tf, f"{prefix}{i:06d}.input_ids.npy", _npy(token_ids(i, 10 + i)), mtime=mtime)
            add(tf, f"{prefix}{i:06d}.json", json.dumps({"id": i}).encode(), mtime=mtime)

    kw = {
        "global_pax": dict(format=tarfile.PAX_FORMAT, pax_headers={"comment": "git"}),
        "gnu_long_names": dict(format=tarfile.GNU_FORMAT),
    }.get(kind, {})
    with tarfile.open(path, "w", **kw) as tf:
        if kind == "folder_first_float_mtime":
            add(tf, "data/", folder=True, mtime=time.time() + 0.5)
            samples(tf, "data/")
        elif kind == "gnu_long_names":
            samples(tf, "x" * 120 + "/")
        elif kind == "pax_per_member":
            samples(tf, mtime=time.time() + 0.5)
        else:
            samples(tf)
            if kind == "trailing_folder":
                add(tf, "empty/", folder=True)
    if kind == "one_zero_block":
        with open(path, "rb") as f:
            data = f.read().rstrip(b"\0")
        with open(path, "wb") as f:
            f.write(data + b"\0" * (-len(data) % 512) + bytes(512))


@pytest.mark.parametrize(
    "kind",
    [
        "folder_first_float_mtime",
        "global_pax",
        "trailing_folder",
        "gnu_long_names",
        "pax_per_member",
        "one_zero_block",
    ],
)
def test_sidecars_of_shards_real_tools_write_are_accepted(tmp_path, kind):
    path = str(tmp_path / f"{kind}.tar")
    _tar_variant(path, kind)
    plain = _prepare([path]).index.lengths.tolist()
    write_sidecars(WebDatasetSource([path]), SCHEMA)
    assert _prepare([path]).index.lengths.tolist() == plain and len(plain) == 4


def test_a_sidecar_that_lies_about_a_signature_is_a_typed_error_at_that_sample_never_served(
    tmp_path,
):
    from prealign.loaders import BadDataPolicy
    from prealign.loaders.sources.shard_files import SUFFIX
    from prealign.schemas.errors import SampleError
    from tests.loaders.index.test_sidecar import _bad_members

    paths = write_shards(str(tmp_path), sample_lengths(20), num_shards=1, extra=_bad_members)
    write_sidecars(WebDatasetSource(paths), causal_lm_schema())
    with np.load(paths[0] + SUFFIX) as z:
        arrays = dict(z)
    assert set(arrays["dim_ids"].tolist()) == {
        0,
        1,
    }  # sample 15 (labels one row short) has a signature of its own
    arrays["dim_ids"][:] = 0  # the lie: every sample has the first one
    with open(paths[0] + SUFFIX, "wb") as f:
        np.savez(f, **arrays)
    loader = PackedLoader(
        WebDatasetSource(paths),
        schema=causal_lm_schema(),
        layout=ParallelLayout(),
        token_budget=4096,
        bad_data=BadDataPolicy(on_error="skip", warn=False),
    )
    with pytest.raises(SampleError, match="field .labels.: expected shape") as exc:
        list(loader)
    assert exc.value.field == "labels"


@pytest.mark.parametrize(
    "key, value", [("size", 2**70), ("size", -5), ("num_events", 2**70), ("num_events", -1)]
)
def test_a_sidecar_count_outside_int64_is_a_typed_error_at_the_start(tmp_path, key, value):
    """``size`` / ``num_events`` past what an int64 holds (or negative) is refused as a malformed
    sidecar naming the shard, never an OverflowError out of the vectorised checks."""
    paths = write_shards(str(tmp_path), sample_lengths(10), num_shards=1)
    side, arrays, meta = _sidecar_arrays(paths)
    arrays["meta"] = np.frombuffer(json.dumps(dict(meta, **{key: value})).encode(), np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    with open(side, "wb") as f:
        f.write(buf.getvalue())
    with pytest.raises(StaleIndexError, match=f"shard-000.tar.*{key}"):
        parse_sidecar(buf.getvalue(), shard=paths[0])
    with pytest.raises(StaleIndexError, match="shard-000.tar"):
        _prepare(paths)


@pytest.mark.parametrize(
    "key, value", [("type", ["sample"]), ("type", {"a": 1}), ("sample", {"a": 1}), ("zzz", 1)]
)
def test_a_sidecar_event_with_a_field_of_the_wrong_type_is_refused_at_start(tmp_path, key, value):
    """A damaged event (a list where its error's ``type`` is, a dict for a sample): the typed
    StaleIndexError naming the shard and the rebuild command when the loader starts, never a
    TypeError."""
    from tests.loader_helpers import add_member, npz_meta, save_npz_meta

    def extra(i, tf):
        if i == 3:
            add_member(tf, f"{i:06d}.input_ids.npy", b"not an npy")

    paths = write_shards(str(tmp_path), sample_lengths(10), num_shards=1, extra=extra)
    write_sidecars(WebDatasetSource(paths), SCHEMA, force=True)
    side = paths[0] + ".prealign-index.npz"
    arrays, meta = npz_meta(side)
    assert len(meta["events"]) == 1 and meta["events"][0][1]["error"]["type"] == "sample"
    meta["events"][0][1]["error"][key] = value
    save_npz_meta(side, arrays, meta)
    data = open(side, "rb").read()
    with pytest.raises(StaleIndexError, match="shard-000.tar") as err:
        parse_sidecar(data, shard=paths[0])
    assert "malformed events" in str(err.value)
    with pytest.raises(StaleIndexError, match="shard-000.tar.*prealign index"):
        _prepare(paths)
