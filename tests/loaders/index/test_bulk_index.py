"""The index pass at machine speed (issue #28, item 3): the bulk tar walk equals the reference
reader (``tar_reader.iter_members``, and ``tarfile``) member for member, and the bulk text pass
writes sidecars equal, array for array and key for key, to the reference pass's, on shards with
long names (GNU and pax), odd sizes, bad samples, links, corruption and samples cut by the block
boundary."""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prealign.loaders import WebDatasetSource
from prealign.loaders.index import bulk_pass, header_pass
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.sources.tar_decode import split_member_name
from prealign.loaders.sources.tar_index import Unhandled, walk
from prealign.loaders.sources.tar_reader import TarFormatError, iter_members
from prealign.schemas.schema import causal_lm_schema

SCHEMA = causal_lm_schema()
FORMATS = (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT)


def _npy(a) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def _tar(members, fmt=tarfile.GNU_FORMAT) -> bytes:
    """A tar of ``(name, data)`` (``data`` None: a symbolic link; ``"dir"``: a directory)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.linkname = tarfile.SYMTYPE, "elsewhere"
                tf.addfile(info)
            elif isinstance(data, str):
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _walked(data: bytes, block: int | None = None):
    """``[(name, offset, end, data)]`` of the bulk walker, fed ``block`` bytes at a time."""
    out, base, buf = [], 0, b""
    block = block or len(data) + 1
    pos = 0
    while True:
        chunk = data[pos : pos + block]
        pos += len(chunk)
        buf += chunk
        w = walk(buf, base, eof=pos >= len(data))
        out += [
            (n, int(o), int(e), buf[int(a) - base : int(a) - base + int(s)])
            for n, o, a, s, e in zip(w.names, w.offset, w.data_at, w.size, w.end)
        ]
        if w.ended:
            return out
        buf, base = buf[w.done - base :], w.done


def _reference(data: bytes):
    return [(m.name, m.offset, m.end, m.data) for m in iter_members(io.BytesIO(data))]


_names = st.text(st.characters(codec="utf-8", exclude_characters="\0/"), min_size=1, max_size=30)
_paths = st.lists(_names, min_size=1, max_size=8).map("/".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(_paths, st.binary(max_size=1500)), max_size=12),
    st.sampled_from(FORMATS),
    st.sampled_from([None, 512, 1536, 4096]),
)
def test_bulk_walk_equals_the_reference_reader_and_tarfile(members, fmt, block):
    try:
        data = _tar(members, fmt)
    except ValueError:  # a name ustar cannot hold
        return
    ref = _reference(data)
    assert _walked(data, block) == ref
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        assert [(m.name, m.offset_data, m.size) for m in tf.getmembers()] == [
            (n, e - -(-len(d) // 512) * 512, len(d)) for n, _, e, d in ref
        ]


@pytest.mark.parametrize("kind", ["symlink", "dir", "checksum", "truncated", "no_end", "base256"])
def test_what_the_bulk_walk_does_not_parse_exactly_is_left_to_the_reference(kind):
    members = [("a.input_ids.npy", b"x" * 700), ("b.txt", b"hi")]
    if kind in ("symlink", "dir"):
        members.insert(1, ("c.txt", None if kind == "symlink" else "dir"))
    data = bytearray(_tar(members))
    if kind == "checksum":
        data[1024 + 512 + 3] ^= 1  # the second header's name
    elif kind == "truncated":
        data = data[: 1024 + 300]
    elif kind == "no_end":
        data = data[: -len(data) + 512 * 5]
    elif kind == "base256":
        data[124:136] = b"\x80" + (700).to_bytes(11, "big")
        data[148:156] = b"%06o\0 " % (sum(data[:148]) + sum(data[156:512]) + 256)
    with pytest.raises(Unhandled):
        _walked(bytes(data))
    if kind in ("checksum", "truncated", "no_end"):
        with pytest.raises(TarFormatError):
            _reference(bytes(data))


# ---- sidecars: the bulk pass against the reference pass ----------------------------------------
def _ids(n, seed, dtype=np.int64):
    return np.random.default_rng(seed).integers(0, 30000, n).astype(dtype)


def _varied_shards(root) -> list[str]:
    """Shards with every kind of sample the text pass meets."""
    long = "d" * 120 + "/"
    good = [(f"{i:05d}.input_ids.npy", _npy(_ids(16 + 37 * i % 240, i))) for i in range(40)]
    odd = [
        (f"{long}p00001.input_ids.npy", _npy(_ids(33, 1))),  # a long name: GNU L or pax path
        ("p00002.input_ids.npy", _npy(_ids(1, 2))),  # one token
        ("p00003.input_ids.npy", _npy(_ids(0, 3))),  # no token
        ("p00004.input_ids.npy", _npy(_ids(50, 4, np.int32))),  # another dtype: a new signature
        ("p00005.input_ids.npy", _npy(np.array([7, -100, 3, -1, 9], np.int32))),  # negative ids
        ("p00006.input_ids.npy", _npy(_ids(50, 6, np.float32))),  # not integers
        ("p00007.input_ids.npy", _npy(_ids(12, 7).reshape(3, 4))),  # not [L]
        ("p00008.input_ids.npy", _npy(_ids(40, 8))[:-9]),  # data cut short
        ("p00009.input_ids.npy", b"\x93NUMPY\x01\x00\x05\x00{'de"),  # a broken header
        ("p00010.input_ids.npy", b"not npy at all"),
        ("p00011.input_ids.npy", _npy(_ids(20, 11))),
        ("p00011.labels.npy", _npy(_ids(20, 12))),
        ("p00012.input_ids.npy", _npy(_ids(20, 13))),
        ("p00012.json", b"{not json"),
        ("p00013.txt", b"no ids"),
        ("README", b"no extension"),
        ("p00014.input_ids.npy", _npy(_ids(20, 14))),
        ("skip-me", b"x"),
        ("p00014.labels.npy", _npy(_ids(20, 15))),
        ("00003.input_ids.npy", _npy(_ids(20, 16))),  # a key seen before: a duplicate
        ("p00015.input_ids.npy", _npy(_ids(20, 17).astype(">i8"))),  # big-endian
        ("p00016.input_ids.npy", _npy(_ids(20, 18).astype(np.uint8))),
        ("p00017.input_ids.npy", _npy(np.array([2**63 - 1, 5], np.int64))),
        ("p00018.input_ids.npy", _npy(_ids(3000, 19))),  # bigger than a small block
        ("p00019.input_ids.npy", _npy(_ids(20, 20))),
        ("p00019.input_ids.npy", _npy(_ids(20, 21))),
    ]
    shards = {
        "good": good,
        "odd": good[:10] + odd + good[10:],
        "empty": [],
        "linked": good[:5] + [("l00001.input_ids.npy", None)] + good[5:10],
        "dir": good[:3] + [("sub", "dir")] + good[3:6],
    }
    os.makedirs(root)
    paths = []
    for fmt in FORMATS:
        for name, members in shards.items():
            path = os.path.join(root, f"{name}-{fmt}.tar")
            try:
                data = _tar(members, fmt)
            except ValueError:  # ustar: the long name does not fit
                data = _tar([m for m in members if not m[0].startswith(long)], fmt)
            with open(path, "wb") as f:
                f.write(data)
            paths.append(path)
    good_tar = _tar(good)
    third = _reference(good_tar)[2][1]
    for name, data in {
        "cut": good_tar[:5000],
        "cut-at-header": good_tar[:4096],
        "no-end": good_tar[: -1024 * 10],
        "flipped": good_tar[: third + 3] + b"#" + good_tar[third + 4 :],
    }.items():
        path = os.path.join(root, f"{name}.tar")
        with open(path, "wb") as f:
            f.write(data)
        paths.append(path)
    return paths


def _sidecars(paths, out) -> dict:
    write_sidecars(WebDatasetSource(paths), SCHEMA, out_dir=out, force=True)
    got = {}
    for name in sorted(os.listdir(out)):
        with np.load(os.path.join(out, name)) as z:
            arrays = {
                k: (z[k].dtype.str, z[k].shape, z[k].tobytes()) for k in z.files if k != "meta"
            }
            got[name] = (json.loads(z["meta"].tobytes()), arrays)
    return got


def _reference_only(records, f):
    raise Unhandled("the reference pass, for the comparison")


@pytest.mark.parametrize("block", [bulk_pass.BLOCK_BYTES, 1024, 3072])
def test_bulk_text_pass_writes_the_reference_passs_sidecars(tmp_path, monkeypatch, block):
    paths = _varied_shards(str(tmp_path / "shards"))
    monkeypatch.setattr(bulk_pass, "BLOCK_BYTES", block)
    calls = []
    real = bulk_pass.bulk_text_pass
    monkeypatch.setattr(header_pass, "bulk_text_pass", lambda r, f: calls.append(1) or real(r, f))
    bulk = _sidecars(paths, str(tmp_path / "bulk"))
    assert len(calls) == len(paths)
    monkeypatch.setattr(header_pass, "bulk_text_pass", _reference_only)
    reference = _sidecars(paths, str(tmp_path / "reference"))
    assert bulk.keys() == reference.keys() and len(bulk) == len(paths)
    for name in bulk:
        assert bulk[name] == reference[name], name
    odd = reference["odd-1.tar.prealign-index.npz"][0]  # (the shards hold what they say)
    assert len(odd["events"]) == 9 and len(odd["dims"]) == 6 and odd["num_events"] == 62
    assert [
        ev[1]["reason"]
        for name in ("cut", "cut-at-header", "no-end", "flipped")
        for ev in reference[f"{name}.tar.prealign-index.npz"][0]["events"]
    ] == ["corrupt_shard"] * 4


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c", "a/b" * 40]),
            st.integers(0, 300),
            st.sampled_from(["input_ids.npy", "labels.npy", "txt", "input_ids.npy"]),
            st.sampled_from([np.int64, np.int32, np.uint16]),
        ),
        max_size=25,
    ),
    st.sampled_from([1024, 2048, 1 << 20]),
    st.sampled_from(FORMATS),
)
def test_bulk_text_pass_equals_the_reference_on_generated_shards(
    tmp_path_factory, monkeypatch, members, block, fmt
):
    root = tmp_path_factory.mktemp("gen")
    shard = [
        (f"{key}{i // 3}.{ext}", _npy(_ids(n, i, dtype)) if ext.endswith("npy") else b"t")
        for i, (key, n, ext, dtype) in enumerate(members)
    ]
    path = str(root / "s.tar")
    try:
        data = _tar(shard, fmt)
    except ValueError:
        return
    with open(path, "wb") as f:
        f.write(data)
    monkeypatch.setattr(bulk_pass, "BLOCK_BYTES", block)
    bulk = _sidecars([path], str(root / "bulk"))
    with monkeypatch.context() as m:
        m.setattr(header_pass, "bulk_text_pass", _reference_only)
        reference = _sidecars([path], str(root / "reference"))
    assert bulk == reference


@settings(max_examples=500, deadline=None)
@given(st.text(st.sampled_from("ab./\nX\u00e9"), max_size=12))
def test_split_name_equals_the_reference_split(name):
    assert bulk_pass.split_name(name) == split_member_name(name)


def test_the_reference_judges_one_sample_per_signature_at_any_shard_size(tmp_path, monkeypatch):
    """Counted work, two sizes: on a shard of plain samples the per-sample reference judge
    (``ShardPass.sample``) runs once per data signature and the reference tar reader never, at 100
    as at 2,000 samples (the bulk pass did not fall back: its per-sample work is arrays)."""
    calls = {"sample": 0, "iter_members": 0}
    judge, walk_members = header_pass.ShardPass.sample, header_pass.iter_members

    def counted_judge(self, *a, **kw):
        calls["sample"] += 1
        return judge(self, *a, **kw)

    def counted_walk(*a, **kw):
        calls["iter_members"] += 1
        return walk_members(*a, **kw)

    monkeypatch.setattr(header_pass.ShardPass, "sample", counted_judge)
    monkeypatch.setattr(header_pass, "iter_members", counted_walk)
    monkeypatch.setattr(bulk_pass, "BLOCK_BYTES", 64 << 10)  # several blocks at either size
    counts = {}
    for n in (100, 2000):
        path = str(tmp_path / f"s{n}.tar")
        members = [
            (f"{i:05d}.input_ids.npy", _npy(_ids(16 + i % 240, i, np.int32 if i % 2 else np.int64)))
            for i in range(n)
        ]
        with open(path, "wb") as f:
            f.write(_tar(members))
        calls.update(sample=0, iter_members=0)
        stats = write_sidecars(
            WebDatasetSource([path]), SCHEMA, out_dir=str(tmp_path / f"o{n}"), force=True
        )
        assert stats["samples"] == n
        counts[n] = dict(calls)
    assert counts[100] == counts[2000] == {"sample": 2, "iter_members": 0}  # two dtypes, two sigs
