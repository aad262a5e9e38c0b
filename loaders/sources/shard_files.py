"""Names and checksums of webdataset shard files and of the sidecar index files kept beside them.

What a source and the index agree on without either importing the other: where a shard's sidecar
lives (:func:`sidecar_path`), the name it goes by (:func:`shard_name`) and the crc32 of a sample's
members recorded at indexing and checked at every read (:func:`sample_checksum`).
"""

from __future__ import annotations

import io
import operator
import os
import stat
import zlib
from typing import Iterable, Sequence

import numpy as np

from prealign.schemas.errors import ConfigError

SUFFIX = ".prealign-index.npz"


def sample_checksum(members: Iterable[tuple]) -> int:
    """crc32 over a sample's members (``extension NUL data`` each, in tar order; ``(extension, data,
    ...)`` tuples, anything after the data ignored): what a read checks.

    >>> hi, ho = sample_checksum([("txt", b"hi")]), sample_checksum([("txt", b"ho")])
    >>> hi == sample_checksum([("txt", b"hi")]) != ho
    True
    """
    crc = 0
    for ext, data, *_ in members:
        crc = zlib.crc32(data, zlib.crc32(ext.encode() + b"\0", crc))
    return crc


def sidecar_path(url: str, index_dir: str | None = None) -> str:
    """Where the sidecar of shard ``url`` lives: beside it, or ``index_dir/<file name><SUFFIX>``.

    >>> sidecar_path("/d/s-0.tar"), sidecar_path("http://h/d/s-0.tar?x=1", "/idx")
    ('/d/s-0.tar.prealign-index.npz', '/idx/s-0.tar.prealign-index.npz')
    """
    if index_dir:
        return os.path.join(index_dir, shard_name(url) + SUFFIX)
    if url.startswith("file://"):
        url = url[len("file://") :]
    base, sep, query = url.partition("?")
    return base + SUFFIX + (sep + query if sep else "")


def check_index_dir_names(urls: Iterable[str]) -> None:
    """An index folder names each sidecar by its shard's file name: two shards of one name
    (``train/s-0.tar`` and ``val/s-0.tar``) would share one sidecar, so they are a
    :class:`ConfigError` naming both."""
    urls = list(urls)
    names = shard_names(urls)
    if len(set(names)) == len(names):  # (the common case, in C: no name twice)
        return
    seen: dict[str, str] = {}
    for url, name in zip(urls, names):
        other = seen.setdefault(name, url)
        if other != url:
            raise ConfigError(
                f"index_dir: shards {other} and {url} have the same file name {shard_name(url)!r}, "
                f"so their sidecars would overwrite each other; index them into separate folders "
                f"or beside the shards"
            )


def shard_name(url: str) -> str:
    """The file name of a shard path or URL (query string dropped)."""
    return os.path.basename(url.split("?", 1)[0].rstrip("/")) or "shard"


def shard_names(urls: list[str], text: str | None = None) -> list[str]:
    """:func:`shard_name` of each of ``urls``; plain paths (no query, no trailing slash: the common
    case) at a string method each, and those of one folder (:func:`one_folder`) in two C calls, so
    100k names cost milliseconds at a loader's start. ``text``: :func:`url_text` of ``urls``, when
    made already.

    >>> shard_names(["/d/a.tar", "b.tar"]), shard_names(["http://h/d/a.tar?x=1", "/d/"])
    (['a.tar', 'b.tar'], ['a.tar', 'd'])
    """
    joined = url_text(urls) if text is None else text
    names = names_text(joined, len(urls))
    if names is not None:
        return names.split("\n") if urls else []
    if "?" in joined or "/\n" in joined or "\n\n" in joined[:1] + joined:
        return [shard_name(u) for u in urls]
    return [u.rpartition("/")[2] for u in urls]


def url_text(urls: list[str]) -> str:
    """``urls`` as one text, each followed by a newline: what the checks of a whole shard list
    search (a few C calls over it instead of a step per shard)."""
    return "\n".join([*urls, ""])  # (a resize of the joined text for its last newline copies it)


class ListLike(Sequence):
    """A read-only sequence that iterates, compares and prints as the list its ``_list()`` makes
    (subclasses give ``__len__``, ``__getitem__`` and ``_list``): equal to any sequence of the
    same items, unhashable like a list."""

    def _list(self) -> list:
        raise NotImplementedError

    def __iter__(self):
        return iter(self._list())

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(other) == len(self) and self._list() == list(other)

    __hash__ = None  # type: ignore[assignment] - (compared like a list)

    def __repr__(self) -> str:
        return repr(self._list())


class Lines(ListLike):
    """The lines of ``text`` (:func:`url_text` of a shard list whose lines all have ``width``
    characters, their newline included, and no other newline: :func:`line_rows`) as a read-only
    sequence of str. An item is sliced from the text when asked for: a source over 100k shards
    keeps no list of 100k names, which the garbage collector would walk in each young collection
    of the start. The list is made at the first walk over all of them (``iter``). Equal to any
    sequence of the same items; pickled as the text.

    >>> lines = Lines(url_text(["/d/a-1", "/d/a-2"]), 7)
    >>> len(lines), lines[1], lines[-2], list(lines), lines == ["/d/a-1", "/d/a-2"]
    (2, '/d/a-2', '/d/a-1', ['/d/a-1', '/d/a-2'], True)
    """

    def __init__(self, text: str, width: int):
        self._text, self._width, self._count, self._items = text, width, len(text) // width, None

    @property
    def text(self) -> str:
        """The :func:`url_text` the lines are read from."""
        return self._text

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._list()[i]
        i = operator.index(i)
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError(f"shard {i} of {self._count}: out of range")
        start = i * self._width
        return self._text[start : start + self._width - 1]

    def _list(self) -> list[str]:
        if self._items is None:
            self._items = self._text.split("\n")[:-1]
        return self._items

    def __eq__(self, other) -> bool:
        if isinstance(other, Lines):
            return self._text == other._text
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment] - (compared like a list)

    def __reduce__(self):
        return Lines, (self._text, self._width)


def line_rows(text: str, count: int) -> np.ndarray | None:
    """``text`` (:func:`url_text` of ``count`` urls) as ``uint8 [count, width]``, a line (its
    newline last) a row, when all lines have one length, are ASCII and hold no other newline (a
    list of zero-padded shard numbers); None otherwise. One copy and a few numpy calls: the checks
    of such a list then look at fixed columns instead of searching the text.

    >>> line_rows(url_text(["/d/a-1", "/d/a-2"]), 2).shape, line_rows(url_text(["/a", "/bb"]), 2)
    ((2, 7), None)
    """
    if not count or len(text) % count or not text.isascii():
        return None
    width = len(text) // count
    u = np.frombuffer(text.encode("ascii"), np.uint8)
    if not bool(np.all(u[width - 1 :: width] == 10)) or np.count_nonzero(u == 10) != count:
        return None
    return u.reshape(count, width)


_SEARCH = False
"""``rows=_SEARCH``: no :func:`line_rows`, the text searched (what the fixed columns replace)."""


def _fixed(text: str, count: int, rows):
    """``rows`` as given (an array, or ``_SEARCH``); None: :func:`line_rows` made, ``_SEARCH``
    when the lines are of other lengths."""
    if rows is None:
        rows = line_rows(text, count)
    return _SEARCH if rows is None else rows


def all_distinct(urls: list[str], text: str, rows=None, folder: str = "") -> bool:
    """No two of ``urls`` are equal (``text``: their :func:`url_text`). Names of one length in
    sorted order (zero-padded shard numbers, a sorted glob) are compared as one fixed-width array
    whose rows strictly increase (a few C calls over the text, no hash per name); others go
    through a set. ``rows``: :func:`line_rows`' answer, when known; ``folder``: a start that
    every line has (:func:`one_folder`), when known (then only what follows it is compared).

    >>> all_distinct(["/d/a-1", "/d/a-2"], url_text(["/d/a-1", "/d/a-2"]))
    True
    >>> all_distinct(["/d/a-2", "/d/a-2"], url_text(["/d/a-2", "/d/a-2"]))
    False
    """
    rows = _fixed(text, len(urls), rows)
    if len(urls) > 1 and rows is not _SEARCH and rows.shape[1] - 1 - len(folder) >= 8:
        width, cut = rows.shape[1], len(folder)
        if _rows_increase(word_columns(rows.reshape(-1), len(urls), width, cut, width, ">u8")):
            return True  # (a sorted list: as below, a word of 8 bytes at a time)
    elif len(urls) > 1 and rows is not _SEARCH:
        width, cut = rows.shape[1], len(folder)
        tail = {"names": ["r"], "formats": [f"S{width - cut}"], "offsets": [cut], "itemsize": width}
        lines = rows.reshape(-1).view(np.dtype(tail))["r"]  # (each line past cut)
        if bool(np.all(lines[1:] > lines[:-1])):  # each row one url: sorted, so distinct
            return True
    return len(set(urls)) == len(urls)


def _rows_increase(words: list[np.ndarray]) -> bool:
    """Each record is greater than the one before it, its bytes compared in order: ``words``
    (:func:`word_columns`, big-endian) compared one column after another, a pair decided by its
    first column that differs."""
    greater = np.zeros(words[0].size - 1, bool)
    undecided = np.ones(words[0].size - 1, bool)
    for w in (w.astype(np.uint64) for w in words):  # (native, contiguous: faster to compare)
        later, earlier = w[1:], w[:-1]
        greater |= undecided & (later > earlier)
        undecided &= later == earlier
    return bool(greater.all())


def one_folder(text: str, count: int, rows=None) -> str | None:
    """The folder (``"/d/"``, ``"s3://b/d/"``) that directly holds each of the ``count`` shards of
    ``text`` (:func:`url_text`), when they all sit in it, none has a query string or a newline and
    each has a file name: their :func:`shard_name` is then what follows the folder, and two shards
    have one name only when they are one path. None otherwise. A few C calls over the text (lines
    of one length, ``rows`` = :func:`line_rows`' answer when known: fixed columns compared).

    >>> one_folder(url_text(["/d/a.tar", "/d/b.tar"]), 2), one_folder(url_text(["/d/a", "/e/b"]), 2)
    ('/d/', None)
    >>> one_folder(url_text(["/d/a.tar", "/d/"]), 2) is None
    True
    """
    folder = text[: text.find("\n")]
    folder = folder[: folder.rfind("/") + 1]
    if not (count and folder and "?" not in text):
        return None
    rows = _fixed(text, count, rows)
    if rows is not _SEARCH:  # each line folder + a name of width - 1 - len(folder) chars, no "/"
        cut, width = len(folder), rows.shape[1]
        if (
            cut < width - 1
            and not bool(np.any(rows[:, cut : width - 1] == ord("/")))
            # (a newline ends each line alone: a line after one that starts with folder does)
            and text.count("\n" + folder) == count - 1
        ):
            return folder
        return None
    if (
        text.count("\n") == count
        and text.count("\n" + folder) == count - 1
        and text.count("/") == count * folder.count("/")
        and not has_line(text, folder)  # (each line is folder + a name without "/": none empty)
    ):
        return folder
    return None


def folder_rows(text: str, count: int) -> tuple[np.ndarray | None, str | None]:
    """``(line_rows(text, count), one_folder(text, count, rows))`` in fewer passes over the text
    when its lines have one length and sit in one folder (a zero-padded shard list): the row ends,
    the columns before the file name (each row's equal to the first's) and the file names'
    columns (no newline, no ``"/"``) checked, not every column twice. Anything else:
    :func:`line_rows` then :func:`one_folder`.

    >>> rows, folder = folder_rows(url_text(["/d/a-1", "/d/a-2"]), 2)
    >>> rows.shape, folder, folder_rows(url_text(["/d/a-1", "/e/a-2"]), 2)[1]
    ((2, 7), '/d/', None)
    """
    first = text[: text.find("\n")]
    cut = first.rfind("/") + 1
    if count and cut and not len(text) % count and text.isascii() and "?" not in text:
        width = len(text) // count
        if cut < width - 1:
            flat = np.frombuffer(text.encode("ascii"), np.uint8)
            rows = flat.reshape(count, width)
            if (
                bool(np.all(rows[:, width - 1] == 10))
                and _columns_equal(flat, count, width, cut)  # (no newline there: row 0 has none)
                # (so a newline or "/" elsewhere is one in a name)
                and byte_counts(flat, (10, ord("/"))) == [count, count * first[:cut].count("/")]
            ):
                return rows, first[:cut]
    rows = line_rows(text, count)
    return rows, one_folder(text, count, _SEARCH if rows is None else rows)


def _columns_equal(flat: np.ndarray, count: int, width: int, cut: int) -> bool:
    """The first ``cut`` columns of each of the ``count`` rows of ``flat`` (uint8, rows of
    ``width``) are those of row 0: compared as 8-byte words (the last one overlapping the one before
    it), a word per row at a time, not a column of bytes per row.

    >>> flat = np.frombuffer(b"/data/a\\n/data/b\\n", np.uint8)
    >>> _columns_equal(flat, 2, 8, 6), _columns_equal(flat, 2, 8, 7)
    (True, False)
    """
    if cut < 8:
        rows = flat.reshape(count, width)
        return bool(np.all(rows[:, :cut] == rows[0, :cut]))
    return all(bool(np.all(w == w[0])) for w in word_columns(flat, count, width, 0, cut))


def word_columns(
    flat: np.ndarray, count: int, stride: int, lo: int, hi: int, dtype: str = "<u8"
) -> list[np.ndarray]:
    """Bytes ``[lo, hi)`` (at least 8) of each of the ``count`` records of ``flat`` (uint8, a
    record every ``stride`` bytes) as uint64 ``[count]`` views, a word at ``lo``, ``lo + 8``, ...,
    the last one ending at ``hi`` (overlapping the one before it): two such lists of words are
    equal exactly when the records' bytes there are; ``dtype=">u8"`` (big-endian): they also
    order as the bytes do, first column first (the overlap repeats bytes found equal before).

    >>> flat = np.frombuffer(b"0123456789\\n", np.uint8)
    >>> [w.tobytes() for w in word_columns(flat, 1, 11, 0, 10)]
    [b'01234567', b'23456789']
    """
    if hi - lo < 8:
        raise ValueError(f"columns {lo}..{hi}: fewer than 8 bytes")
    starts = [*range(lo, hi - 7, 8), *([hi - 8] if (hi - lo) % 8 else [])]
    return [np.ndarray((count,), dtype, flat, at, (stride,)) for at in starts]


_CHUNK = 1 << 18
"""Bytes compared at a time by :func:`byte_counts` (the comparison's scratch stays in cache)."""


def byte_counts(flat: np.ndarray, values: tuple[int, ...]) -> list[int]:
    """How many bytes of ``flat`` (uint8) equal each of ``values``, a slice of :data:`_CHUNK` bytes
    at a time (no scratch array as large as ``flat``).

    >>> byte_counts(np.frombuffer(b"/d/a\\n/d/b\\n", np.uint8), (10, ord("/")))
    [2, 4]
    """
    counts = [0] * len(values)
    for lo in range(0, flat.size, _CHUNK):
        part = flat[lo : lo + _CHUNK]
        for i, v in enumerate(values):
            counts[i] += int(np.count_nonzero(part == v))
    return counts


def any_line_ends(text: str, suffix: str, rows=_SEARCH) -> bool:
    """Some line of ``text`` (:func:`url_text`) ends with ``suffix``; ``rows``: the
    :func:`line_rows` of ``text`` when known (each line's last columns compared instead of a search
    of the text).

    >>> text = url_text(["/d/a.tar", "/d/b.tgz"])
    >>> any_line_ends(text, ".tgz", line_rows(text, 2)), any_line_ends(text, ".tar.gz")
    (True, False)
    """
    if rows is None or rows is _SEARCH:
        return suffix + "\n" in text
    width = rows.shape[1]
    if not suffix:
        return True
    if width - 1 < len(suffix) or not suffix.isascii():
        return False
    if not bool(np.any(rows[:, width - 2] == ord(suffix[-1]))):  # (one column: most lists)
        return False
    tail = rows[:, width - 1 - len(suffix) : width - 1]
    return bool(np.any(np.all(tail == np.frombuffer(suffix.encode(), np.uint8), axis=1)))


def has_line(text: str, line: str) -> bool:
    """Some line of ``text`` (:func:`url_text`) is ``line``: two searches for a pattern as long as
    the line (fast: the searches skip ahead by its length, where a two-character pattern such as
    ``"/\n"`` steps through the text).

    >>> has_line(url_text(["/d/a", "/d/"]), "/d/"), has_line(url_text(["/d/a", "/d/b"]), "/d/")
    (True, False)
    """
    return text.startswith(line + "\n") or f"\n{line}\n" in text


def names_text(text: str, count: int) -> str | None:
    """The :func:`shard_name` of each of the ``count`` shards of ``text`` (:func:`url_text`), one a
    line (no newline after the last), when they sit in one folder (:func:`one_folder`; else None):
    two C calls.

    >>> names_text(url_text(["/d/a.tar", "/d/b.tar"]), 2)
    'a.tar\\nb.tar'
    """
    folder = one_folder(text, count)
    if folder is None:
        return None
    return text.replace("\n" + folder, "\n")[len(folder) : -1]


def plain_local(urls: list[str], text: str | None = None) -> bool:
    """True when every one of ``urls`` is a plain local path (no scheme, no query): one check in C,
    so a start over 100k local shards asks no per-shard question of its URLs. ``text``:
    :func:`url_text` of ``urls``, when made already."""
    joined = url_text(urls) if text is None else text
    return ":" not in joined and "?" not in joined


class NotRegular(OSError):
    """A path that is not a regular file (a FIFO, a device, a socket, a folder); ``kind`` says
    which."""

    def __init__(self, path: str, kind: str):
        self.kind = kind
        super().__init__(f"{path}: {kind}, not a regular file")


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words.

    >>> file_kind(stat.S_IFIFO | 0o600), file_kind(stat.S_IFREG | 0o644)
    ('a FIFO', 'a regular file')
    """
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return f"mode {oct(mode)}"


def open_regular(path: str) -> io.FileIO:
    """``open(path, "rb", buffering=0)`` of a regular file, opened without blocking (a FIFO nobody
    writes is refused at once, never waited on) and checked after the open (``fstat``: no swap
    between a check and the open); anything else is :class:`NotRegular`. A missing path raises
    ``FileNotFoundError``. Unbuffered (its readers read whole spans, ``pread`` or ``read(n)`` in a
    loop): a shard's first read makes no buffer it does not use."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    # (checked on the descriptor: fdopen of a folder raises a bare IsADirectoryError, issue #31)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegular(path, file_kind(mode))
        return io.FileIO(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def write_atomically(path: str, data: bytes) -> None:
    """``data`` written to ``<path>.<pid>.part`` then renamed to ``path`` (readers see the old file
    or the new one, never half of one); a folder at ``path`` is a :class:`ConfigError`. A write that
    fails (disk full, a file size limit, an interrupt) removes its own
    ``.part`` and raises: nothing half-written is left behind."""
    if os.path.isdir(path):
        raise ConfigError(
            f"{path}: is a folder, where an index file is written; remove or rename the folder"
        )
    tmp = f"{path}.{os.getpid()}.part"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
