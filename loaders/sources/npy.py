"""The one reader of ``.npy`` headers and ``.npz`` archives: tar members, header-only lengths and
sidecars.

    .npy bytes --parse_npy_header--> NpyHeader(shape, dtype, fortran_order, offset)  (per member)
               --npy_array-------->  ndarray (a view of the bytes, or a writable copy)
    .npz bytes --read_npz--------->  {name: ndarray}

Nothing is unpickled or evaluated. A header may declare: format version 1.0 or 2.0, at most
:data:`MAX_HEADER_BYTES` of header text, a dtype torch holds (:data:`ACCEPTED_DTYPES`: bool,
int8-64, uint8-64, float16-64, complex64/128, either byte order; never an object, string, record or
date dtype), C or Fortran order, at most :data:`MAX_NDIM` non-negative dims whose byte size fits in
an int64. The header ``np.save`` writes is matched by one regex; any other spelling goes through
numpy's own public header reader (``ast.literal_eval`` of the capped text), then through the same
checks. An ``.npz`` entry must be a ``.npy``, named once, lie inside the file without overlapping
another, declare at most what the caller allows (checked before anything is inflated) and match its
crc32.
"""

from __future__ import annotations

import functools
import io
import re
import struct
import tokenize
import zipfile
import zlib
from collections import Counter
from dataclasses import dataclass

import numpy as np

MAX_HEADER_BYTES = 10_000
"""Longest header text read (numpy's own default cap, ``max_header_size``)."""
MAX_NDIM = 32
"""Most dims a header may declare (numpy 1.x's limit)."""
MAX_DECLARED_BYTES = (1 << 63) - 1
"""Most bytes a shape may declare (its size must fit in an int64)."""
_SIZES = {"b": (1,), "i": (1, 2, 4, 8), "u": (1, 2, 4, 8), "f": (2, 4, 8), "c": (8, 16)}
ACCEPTED_DTYPES = frozenset(
    np.dtype(f"{order}{kind}{size}")
    for kind, sizes in _SIZES.items()
    for size in sizes
    for order in "<>"
)
"""Every dtype an ``.npy`` member may have (both byte orders)."""
_DESCR = {dt.str.encode(): dt for dt in ACCEPTED_DTYPES}  # the descr np.save writes -> dtype
_MAGIC = b"\x93NUMPY"
_HEADER = re.compile(
    rb"\{'descr': '([^'\\]{1,8})', 'fortran_order': (True|False), "
    rb"'shape': \(((?:(?:0|[1-9]\d{0,18}), ?)*(?:0|[1-9]\d{0,18})?)\), \} *\n"
)
_NUMPY_ERRORS = (
    ValueError,
    SyntaxError,
    TypeError,
    KeyError,
    IndexError,
    RecursionError,
    MemoryError,
    OverflowError,
    EOFError,
    tokenize.TokenError,
)  # what numpy's header reader raises on crafted text
# (tokenize.TokenError: its filter of Python 2 headers, on unbalanced brackets)
_CACHE_SIZE = 4096


class NpyFormatError(ValueError):
    """An ``.npy`` header or ``.npz`` archive that is malformed or declares something refused; names
    the member, the part of it (``field``), what was expected and what came."""

    def __init__(self, member: str, field: str, expected: str, actual: str):
        self.member, self.field, self.expected, self.actual = member, field, expected, actual
        super().__init__(f"{member}: {field}: expected {expected}, got {actual}")

    def __reduce__(self):  # pickles as itself (out of a DataLoader worker)
        return type(self), (self.member, self.field, self.expected, self.actual)


class ArrayTooLarge(Exception):
    """An array (or all entries of an archive) declares more bytes than the caller allows."""


@dataclass(frozen=True)
class NpyHeader:
    """What an ``.npy`` header declares; the data starts at ``offset``."""

    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool
    offset: int

    @functools.cached_property  # (headers are cached and shared: computed once each)
    def count(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of data the header declares."""
        return self.count * self.dtype.itemsize


_seen: dict[
    bytes, NpyHeader
] = {}  # header bytes -> parsed: token arrays repeat their lengths, so most hit


def parse_npy_header(data: bytes | memoryview, *, member: str = "npy") -> NpyHeader:
    """The header of ``.npy`` bytes (the data itself is not needed), every rule of the module
    checked. Raises :class:`NpyFormatError` naming ``member``.

    >>> buf = io.BytesIO(); np.save(buf, np.zeros((2, 3), np.int32))
    >>> h = parse_npy_header(buf.getvalue()); h.shape, h.dtype, h.fortran_order, h.offset
    ((2, 3), dtype('int32'), False, 128)
    """
    bad = functools.partial(NpyFormatError, member)
    head = bytes(data[:12])
    if len(head) < 10 or head[:6] != _MAGIC:
        raise bad(
            "magic",
            "an .npy header (b'\\x93NUMPY' then a version)",
            f"{len(data)} bytes starting {head[:8]!r}",
        )
    version = (head[6], head[7])
    if version not in ((1, 0), (2, 0)):
        raise bad("version", "format version 1.0 or 2.0", f"{version[0]}.{version[1]}")
    prefix = 10 if version == (1, 0) else 12
    if len(head) < prefix:
        raise bad("header", "a complete header length", f"{len(data)} bytes")
    size = int.from_bytes(head[8:prefix], "little")
    if size > MAX_HEADER_BYTES:
        raise bad("header", f"at most {MAX_HEADER_BYTES} bytes of header", f"{size} bytes")
    if len(data) < prefix + size:
        raise bad("header", f"{size} bytes of header", f"{len(data) - prefix} bytes (truncated)")
    raw = bytes(data[: prefix + size])
    hit = _seen.get(raw)
    if hit is not None:
        return hit
    m = _HEADER.fullmatch(raw, prefix)
    if m is not None and m.group(1) in _DESCR:
        shape = tuple(int(d) for d in m.group(3).split(b",") if d.strip())
        dtype, fortran = _DESCR[m.group(1)], m.group(2) == b"True"
    else:  # any other spelling: numpy's reader (public, capped, no pickle), then the same checks
        reader = (
            np.lib.format.read_array_header_1_0
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0
        )
        try:
            shape, fortran, dtype = reader(io.BytesIO(raw[8:]), max_header_size=MAX_HEADER_BYTES)
        except _NUMPY_ERRORS as exc:
            raise bad(
                "header",
                "a header dict {'descr', 'fortran_order', 'shape'}",
                f"{type(exc).__name__}: {exc}",
            ) from None
    if dtype.hasobject:
        raise bad(
            "descr",
            "a dtype without objects (object arrays need unpickling, which is never done)",
            f"dtype {dtype}",
        )
    if (
        dtype.fields is not None
        or dtype.subdtype is not None
        or dtype.itemsize not in _SIZES.get(dtype.kind, ())
    ):
        raise bad(
            "descr",
            "a dtype torch holds (bool, int8-64, uint8-64, float16-64, complex64/128)",
            f"dtype {dtype}",
        )
    if not isinstance(fortran, bool):
        raise bad("fortran_order", "True or False", repr(fortran))
    if len(shape) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
        raise bad("shape", f"at most {MAX_NDIM} non-negative int dims", repr(shape))
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= max(d, 1)
    if nbytes > MAX_DECLARED_BYTES:
        raise bad(
            "shape",
            f"at most {MAX_DECLARED_BYTES} bytes",
            f"shape {shape} {dtype} ({nbytes} bytes)",
        )
    out = NpyHeader(shape=tuple(shape), dtype=dtype, fortran_order=fortran, offset=prefix + size)
    if len(_seen) >= _CACHE_SIZE:
        _seen.clear()
    _seen[raw] = out
    return out


def npy_array(
    data: bytes | memoryview, header: NpyHeader, *, member: str = "npy", copy: bool = True
) -> np.ndarray:
    """The array of ``.npy`` bytes whose header is ``header`` (exactly its declared bytes must
    follow): a writable copy, or with ``copy=False`` a view of ``data``. Raises
    :class:`NpyFormatError`."""
    have = len(data) - header.offset
    if have != header.nbytes:
        raise NpyFormatError(
            member,
            "data",
            f"{header.nbytes} bytes for shape {header.shape} {header.dtype}",
            f"{have} bytes",
        )
    flat = np.frombuffer(data, header.dtype, header.count, header.offset)
    arr = flat.reshape(header.shape[::-1]).T if header.fortran_order else flat.reshape(header.shape)
    return arr.copy(order="K") if copy else arr


def read_npy(
    data: bytes | memoryview, *, max_bytes: int, member: str = "npy", copy: bool = True
) -> np.ndarray:
    """``.npy`` bytes -> array, its header parsed once; :class:`ArrayTooLarge` if it declares more
    than ``max_bytes`` (before anything is allocated), :class:`NpyFormatError` if malformed."""
    header = parse_npy_header(data, member=member)
    if header.nbytes > max_bytes:
        raise ArrayTooLarge(
            f"{member} declares shape {header.shape} {header.dtype} = {header.nbytes} bytes, over "
            f"the {max_bytes} bytes allowed"
        )
    return npy_array(data, header, member=member, copy=copy)


def read_npz(
    data: bytes,
    *,
    max_bytes: int,
    member: str = "npz",
    copy: bool = True,
    names: frozenset[str] | set[str] | None = None,
) -> dict[str, np.ndarray]:
    """``.npz`` bytes -> ``{name: array}``. The entries' sizes in the zip directory, then each one's
    ``.npy`` header, are checked against ``max_bytes`` (all entries together) before anything is
    inflated (:class:`ArrayTooLarge`); every entry must be a uniquely named ``.npy`` inside the
    file, not overlapping another, unencrypted, of exactly its declared size and crc32
    (:class:`NpyFormatError`; a broken zip directory is ``zipfile.BadZipFile``). A stored entry with
    ``copy=False`` is a view of ``data``. ``names``: the only entry names (without ``.npy``) a
    format has; any other, or more entries than that, is refused
    before any entry is looked at (a crafted archive of 100k entries costs one pass over its
    directory)."""
    bad = functools.partial(NpyFormatError, member)
    view = memoryview(data)
    out: dict[str, np.ndarray] = {}
    stored = _plain_stored_entries(data, view, max_bytes, names)
    if (
        stored is not None
    ):  # what np.savez writes, the checks below passed: no zipfile (a sidecar per shard)
        for name, raw in stored:
            out[name[:-4]] = arr = _entry_array(raw, name, member, max_bytes, copy)
            max_bytes -= arr.nbytes
        return out
    declared = _declared_entries(data)
    if (
        names is not None and declared is not None and declared > len(names)
    ):  # before the directory is parsed
        raise bad("entries", f"at most the entries {sorted(names)}", f"{declared} entries")
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        infos = zf.infolist()
        if names is not None and (
            len(infos) > len(names)
            or any(i.filename[:-4] not in names or not i.filename.endswith(".npy") for i in infos)
        ):
            other = [
                i.filename
                for i in infos
                if i.filename[:-4] not in names or not i.filename.endswith(".npy")
            ]
            raise bad(
                "entries",
                f"at most the entries {sorted(names)}",
                f"{len(infos)} entries" + (f", unknown ones such as {other[:3]}" if other else ""),
            )
        twice = sorted(name for name, n in Counter(i.filename for i in infos).items() if n > 1)
        if twice:
            raise bad("entries", "each entry name once", f"duplicate entries {twice}")
        declared = sum(i.file_size for i in infos)
        if declared > max_bytes:
            raise ArrayTooLarge(
                f"{member} entries declare {declared} bytes in the zip directory, over the "
                f"{max_bytes} bytes allowed"
            )
        starts = {}
        for info in infos:  # every entry checked before any is inflated
            name = info.filename
            if not name.endswith(".npy"):
                raise bad(
                    name, "entries that are .npy arrays", f"entry {name!r} is not a .npy array"
                )
            if info.flag_bits & 1:
                raise bad(name, "an unencrypted entry", "an encrypted entry")
            at = info.header_offset
            local = view[at : at + 30] if at >= 0 else b""
            if len(local) < 30 or local[:4] != b"PK\x03\x04":
                raise bad(name, "a local file header inside the file", f"none at offset {at}")
            starts[name] = (
                at
                + 30
                + int.from_bytes(local[26:28], "little")
                + int.from_bytes(local[28:30], "little")
            )
            if starts[name] + info.compress_size > len(data):
                raise bad(
                    name,
                    f"its {info.compress_size} bytes inside the file ({len(data)} bytes)",
                    f"bytes {starts[name]}..{starts[name] + info.compress_size}",
                )
        spans = sorted(
            (i.header_offset, starts[i.filename] + i.compress_size, i.filename) for i in infos
        )
        for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
            if begin < end:
                raise bad(second, "entries that do not overlap", f"its bytes overlap {first!r}")
        for info in infos:
            name, start = info.filename, starts[info.filename]
            if info.compress_type == zipfile.ZIP_STORED:
                if info.compress_size != info.file_size:
                    raise bad(name, f"{info.file_size} stored bytes", f"{info.compress_size}")
                raw = view[start : start + info.file_size]
                if zlib.crc32(raw) != info.CRC:
                    raise bad(name, f"crc32 {info.CRC:08x}", f"{zlib.crc32(raw):08x}")
            else:
                with zf.open(
                    info
                ) as f:  # inflates at most the directory's size (+1 to see more): crc checked
                    raw = f.read(info.file_size + 1)
                if len(raw) != info.file_size:
                    raise bad(
                        name, f"{info.file_size} bytes inflated (its directory size)", f"{len(raw)}"
                    )
            out[name[:-4]] = arr = _entry_array(raw, name, member, max_bytes, copy)
            max_bytes -= arr.nbytes
    return out


def _entry_array(raw, name: str, member: str, max_bytes: int, copy: bool) -> np.ndarray:
    """The array of one ``.npz`` entry's bytes, refused (:class:`ArrayTooLarge`) when its header
    declares more than the ``max_bytes`` left of the archive's allowance."""
    header = parse_npy_header(raw, member=name)
    if header.nbytes > max_bytes:
        raise ArrayTooLarge(
            f"{name} declares shape {header.shape} {header.dtype} = {header.nbytes} "
            f"bytes, over the {max_bytes} bytes left of {member}'s allowance"
        )
    return npy_array(raw, header, member=name, copy=copy)


_EOCD = struct.Struct(
    "<4sHHHHIIH"
)  # end of central directory: signature, disks, entries, size, offset, comment
_ENTRY = struct.Struct(
    "<4s2xHHH4xIIIHHH8xI"
)  # central directory entry, the fields read_npz checks (the version needed to extract on)


@dataclass(frozen=True)
class StoredEntry:
    """One entry of a plain stored ``.npz`` (:func:`plain_npz_entries`): its ``name``, the offsets
    of its local header (``local``), of its ``.npy`` bytes (``start..end``) and of its record in the
    zip directory (``directory``), and its ``crc`` (crc32)."""

    name: str
    local: int
    start: int
    end: int
    directory: int
    crc: int


def _plain_stored_entries(
    data: bytes, view: memoryview, max_bytes: int, names
) -> list[tuple[str, memoryview]] | None:
    """``[(entry name, its bytes)]`` of :func:`plain_npz_entries`, None where that is None."""
    entries = plain_npz_entries(data, max_bytes, names)
    return None if entries is None else [(e.name, view[e.start : e.end]) for e in entries]


def plain_npz_entries(data: bytes, max_bytes: int, names) -> list[StoredEntry] | None:
    """The entries in directory order when ``data`` is a plain zip of stored ``.npy`` entries (no
    comment, no prefix, no zip64 locator, no extra field in the directory, ASCII names without NUL,
    a version ``zipfile`` implements, each entry once, unencrypted, inside the file, not
    overlapping, of its recorded crc32; all of them within ``max_bytes`` and ``names``): what
    ``np.savez`` writes, parsed with one ``struct`` call per entry. None for anything else, which
    :func:`read_npz` then reads with ``zipfile`` and all its checks (and names what is wrong), so
    this path accepts nothing that one refuses and reads what it reads. (A local header's extra
    field, 20 bytes from ``np.savez``, is skipped unread, as ``zipfile`` does.)"""
    at = len(data) - _EOCD.size
    if at < 0:
        return None
    sig, disk, cd_disk, here, count, cd_size, cd_at, comment = _EOCD.unpack_from(data, at)
    if (
        sig != b"PK\x05\x06"
        or disk
        or cd_disk
        or here != count
        or comment
        or cd_at + cd_size != at
        or (names is not None and count > len(names))
        or (at >= 20 and data[at - 20 : at - 16] == b"PK\x06\x07")  # zipfile follows zip64
    ):
        return None
    entries, pos, total, seen = [], cd_at, 0, set()
    for _ in range(count):
        if pos + _ENTRY.size > at:
            return None
        sig, version, flags, method, crc, csize, size, nlen, elen, clen, local = _ENTRY.unpack_from(
            data, pos
        )
        name_bytes = data[pos + _ENTRY.size : pos + _ENTRY.size + nlen]
        directory = pos
        pos += _ENTRY.size + nlen + elen + clen
        if (
            sig != b"PK\x01\x02"
            or version > zipfile.MAX_EXTRACT_VERSION  # zipfile: NotImplementedError
            or elen  # zipfile parses an extra field (and refuses a corrupt one)
            or b"\x00" in name_bytes  # zipfile cuts a name at NUL
            or flags & 1
            or method != zipfile.ZIP_STORED
            or csize != size
            or 0xFFFFFFFF in (size, local)
            or not name_bytes.isascii()
            or pos > at
        ):
            return None
        name = name_bytes.decode()
        if (
            not name.endswith(".npy")
            or name in seen
            or (names is not None and name[:-4] not in names)
            or data[local : local + 4] != b"PK\x03\x04"
            or local + 30 > len(data)
        ):
            return None
        seen.add(name)
        start = (
            local
            + 30
            + int.from_bytes(data[local + 26 : local + 28], "little")
            + int.from_bytes(data[local + 28 : local + 30], "little")
        )
        total += size
        entries.append(StoredEntry(name, local, start, start + size, directory, crc))
    if pos != at or total > max_bytes:
        return None
    spans = sorted((e.local, e.end) for e in entries)
    if (
        any(begin < end for (_, end), (begin, _) in zip(spans, spans[1:]))
        or spans
        and spans[-1][1] > len(data)
    ):
        return None
    view = memoryview(data)
    if any(zlib.crc32(view[e.start : e.end]) != e.crc for e in entries):
        return None
    return entries


def _declared_entries(data: bytes) -> int | None:
    """The entry count a zip's end-of-central-directory record declares (zip64's when it defers to
    it), None when there is none to read (``zipfile`` then says what is wrong)."""
    at = data.rfind(b"PK\x05\x06", max(0, len(data) - (22 + 0xFFFF)))
    if at < 0 or at + 22 > len(data):
        return None
    count = int.from_bytes(data[at + 10 : at + 12], "little")
    if count != 0xFFFF:
        return count
    loc = at - 20
    if loc < 0 or data[loc : loc + 4] != b"PK\x06\x07":
        return None
    rec = int.from_bytes(data[loc + 8 : loc + 16], "little")
    if rec + 40 > len(data) or data[rec : rec + 4] != b"PK\x06\x06":
        return None
    return int.from_bytes(data[rec + 32 : rec + 40], "little")
