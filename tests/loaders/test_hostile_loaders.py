"""A hostile-input pass over the loader layer: tars, members, images, arrays, index and state files
as a broken data source or a careless user would send them. Each case asserts its typed outcome
(the error class, the reason it is counted under, the argument or key it names), never a crash, a
hang or an allocation the size of a lie.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import tarfile
import threading
import time
import zipfile

import datasets
import numpy as np
import pytest
import torch

from prealign.loaders import (
    BadDataPolicy,
    HFSource,
    PackedLoader,
    SampleIndex,
    WebDatasetSource,
    build_index,
)
from prealign.loaders.errors import (
    BadSampleError,
    CorruptShardError,
    IndexFileError,
    MissingShardError,
    PlanError,
    ResumeError,
    ShardTimeoutError,
)
from prealign.loaders.media.vlm import MediaError, decode_image
from prealign.loaders.options import IndexOptions
from prealign.loaders.sources.tar_decode import DecodeLimits, decode_member
from prealign.loaders.sources.tar_reader import TarFormatError, iter_members
from prealign.loaders.state import LoaderState
from prealign.schemas import ParallelLayout, causal_lm_schema
from prealign.schemas.errors import ConfigError, PrealignError
from tests.loader_helpers import _npy, add_member, hf_rows, sample_lengths, token_ids, write_shards

SCHEMA = causal_lm_schema()
SKIP = BadDataPolicy(on_error="skip", max_consecutive=50, warn=False)


# ---- helpers
# ---------------------------------------------------------------------------------------
def _sample_members(tf: tarfile.TarFile, i: int, n: int = 5, prefix: str = "") -> None:
    add_member(tf, f"{prefix}{i:06d}.input_ids.npy", _npy(token_ids(i, n)))


def _tar(path, build, fmt=tarfile.USTAR_FORMAT) -> str:
    with tarfile.open(path, "w", format=fmt) as tf:
        build(tf)
    return str(path)


def _patch_header(data: bytearray, at: int, field: slice, value: bytes) -> None:
    """Overwrite ``field`` of the header at byte ``at`` and fix its checksum."""
    head = data[at : at + 512]
    head[field] = value
    head[148:156] = b" " * 8
    head[148:156] = b"%06o\0 " % sum(head)
    data[at : at + 512] = head


def _good_then(path, tail: bytes) -> str:
    """A shard with two good samples, then ``tail`` (raw tar bytes), then the end marker."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        _sample_members(tf, 0)
        _sample_members(tf, 1)
    body = buf.getvalue().rstrip(b"\0")
    body += b"\0" * (-len(body) % 512)
    with open(path, "wb") as f:
        f.write(body + tail + b"\0" * 1024)
    return str(path)


def _member_bytes(name: str, data: bytes, fmt=tarfile.USTAR_FORMAT, **info) -> bytearray:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    for k, v in info.items():
        setattr(ti, k, v)
    raw = ti.tobuf(format=fmt, encoding="utf-8", errors="surrogateescape")
    return bytearray(raw + data + b"\0" * (-len(data) % 512))


# ---- 1. sizes that lie
# -------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["base256_100GiB", "octal_8GiB", "pax_1e30", "pax_header_1e30"])
def test_a_member_larger_than_the_file_is_a_corrupt_shard_not_an_allocation(tmp_path, how):
    member = _member_bytes("000002.input_ids.npy", _npy(token_ids(2, 5)))
    if how == "base256_100GiB":
        _patch_header(member, 0, slice(124, 136), b"\x80" + (100 << 30).to_bytes(11, "big"))
    elif how == "octal_8GiB":
        _patch_header(member, 0, slice(124, 136), b"77777777777\0")
    elif how == "pax_1e30":  # a pax size record for the next member
        member = _member_bytes(
            "000002.input_ids.npy",
            _npy(token_ids(2, 5)),
            fmt=tarfile.PAX_FORMAT,
            pax_headers={"size": str(10**30)},
        )
    else:  # the pax header's own size field lies
        member = _member_bytes(
            "000002.input_ids.npy",
            _npy(token_ids(2, 5)),
            fmt=tarfile.PAX_FORMAT,
            pax_headers={"comment": "x"},
        )
        _patch_header(member, 0, slice(124, 136), b"\x80" + (10**24).to_bytes(11, "big"))
    path = _good_then(tmp_path / "bad.tar", bytes(member))
    good = write_shards(str(tmp_path / "good"), [4, 6], num_shards=1)
    with pytest.raises(
        CorruptShardError, match="bad.tar.*(claims .* left in the archive|bad pax size)"
    ):
        build_index(WebDatasetSource([path]), SCHEMA)
    idx = build_index(WebDatasetSource([path] + good), SCHEMA, policy=SKIP)
    assert idx.report.counts == {"corrupt_shard": 1}
    assert (
        len(idx) == 3
    )  # the first sample (the second is lost with the shard: its end is unknown) + 2 good


def test_iter_members_never_reads_past_what_the_stream_holds():
    member = _member_bytes("a.bin", b"x" * 10)
    _patch_header(member, 0, slice(124, 136), b"\x80" + (100 << 30).to_bytes(11, "big"))
    with pytest.raises(TarFormatError, match="claims 107374182400 bytes"):
        list(iter_members(io.BytesIO(bytes(member) + b"\0" * 1024)))


def test_a_huge_pax_header_is_refused(tmp_path):
    member = _member_bytes(
        "000002.input_ids.npy",
        _npy(token_ids(2, 5)),
        fmt=tarfile.PAX_FORMAT,
        pax_headers={"comment": "y" * (2 << 20)},
    )
    path = _good_then(tmp_path / "pax.tar", bytes(member))
    idx = build_index(WebDatasetSource([path]), SCHEMA, policy=SKIP)
    assert idx.report.counts == {"corrupt_shard": 1} and len(idx) == 1
    assert "extended header of" in idx.report.examples[0].message


# ---- 13. links, duplicates, odd names
# --------------------------------------------------------------
@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE])
def test_link_members_are_counted_under_the_policy(tmp_path, kind):
    def build(tf):
        _sample_members(tf, 0)
        _sample_members(tf, 1)
        link = tarfile.TarInfo("000001.json")
        link.type, link.linkname = kind, "/etc/passwd"
        tf.addfile(link)
        _sample_members(tf, 2)

    path = _tar(tmp_path / "links.tar", build)
    with pytest.raises(BadSampleError, match="link_member") as exc:
        build_index(WebDatasetSource([path]), SCHEMA)
    assert exc.value.reason == "link_member" and exc.value.field == "json"
    idx = build_index(WebDatasetSource([path]), SCHEMA, policy=SKIP)
    assert len(idx) == 2 and idx.report.counts == {"link_member": 1}


def test_a_key_repeated_later_in_a_shard_is_counted(tmp_path):
    def build(tf):
        for i in (0, 1, 0, 2):
            _sample_members(tf, i)

    idx = build_index(WebDatasetSource([_tar(tmp_path / "dup.tar", build)]), SCHEMA, policy=SKIP)
    assert len(idx) == 3 and idx.report.counts == {"duplicate_key": 1}


def test_dotdot_absolute_and_long_names_are_only_keys(tmp_path):
    long_dir = "d" * 120 + "/"

    def build(tf):
        _sample_members(tf, 0, prefix="../../")
        _sample_members(tf, 1, prefix="/abs/")
        _sample_members(tf, 2, prefix=long_dir)

    root = tmp_path / "in"
    root.mkdir()
    before = sorted(os.listdir(tmp_path))
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        src = WebDatasetSource([_tar(root / f"names{fmt}.tar", build, fmt)])
        idx = build_index(src, SCHEMA)
        keys = [src.load(tuple(loc))["__key__"] for loc in idx.locations]
        assert keys == ["../../000000", "/abs/000001", long_dir + "000002"]
    assert sorted(os.listdir(tmp_path)) == before  # nothing written anywhere


def test_zero_size_and_empty_shards(tmp_path):
    empty_file = tmp_path / "zero.tar"
    empty_file.write_bytes(b"")
    empty_tar = _tar(tmp_path / "empty.tar", lambda tf: None)
    good = write_shards(str(tmp_path / "good"), [4, 6], num_shards=1)
    idx = build_index(WebDatasetSource([str(empty_file), empty_tar] + good), SCHEMA, policy=SKIP)
    assert len(idx) == 2 and idx.report.counts == {"corrupt_shard": 1}  # zero bytes: no end marker


def test_truncated_member_data(tmp_path):
    path = write_shards(str(tmp_path), [30], num_shards=1)[0]
    data = open(path, "rb").read()
    open(path, "wb").write(data[: 512 + 100])  # header + part of the first member's data
    with pytest.raises(CorruptShardError, match="claims 368 bytes, only 100 left"):
        build_index(WebDatasetSource([path]), SCHEMA)


def test_odd_array_dtypes(tmp_path):
    bad = {1: np.array(["a", "b"]), 2: np.zeros(3, dtype=[("a", "<i4")]), 3: np.zeros(3, "M8[s]")}

    def extra(i, tf):
        if i == 4:  # big-endian ids: converted, indexed like the native ones
            add_member(tf, f"{i:06d}.input_ids.npy", _npy(token_ids(i, 7).astype(">i8")))
            return True
        if i in bad:
            add_member(tf, f"{i:06d}.input_ids.npy", _npy(bad[i]))
            return True
        return False

    paths = write_shards(str(tmp_path), [5] * 6, num_shards=1, extra=extra)
    src = WebDatasetSource(paths)
    idx = build_index(src, SCHEMA, policy=SKIP)
    assert idx.report.counts == {"bad_sample": 3} and idx.lengths.tolist() == [5, 7, 5]
    assert src.load(tuple(idx.locations[1]))["input_ids"].tolist() == token_ids(4, 7).tolist()
    assert {e.where.rsplit(":", 1)[1] for e in idx.report.examples} == {
        "000001",
        "000002",
        "000003",
    }


# ---- 14. configuration mistakes are never counted
# --------------------------------------------------
def test_missing_shards_are_a_config_error_before_scanning(tmp_path):
    good = write_shards(str(tmp_path), [4, 6, 8], num_shards=3)
    with pytest.raises(MissingShardError, match=r"2 of 5 shard file\(s\) do not exist") as exc:
        build_index(WebDatasetSource(str(tmp_path / "shard-{000..004}.tar")), SCHEMA, policy=SKIP)
    assert isinstance(exc.value, ConfigError) and "shard-003.tar" in str(exc.value)
    with pytest.raises(MissingShardError):
        build_index(WebDatasetSource(good + [str(tmp_path / "nope.tar")]), SCHEMA, policy=SKIP)
    with pytest.raises(MissingShardError, match="folders"):
        build_index(WebDatasetSource(good + [str(tmp_path)]), SCHEMA, policy=SKIP)
    with pytest.raises(ConfigError, match="urls"):
        WebDatasetSource([])


def test_a_bug_in_a_transform_propagates_and_is_never_counted(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(6), num_shards=1)

    def buggy(sample):
        return sample.no_such_attribute  # AttributeError: a bug, not bad data

    def config_mistake(sample):
        raise ConfigError("tokenizer: not configured")

    with pytest.raises(AttributeError):
        build_index(WebDatasetSource(paths, transform=buggy), SCHEMA, policy=SKIP)
    with pytest.raises(ConfigError, match="tokenizer"):
        build_index(WebDatasetSource(paths, transform=config_mistake), SCHEMA, policy=SKIP)


def test_a_bug_in_a_user_decoder_propagates(tmp_path):
    def extra(i, tf):
        if i == 0:
            add_member(tf, f"{i:06d}.meta.bin", b"\x00")
        return False

    paths = write_shards(str(tmp_path), [4, 5], num_shards=1, extra=extra)
    with pytest.raises(ZeroDivisionError):
        build_index(
            WebDatasetSource(paths, decoders={"bin": lambda b: 1 // b[0]}), SCHEMA, policy=SKIP
        )
    idx = build_index(
        WebDatasetSource(paths, decoders={"bin": lambda b: int("x")}), SCHEMA, policy=SKIP
    )
    assert len(idx) == 1 and idx.report.counts == {"bad_sample": 1}


@pytest.mark.slow
def test_typed_errors_from_index_workers_keep_their_type(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(8), num_shards=2)

    def config_mistake(sample):
        raise ConfigError("tokenizer: not configured")

    with pytest.raises(ConfigError, match="tokenizer"):
        build_index(WebDatasetSource(paths, transform=config_mistake), SCHEMA, num_workers=2)


# ---- 2, 3. images and arrays
# -----------------------------------------------------------------------
def _eps() -> bytes:
    return b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n%%EOF\n"


def test_postscript_named_jpg_never_reaches_the_eps_plugin(monkeypatch):
    from PIL import EpsImagePlugin

    reached = []
    monkeypatch.setattr(
        EpsImagePlugin.EpsImageFile,
        "_open",
        lambda self: reached.append(1) or (_ for _ in ()).throw(SyntaxError("EPS plugin reached")),
    )
    with pytest.raises(BadSampleError, match="corrupt_image") as exc:
        decode_member("k", "0.jpg", _eps())
    assert exc.value.reason == "corrupt_image"
    with pytest.raises(MediaError) as exc2:
        decode_image(_eps(), sample="k", name="0.jpg")
    assert exc2.value.reason == "corrupt_image" and "JPEG, PNG" in exc2.value.expected
    assert reached == []


@pytest.fixture(scope="module")
def png_bomb() -> bytes:
    """A 13000 x 13000 PNG of a few hundred KB."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (13000, 13000)).save(buf, format="PNG")
    return buf.getvalue()


def test_a_png_bomb_is_refused_before_decoding(png_bomb):
    assert len(png_bomb) < 400_000
    with pytest.raises(BadSampleError, match="169000000 pixels") as exc:
        decode_member("k", "png", png_bomb)
    assert exc.value.reason == "corrupt_image"
    with pytest.raises(MediaError, match="max_image_pixels") as exc2:
        decode_image(png_bomb, sample="k", name="0.png")
    assert exc2.value.reason == "corrupt_image"
    small = DecodeLimits(max_image_pixels=10)
    from PIL import Image

    tiny = io.BytesIO()
    Image.new("RGB", (4, 4)).save(tiny, format="PNG")
    with pytest.raises(MediaError):
        decode_image(tiny.getvalue(), sample="k", name="0.png", limits=small)
    with pytest.raises(MediaError):
        decode_image(Image.new("RGB", (4, 4)), sample="k", name="0.png", limits=small)
    assert decode_image(tiny.getvalue(), sample="k", name="0.png").size == (4, 4)


def _npz_of(entries: dict[str, tuple[bytes, int]]) -> bytes:
    """An npz whose entry ``name`` is ``header`` followed by ``zeros`` zero bytes, deflated."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, (header, zeros) in entries.items():
            with zf.open(name, "w", force_zip64=True) as f:
                f.write(header)
                chunk = b"\0" * (1 << 22)
                for _ in range(zeros // len(chunk)):
                    f.write(chunk)
                f.write(b"\0" * (zeros % len(chunk)))
    return buf.getvalue()


def _npy_header(shape, dtype="<u1") -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": dtype, "fortran_order": False, "shape": shape}
    )
    return buf.getvalue()


def test_an_npz_bomb_is_refused_before_inflating():
    n = 300 << 20  # 300 MiB of zeros: ~300 KB deflated
    bomb = _npz_of({"a.npy": (_npy_header((n,)), n)})
    assert len(bomb) < 2 << 20
    with pytest.raises(BadSampleError, match="array_too_large") as exc:
        decode_member("k", "npz", bomb)
    assert exc.value.reason == "array_too_large"
    ok = decode_member("k", "npz", bomb, limits=DecodeLimits(max_array_bytes=n + 1024))
    assert ok["a"].shape == (n,)
    del ok


def test_an_npy_header_that_lies_is_refused_before_allocating():
    liar = _npy_header((10**12,), "<i8") + b"\0" * 80
    with pytest.raises(BadSampleError) as exc:
        decode_member("k", "input_ids.npy", liar)
    assert exc.value.reason == "array_too_large"
    short = _npy_header((100,), "<i8") + b"\0" * 80  # under the cap, but the data is short
    with pytest.raises(BadSampleError, match="npy"):
        decode_member("k", "input_ids.npy", short)
    # an npz whose entries together exceed the cap, each alone under it
    two = _npz_of({"a.npy": (_npy_header((200,)), 200), "b.npy": (_npy_header((200,)), 200)})
    with pytest.raises(BadSampleError, match="array_too_large"):
        decode_member("k", "npz", two, limits=DecodeLimits(max_array_bytes=300))


def test_odd_member_contents():
    with pytest.raises(BadSampleError, match="RecursionError"):
        decode_member("k", "json", b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(BadSampleError, match="UnicodeDecodeError"):
        decode_member("k", "txt", b"\xff\xfe\xfa")
    with pytest.raises(BadSampleError, match="not a .npy array"):
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            zf.writestr("x.pkl", pickle.dumps(1))
        decode_member("k", "npz", buf.getvalue())
    with pytest.raises(BadSampleError, match="BadZipFile"):
        decode_member("k", "npz", b"PK\x03\x04 not really")
    with pytest.raises(ConfigError, match="max_image_pixels"):
        DecodeLimits(max_image_pixels=0)


# ---- 4. a stalled read
# -----------------------------------------------------------------------------
def _release(fifo: str) -> None:
    """Let a reader blocked opening ``fifo`` go (open the write side without blocking, close it)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_a_fifo_shard_times_out_naming_the_shard(tmp_path):
    fifo = str(tmp_path / "stuck.tar")
    os.mkfifo(fifo)
    good = write_shards(str(tmp_path / "good"), [4, 6], num_shards=1)
    try:
        t0 = time.monotonic()
        with pytest.raises(ShardTimeoutError, match="stuck.tar.*no data for 1 s") as exc:
            build_index(WebDatasetSource([fifo], read_timeout=1.0), SCHEMA)
        assert time.monotonic() - t0 < 10 and isinstance(exc.value, CorruptShardError)
        _release(fifo)
        idx = build_index(WebDatasetSource([fifo] + good, read_timeout=1.0), SCHEMA, policy=SKIP)
        assert len(idx) == 2 and idx.report.counts == {"shard_timeout": 1}
    finally:
        for _ in range(3):
            _release(fifo)


def test_a_read_that_stalls_mid_shard_times_out(tmp_path):
    """A writer that sends one sample's bytes, then stops (a hung mount mid-file)."""
    fifo = str(tmp_path / "slow.tar")
    os.mkfifo(fifo)
    good = write_shards(str(tmp_path / "good"), [4, 6], num_shards=1)
    head = open(good[0], "rb").read()[:1024]
    stop = threading.Event()

    def writer():
        fd = os.open(fifo, os.O_WRONLY)
        os.write(fd, head)
        stop.wait(20)
        os.close(fd)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        with pytest.raises(ShardTimeoutError, match="slow.tar"):
            build_index(WebDatasetSource([fifo], read_timeout=1.0), SCHEMA)
    finally:
        stop.set()
        t.join(5)


def test_a_corrupt_tar_gz_is_a_corrupt_shard_at_once_not_a_stall(tmp_path):
    """Corrupt deflate data raises zlib.error in the reader thread: it must reach the caller as an
    unreadable shard, not leave it waiting out ``read_timeout``."""
    import gzip
    import time

    good = write_shards(str(tmp_path / "good"), [40, 60, 50], num_shards=1)
    blob = bytearray(gzip.compress(open(good[0], "rb").read()))
    for i in range(
        20, 60
    ):  # scramble the deflate stream near its start: zlib.error in the reader thread
        blob[i] ^= 0xFF
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(bytes(blob))
    t0 = time.monotonic()
    idx = build_index(
        WebDatasetSource([str(good[0]), str(bad)], read_timeout=30.0),
        SCHEMA,
        policy=BadDataPolicy(on_error="skip", warn=False),
    )
    assert time.monotonic() - t0 < 20
    assert "corrupt_shard" in idx.report.counts and "shard_timeout" not in idx.report.counts


# ---- 6. optional fields present in some samples only
# ------------------------------------------------
@pytest.mark.parametrize("field", ["loss_mask", "labels"])
def test_a_mix_of_samples_with_and_without_an_optional_field_is_refused_at_indexing(field):
    lengths = sample_lengths(24, seed=3)

    def transform(row):
        ids = torch.tensor(row["input_ids"])
        out = {"input_ids": ids}
        if row["id"] % 3 == 0:
            out[field] = torch.ones(len(ids)) if field == "loss_mask" else torch.roll(ids, -1)
        return out

    src = HFSource(datasets.Dataset.from_dict(hf_rows(lengths)), transform=transform)
    with pytest.raises(BadSampleError, match="field_mismatch") as exc:
        build_index(src, SCHEMA)
    assert exc.value.reason == "field_mismatch" and exc.value.field == field
    loader = PackedLoader(
        src, schema=SCHEMA, layout=ParallelLayout(), token_budget=256, bad_data=SKIP
    )
    assert loader.report.counts == {"field_mismatch": 16} and len(loader.index) == 8
    seen = sum(len(b["sample_index"]) for b in loader)  # every micro-batch collates: nothing mixed
    assert seen == 8


# ---- 15. crafted index files
# ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_index(tmp_path_factory):
    src = HFSource(datasets.Dataset.from_dict(hf_rows(sample_lengths(10))))
    return build_index(src, SCHEMA)


def _save_npz(path, **arrays) -> str:
    np.savez(path, **arrays)
    return str(path)


class _Boom:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_crafted_index_files_are_index_file_errors_naming_the_key(tmp_path, good_index):
    good_index.save(str(tmp_path / "ok.npz"))
    z = dict(np.load(tmp_path / "ok.npz"))
    assert len(SampleIndex.load(str(tmp_path / "ok.npz"))) == 10
    flag = tmp_path / "unpickled"
    cases = {
        "not_zip": ("not an .npz index", None),
        "missing": ("missing \\['shards'\\]", {k: v for k, v in z.items() if k != "shards"}),
        "extra": ("unknown \\['evil'\\]", {**z, "evil": np.zeros(1)}),
        "float_lengths": (
            "'lengths': expected an integer",
            {**z, "lengths": z["lengths"].astype(float)},
        ),
        "flat_locations": (
            "'locations': expected an integer array of rank 2",
            {**z, "locations": z["locations"].ravel()},
        ),
        "short_shards": ("'shards': .* with 10 rows", {**z, "shards": z["shards"][:3]}),
        "negative": ("lengths must be >= 1", {**z, "lengths": -z["lengths"]}),
        "report_text": ("'report': not JSON", {**z, "report": np.frombuffer(b"{nope", np.uint8)}),
        "report_shape": (
            "'report': expected",
            {**z, "report": np.frombuffer(b'{"counts": [1]}', np.uint8)},
        ),
        "media_int": ("'media': expected a bool", {**z, "media": np.ones(10, np.int64)}),
        "dims_list": ("'dims': expected", {**z, "dims": np.frombuffer(b"[1, 2]", np.uint8)}),
        "pickle": (
            "'lengths' unreadable",
            {**z, "lengths": np.array([_Boom(str(flag))], dtype=object)},
        ),
    }
    seen = 0
    for name, (says, arrays) in cases.items():
        path = tmp_path / f"{name}.npz"
        if arrays is None:
            path.write_text("hello")
        elif name == "pickle":
            np.savez(path, **arrays)  # object arrays are pickled (the default of every numpy)
        else:
            _save_npz(path, **arrays)
        with pytest.raises(IndexFileError, match=says):
            SampleIndex.load(str(path))
        seen += 1
    assert seen == len(cases) and not flag.exists()
    arr = tmp_path / "bare.npy"
    np.save(arr, np.arange(3))
    with pytest.raises(IndexFileError, match="bare array"):
        SampleIndex.load(str(arr))
    with pytest.raises(IndexFileError, match="no such file"):
        SampleIndex.load(str(tmp_path / "absent.npz"))


def test_an_index_of_other_data_is_refused_before_any_batch(tmp_path):
    lengths = sample_lengths(12)
    wds = WebDatasetSource(write_shards(str(tmp_path), lengths, num_shards=3))
    idx = build_index(wds, SCHEMA)
    kw = {"schema": SCHEMA, "layout": ParallelLayout(), "token_budget": 128}
    fewer = WebDatasetSource(wds.urls[:2])
    with pytest.raises(IndexFileError, match="column 0: values in \\[0, 2\\], this source has 2"):
        PackedLoader(fewer, **kw, indexing=IndexOptions(prebuilt=idx)).prepare()
    hf = HFSource(datasets.Dataset.from_dict(hf_rows(lengths)))
    with pytest.raises(IndexFileError, match="expected \\[N, 1\\] for HFSource"):
        PackedLoader(hf, **kw, indexing=IndexOptions(prebuilt=idx)).prepare()
    short = HFSource(datasets.Dataset.from_dict(hf_rows(lengths[:5])))
    with pytest.raises(IndexFileError, match="this source has 5"):
        PackedLoader(short, **kw, indexing=IndexOptions(prebuilt=build_index(hf, SCHEMA))).prepare()


# ---- 15. edited resume states, seeds, epochs
# -------------------------------------------------------
@pytest.fixture(scope="module")
def small_loader():
    src = HFSource(datasets.Dataset.from_dict(hf_rows(sample_lengths(40, seed=2))))
    return PackedLoader(src, schema=SCHEMA, layout=ParallelLayout(), token_budget=128)


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda s: {**s, "epoch": 2.7}, "'epoch': expected an int >= 0, got 2.7"),
        (lambda s: {**s, "epoch": "3"}, "'epoch': expected an int >= 0, got '3'"),
        (lambda s: {**s, "position": True}, "'position': expected an int >= 0, got True"),
        (lambda s: {**s, "position": float("inf")}, "'position': expected an int >= 0, got inf"),
        (lambda s: {**s, "epoch": -1}, "'epoch': expected an int >= 0, got -1"),
        (lambda s: {**s, "version": True}, "'version'"),
        (lambda s: {**s, "config": [1]}, "'config': expected an object"),
        (lambda s: {k: v for k, v in s.items() if k != "data"}, "missing key\\(s\\) \\['data'\\]"),
        (lambda s: {**s, "position": 10**6}, "'position': 1000000 is past the end of epoch 0"),
        (lambda s: json.dumps(s).replace('"position": 0', '"position": Infinity'), "not JSON text"),
        (lambda s: json.dumps(s).replace('"seed": 0', '"seed": NaN'), "not JSON text"),
        (
            lambda s: {**s, "config": {**s["config"], "seed": float("nan")}},
            "'config.seed': a non-finite",
        ),
        (lambda s: "{not json", "not JSON text"),
        (lambda s: b"\xff\xfe", "not UTF-8"),
    ],
)
def test_edited_states_are_refused_naming_the_key(small_loader, edit, says):
    state = small_loader.state_dict()
    assert state["position"] == 0 and state["config"]["seed"] == 0
    with pytest.raises(ResumeError, match=says):
        small_loader.load_state_dict(edit(state))


def test_the_untouched_state_still_loads(small_loader):
    state = json.dumps(small_loader.state_dict())
    small_loader.load_state_dict(state)
    assert LoaderState.from_dict(state).position == 0


def test_seed_and_epoch_must_be_non_negative_ints(small_loader):
    src = small_loader.source
    for seed in (-1, 2.7, "3", True):  # never coerced
        with pytest.raises(PlanError, match="seed: expected an int >= 0"):
            PackedLoader(
                src,
                schema=SCHEMA,
                layout=ParallelLayout(),
                token_budget=128,
                seed=seed,
                indexing=IndexOptions(prebuilt=small_loader.index),
            )
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(PlanError, match="epoch"):
            small_loader.set_epoch(bad)


def test_every_error_here_is_a_prealign_error():
    for cls in (IndexFileError, MissingShardError, ShardTimeoutError, ResumeError, PlanError):
        assert issubclass(cls, PrealignError)
    assert issubclass(MissingShardError, ConfigError) and issubclass(IndexFileError, ConfigError)
    assert not issubclass(
        ShardTimeoutError, ConfigError
    )  # a stall is counted under skip, like a corrupt shard
