"""Sources and the index pass: safe webdataset decoding, bad-data policies, HF
map-style/streaming."""

from __future__ import annotations

import io
import json
import os
import pickle
import tarfile

import datasets
import numpy as np
import pytest
import torch

from prealign.loaders import (
    BadDataPolicy,
    BadSampleError,
    BadSampleWarning,
    CorruptShardError,
    HFSource,
    MissingMemberError,
    SampleIndex,
    TooManyBadSamplesError,
    UnsafeMemberError,
    WebDatasetSource,
    build_index,
)
from prealign.loaders.errors import MissingShardError
from prealign.loaders.sources.tar_decode import decode_member, split_member_name
from prealign.schemas import causal_lm_schema
from prealign.schemas.errors import ConfigError
from tests.loader_helpers import add_member, hf_rows, sample_lengths, token_ids, write_shards

SCHEMA = causal_lm_schema()
SKIP = BadDataPolicy(on_error="skip", max_consecutive=5)


class _Boom:
    """Unpickling this would create a file: proves nothing is ever unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _npy_bytes(arr) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=arr.dtype == object)
    return buf.getvalue()


def test_decode_table():
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (3, 2), (255, 0, 0)).save(png, format="PNG")
    assert decode_member("k", "json", b'{"q": "x"}') == {"q": "x"}
    assert decode_member("k", "txt", "héllo".encode()) == "héllo"
    assert decode_member("k", "cls", b"3") == 3 and decode_member("k", "cls", b"cat") == "cat"
    assert decode_member("k", "input_ids.npy", _npy_bytes(np.arange(4))).tolist() == [0, 1, 2, 3]
    buf = io.BytesIO()
    np.savez(buf, a=np.ones(2))
    assert decode_member("k", "npz", buf.getvalue())["a"].tolist() == [1.0, 1.0]
    img = decode_member("k", "png", png.getvalue())
    assert img.size == (3, 2)
    assert decode_member("k", "png", png.getvalue(), image="bytes") == png.getvalue()
    assert decode_member("k", "bin", b"\x00\x01") == b"\x00\x01"
    assert decode_member("k", "x.bin", b"\x02", extra={"x.bin": lambda d: d[0]}) == 2
    assert split_member_name("d/000.meta.json") == ("d/000", "meta.json")
    assert split_member_name("d/.hidden") is None


@pytest.mark.parametrize("ext", ["pickle", "pkl", "pyd", "pth", "pt", "logits.pth"])
def test_pickle_like_members_are_refused_never_unpickled(tmp_path, ext):
    flag = tmp_path / "unpickled"
    payload = pickle.dumps(_Boom(str(flag)))
    with pytest.raises(UnsafeMemberError) as exc:
        decode_member(
            "s/0", ext, payload, extra={ext: pickle.loads}
        )  # even a user decoder cannot override
    assert exc.value.field == ext and "pickle" in exc.value.actual
    assert not flag.exists()


def test_object_npy_is_refused(tmp_path):
    flag = tmp_path / "unpickled"
    data = _npy_bytes(np.array([_Boom(str(flag))], dtype=object))
    with pytest.raises(BadSampleError, match="npy"):
        decode_member("s/0", "npy", data)
    assert not flag.exists()


def _index(paths, policy=None, **kw):
    return build_index(WebDatasetSource(paths, **kw), SCHEMA, policy=policy)


@pytest.mark.slow
def test_webdataset_index_and_read(tmp_path):
    lengths = sample_lengths(30)
    paths = write_shards(str(tmp_path), lengths, num_shards=3)
    src = WebDatasetSource(
        str(tmp_path / "shard-{000..002}.tar"), required=("input_ids.npy", "json")
    )
    assert src.num_shards == 3
    idx = build_index(src, SCHEMA)
    assert idx.lengths.tolist() == lengths and idx.shards.tolist() == [0] * 10 + [1] * 10 + [2] * 10
    for i in (0, 17, 29):
        sample = src.load(tuple(idx.locations[i]))
        assert sample["__key__"] == f"{i:06d}" and sample["json"] == {"id": i}
        assert torch.equal(sample["input_ids"], torch.from_numpy(token_ids(i, lengths[i])))
    assert build_index(src, SCHEMA, num_workers=2).digest == idx.digest
    assert paths == src.urls


def test_index_save_load_roundtrip(tmp_path):
    idx = _index(write_shards(str(tmp_path), sample_lengths(12)))
    idx.save(str(tmp_path / "idx.npz"))
    back = SampleIndex.load(str(tmp_path / "idx.npz"))
    assert back.digest == idx.digest and back.report.to_dict() == idx.report.to_dict()


def _with_bad(bad: set[int], kind: str):
    def extra(i, tf):
        if i not in bad:
            return False
        if kind == "missing":
            add_member(tf, f"{i:06d}.json", b"{}")
        elif kind == "pickle":
            add_member(tf, f"{i:06d}.input_ids.npy", _npy_bytes(token_ids(i, 5)))
            add_member(tf, f"{i:06d}.extra.pickle", pickle.dumps([1]))
        elif kind == "badjson":
            add_member(tf, f"{i:06d}.input_ids.npy", _npy_bytes(token_ids(i, 5)))
            add_member(tf, f"{i:06d}.json", b"{not json")
        return True

    return extra


@pytest.mark.parametrize(
    "kind, reason, error",
    [
        ("missing", "missing_member", MissingMemberError),
        ("pickle", "unsafe_member", UnsafeMemberError),
        ("badjson", "bad_sample", BadSampleError),
    ],
)
def test_bad_samples_raise_or_skip_and_count(tmp_path, kind, reason, error):
    lengths = sample_lengths(20)
    paths = write_shards(str(tmp_path), lengths, num_shards=2, extra=_with_bad({3, 12}, kind))
    req = ("input_ids.npy",) if kind == "missing" else ()
    with pytest.raises(error) as exc:
        _index(paths, required=req)
    assert "000003" in str(exc.value)
    with pytest.warns(BadSampleWarning, match="000003"):
        idx = _index(paths, SKIP, required=req)
    assert len(idx) == 18 and idx.report.counts == {reason: 2}
    assert [e.where for e in idx.report.examples] == [f"{paths[0]}:000003", f"{paths[1]}:000012"]


def test_fields_that_disagree_are_bad_samples(tmp_path):
    def transform(s):
        ids = torch.from_numpy(s["input_ids.npy"])
        labels = ids[:-1] if s["json"]["id"] == 4 else ids
        return {"input_ids": ids, "labels": labels}

    paths = write_shards(str(tmp_path), sample_lengths(8), num_shards=1)
    with pytest.raises(BadSampleError, match="000004.*labels"):
        _index(paths, transform=transform)
    with pytest.warns(BadSampleWarning):
        assert len(_index(paths, SKIP, transform=transform)) == 7


def test_transform_errors_are_bad_samples(tmp_path):
    def transform(s):
        if s["json"]["id"] == 2:
            raise KeyError("no text")
        return {"input_ids": torch.from_numpy(s["input_ids.npy"])}

    paths = write_shards(str(tmp_path), sample_lengths(6), num_shards=1)
    with pytest.raises(BadSampleError, match="transform to succeed.*KeyError"):
        _index(paths, transform=transform)


def test_truncated_shard(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(20), num_shards=2)
    size = os.path.getsize(paths[1])
    with open(paths[1], "r+b") as f:
        f.truncate(size // 2 + 100)
    with pytest.raises(CorruptShardError, match="shard-001"):
        _index(paths)
    with pytest.warns(BadSampleWarning, match="corrupt_shard"):
        idx = _index(paths, SKIP)
    assert idx.report.counts == {"corrupt_shard": 1}
    assert 10 < len(idx) < 20  # the first shard and the readable part of the second
    # a shard file that does not exist is a configuration mistake, never a counted skip (issue 8,
    # item 14)
    with pytest.raises(MissingShardError, match="nope.tar") as exc:
        _index(paths[:1] + [str(tmp_path / "nope.tar")], SKIP)
    assert isinstance(exc.value, ConfigError)


def test_too_many_bad_samples_in_a_row(tmp_path):
    paths = write_shards(
        str(tmp_path),
        sample_lengths(20),
        num_shards=1,
        extra=_with_bad(set(range(4, 12)), "badjson"),
    )
    with (
        pytest.warns(BadSampleWarning),
        pytest.raises(TooManyBadSamplesError, match="5 bad samples in a row"),
    ):
        _index(paths, SKIP)
    idx = _index(paths, BadDataPolicy(on_error="skip", max_consecutive=9, warn=False))
    assert len(idx) == 12 and idx.report.total == 8


def test_members_without_extension_are_counted(tmp_path):
    def extra(i, tf):
        if i == 1:
            add_member(tf, "README", b"hello")
        return False

    idx = _index(write_shards(str(tmp_path), sample_lengths(4), num_shards=1, extra=extra))
    assert len(idx) == 4 and idx.report.counts == {"ignored_member": 1}


def test_pipe_url_is_read_sequentially(tmp_path):
    paths = write_shards(str(tmp_path / "src"), sample_lengths(6), num_shards=1)
    src = WebDatasetSource(
        [f"pipe:cat {paths[0]}"]
    )  # no cache_dir needed, nothing copied (issue #7)
    idx = build_index(src, SCHEMA)
    assert len(idx) == 6
    assert src.load(tuple(idx.locations[5]))["json"] == {"id": 5}


@pytest.mark.slow
def test_hf_map_style_and_streaming():
    lengths = sample_lengths(25)
    table = datasets.Dataset.from_dict(hf_rows(lengths))
    mapped = HFSource(table, rows_per_shard=10)
    assert mapped.num_shards == 3 and not mapped.sequential
    idx = build_index(mapped, SCHEMA, num_workers=2)
    assert idx.lengths.tolist() == lengths
    stream = HFSource(table.to_iterable_dataset(num_shards=4), lookback=2)
    assert stream.num_shards == 4 and stream.sequential
    sidx = build_index(stream, SCHEMA)
    assert sidx.lengths.tolist() == lengths
    for i in (
        20,
        3,
        4,
        24,
        0,
        1,
    ):  # out of order: forward reads, look-back window, re-opened shards
        assert (
            stream.load(tuple(sidx.locations[i]))["input_ids"] == token_ids(i, lengths[i]).tolist()
        )
    with pytest.raises(ConfigError, match="datasets.Dataset"):
        HFSource([{"input_ids": [1]}])


def test_hf_transform_and_empty_source():
    table = datasets.Dataset.from_dict({"text": ["a b c", "d e", ""]})

    def words(row):
        return {"input_ids": torch.tensor([len(w) for w in row["text"].split()], dtype=torch.int64)}

    with pytest.raises(BadSampleError, match="non-empty"):
        build_index(HFSource(table, transform=words), SCHEMA)
    with pytest.warns(BadSampleWarning):
        idx = build_index(HFSource(table, transform=words), SCHEMA, policy=SKIP)
    assert idx.lengths.tolist() == [3, 2] and idx.report.counts == {"bad_sample": 1}
    with pytest.raises(BadSampleError, match="at least one good sample"):
        build_index(HFSource(table.select([2]), transform=words), SCHEMA, policy=SKIP)


def test_source_changed_is_detected(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(6), num_shards=1)
    src = WebDatasetSource(paths)
    idx = build_index(src, SCHEMA)
    with open(paths[0], "r+b") as f:  # another file in place: byte ranges now cut other members
        f.seek(0)
        f.write(b"\0" * 1024)
    from prealign.loaders import SourceChangedError

    with pytest.raises((SourceChangedError, BadSampleError)):
        WebDatasetSource(paths).load(tuple(idx.locations[0]))
    assert json.dumps(src.describe())


def test_long_member_names_and_read_paths(tmp_path):
    """Random access parses plain headers itself and hands pax/long-name headers to tarfile."""
    deep = "d" * 120 + "/"
    path = str(tmp_path / "long.tar")
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        for i in range(3):
            add_member(tf, f"{deep}{i:03d}.input_ids.npy", _npy_bytes(token_ids(i, 4 + i)))
    src = WebDatasetSource([path])
    idx = build_index(src, SCHEMA)
    assert idx.lengths.tolist() == [4, 5, 6]
    assert src.load(tuple(idx.locations[2]))["__key__"] == f"{deep}002"


def test_mixed_dtypes_are_checked_per_sample(tmp_path):
    def transform(s):
        ids = torch.from_numpy(s["input_ids.npy"])
        return {
            "input_ids": ids.to(torch.float32) if s["json"]["id"] == 3 else ids
        }  # (int32 would become int64)

    paths = write_shards(str(tmp_path), sample_lengths(8), num_shards=1)
    with pytest.raises(BadSampleError, match="000003.*dtype"):
        _index(paths, transform=transform)


def test_pax_names_and_corrupt_headers(tmp_path):
    path = str(tmp_path / "pax.tar")
    name = "p" * 150 + "/000.input_ids.npy"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        add_member(tf, name, _npy_bytes(token_ids(0, 7)))
    src = WebDatasetSource([path])
    idx = build_index(src, SCHEMA)
    assert (
        idx.lengths.tolist() == [7]
        and src.load(tuple(idx.locations[0]))["__key__"] == "p" * 150 + "/000"
    )
    data = bytearray(open(path, "rb").read())
    data[1030] ^= (
        0xFF  # inside the member header after the pax header: its checksum no longer matches
    )
    bad = tmp_path / "bad.tar"
    bad.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match="checksum"):
        build_index(WebDatasetSource([str(bad)]), SCHEMA)


# ---- the index pass checks what the collator checks ---------------------------------------------
TOPK = causal_lm_schema(topk="K", vocab_size=1000)


def _topk_rows(n: int, bad: dict[int, str], k: int = 4) -> datasets.Dataset:
    """``n`` rows of teacher top-k data; ``bad[i]`` makes row ``i`` wrong in one way."""
    return datasets.Dataset.from_list(
        [{"n": 5 + i % 7, "bad": bad.get(i, ""), "k": k} for i in range(n)]
    )


def _topk(row) -> dict:
    n, k, bad = row["n"], row["k"], row["bad"]
    ids = torch.full((n, 2 if bad == "k" else k), 999999 if bad == "vocab" else 1)
    lp = -torch.ones(n, ids.shape[1])
    lp[1, 0] = {"nan": float("nan"), "positive": 0.5}.get(bad, -1.0)
    if bad == "bf16":
        lp = lp.bfloat16()
    return {
        "input_ids": torch.arange(1, n + 1),
        "teacher_topk_ids": ids,
        "teacher_topk_log_probs": lp,
    }


@pytest.mark.slow
def test_index_rejects_what_the_collator_rejects_value_bounds():
    """Value bounds (ids < vocab, finite log-probs <= 0) are the collator's checks: the index pass
    counts such samples by policy instead of letting them crash an epoch."""
    bad = {13: "vocab", 40: "nan", 70: "positive"}
    src = HFSource(_topk_rows(90, bad), transform=_topk, rows_per_shard=32)
    with pytest.raises(BadSampleError, match=r"hf\[13\].*teacher_topk_ids.*\[0, 999\]"):
        build_index(src, TOPK)
    with pytest.warns(BadSampleWarning, match="teacher_topk_log_probs"):
        idx = build_index(src, TOPK, policy=SKIP)
    assert len(idx) == 87 and idx.report.counts == {"bad_sample": 3}
    assert [e.where for e in idx.report.examples] == ["hf[13]", "hf[40]", "hf[70]"]
    assert build_index(src, TOPK, policy=SKIP, num_workers=2).digest == idx.digest


@pytest.mark.slow
@pytest.mark.parametrize(
    "rows_per_shard", [64, 3]
)  # the odd one inside a chunk / alone in its shard
def test_index_fixes_named_dims_by_the_first_sample(tmp_path, rows_per_shard):
    """K differing between samples passes per-sample validation, but no micro-batch could hold
    both: the first accepted sample fixes K, a later other K is bad data (``dim_mismatch``)."""
    src = HFSource(_topk_rows(20, {7: "k"}), transform=_topk, rows_per_shard=rows_per_shard)
    with pytest.raises(
        BadSampleError,
        match=r"dim_mismatch: sample hf\[7\], field 'teacher_topk_log_probs': "
        r"expected K = 4 .*hf\[0\].*got K = 2",
    ) as err:
        build_index(src, TOPK)
    assert err.value.reason == "dim_mismatch"
    idx = build_index(src, TOPK, policy=BadDataPolicy(on_error="skip", warn=False), num_workers=2)
    assert len(idx) == 19 and idx.report.counts == {"dim_mismatch": 1} and idx.dims["K"] == 4
    assert 7 not in idx.locations[:, 0].tolist()
    path = str(tmp_path / "idx.npz")
    idx.save(path)
    back = SampleIndex.load(path)
    assert back.dims == idx.dims and back.digest == idx.digest
    # the dims are part of the digest: the same lengths and locations with another K differ
    other = build_index(
        HFSource(_topk_rows(20, {7: "k"}, k=8), transform=_topk),
        TOPK,
        policy=BadDataPolicy(on_error="skip", warn=False),
    )
    assert other.dims["K"] == 8 and other.lengths.tolist() == idx.lengths.tolist()
    assert other.digest != idx.digest
    # the loader collates every micro-batch of the index (no mid-epoch error)
    from prealign.loaders import IndexOptions, PackedLoader
    from prealign.schemas import ParallelLayout

    loader = PackedLoader(
        src,
        schema=TOPK,
        layout=ParallelLayout(cp=2),
        token_budget=48,
        indexing=IndexOptions(prebuilt=idx),
    )
    assert sorted(i for b in loader for i in b["sample_index"].tolist()) == list(range(19))


def test_index_fixes_each_field_dtype_by_the_first_sample():
    """float32 and bf16 log-probs are both allowed but never in one batch: a bf16 sample in another
    chunk than the float32 ones is bad data by policy, not a mid-epoch crash."""
    src = HFSource(_topk_rows(90, {70: "bf16"}), transform=_topk, rows_per_shard=32)
    idx = build_index(src, TOPK, policy=BadDataPolicy(on_error="skip", warn=False))
    assert len(idx) == 89 and idx.report.counts == {"dim_mismatch": 1}
    assert idx.dims["dtype[teacher_topk_log_probs]"] == "float32"
    from prealign.loaders import IndexOptions, PackedLoader
    from prealign.schemas import ParallelLayout

    loader = PackedLoader(
        src,
        schema=TOPK,
        layout=ParallelLayout(cp=2),
        token_budget=48,
        indexing=IndexOptions(prebuilt=idx),
    )
    assert sorted(i for b in loader for i in b["sample_index"].tolist()) == list(
        range(89)
    )  # index rows
    assert 70 not in idx.locations[:, 0].tolist()


# ---- pax records --------------------------------------------------------------------------------
def _pax_tar(tmp_path, length: bytes) -> str:
    """A pax shard whose first extended-header record has the length field ``length``."""
    path = tmp_path / "pax.tar"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for k in range(2):
            data = _npy_bytes(token_ids(k, 5))
            info = tarfile.TarInfo(f"s{k}.input_ids.npy")
            info.size, info.pax_headers = len(data), {"comment": "x"}
            tf.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    i = raw.index(b" comment=x\n")
    path.write_bytes(raw[: i - 2] + length + raw[i:])
    return str(path)


@pytest.mark.slow
def test_pax_record_length_zero_does_not_hang(tmp_path):
    """A zero record length used to loop forever: checked in a child process with a time limit."""
    import subprocess
    import sys

    path = _pax_tar(tmp_path, b"00")
    code = (
        "import sys; from prealign.loaders.sources.tar_reader import TarFormatError, iter_members\n"
        "try:\n    list(iter_members(open(sys.argv[1], 'rb')))\n"
        "except TarFormatError as e:\n    print('TarFormatError', e)\n"
    )
    from tests import ROOT as root

    try:
        out = subprocess.run(
            [sys.executable, "-c", code, path], capture_output=True, text=True, timeout=60, cwd=root
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the tar reader hangs on a pax record of length 0")
    assert (
        out.stdout.startswith("TarFormatError bad pax record length b'00 comment=x")
        and "at byte 512" in out.stdout
    )
    with pytest.raises(CorruptShardError, match="bad pax record"):
        _index([path])
    with pytest.warns(BadSampleWarning), pytest.raises(BadSampleError, match="corrupt_shard"):
        _index([path], SKIP)  # the shard is unreadable: counted, and no good sample is left


@pytest.mark.parametrize("length", [b"zz", b"99", b" 1", b"-5"])
def test_bad_pax_record_is_a_corrupt_shard(tmp_path, length):
    """Non-numeric, too long or signed lengths are a corrupt shard by policy, not a bare
    ValueError."""
    path = _pax_tar(tmp_path, length)
    good = write_shards(str(tmp_path / "good"), sample_lengths(4), num_shards=1)
    with pytest.raises(CorruptShardError, match="bad pax record"):
        _index([path])
    with pytest.warns(BadSampleWarning, match="corrupt_shard"):
        idx = _index(good + [path], SKIP)
    assert len(idx) == 4 and idx.report.counts == {"corrupt_shard": 1}


def test_a_hung_stat_costs_one_timeout_and_a_path_stat_refuses_is_missing(tmp_path, monkeypatch):
    import threading
    import time

    from prealign.loaders.errors import ShardTimeoutError
    from prealign.loaders.index import sidecar

    good = write_shards(str(tmp_path), [4, 6, 8], num_shards=3)
    with pytest.raises(MissingShardError, match="1 of 4"):
        sidecar.shard_sizes(WebDatasetSource(good + [good[0] + "\x00x"], read_timeout=2.0))
    with pytest.raises(MissingShardError, match="1 of 4"):
        sidecar.shard_sizes(WebDatasetSource(good + [good[0] + "\x00x"], read_timeout=None))
    release = threading.Event()
    monkeypatch.setattr(
        sidecar, "_local_size", lambda path: release.wait(30)
    )  # every stat hangs (a dead mount)
    before = sum(t.name == "prealign-map" for t in threading.enumerate())
    with pytest.raises(ShardTimeoutError, match="shard-000.tar.*hung mount"):
        sidecar.shard_sizes(WebDatasetSource(good, read_timeout=0.2))
    stuck = sum(t.name == "prealign-map" for t in threading.enumerate()) - before
    release.set()
    assert stuck == 1  # one stat waited on, not one thread (and one timeout) per shard
    time.sleep(0.05)


def test_a_shard_path_that_is_a_folder_is_a_corrupt_shard(tmp_path):
    """A folder where a shard is named (data laid out wrong, like a garbled tar): the scan yields a
    ``CorruptShardError`` naming it (``corrupt_shard`` under skip), never a bare
    ``IsADirectoryError``; a path through a file (``NotADirectoryError``) alike."""
    folder = tmp_path / "x.tar"
    folder.mkdir()
    (tmp_path / "f").write_bytes(b"")
    for path in (str(folder), str(tmp_path / "f" / "y.tar")):
        records = list(WebDatasetSource([path]).scan(0))
        assert len(records) == 1 and records[0][0] is None, records
        err = records[0][1]
        assert type(err) is CorruptShardError and err.shard == path, repr(err)
        assert err.reason == "corrupt_shard" and "Directory" in err.cause


def test_a_shard_that_cannot_be_opened_for_a_system_reason_propagates(tmp_path, monkeypatch):
    """EIO or EACCES at open is a system error: it propagates out of the scan, never counted."""
    import errno

    from prealign.loaders.sources import remote
    from prealign.schemas.errors import PrealignError

    path = write_shards(str(tmp_path), sample_lengths(2), num_shards=1)[0]

    def failing_open(url, *args, **kwargs):
        raise OSError(errno.EIO, os.strerror(errno.EIO), url)

    with monkeypatch.context() as m:
        m.setattr(remote, "open_stream", failing_open)
        with pytest.raises(OSError) as err:
            list(WebDatasetSource([path]).scan(0))
    assert err.value.errno == errno.EIO and not isinstance(err.value, PrealignError)
    if os.geteuid() == 0:
        pytest.skip("platform: running as root, chmod 000 does not deny root a read")
    os.chmod(path, 0)
    try:
        with pytest.raises(PermissionError):
            list(WebDatasetSource([path]).scan(0))
    finally:
        os.chmod(path, 0o644)
