"""The one ``.npy`` header parser and ``.npz`` reader (issue #16): equal to ``numpy.lib.format`` on
every valid array of an accepted dtype, shape and order; hostile headers and archives are typed
errors; every call site (tar members, header-only lengths, sidecars) goes through it, parsing a
member's header once."""

from __future__ import annotations

import io
import pickle
import struct
import zipfile

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prealign.loaders.errors import BadSampleError, StaleIndexError
from prealign.loaders.index.sidecar import parse_sidecar
from prealign.loaders.sources import npy
from prealign.loaders.sources.header_lengths import HeaderError, npy_header
from prealign.loaders.sources.npy import (
    ACCEPTED_DTYPES,
    MAX_HEADER_BYTES,
    ArrayTooLarge,
    NpyFormatError,
    parse_npy_header,
    read_npy,
    read_npz,
)
from prealign.loaders.sources.tar_decode import DecodeLimits, decode_member
from tests.conftest import examples

DTYPES = sorted(ACCEPTED_DTYPES, key=str)
BIG = 1 << 40


def _save(arr: np.ndarray, version=None) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, version=version, allow_pickle=False)
    return buf.getvalue()


def _header(text: str, version=(1, 0)) -> bytes:
    """A raw ``.npy`` header of ``text`` (padded and ended with a newline as numpy does)."""
    body = text.encode("latin1")
    prefix = 10 if version == (1, 0) else 12
    body += b" " * (-(prefix + len(body) + 1) % 64) + b"\n"
    length = struct.pack("<H" if version == (1, 0) else "<I", len(body))
    return b"\x93NUMPY" + bytes(version) + length + body


@st.composite
def arrays(draw):
    """A random array of an accepted dtype, shape (0-5 dims, empty ones included) and memory
    order."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=5)))
    count = int(np.prod(shape, dtype=np.int64))
    # the bytes from a drawn seed: older hypothesis (the floor, 6.100) cannot draw binaries of up to
    # 50 KB
    raw = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).bytes(count * dtype.itemsize)
    arr = np.frombuffer(raw, dtype=dtype).reshape(shape)
    return np.asfortranarray(arr) if draw(st.booleans()) else arr.copy()


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    return (
        got.dtype == want.dtype
        and got.shape == want.shape
        and got.tobytes("A") == want.tobytes("A")
        and got.flags.f_contiguous == want.flags.f_contiguous
        and got.flags.c_contiguous == want.flags.c_contiguous
    )


# ---- equal to numpy on every valid input
# ------------------------------------------------------------
@examples(200)
@given(arr=arrays(), version=st.sampled_from([None, (1, 0), (2, 0)]))
def test_parser_and_reader_equal_numpy_on_valid_arrays(arr, version):
    data = _save(arr, version)
    fp = io.BytesIO(data)
    v = np.lib.format.read_magic(fp)
    reader = (
        np.lib.format.read_array_header_1_0 if v == (1, 0) else np.lib.format.read_array_header_2_0
    )
    shape, fortran, dtype = reader(fp)
    head = parse_npy_header(data)
    assert (head.shape, head.fortran_order, head.dtype, head.offset) == (
        shape,
        fortran,
        dtype,
        fp.tell(),
    )
    want = np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)
    got = read_npy(data, max_bytes=BIG)
    assert _same(got, want) and got.flags.writeable
    assert _same(read_npy(data, max_bytes=BIG, copy=False), want)
    assert npy_header(data[: head.offset]) == (shape, dtype)  # the header alone is enough


@examples(100)
@given(
    arr=arrays(),
    order=st.permutations(["descr", "fortran_order", "shape"]),
    spaced=st.booleans(),
    version=st.sampled_from([(1, 0), (2, 0)]),
)
def test_headers_numpy_does_not_write_go_through_numpys_reader_with_the_same_rules(
    arr, order, spaced, version
):
    """Other key orders and spacing (not the regex's): numpy's public header reader, then the same
    checks."""
    fortran = arr.flags.f_contiguous and not arr.flags.c_contiguous
    values = {
        "descr": np.lib.format.dtype_to_descr(arr.dtype),
        "fortran_order": fortran,
        "shape": arr.shape,
    }
    sep = ",  " if spaced else ","
    text = "{" + sep.join(f"{k!r}: {values[k]!r}" for k in order) + "}"
    data = _header(text, version) + arr.tobytes("A")
    want = np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)
    assert _same(read_npy(data, max_bytes=BIG), want)
    assert parse_npy_header(data).shape == want.shape


@examples(60)
@given(
    entries=st.dictionaries(
        st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True), arrays(), max_size=4
    ),
    compressed=st.booleans(),
)
def test_npz_reader_equals_numpy(entries, compressed):
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **entries)
    data = buf.getvalue()
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        want = {k: z[k] for k in z.files}
    for copy in (True, False):
        got = read_npz(data, max_bytes=BIG, copy=copy)
        assert sorted(got) == sorted(want) and all(_same(got[k], want[k]) for k in want)


@examples(300)
@given(
    body=st.binary(max_size=300),
    version=st.sampled_from([b"\x01\x00", b"\x02\x00"]),
    size=st.integers(0, 400),
)
def test_random_header_bytes_raise_only_the_typed_error(body, version, size):
    data = (
        b"\x93NUMPY" + version + size.to_bytes(2 if version == b"\x01\x00" else 4, "little") + body
    )
    try:
        head = parse_npy_header(data)
    except NpyFormatError:
        return
    assert head.dtype in ACCEPTED_DTYPES and all(d >= 0 for d in head.shape)


# ---- hostile headers
# ---------------------------------------------------------------------------------
def _pickled_object_array() -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    return buf.getvalue()


GOOD = _save(np.arange(6, dtype=np.int32).reshape(2, 3))
HOSTILE = {
    "empty": (b"", "magic"),
    "bad magic": (b"PK\x03\x04" + GOOD[4:], "magic"),
    "pickle stream": (pickle.dumps(np.arange(3)), "magic"),
    "version 3.0": (GOOD[:6] + b"\x03\x00" + GOOD[8:], "version"),
    "truncated length": (GOOD[:9], "magic"),
    "truncated header": (GOOD[:60], "truncated"),
    "header longer than the cap": (
        _header(
            "{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }" + " " * MAX_HEADER_BYTES,
            (2, 0),
        ),
        "at most 10000 bytes of header",
    ),
    "object dtype (a pickle)": (_pickled_object_array(), "unpickling"),
    "object field in a record": (
        _header("{'descr': [('a', '|O')], 'fortran_order': False, 'shape': (1,), }"),
        "unpickling",
    ),
    "string dtype": (_save(np.array(["ab", "c"])), "torch holds"),
    "bytes dtype": (
        _header("{'descr': '|S4', 'fortran_order': False, 'shape': (1,), }"),
        "torch holds",
    ),
    "record dtype": (
        _header("{'descr': [('a', '<i4'), ('b', '<f4')], 'fortran_order': False, 'shape': (1,), }"),
        "torch holds",
    ),
    "datetime dtype": (
        _header("{'descr': '<M8[s]', 'fortran_order': False, 'shape': (1,), }"),
        "torch holds",
    ),
    "float128": (
        _header("{'descr': '<f16', 'fortran_order': False, 'shape': (1,), }"),
        "torch holds",
    ),
    "unknown descr": (
        _header("{'descr': 'nonsense', 'fortran_order': False, 'shape': (1,), }"),
        "header dict",
    ),
    "huge dims": (
        _header("{'descr': '<i8', 'fortran_order': False, 'shape': (4294967296, 4294967296), }"),
        "shape",
    ),
    "huge dim": (
        _header(
            "{'descr': '<i8', 'fortran_order': False, 'shape': (99999999999999999999999999,), }"
        ),
        "shape",
    ),
    "negative dim": (
        _header("{'descr': '<i8', 'fortran_order': False, 'shape': (-1, 3), }"),
        "non-negative",
    ),
    "bool dim": (
        _header("{'descr': '<i8', 'fortran_order': False, 'shape': (True,), }"),
        "non-negative",
    ),
    "too many dims": (
        _header("{'descr': '<i8', 'fortran_order': False, 'shape': (" + "1, " * 33 + "), }"),
        "at most 32",
    ),
    "fortran_order not a bool": (
        _header("{'descr': '<i8', 'fortran_order': 1, 'shape': (1,), }"),
        "header dict",
    ),
    "extra key": (
        _header("{'descr': '<i8', 'fortran_order': False, 'shape': (1,), 'x': 1}"),
        "header dict",
    ),
    "a call": (
        _header(
            "{'descr': __import__('os').system('true'), 'fortran_order': False, 'shape': (1,)}"
        ),
        "header dict",
    ),
    "deep nesting": (
        _header("{'descr': " + "[" * 500 + "]" * 500 + ", 'fortran_order': False, 'shape': ()}"),
        "header dict",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_headers_are_typed_errors_at_every_call_site(case):
    data, match = HOSTILE[case]
    with pytest.raises(NpyFormatError, match=match) as exc:
        parse_npy_header(data, member="x.npy")
    assert (
        exc.value.member == "x.npy" and exc.value.field and exc.value.expected and exc.value.actual
    )
    with pytest.raises(HeaderError, match=match) as head:  # header-only lengths
        npy_header(data, field="input_ids.npy", sample="s/0001")
    assert (head.value.sample, head.value.field) == ("s/0001", "input_ids.npy")
    with pytest.raises(BadSampleError, match=match) as bad:  # tar member decoding
        decode_member("s/0001", "input_ids.npy", data)
    assert (bad.value.sample, bad.value.field) == ("s/0001", "input_ids.npy")
    with pytest.raises(StaleIndexError, match="shard-007.tar"):  # sidecars
        parse_sidecar(_npz_with("lengths.npy", data), shard="shard-007.tar")


def test_data_of_another_size_than_declared_is_refused():
    with pytest.raises(NpyFormatError, match="24 bytes for shape"):
        read_npy(GOOD[:-1], max_bytes=BIG)
    with pytest.raises(NpyFormatError, match="got 25 bytes"):
        read_npy(GOOD + b"\0", max_bytes=BIG)
    with pytest.raises(ArrayTooLarge, match="24 bytes"):
        read_npy(GOOD, max_bytes=23)


def test_each_member_header_is_parsed_once_and_never_by_numpy(monkeypatch):
    """The profile's hot spot: decoding a member no longer parses its header twice through numpy."""

    def boom(*a, **k):
        raise AssertionError("numpy's .npy reader called")

    for name in ("read_magic", "read_array_header_1_0", "read_array_header_2_0", "read_array"):
        monkeypatch.setattr(np.lib.format, name, boom)
    monkeypatch.setattr(
        npy, "_seen", {}
    )  # no header parsed by an earlier test: this one's parse is timed here
    arr = decode_member("k", "input_ids.npy", GOOD)
    assert arr.tolist() == [[0, 1, 2], [3, 4, 5]] and arr.flags.writeable
    assert npy_header(GOOD) == ((2, 3), np.dtype(np.int32))


def test_fortran_order_is_read_alike_everywhere():
    f = np.asfortranarray(np.arange(12, dtype=np.int64).reshape(3, 4))
    data = _save(f)
    assert npy_header(data) == ((3, 4), np.dtype(np.int64))
    got = decode_member("k", "x.npy", data)
    assert np.array_equal(got, f) and got.flags.f_contiguous
    assert np.array_equal(read_npz(_npz_with("x.npy", data), max_bytes=BIG)["x"], f)


# ---- hostile archives
# ----------------------------------------------------------------------------------
def _npz_with(name: str, data: bytes, compression=zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=compression) as zf:
        zf.writestr(name, data)
    return buf.getvalue()


def _two_entries_of_one_name() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf, pytest.warns(UserWarning, match="Duplicate"):
        zf.writestr("a.npy", GOOD)
        zf.writestr("a.npy", GOOD)
    return buf.getvalue()


def _overlapping() -> bytes:
    """Two directory entries pointing at the same local entry (the overlapping-files zip bomb)."""
    data = _npz_with("a.npy", GOOD)
    cd = data.index(b"PK\x01\x02")
    end = data.index(b"PK\x05\x06")
    entry = data[cd:end]
    second = entry.replace(b"a.npy", b"b.npy")
    eocd = bytearray(data[end:])
    struct.pack_into("<HHI", eocd, 8, 2, 2, len(entry) * 2)
    return data[:cd] + entry + second + bytes(eocd[:16]) + struct.pack("<I", cd) + bytes(eocd[20:])


def _patched(data: bytes, find: bytes, replace: bytes) -> bytes:
    assert find in data
    return data.replace(find, replace, 1)


def _encrypted() -> bytes:
    data = bytearray(_npz_with("a.npy", GOOD))
    cd = data.index(b"PK\x01\x02")
    data[cd + 8] |= 1  # the central directory's "encrypted" flag
    return bytes(data)


def _outside() -> bytes:
    data = bytearray(_npz_with("a.npy", GOOD))
    cd = data.index(b"PK\x01\x02")
    struct.pack_into(
        "<I", data, cd + 42, len(data) + 100
    )  # the local header's offset, past the end
    return bytes(data)


def _flipped() -> bytes:
    data = bytearray(_npz_with("a.npy", GOOD))
    data[data.index(GOOD) + len(GOOD) - 1] ^= 1
    return bytes(data)


HOSTILE_NPZ = {
    "not a zip": (b"PK\x03\x04 not really", zipfile.BadZipFile, "zip"),
    "not an npy entry": (_npz_with("x.pkl", pickle.dumps(1)), NpyFormatError, "not a .npy array"),
    "duplicate names": (_two_entries_of_one_name(), NpyFormatError, "duplicate entries"),
    "overlapping entries": (_overlapping(), NpyFormatError, "overlap"),
    "encrypted": (_encrypted(), NpyFormatError, "encrypted"),
    "outside the file": (_outside(), NpyFormatError, "local file header inside the file"),
    "crc mismatch": (_flipped(), NpyFormatError, "crc32"),
    "a pickle inside": (_npz_with("a.npy", _pickled_object_array()), NpyFormatError, "unpickling"),
    "short data inside": (
        _npz_with("a.npy", GOOD[:-4], zipfile.ZIP_DEFLATED),
        NpyFormatError,
        "24 bytes",
    ),
    "bomb": (
        _npz_with(
            "a.npy",
            _header("{'descr': '|u1', 'fortran_order': False, 'shape': (4000000,), }")
            + bytes(4_000_000),
            zipfile.ZIP_DEFLATED,
        ),
        ArrayTooLarge,
        "zip directory",
    ),
    "header larger than the directory": (
        _npz_with(
            "a.npy", _header("{'descr': '<i8', 'fortran_order': False, 'shape': (1000000,), }")
        ),
        ArrayTooLarge,
        "declares shape",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_NPZ))
def test_hostile_archives_are_typed_errors(case):
    data, error, match = HOSTILE_NPZ[case]
    with pytest.raises(error, match=match):
        read_npz(data, max_bytes=1 << 20)
    with pytest.raises(BadSampleError) as bad:
        decode_member("s/0001", "npz", data, limits=DecodeLimits(max_array_bytes=1 << 20))
    assert (bad.value.sample, bad.value.field) == ("s/0001", "npz")
    with pytest.raises(StaleIndexError, match="shard-007.tar"):
        parse_sidecar(data, shard="shard-007.tar")


def test_a_bomb_is_refused_before_inflating(monkeypatch):
    data = HOSTILE_NPZ["bomb"][0]
    monkeypatch.setattr(zipfile.ZipFile, "open", lambda *a, **k: pytest.fail("inflated"))
    with pytest.raises(ArrayTooLarge):
        read_npz(data, max_bytes=1 << 20)


def test_the_typed_error_pickles_as_itself():
    """Out of a DataLoader worker, with its member, field, expected and actual."""
    with pytest.raises(NpyFormatError) as exc:
        parse_npy_header(b"nope", member="a.npy")
    back = pickle.loads(pickle.dumps(exc.value))
    assert type(back) is NpyFormatError and str(back) == str(exc.value)
    assert (back.member, back.field, back.expected, back.actual) == (
        "a.npy",
        "magic",
        exc.value.expected,
        exc.value.actual,
    )
