"""Every sidecar of a source read and checked at once: a loader's start over many small shards at a
cost per distinct sidecar layout, not a parse per sidecar (issue #28).

    sidecar files ──open, preadv into the file's slot of one buffer, close (no seek, no stat: a
                    read that stops short of its slot read the whole file), block after block of
                    2 MiB (on threads where the file system is slow)──► a block grouped by length
      a length's first file: read alone (parse_sidecar, check_meta: every check): its template
      every other file compared with it in a few numpy calls, byte for byte: the zip's records and
          the npy headers (but for the crc32 and time fields), the meta JSON (but for the values of
          ``shard``, ``size``, ``hash``, ``probe``: bytes that can neither end nor escape a JSON
          string, digits); then each entry's crc32 (from its first byte that may differ: the
          template's crc32 of the bytes before), and its arrays are copies of the block's columns
      any file that differs anywhere else: read alone, as a file that is its own template
    ──► the in-memory form of a merged index (``meta``, ``arrays``), its values checked at once
        (:func:`~prealign.loaders.index.sidecar.joint_values`); the loader builds its index from it
        as from a merged file (:func:`~prealign.loaders.index.merged.merged_index`)

A file that equals a template outside those bytes is parsed by the path that read the template into
the same entries, headers and meta (the fields' values aside, each checked for its type), so this
accepts nothing :func:`~prealign.loaders.index.sidecar.parse_sidecar` refuses, and what it refuses
is read alone and named by that function, the first failure in shard order raised. Only local
sidecars of plain paths take this path (URLs are read on threads, one by one:
:func:`~prealign.loaders.index.source_index.sidecar_records`), and only when every shard has one.

Its cost is about 9 µs of CPU per sidecar (2,000 sidecars of 10 samples: 17-19 ms, this machine,
warm): 3 system calls (~4 µs: ~2 to open and close, ~2 to copy its 3.5 KB in), 4 ``zlib.crc32``
calls and the cutting of their bytes (~2 µs), its share of the numpy calls of its block (~1.5 µs:
the byte comparison most) and of the merged form (~1 µs). From 1,000 sidecars a start says once
that a merged index is one read (:class:`~prealign.loaders.index.source_index.MergedIndexWarning`).
"""

from __future__ import annotations

import collections
import itertools
import json
import operator
import os
import stat
import struct
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from prealign.loaders.errors import StaleIndexError
from prealign.loaders.index.hints import index_hint
from prealign.loaders.index.sidecar import (
    KEYS,
    SIDECAR_THREADS,
    config_key,
    expected_of,
    joint_values,
    parse_sidecar,
    probe_version,
    read_sidecar_bytes,
    sidecar_limit,
)
from prealign.loaders.index.source_index import MERGE_ADVICE_SHARDS, advise_merge, check_meta
from prealign.loaders.sources import remote
from prealign.loaders.sources.npy import parse_npy_header, plain_npz_entries
from prealign.loaders.sources.shard_files import SUFFIX, plain_local, shard_names

TEMPLATES = 4
"""Templates tried per byte length before the files left over are read one by one (sidecars of one
data set have a few layouts: their sample counts, the digits of their sizes)."""
_ARRAYS = sorted(KEYS - {"meta"})
_FIELDS = (("shard", str), ("size", int), ("hash", str), ("probe", str))
"""The meta fields whose values differ from shard to shard, and their JSON types."""
_DIGITS = 18
"""Most digits of a ``size`` read here (below 2**62, the bound parse_sidecar checks)."""
_TEXT = np.zeros(256, bool)
_TEXT[32:127] = True
_TEXT[[ord('"'), ord("\\")]] = False
"""The bytes a string value may hold: printable ASCII but the two that end or escape it."""
_DIGIT = np.zeros(256, bool)
_DIGIT[ord("0") : ord("9") + 1] = True


def sidecars_merged(source, schema) -> tuple[dict, dict[str, np.ndarray]] | None:
    """``(meta, arrays)`` as a merged index holds them (``meta``: ``names``, ``probes``,
    ``probe_versions`` (uint8 ``[S]``: each probe's definition), ``dims``,
    ``events`` as ``[shard, position, BadRecord]``; ``arrays``: ``shards [S, 5]``, ``spans``,
    ``lengths``, ``media``, ``dim_ids`` (rows of ``meta["dims"]``), ``bounds``) from every shard's
    sidecar, each checked as :func:`~prealign.loaders.index.source_index.sidecar_records` checks it
    (a :class:`StaleIndexError` naming the first shard at fault). None when the source reads no
    sidecars, a shard or folder is not a plain local path, or a shard has no sidecar (then the
    sidecars are read one by one and the others' shards indexed)."""
    names = _names(source)
    paths = _paths(source, names)
    if paths is None:
        return None
    bulk = _Bulk(source, names, config_key(source, schema))
    try:
        _read_all(paths, bulk.take)
    except _Missing:
        return None
    parts = bulk.parts
    for shard in sorted(bulk.alone):  # read alone, every check: the first at fault raises
        part = _Part.alone(source, shard, bulk.key)
        if part is None:  # (removed since: that shard is indexed, the others read one by one)
            return None
        parts.append(part)
    found = _assemble(source, parts)
    if len(paths) >= MERGE_ADVICE_SHARDS:
        advise_merge(source)
    return found


def _names(source):
    """A call that gives the :func:`~prealign.loaders.sources.shard_files.shard_names` of the
    source's shards, made once and from the source's own url text when it keeps one (no second
    join of every path)."""
    made: list = []

    def names() -> list[str]:
        if not made:
            text = source.url_text() if hasattr(source, "url_text") else None
            made.append(shard_names(source.urls, text))
        return made[0]

    return names


def _paths(source, names) -> list[str] | None:
    """The sidecar path of each shard when every shard and the index folder are plain local paths
    (:func:`~prealign.loaders.sources.shard_files.sidecar_path`, at a string operation each);
    ``names``: :func:`_names` of the source."""
    urls = getattr(source, "urls", None)
    if not getattr(source, "sidecars", False) or not urls or not plain_local(urls):
        return None
    index_dir = getattr(source, "index_dir", None)
    if not index_dir:
        return [u + SUFFIX for u in urls]
    if remote.scheme(index_dir):
        return None
    prefix = os.path.join(index_dir, "")
    return [prefix + name + SUFFIX for name in names()]


_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
_AT_ONCE = 256
"""Files open at once while read (well below a process's usual limit of 1,024)."""
_SLOT = 64 << 10
"""Bytes each of the first files may fill (:data:`_TIMED` of them); the others' slot is
:func:`_fit` to the largest of those. A file that fills its slot is read again, with the files
after it, in slots that fit it."""
_BLOCK = 2 << 20
"""Most bytes of the buffer a block of files is read into (the buffer is reused block after
block: fewer, larger blocks, fewer numpy calls)."""
_TIMED = 32
"""Files read first, timed: their wall time per file says whether the file system is slow."""
_SLOW_FILE = 1e-3
"""Wall seconds per file (open, read, close) from which the rest are read on threads: a parallel or
network file system's metadata round trips, not a local disk or the page cache (2 to 5 µs)."""
_THREAD_FILES = 32
"""Files a thread reads per step once the file system is slow (so all threads have work)."""


def _fit(length: int) -> int:
    """The slot of files of about ``length`` bytes: a quarter more, in KiB."""
    return -(-(length + length // 4 + 1) // 1024) * 1024


def _words_of(n: int) -> int:
    """``n`` bytes rounded up to whole uint64 words (a slot holds a file's words)."""
    return -(-n // 8) * 8


class _Missing(Exception):
    """A sidecar does not exist."""


@dataclass
class _Block:
    """Sidecars of shards ``first`` on, read: the ``lengths[i]`` bytes (int64) of shard
    ``first + i``'s at ``buf[i * slot:]`` (``buf``: uint8, of ``buffer``); 0 for one to read
    alone (over :func:`sidecar_limit` of an empty shard, not a regular file, empty, unreadable:
    that reader names why)."""

    first: int
    slot: int
    buffer: _Buffer
    lengths: np.ndarray

    @property
    def buf(self) -> np.ndarray:
        """The bytes read (uint8, :attr:`_Buffer.array`)."""
        return self.buffer.array


def _read_all(paths: list[str], take) -> None:
    """Every file read, :class:`_Block` after block handed to ``take`` in shard order (each one
    before the next is read into the same buffer); :class:`_Missing` when one does not exist. The
    first :data:`_TIMED` files are timed: on a slow file system (:data:`_SLOW_FILE` a file) the
    rest are read on up to :data:`~prealign.loaders.index.sidecar.SIDECAR_THREADS` threads, a
    buffer each step, the system calls overlapping (they release the GIL)."""
    reader = _Reader()
    for block in reader.blocks(paths[:_TIMED], 0):
        take(block)
    if len(paths) <= _TIMED:
        return
    reader.slot = min(reader.slot, _words_of(_fit(reader.longest)))
    if reader.seconds <= _SLOW_FILE * _TIMED:
        for block in reader.blocks(paths[_TIMED:], _TIMED):
            take(block)
        return

    def step(lo: int) -> list[_Block]:
        return list(_Reader(reader.slot).blocks(paths[lo : lo + _THREAD_FILES], lo, keep=True))

    steps = range(_TIMED, len(paths), _THREAD_FILES)
    with ThreadPoolExecutor(
        max_workers=min(SIDECAR_THREADS, len(steps)), thread_name_prefix="prealign-sidecars"
    ) as pool:
        for blocks in pool.map(step, steps):
            for block in blocks:
                take(block)


class _Buffer:
    """``array`` (uint8, uninitialised: only the bytes read are looked at) and the views of its
    slots for ``preadv``, per slot size (made once), for one start's reads (none is kept for the
    next start: a real restart is a new process)."""

    def __init__(self, size: int):
        self.array = np.empty(max(size, _BLOCK), np.uint8)
        self._views: dict[int, list] = {}
        self._scratch: tuple[np.ndarray, np.ndarray] | None = None

    def scratch(self, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """uint64 and bool ``[k, n]`` to compute in (``k * n`` at most a word a byte of
        ``array``: a block's files, their words), kept with the buffer."""
        if self._scratch is None:
            size = self.array.size // 8
            self._scratch = (np.empty(size, "<u8"), np.empty(size, bool))
        words, flags = self._scratch
        return words[: k * n].reshape(k, n), flags[: k * n].reshape(k, n)

    def slots(self, slot: int) -> list:
        """``[[view]]`` of each slot of ``slot`` bytes, in order."""
        if slot not in self._views:
            if len(self._views) >= 4:
                self._views.clear()
            view = memoryview(self.array)
            ends = range(slot, self.array.size + 1, slot)
            self._views[slot] = [[view[end - slot : end]] for end in ends]
        return self._views[slot]


class _Reader:
    """Files read into a :class:`_Buffer` of ``slot`` bytes a file, :data:`_AT_ONCE` open at a
    time, each step one ``map`` of each system call over them (no Python step per file): open,
    ``preadv`` into its slot, close (no ``fstat`` or seek: a read that stops short of its slot
    read the whole file). ``seconds``: the wall time spent reading; ``longest``: the most bytes a
    file read; ``buffer``: the one read into last (None before the first read)."""

    def __init__(self, slot: int = _SLOT):
        self.slot = _words_of(slot)
        self.seconds = 0.0
        self.longest = 0
        self.buffer: _Buffer | None = None

    def blocks(self, paths: list[str], first: int, keep: bool = False):
        """The :class:`_Block`\\ s of ``paths`` (shards ``first`` on), one after another; each
        one's buffer is read into again for the next unless ``keep``."""
        lo = 0
        while lo < len(paths):
            k = min(max(1, _BLOCK // self.slot), len(paths) - lo)
            t0 = time.perf_counter()
            lengths, need = self._read(paths[lo : lo + k], keep)
            self.seconds += time.perf_counter() - t0
            if lengths.size:
                self.longest = max(self.longest, int(lengths.max()))
                yield _Block(first + lo, self.slot, self.buffer, lengths)
            lo += lengths.size
            if need:
                self.slot = _words_of(max(_fit(need), 2 * self.slot))

    def _read(self, paths: list[str], keep: bool) -> tuple[np.ndarray, int]:
        """The lengths of the files of ``paths`` read into the buffer, up to the first that
        outgrew its slot (when one does) and the bytes that one needs (else 0). A step that fails
        anywhere (a FIFO, a folder, a file removed: ``OSError``) is read again one by one."""
        slot, k = self.slot, len(paths)
        if keep or self.buffer is None or self.buffer.array.size < k * slot:
            self.buffer = _Buffer(k * slot)
        lengths = np.empty(k, np.int64)
        for lo in range(0, k, _AT_ONCE):
            step, slots = paths[lo : lo + _AT_ONCE], self.buffer.slots(slot)[lo : lo + _AT_ONCE]
            try:
                got, need = _read_block(step, slots)
            except (OSError, ValueError):
                got, need = _read_one_by_one(step, slots)
            lengths[lo : lo + got.size] = got
            if need:
                return lengths[: lo + got.size], need
        return lengths, 0


def _read_one_by_one(paths: list[str], slots: list) -> tuple[np.ndarray, int]:
    """:meth:`_Reader._read` of a step, file by file (:func:`_read_one`)."""
    lengths: list[int] = []
    for path, (target,) in zip(paths, slots):
        try:
            data = _read_one(path)
        except FileNotFoundError:
            raise _Missing(path) from None
        if len(data) >= len(target):
            return np.asarray(lengths, np.int64), len(data) + 1
        target[: len(data)] = data
        lengths.append(len(data))
    return np.asarray(lengths, np.int64), 0


def _read_block(paths: list[str], slots: list) -> tuple[np.ndarray, int]:
    """:meth:`_Reader._read` of files that all open and read, each with ``preadv`` from 0: a
    FIFO or socket cannot (``OSError``: the step is read again one by one, and refused there). A
    file that fills its slot (``fstat``, that file only) is a regular one to read in a larger
    slot, or one to read alone (length 0: a character device, over the limit, shrunk while read).
    (A character or block device that reads a few bytes and stops is taken as a file: its bytes
    must still be a valid sidecar of this shard; a platform without ``preadv`` reads one by
    one.)"""
    fds: list[int] = []
    try:
        fds.extend(map(os.open, paths, itertools.repeat(_FLAGS)))
        preadv = getattr(os, "preadv", _no_preadv)
        got = np.fromiter(map(preadv, fds, slots, itertools.repeat(0)), np.int64, len(fds))
        slot = len(slots[0][0])
        for i in np.flatnonzero(got == slot).tolist():
            st = os.fstat(fds[i])
            if stat.S_ISREG(st.st_mode) and slot <= st.st_size <= sidecar_limit(0):
                return got[:i], st.st_size + 1
            got[i] = 0
        return got, 0
    finally:
        _close(fds)


def _no_preadv(fd: int, buffers: list, offset: int) -> int:
    """A platform without ``os.preadv``: each step read one by one."""
    raise OSError("no os.preadv here: read one by one")


def _close(fds: list[int]) -> None:
    """Every fd of ``fds`` closed (one ``map``; one that fails is closed all the same)."""
    rest = iter(fds)
    while True:
        try:
            collections.deque(map(os.close, rest), 0)
            return
        except OSError:
            continue


def _read_one(path: str) -> bytes:
    """The bytes of one file, whatever it is (``FileNotFoundError`` when it does not exist;
    ``b""`` for one to read alone)."""
    try:
        fd = os.open(path, _FLAGS)
    except FileNotFoundError:
        raise
    except (OSError, ValueError):
        return b""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > sidecar_limit(0):
            return b""
        data = os.read(fd, st.st_size + 1)
        return data if len(data) == st.st_size else b""  # (else grew, or shrank, while read)
    except OSError:
        return b""
    finally:
        os.close(fd)


@dataclass
class _Part:
    """Sidecars of some shards (``shards``, in the order their rows are), parsed: ``rows`` samples
    each, ``num_events`` records each, the per-shard ``names``, ``sizes``, ``probes``, the shared
    ``dims`` and ``events`` (``[position, BadRecord]``) and the arrays, shard after shard
    (``dim_ids`` rows of ``dims``); ``probe_version`` the definition of its probes (its sidecars'
    version decides: one meta, one version)."""

    shards: np.ndarray
    rows: np.ndarray
    num_events: np.ndarray
    names: list
    sizes: np.ndarray
    probes: list
    dims: list
    events: list
    arrays: dict
    probe_version: int

    @classmethod
    def of(cls, shards, meta: dict, arrays: dict, names, sizes, probes) -> _Part:
        """The part of ``shards`` whose sidecars share the parsed ``meta`` but for their values."""
        k = len(shards)
        return cls(
            shards=np.asarray(shards, np.int64),
            rows=np.full(k, len(arrays["lengths"]) // max(k, 1), np.int64),
            num_events=np.full(k, meta["num_events"], np.int64),
            names=names,
            sizes=np.asarray(sizes, np.int64),
            probes=probes,
            dims=meta["dims"],
            events=meta["events"],
            arrays=arrays,
            probe_version=probe_version(meta["version"]),
        )

    @classmethod
    def alone(cls, source, shard: int, key: str, data: bytes | None = None) -> _Part | None:
        """Shard ``shard``'s sidecar (``data``, else read now) parsed by itself, every check made
        (the errors of :func:`~prealign.loaders.index.source_index.sidecar_records`); None when it
        has none."""
        data = read_sidecar_bytes(source, shard) if data is None else data
        return None if data is None else cls.parsed(shard, *_parse(source, shard, data, key))

    @classmethod
    def parsed(cls, shard: int, meta: dict, arrays: dict) -> _Part:
        """The part of one sidecar parsed already."""
        size, probe, *_ = expected_of(meta, arrays["spans"])
        return cls.of([shard], meta, arrays, [meta["shard"]], [size], [probe])


def _parse(source, shard: int, data: bytes, key: str) -> tuple[dict, dict]:
    """``parse_sidecar`` and ``check_meta``: one sidecar read alone, as
    :func:`~prealign.loaders.index.source_index.sidecar_records` reads it (its values checked with
    all the others': :func:`~prealign.loaders.index.sidecar.joint_values`)."""
    url = source.urls[shard]
    meta, arrays = parse_sidecar(data, shard=url, fix=lambda: index_hint(source), values=False)
    check_meta(source, url, meta, key)
    return meta, arrays


def _pick(items: list, at: np.ndarray) -> list:
    """``[items[i] for i in at]``, taken from C."""
    if at.size < 2:
        return [items[i] for i in at.tolist()]
    return list(operator.itemgetter(*at.tolist())(items))


@dataclass
class _Layout:
    """Where the ``length`` bytes of a template sidecar are: ``fixed`` uint64 ``[length / 8]``
    masks of the bytes every file of its layout has alike (zip records but their crc32 and time
    fields, npy headers, the meta JSON but the values of :data:`_FIELDS`), ``bytes`` the
    template's (uint8), ``crcs`` ``(start, end, column of its recorded crc32, crc32 of the
    entry's bytes before start, the template's crc32 of the entry)`` of each entry
    (:func:`_crc_from`), ``data`` ``{entry: (start, end, header)}`` of each array, ``fields``
    ``{name: (start, end)}`` of each value in the file, ``text`` and ``digits`` the offsets of
    the bytes of its string values and of its int values."""

    fixed: np.ndarray
    length: int
    template_bytes: np.ndarray
    crcs: list
    data: dict
    fields: dict
    text: np.ndarray
    digits: np.ndarray
    _cuts: dict = field(default_factory=dict)

    @classmethod
    def of(cls, data: bytes, meta: dict) -> _Layout | None:
        """The layout of template ``data`` (whose parsed meta is ``meta``), None when it is not
        what :func:`~prealign.loaders.sources.npy.plain_npz_entries` reads."""
        entries = plain_npz_entries(data, 64 * len(data) + (1 << 20), KEYS)
        if entries is None:
            return None
        view = memoryview(data)
        varies = np.zeros(len(data), bool)
        regions, crcs = {}, []
        for e in entries:
            header = parse_npy_header(view[e.start : e.end], member=e.name)
            if header.fortran_order and len(header.shape) > 1:
                return None
            varies[e.local + 10 : e.local + 18] = True  # time, date, crc32 (local header)
            varies[e.directory + 12 : e.directory + 20] = True  # (directory record)
            regions[e.name[:-4]] = (e.start + header.offset, e.end, header)
            crcs.append((e.start, e.end, e.directory + 16))
        lo, hi, _ = regions["meta"]
        fields = _meta_fields(data[lo:hi], meta)
        if fields is None:
            return None
        for name in _ARRAYS:
            a, b, _ = regions[name]
            varies[a:b] = True
        for a, b in fields.values():
            varies[lo + a : lo + b] = True
        crcs = [_crc_from(data, varies, *c) for c in crcs]
        fields = {name: (lo + a, lo + b) for name, (a, b) in fields.items()}
        return cls(
            fixed=_words(~varies),
            length=len(data),
            template_bytes=np.frombuffer(data, np.uint8),
            crcs=crcs,
            data=regions,
            fields=fields,
            text=_offsets(fields, str),
            digits=_offsets(fields, int),
        )

    def fixed_words(self, data: bytes) -> np.ndarray:
        """The :attr:`fixed` bytes of one file (``length`` bytes), masked, as uint64 words."""
        return self.fixed & np.frombuffer(data + bytes(-len(data) % 8), "<u8")

    def same(self, words: np.ndarray, template: np.ndarray, scratch=None) -> np.ndarray:
        """Which files (``words``: uint64 ``[k, length / 8]``, each file's bytes) have the
        ``template``'s :meth:`fixed_words`: compared 8 bytes at a time (in one pass: faster
        than run by run of the words that hold such bytes); ``scratch``: uint64 and bool arrays
        of ``words``' shape to compute in."""
        masked, equal = scratch or (np.empty(words.shape, "<u8"), np.empty(words.shape, bool))
        np.bitwise_and(words, self.fixed, out=masked)
        return np.equal(masked, template, out=equal).all(axis=1)

    def crc_ok(self, rows: np.ndarray) -> np.ndarray:
        """Each file's entries (``rows``: the files' bytes, uint8 ``[k, >= length]``, C order) of
        their recorded crc32: each entry's crc32 over all its bytes, its bytes from its first that
        may vary (those before are the template's, :meth:`same`: their crc32 is the template's,
        the ``zlib.crc32`` it starts from). An entry whose bytes are the template's
        (:attr:`template_bytes`) in every file has the template's crc32 (checked when the
        template was read): no call (a data set's constant arrays: ``media`` and ``dim_ids`` of
        text). One ``zlib.crc32`` for each other entry of each file, its bytes cut from the rows
        by one ``struct`` unpacking a file, all called from C: no Python step per file."""
        found = np.empty((len(rows), len(self.crcs)), np.uint32)
        moving = []
        for j, (a, b, _, _, whole) in enumerate(self.crcs):
            mine = self.template_bytes[a:b]
            if len(rows) and (rows[-1, a:b] == mine).all() and (rows[:, a:b] == mine).all():
                found[:, j] = whole
            else:
                moving.append(j)
        if moving and len(rows):
            rows = np.ascontiguousarray(rows)
            cut = self._cut(tuple(moving), rows.shape[1])
            pieces = itertools.chain.from_iterable(cut.iter_unpack(memoryview(rows).cast("B")))
            seeds = itertools.cycle([self.crcs[j][3] for j in moving])
            crcs = np.asarray(list(map(zlib.crc32, pieces, seeds)), np.uint32)
            found[:, moving] = crcs.reshape(len(rows), len(moving))
        cols = np.asarray([c for _, _, c, _, _ in self.crcs])[:, None] + np.arange(4)
        recorded = np.ascontiguousarray(rows[:, cols.reshape(-1)]).view("<u4")
        return (found == recorded).all(axis=1)

    def _cut(self, moving: tuple, width: int) -> struct.Struct:
        """The ``struct`` that unpacks a row of ``width`` bytes into the bytes of the entries
        ``moving`` from their first that may vary (made once)."""
        if (moving, width) not in self._cuts:
            spec, at = [], 0
            for a, b, _, _, _ in (self.crcs[j] for j in moving):
                spec.append(f"{a - at}x{b - a}s")
                at = b
            self._cuts[moving, width] = struct.Struct("".join(spec) + f"{width - at}x")
        return self._cuts[moving, width]

    def values_ok(self, rows: np.ndarray) -> np.ndarray:
        """Each file's values are what parse_sidecar reads as the template's: a string's bytes
        printable ASCII without ``"`` or ``\\`` (nothing ends or escapes it), a size's digits
        without a leading zero."""
        ok = _TEXT.take(rows.take(self.text, axis=1)).all(axis=1)
        ok &= _DIGIT.take(rows.take(self.digits, axis=1)).all(axis=1)
        for name, (a, b) in self.fields.items():
            if dict(_FIELDS)[name] is int and b - a > 1:
                ok &= rows[:, a] != 48
        return ok

    def names_ok(self, rows: np.ndarray, names: list[str], template: str) -> np.ndarray:
        """Each file names its shard, ``names`` (the template's name, ``template``, when names are
        not a value of the layout)."""
        if "shard" not in self.fields:
            return np.asarray([n == template for n in names], bool)
        a, b = self.fields["shard"]
        joined = "".join(names)
        if set(map(len, names)) != {b - a} or not joined.isascii():
            return np.zeros(len(rows), bool)  # (other lengths: each read alone, to be named)
        wanted = np.frombuffer(joined.encode(), np.uint8).reshape(len(rows), b - a)
        return (rows[:, a:b] == wanted).all(axis=1)

    def sizes(self, rows: np.ndarray) -> np.ndarray:
        """The ``size`` of each file (int64; its digits checked by :meth:`values_ok`)."""
        a, b = self.fields["size"]
        digits = rows[:, a:b].astype(np.int64) - 48
        return digits @ (10 ** np.arange(b - a - 1, -1, -1, dtype=np.int64))

    def strings(self, rows: np.ndarray, name: str) -> list[str]:
        """The value ``name`` of each file (str; its bytes checked by :meth:`values_ok`)."""
        a, b = self.fields[name]
        text = np.ascontiguousarray(rows[:, a:b]).tobytes().decode("ascii")
        cuts = range(0, len(text) + 1, b - a)
        return list(map(text.__getitem__, map(slice, cuts, cuts[1:])))

    def arrays(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Each array of every file, file after file: one slice of the group's bytes each."""
        out = {}
        for name in _ARRAYS:
            a, b, header = self.data[name]
            flat = rows[:, a:b].copy().view(header.dtype)  # (a copy: the rows are reread)
            out[name] = flat.reshape((len(rows) * header.shape[0], *header.shape[1:]))
        return out


def _offsets(fields: dict, kind: type) -> np.ndarray:
    """The offsets (int64) of the bytes of the ``fields`` (``{name: (start, end)}``) of type
    ``kind``."""
    spans = [np.arange(a, b) for name, (a, b) in fields.items() if dict(_FIELDS)[name] is kind]
    return np.concatenate(spans + [np.zeros(0, np.int64)])


def _crc_from(data: bytes, varies: np.ndarray, start: int, end: int, column: int) -> tuple:
    """``(first, end, column, seed, whole)`` of the entry ``data[start:end]``: ``first`` its first
    byte that ``varies`` (or ``end``), ``seed`` the crc32 of the bytes before it, the same in every
    file of the layout (``zlib.crc32(entry[first:], seed)`` is the crc32 of the whole entry),
    ``whole`` the template's crc32 of the entry."""
    moving = np.flatnonzero(varies[start:end])
    first = start + int(moving[0]) if moving.size else end
    seed = zlib.crc32(data[start:first])
    return first, end, column, seed, zlib.crc32(data[first:end], seed)


def _words(mask: np.ndarray) -> np.ndarray:
    """``mask`` (bool ``[L]``) as uint64 words of bytes 0xFF (True) and 0 (False; past ``L``)."""
    out = np.zeros(-(-len(mask) // 8) * 8, np.uint8)
    out[: len(mask)] = np.where(mask, 0xFF, 0)
    return out.view("<u8")


def _meta_fields(text: bytes, meta: dict) -> dict[str, tuple[int, int]] | None:
    """``{field: (start, end)}`` in the meta JSON ``text`` of each value of :data:`_FIELDS` that
    stands once, as ``"field": value``, proven the top level's: the text with each replaced by
    another value of the same length parses to ``meta`` with those values replaced (so a file that
    differs from ``text`` only there holds its own values in ``meta``'s place). None when ``text``
    does not parse as ``meta`` did."""
    try:
        raw = json.loads(text.decode())
    except (ValueError, UnicodeDecodeError):
        return None
    fields, changed, swapped = {}, dict(raw), bytearray(text)
    for name, kind in _FIELDS:
        value = raw.get(name)
        if type(value) is not kind or value == "":
            continue
        token = json.dumps(value).encode()
        if kind is str:
            token = token[1:-1]
            pattern = b'"%s": "%s"' % (name.encode(), token)
            lo = text.find(pattern) + len(name) + 5
        else:
            pattern = b'"%s": %s' % (name.encode(), token)
            lo = text.find(pattern) + len(name) + 4
        if text.count(pattern) != 1 or (kind is int and len(token) > _DIGITS):
            continue
        hi = lo + len(token)
        other = (b"1" if token[:1] != b"1" else b"2") + b"0" * (len(token) - 1)
        swapped[lo:hi] = other
        changed[name] = other.decode() if kind is str else int(other)
        fields[name] = (lo, hi)
    try:
        if json.loads(bytes(swapped).decode()) != changed:
            return None
    except (ValueError, UnicodeDecodeError):
        return None
    return fields


@dataclass
class _Template:
    """A sidecar read alone (``meta``, ``probe``: its probe) and its :class:`_Layout`; ``words``
    its :meth:`_Layout.fixed_words`."""

    layout: _Layout
    words: np.ndarray
    meta: dict
    probe: str


class _Bulk:
    """The sidecars of a source taken block after block (:meth:`take`): ``parts`` read at once,
    ``alone`` the shards to read alone (to be named when at fault), ``templates`` tried for each
    byte length (up to :data:`TEMPLATES`, None for a try that gave none)."""

    def __init__(self, source, names, key: str):
        self.source, self.names, self.key = source, names, key
        self.templates: dict[int, list[_Template | None]] = {}
        self.parts: list[_Part] = []
        self.alone: list[int] = []

    def take(self, block: _Block) -> None:
        """A block's files grouped by byte length, each group compared with the templates of its
        length (a new one, read alone, where none matches); the files left read alone."""
        lengths = block.lengths
        if (lengths == lengths[0]).all():
            groups = [np.arange(lengths.size)]
        else:
            order = np.argsort(lengths, kind="stable")
            groups = np.split(order, np.flatnonzero(np.diff(lengths[order])) + 1)
        for group in groups:
            length = int(lengths[group[0]])
            left = group if length else group[:0]  # (an empty file is no sidecar either)
            tried = self.templates.setdefault(length, [])
            for i in range(TEMPLATES):
                if not left.size:
                    break
                if i == len(tried):
                    tried.append(self._template(block, int(left[0])))
                    if tried[i] is None:
                        left = left[1:]
                        continue
                if tried[i] is not None:
                    left = self._match(tried[i], block, left)
            self.alone.extend((block.first + (left if length else group)).tolist())

    def _template(self, block: _Block, i: int) -> _Template | None:
        """File ``i`` of ``block`` read alone as a template; None when it is none (to be read
        alone: in ``alone``; not what :func:`_Layout.of` reads: in ``parts``)."""
        shard, at = block.first + i, i * block.slot
        data = bytes(memoryview(block.buf)[at : at + int(block.lengths[i])])
        try:
            meta, arrays = _parse(self.source, shard, data, self.key)
        except StaleIndexError:
            self.alone.append(shard)
            return None
        layout = _Layout.of(data, meta)
        if layout is None:
            self.parts.append(_Part.parsed(shard, meta, arrays))
            return None
        _, probe, *_ = expected_of(meta, arrays["spans"])
        return _Template(layout, layout.fixed_words(data), meta, probe)

    def _match(self, template: _Template, block: _Block, left: np.ndarray) -> np.ndarray:
        """The files ``left`` of ``block`` (of the template's length, in order) that equal the
        template but for their values taken as a :class:`_Part`; those with a value it refuses
        (a crc32, a name, a character) in ``alone``; those of another layout returned."""
        layout, meta, slot = template.layout, template.meta, block.slot
        width = len(layout.fixed) * 8
        lo, hi = int(left[0]), int(left[-1]) + 1
        whole = block.buf[: block.lengths.size * slot].reshape(-1, slot)
        rows = whole[lo:hi] if hi - lo == left.size else whole[left, :width]  # (in place or not)
        words = rows.view("<u8")[:, : width // 8]
        same = layout.same(words, template.words, block.buffer.scratch(*words.shape))
        mine = left[same]
        if mine.size < left.size:
            rows = rows[same]
        names = _pick(self.names(), block.first + mine)  # (what each must name: checked)
        ok = layout.values_ok(rows) & layout.names_ok(rows, names, meta["shard"])
        ok &= layout.crc_ok(rows)
        if not ok.all():
            self.alone.extend((block.first + mine[~ok]).tolist())
            mine, rows = mine[ok], rows[ok]
            names = _pick(self.names(), block.first + mine)
        if mine.size:
            k, fields = mine.size, layout.fields
            sizes = layout.sizes(rows) if "size" in fields else np.full(k, meta["size"])
            probes = layout.strings(rows, "probe") if "probe" in fields else [template.probe] * k
            arrays = layout.arrays(rows)
            self.parts.append(_Part.of(block.first + mine, meta, arrays, names, sizes, probes))
        return left[~same]


def _assemble(source, parts: list[_Part]):
    """The merged form of ``parts`` in shard order, its values checked (every shard at once:
    :func:`~prealign.loaders.index.sidecar.joint_values`); a failure read again shard by shard to
    name it."""
    n = source.num_shards
    slots = np.concatenate([p.shards for p in parts])  # (the shard of each slot)
    slot_rows = np.concatenate([p.rows for p in parts])
    slot_of = np.empty(n, np.int64)
    slot_of[slots] = np.arange(n)
    rows = slot_rows[slot_of]
    arrays = {name: np.concatenate([p.arrays[name] for p in parts]) for name in _ARRAYS}
    if not np.array_equal(slots, np.arange(n)):  # rows into shard order
        starts = np.concatenate([[0], np.cumsum(slot_rows)])[:-1][slot_of]
        take = np.repeat(starts - np.concatenate([[0], np.cumsum(rows)])[:-1], rows)
        take += np.arange(take.size)
        arrays = {name: a[take] for name, a in arrays.items()}
    dims: list = []  # each part's dims, as rows of all the distinct ones
    tables = [
        np.asarray(
            [dims.index(d) if d in dims else dims.append(d) or len(dims) - 1 for d in p.dims],
            np.int64,
        )
        for p in parts
    ]
    base = np.concatenate([[0], np.cumsum([len(t) for t in tables])])[:-1]
    per_shard = {key: np.empty(n, np.int64) for key in ("sizes", "num_events", "ndims", "base")}
    names, probes = np.empty(n, object), np.empty(n, object)
    versions = np.empty(n, np.uint8)
    events = []
    for p, t, b in zip(parts, tables, base.tolist()):
        names[p.shards], probes[p.shards] = p.names, p.probes
        versions[p.shards] = p.probe_version
        per_shard["sizes"][p.shards], per_shard["num_events"][p.shards] = p.sizes, p.num_events
        per_shard["ndims"][p.shards], per_shard["base"][p.shards] = len(t), b
        if p.events:
            events.extend([s, pos, ev] for s in p.shards.tolist() for pos, ev in p.events)
    events.sort(key=lambda e: (e[0], e[1]))
    first_last = joint_values(
        arrays,
        rows=rows,
        ndims=per_shard["ndims"],
        sizes=per_shard["sizes"],
        num_events=per_shard["num_events"],
        events=[(s, pos) for s, pos, _ in events],
    )
    if first_last is None:
        _name_fault(source)
    table = np.concatenate(tables) if tables else np.zeros(0, np.int64)
    arrays["dim_ids"] = table[np.repeat(per_shard["base"], rows) + arrays["dim_ids"]]
    shards = np.stack([per_shard["sizes"], rows, per_shard["num_events"], *first_last], axis=1)
    meta = {
        "names": names.tolist(),
        "probes": probes.tolist(),
        "probe_versions": versions,
        "dims": dims,
        "events": events,
    }
    return meta, {"shards": shards, **arrays}


def _name_fault(source) -> None:
    """Raise the error of the first sidecar at fault, each parsed again alone with every check (a
    value the checks of all sidecars at once refused: an id, a byte range, the tiling)."""
    for shard, url in enumerate(source.urls):
        parse_sidecar(read_sidecar_bytes(source, shard), shard=url, fix=lambda: index_hint(source))
    raise StaleIndexError(source.urls[0], "sidecar indexes inconsistent", index_hint(source))
