"""webdataset tar shards as a :class:`~prealign.loaders.sources.source.Source`.

A sample is the run of consecutive members sharing a key (``0001.input_ids.npy``, ``0001.json``
-> key ``0001``), decoded safely by :mod:`prealign.loaders.sources.tar_decode` (never unpickled).
Indexing walks each tar once and records each sample's byte range, so a worker reads one sample with
one ``seek`` + ``read``. Remote shards (``http(s)://``, ``s3://``, ``gs://``) are read by byte
range, never copied whole; ``pipe:`` and ``.tar.gz`` shards front to back
(:mod:`prealign.loaders.sources.remote`). Sidecar indexes (``prealign index``,
:mod:`prealign.loaders.index.sidecar`) beside the shards, or in ``index_dir``, are found and used by
themselves. A location is ``(shard, start, end, checksum)``: a read whose members no longer have the
checksum recorded at indexing raises :class:`SourceChangedError`.

Sample dict: ``{"__key__": str, "__url__": str, "__shard__": int, <extension>: decoded value}``.
Without a ``transform``, every ``<name>.npy`` member becomes a tensor field ``<name>``.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import tempfile
import threading
from collections import OrderedDict
from typing import Callable, Mapping, Sequence

import numpy as np

from prealign.loaders.errors import (
    BadSampleError,
    CorruptShardError,
    IndexFileError,
    MissingMemberError,
    MissingShardError,
    ShardGoneError,
    ShardTimeoutError,
    SourceChangedError,
)
from prealign.loaders.sources import remote as _remote
from prealign.loaders.sources.brace_range import keeps_digits, numeric_ranges, ranges_text
from prealign.loaders.sources.deadline import Stalled, TimedReader, call_with_timeout
from prealign.loaders.sources.shard_files import (
    Lines,
    NotRegular,
    all_distinct,
    any_line_ends,
    check_index_dir_names,
    folder_rows,
    has_line,
    line_rows,
    open_regular,
    plain_local,
    sample_checksum,
    url_text,
)
from prealign.loaders.sources.source import (
    Location,
    Skip,
    Source,
    Transform,
    check_folder,
    check_positive_int,
)
from prealign.loaders.sources.tar_decode import (
    DEFAULT_LIMITS,
    DecodeLimits,
    decode_member,
    split_member_name,
)
from prealign.loaders.sources.tar_reader import TarFormatError, iter_members
from prealign.schemas.errors import ConfigError, SampleError
from prealign.schemas.layout import is_flag

_SPILL_CHUNK = 4 << 20
_AHEAD_BYTES = 64 << 20
"""At most this many bytes of a micro-batch read ahead (:meth:`WebDatasetSource.read_ahead`)."""
_REMOTE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
_BRACE = re.compile(r"[{}\\]")
_FAR = re.compile(r"^(?!file://)[a-zA-Z][a-zA-Z0-9+.-]*:")
"""A URL that is not a local path (``file://`` is)."""


def expand_urls(urls: str | Sequence[str]) -> list[str]:
    """Brace-expanded list of shard URLs/paths (``"shard-{000..002}.tar"`` -> three names).

    >>> expand_urls("s-{0..2}.tar")
    ['s-0.tar', 's-1.tar', 's-2.tar']
    """
    return _expanded(urls)[0]


def _check_arguments(required, decoders, remote, cache_dir, index_dir, sidecars) -> tuple:
    """``required`` as a tuple; :class:`WebDatasetSource`'s arguments of a type it cannot use are
    a :class:`~prealign.schemas.errors.ConfigError` naming the argument (``required="txt"`` is not
    the members ``t``, ``x``, ``t``; ``sidecars="no"`` is not True)."""

    if isinstance(required, (str, bytes)) or not hasattr(required, "__iter__"):
        raise ConfigError(
            f"required: expected a list or tuple of member extensions (('txt',)), got "
            f"{type(required).__name__} {required!r:.80}"
        )
    names = tuple(required)
    for ext in names:
        if not isinstance(ext, str) or not ext:
            raise ConfigError(f"required: expected member extensions (str), got {ext!r:.80}")
    if decoders is not None and not (
        isinstance(decoders, Mapping)
        and all(isinstance(k, str) and callable(v) for k, v in decoders.items())
    ):
        raise ConfigError(
            f"decoders: expected a mapping extension (str) -> callable(bytes), got {decoders!r:.80}"
        )
    if remote is not None and not isinstance(remote, _remote.RemoteOptions):
        raise ConfigError(f"remote: expected a RemoteOptions or None, got {type(remote).__name__}")
    check_folder("cache_dir", cache_dir)
    check_folder("index_dir", index_dir)
    if not is_flag(sidecars):  # (True, False, or 1 / 0)
        raise ConfigError(f"sidecars: expected a bool, got {sidecars!r}")
    return names


def _expanded(urls: str | Sequence[str]) -> tuple[list[str], str, str | None, object]:
    """:func:`expand_urls`, the :func:`~prealign.loaders.sources.shard_files.url_text` of the list
    (made once: a start over 100k shards searches it instead of stepping through the names), the
    one folder of them all (:func:`~prealign.loaders.sources.shard_files.one_folder`) and the
    text's :func:`~prealign.loaders.sources.shard_files.line_rows` (None: lines of other lengths
    or not made). Numeric ranges (``"/d/s-{000000..099999}.tar"``, ``"/d/{00..99}/s-{000..999}"``:
    :func:`~prealign.loaders.sources.brace_range.numeric_ranges`) are made by numpy in milliseconds
    (:func:`_range_expanded`); braceexpand, ~3 us a name, expands any other pattern."""
    import braceexpand

    if isinstance(urls, Lines):  # (another source's shards: read-only)
        return (urls, urls.text, *_check_unique(urls, urls.text))
    if isinstance(urls, os.PathLike):  # (one shard's path: as its str)
        urls = os.fspath(urls)
    parts = numeric_ranges(urls) if isinstance(urls, str) else None
    if parts is not None:  # (ranges "/d/s-{000000..099999}.tar": their text made by numpy)
        return _range_expanded(*parts)
    # (a list or tuple joined as given: copied only below, when the lines differ in length)
    items = urls if isinstance(urls, (list, tuple)) else [urls] if isinstance(urls, str) else None
    if items is None and (isinstance(urls, (Mapping, bytes)) or not hasattr(urls, "__iter__")):
        raise ConfigError(
            f"urls: expected a shard path or URL, or a list of them, got {type(urls).__name__}"
        )
    items = list(urls) if items is None else items
    try:
        text = url_text(items)
    except TypeError:  # (not all strings: each made one below; a path object is one)
        text = "{"
        for i, item in enumerate(items):
            if not isinstance(item, (str, os.PathLike)):
                raise ConfigError(
                    f"urls[{i}]: expected a shard path or URL (a str), got "
                    f"{type(item).__name__} {item!r:.80}"
                ) from None
    if "{" not in text and "}" not in text and "\\" not in text:  # (100k plain paths: 3 searches)
        out = items
    else:
        out = [
            u
            for item in map(str, items)  # (a plain path as it is: braceexpand costs ~15 us a name)
            for u in (braceexpand.braceexpand(item) if _BRACE.search(item) else (item,))
        ]
        text = url_text(out)
    if not out:
        raise ConfigError(f"urls: no shard URLs given ({urls!r})")
    folder, rows = _check_unique(out, text)
    # (lines of one length: the names sliced from the text, no list of them kept)
    out = Lines(text, rows.shape[1]) if rows is not None else list(out)
    return out, text, folder, rows


def _range_expanded(literals: tuple[str, ...], ranges: tuple):
    """:func:`_expanded` of numeric ranges (``brace_range.numeric_ranges``): the same four answers
    as braceexpand's list would give, the names made by numpy. Their shards are each their own
    when their :func:`shard_identity` keeps the digits (``keeps_digits``): then
    :func:`_check_unique` could only answer :func:`~prealign.loaders.sources.shard_files.
    folder_rows`, which is what is returned, without its step per shard for relative paths and
    URLs. Else (``"/d/{0..1}/../x"``, ``"s3://b/x#{0..1}"``: one shard twice) it is asked."""
    text, width = ranges_text(literals, ranges)
    lines = Lines(text, width)
    if keeps_digits(shard_identity, literals, tuple(d for _, _, d in ranges)):
        rows, folder = folder_rows(text, len(lines))
    else:
        folder, rows = _check_unique(lines, text)
    return (lines if rows is not None else list(lines)), text, folder, rows


def shard_identity(url: str) -> str:
    """What one shard is called whatever way it is written: a local path made absolute and normal
    (``./d/../d/a.tar``, ``file:///w/d/a.tar`` and ``d/a.tar`` are one shard; no file system call,
    so symlinks are not followed); a URL with its scheme and host in lower case, its fragment
    dropped; a ``pipe:`` command as it is."""
    if url.startswith("pipe:"):
        return url
    if _remote.is_remote(url):
        import urllib.parse

        parts = urllib.parse.urlsplit(url)
        return urllib.parse.urlunsplit(
            (parts.scheme.lower(), parts.netloc.lower(), parts.path, parts.query, "")
        )
    return os.path.normpath(os.path.abspath(_remote.local_path(url)))


def check_unique(urls: Sequence[str], text: str | None = None) -> None:
    """A :class:`ConfigError` naming both positions when one shard is listed twice
    (:func:`shard_identity`): its samples would be served twice per epoch. ``text``:
    :func:`~prealign.loaders.sources.shard_files.url_text` of ``urls``, when made already.

    >>> same = shard_identity("file:///d/x.tar") == shard_identity("/d/../d/x.tar")
    >>> same, shard_identity("S3://B/k/x.tar#f")
    (True, 's3://b/k/x.tar')
    """
    _check_unique(urls, text)


def _check_unique(urls: Sequence[str], text: str | None) -> tuple[str | None, object]:
    """:func:`check_unique`; returns the one folder of ``urls`` (``one_folder``), when found, and
    the ``line_rows`` of their text (None when not made or of lines of other lengths)."""
    folder, rows = None, None
    if urls and (text is not None or set(map(type, urls)) == {str}):
        text = url_text(urls) if text is None else text
        rows, folder = folder_rows(text, len(urls))
        fixed = False if rows is None else rows  # (False: the text searched)
        start = "" if _normal_absolute(urls, text, folder, rows) else _one_host(urls, text)
        if start is not None and all_distinct(urls, text, fixed, folder or start):
            return folder, rows  # each its own identity, or it with one start: no call per shard
    seen: dict[str, int] = {}
    for i, url in enumerate(urls):
        j = seen.setdefault(shard_identity(url), i)
        if j != i:
            raise ConfigError(
                f"urls: shard {urls[j]!r} (position {j}) and {url!r} (position {i}) are one shard; "
                f"list each shard once (its samples would be served twice per epoch)"
            )
    return folder, rows


def url_schemes(urls: Sequence[str], text: str) -> frozenset[str]:
    """The :func:`~prealign.loaders.sources.remote.scheme` of each of ``urls`` (``text``: their
    :func:`~prealign.loaders.sources.shard_files.url_text`): the first's alone when every line
    starts with its ``scheme:`` as written and no url holds a newline (three searches: a list of
    100k URLs on one store), else one a url.

    >>> sorted(url_schemes(["s3://b/0", "S3://b/1"], url_text(["s3://b/0", "S3://b/1"])))
    ['s3']
    """
    first = _remote.scheme(urls[0]) if len(urls) else ""
    if first and _every_line_starts(text, len(urls), urls[0][: len(first) + 1]):
        return frozenset((first,))
    return frozenset(map(_remote.scheme, urls))


def any_sequential(urls: Sequence[str]) -> bool:
    """Some shard of ``urls`` is only readable front to back
    (:func:`~prealign.loaders.sources.remote.is_sequential`)."""
    return any(map(_remote.is_sequential, urls))


def _one_host(urls: Sequence[str], text: str) -> str | None:
    """The ``scheme://host/`` that every url starts with, when each is a URL whose
    :func:`shard_identity` is itself with that start in lower case (so two are one shard only when
    they are equal): none holds what ``urlsplit`` drops or moves (a fragment ``#``, a tab or
    carriage return, a ``?`` that ends it). A few searches over their ``url_text``, ``text``; None
    otherwise (then each url's identity is made). A list of 100k object-store URLs at a start.

    >>> urls = ["s3://b/d/0.tar", "s3://b/e/1.tar"]
    >>> fragment = urls[:1] + ["s3://b/d/0.tar#x"]  # (one shard: a fragment is dropped)
    >>> _one_host(urls, url_text(urls)), _one_host(fragment, url_text(fragment)) is None
    ('s3://b/', True)
    """
    first = urls[0]
    scheme, sep, rest = first.partition("://")
    host = rest[: rest.find("/")] if "/" in rest else None
    if not (sep and host and _remote.is_remote(first)) or "?" in host or "pipe:" in first[:5]:
        return None
    start = f"{scheme}://{host}/"
    if not _every_line_starts(text, len(urls), start) or any(
        c in text for c in ("#", "\t", "\r", "?\n")
    ):
        return None
    try:  # (the start itself: a host urlsplit refuses raises below, for the first url)
        shard_identity(first)
    except ValueError:
        return None
    return start


_ABNORMAL = ("//", "/./", "/../", "/.\n", "/..\n", "/\n", "\x00")
"""In ``"\n".join(urls) + "\n"``: what makes one of them other than a normal absolute local path."""


def _normal_absolute(urls: Sequence[str], text: str, folder: str | None, rows=None) -> bool:
    """Every url is an absolute local path already normal (``os.path.normpath(os.path.abspath(u)) ==
    u``): its own :func:`shard_identity`. A few substring searches over their ``url_text``
    (a start over 100k shards); fewer when they are all in ``folder`` (``one_folder``): then only
    the folder and the names ``.`` and ``..`` can be other than normal; ``rows``: the text's
    ``line_rows`` (a line of another length than its rows is not searched for)."""
    lines = len(urls)
    if folder is not None:
        return (
            folder.startswith("/")
            and "//" not in folder
            and (folder == "/" or os.path.normpath(folder) + "/" == folder)
            and "\x00" not in text
            # (each line is folder + a name without "/": abnormal only when the name is . or ..)
            and not any(
                (rows is None or len(line) == rows.shape[1] - 1) and has_line(text, line)
                for line in (folder + ".", folder + "..")
            )
        )
    return _every_line_starts(text, lines, "/") and not any(bad in text for bad in _ABNORMAL)


def _every_line_starts(text: str, count: int, head: str) -> bool:
    """Each of the ``count`` urls of ``text`` (their ``url_text``) starts with ``head`` and none
    holds a newline (so a line is a url): three searches of the text, no step per url."""
    return (
        text.startswith(head) and text.count("\n") == count and text.count("\n" + head) == count - 1
    )


_TORCH_KINDS = "biufc"  # bool, int, uint, float, complex: what torch.from_numpy takes


def _pread(fd: int, size: int, at: int) -> bytes:
    """``size`` bytes of file ``fd`` from byte ``at`` (fewer at its end), one system call (a short
    read is read on, as a buffered ``read(size)`` does)."""
    data = os.pread(fd, size, at)
    while len(data) < size and (more := os.pread(fd, size - len(data), at + len(data))):
        data += more
    return data


def numpy_fields(sample: dict) -> dict:
    """Default transform: every ``<name>.npy`` member -> tensor ``<name>``; other keys kept as they
    are. A big-endian array is converted to native order; an array torch cannot hold (strings,
    records, dates) is a :class:`~prealign.loaders.errors.BadSampleError` naming the member."""
    import torch  # (here: ``prealign index --text`` imports this module, never torch)

    return numpy_arrays(sample, torch.from_numpy)


def numpy_arrays(sample: dict, convert: Callable | None = None) -> dict:
    """:func:`numpy_fields` without torch: the same fields, checks and errors, each array as it is
    (or ``convert(array)``). The index pass checks a text sample with it: same lengths, no
    torch."""
    out = {}
    for k, v in sample.items():
        if isinstance(v, np.ndarray) and k.endswith(".npy"):
            if v.dtype.kind not in _TORCH_KINDS or v.dtype.fields is not None:
                raise BadSampleError(
                    sample=sample.get("__key__"),
                    field=k,
                    expected="a numeric or bool array",
                    actual=f"dtype {v.dtype}",
                )
            if not v.dtype.isnative:
                v = v.astype(v.dtype.newbyteorder("="))
            out[k[:-4]] = v if convert is None else convert(v)
        else:
            out[k] = v
    return out


def check_members(
    where: str, key: str, members: list[tuple[str, bytes, str]], duplicate: bool
) -> None:
    """Raise the :class:`BadSampleError` of a sample whose key was already seen in its shard
    (``duplicate_key``), that has a link member (``link_member``) or a member of another type (a
    directory, GNU sparse, an unknown typeflag: ``unknown_member``); the full and the header pass
    alike."""
    if duplicate:
        raise BadSampleError(
            sample=where,
            field=None,
            reason="duplicate_key",
            expected="a key once per shard",
            actual=f"key {key!r} again after other samples",
        )
    links = [(ext, kind) for ext, _, kind in members if kind != "file"]
    if links:
        ext, kind = links[0]
        if kind in ("hardlink", "symlink", "chardev", "blockdev", "fifo"):
            raise BadSampleError(
                sample=where,
                field=ext,
                reason="link_member",
                expected="regular file members",
                actual=f"a {kind} member (webdataset samples hold their bytes; links are not "
                f"followed)",
            )
        raise BadSampleError(
            sample=where,
            field=ext,
            reason="unknown_member",
            expected="regular file members",
            actual=f"a {kind} member (its data is not read)",
        )


class WebDatasetSource(Source):
    """webdataset shards (local paths, ``file://`` or remote URLs).

    ``required``: member extensions every sample must have (``("input_ids.npy",)``); a sample
    without one is a :class:`~prealign.loaders.errors.MissingMemberError` (handled by the loader's
    bad-data policy). ``image``: ``"pil"`` or ``"bytes"``. ``decoders``: extra ``{extension: bytes
    -> value}`` decoders (pickle-like extensions stay refused; they signal bad bytes with
    ``ValueError``). ``limits``: caps on decoded pixels / array bytes
    (:class:`~prealign.loaders.sources.tar_decode.DecodeLimits`). ``read_timeout``: seconds a shard
    read (open, one 1 MiB chunk, a sample's ``open`` + ``seek`` + ``read``) may make no progress, in
    the index pass and when a batch is loaded alike, before it is a
    :class:`~prealign.loaders.errors.ShardTimeoutError` (``None``: wait forever); a ``pipe:``
    command that stalls is killed.

    Within a shard, a sample with a hard or symbolic link member (``link_member``) or a key already
    seen earlier in the shard (``duplicate_key``) is a bad sample; a local shard that does not exist
    is a :class:`~prealign.loaders.errors.MissingShardError` (configuration, raised before the index
    pass by :func:`~prealign.loaders.index.sidecar.check_source`, or at its first read or later when
    ``shard_check`` checks it against its sidecar); a shard indexed in process and gone when a batch
    is loaded (deleted or replaced since indexing) a
    :class:`~prealign.loaders.errors.ShardGoneError` (bad data: counted under ``skip``).
    """

    sequential = True
    KIND = "webdataset"
    """:meth:`describe`'s kind (without the per-shard list that ``describe`` makes)."""
    shard_check: Callable | None = None
    """Set by the index pass from the shards' sidecars
    (:class:`~prealign.loaders.index.sidecar.ShardChecks`): ``shard_check(source, shard)`` raises
    when a shard no longer matches its index. Called at the first read of
    each shard in each process, before any of its samples is served."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        transform: Transform | None = numpy_fields,
        required: Sequence[str] = (),
        image: str = "pil",
        decoders: Mapping[str, Callable[[bytes], object]] | None = None,
        cache_dir: str | None = None,
        cache_limit: int | None = None,
        index_dir: str | None = None,
        sidecars: bool = True,
        remote: "_remote.RemoteOptions | None" = None,
        max_open_files: int = 16,
        limits: DecodeLimits = DEFAULT_LIMITS,
        read_timeout: float | None = 120.0,
    ):
        if image not in ("pil", "bytes"):
            raise ConfigError(f"image: expected 'pil' or 'bytes', got {image!r}")
        if not isinstance(limits, DecodeLimits):
            raise ConfigError(f"limits: expected a DecodeLimits, got {type(limits).__name__}")
        if read_timeout is not None and (
            isinstance(read_timeout, bool)
            or not isinstance(read_timeout, (int, float))
            or not 0 < read_timeout <= threading.TIMEOUT_MAX  # (a thread's wait: no longer)
        ):
            raise ConfigError(
                f"read_timeout: expected seconds > 0 and <= {threading.TIMEOUT_MAX:g}, or None (no "
                f"deadline), got {read_timeout!r}"
            )
        required = _check_arguments(required, decoders, remote, cache_dir, index_dir, sidecars)
        self.urls, text, self.folder, rows = _expanded(urls)
        """``folder``: the one folder that holds every shard
        (:func:`~prealign.loaders.sources.shard_files.one_folder`), None when there is none."""
        self.transform = transform
        self.required = required  # (a tuple of str: _check_arguments)
        self.image = image
        self.decoders = dict(decoders or {})
        self.cache_dir = cache_dir
        self.index_dir, self.sidecars, self.max_open_files = (
            index_dir,
            bool(sidecars),
            check_positive_int("max_open_files", max_open_files),
        )
        """Sidecars: looked up beside each shard (or in ``index_dir``) when ``sidecars``."""
        if index_dir and self.folder is None:
            # (shards of one folder: distinct paths, as _expanded checked, have distinct names)
            check_index_dir_names(self.urls)
        if remote is None:
            limit = {} if cache_limit is None else {"cache_limit": cache_limit}  # (checked there)
            remote = _remote.RemoteOptions(cache_dir=cache_dir, **limit)
        self.local_only = plain_local(self.urls, text)
        """Every shard a plain local path (one check at the start: no per-shard question of the URLs
        then)."""
        self.schemes = frozenset({""}) if self.local_only else url_schemes(self.urls, text)
        """The schemes of the shards' URLs (:func:`~prealign.loaders.sources.remote.scheme`, lower
        case; ``""``: a local path), found once at the start."""
        if (
            remote.cache_dir is None
            and remote.private_dir is None
            and self.schemes & {"http", "https"}
        ):  # made here: see RemoteOptions
            remote = dataclasses.replace(remote, private_dir=_remote.private_folder())
        self.remote = remote
        self.limits = limits
        self.read_timeout = None if read_timeout is None else float(read_timeout)
        self._local().update(url_text=text, url_rows=rows)  # (for the merged index's check)
        self._stream_only = (
            any(any_line_ends(text, end, rows) for end in (".tar.gz", ".tgz"))
            if self.local_only  # (only a gzip-compressed tar can be sequential)
            else "pipe" in self.schemes
            or (any(e in text for e in (".tar.gz", ".tgz")) and any_sequential(self.urls))
        )

    # ---- shards ---------------------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return len(self.urls)

    def url_text(self) -> str:
        """:func:`~prealign.loaders.sources.shard_files.url_text` of the shards (made once per
        process)."""
        local = self._local()
        if "url_text" not in local:
            local["url_text"] = url_text(self.urls)
        return local["url_text"]

    def url_rows(self) -> np.ndarray | None:
        """:func:`~prealign.loaders.sources.shard_files.line_rows` of :meth:`url_text` (uint8
        ``[S, width]``: a shard a row) when every line has one length, else None (made once per
        process)."""
        local = self._local()
        if "url_rows" not in local:
            local["url_rows"] = line_rows(self.url_text(), self.num_shards)
        return local["url_rows"]

    @property
    def stream_only(self) -> bool:
        """True when some shard can only be read front to back (``pipe:``, ``.tar.gz``): the loader
        then shuffles micro-batches within a bounded window of steps, not over the whole epoch."""
        found = self.__dict__.get("_stream_only")  # (found once, at __init__)
        return any_sequential(self.urls) if found is None else found

    # ---- scanning -------------------------------------------------------------------------------
    def scan_after(self, shard: int, ordinal: int, location, *, seek=None):
        """The records after the sample at ``location`` (``(shard, start, end, ...)``): the members
        before byte ``end`` are read (their keys recorded for the duplicate-key check) but not
        decoded. ``seek``: the location of a sample at or before it that an earlier run consumed:
        the shard is opened at its end (a file seek, an HTTP ``Range`` read; a compressed or piped
        shard is read from its start) and nothing before it is read (nor checked for duplicate
        keys). A subclass with its own ``scan`` gets :meth:`Source.scan_after` (its scan again,
        records dropped)."""
        if type(self).scan is not WebDatasetSource.scan:
            return super().scan_after(shard, ordinal, location)
        return self.scan(shard, after=int(location[2]), seek=int(seek[2]) if seek else 0)

    def scan(self, shard: int, *, after: int = 0, seek: int = 0):
        """:meth:`Source.scan`; ``after``: yield only the records from that byte on
        (:meth:`scan_after`); ``seek``: start reading at that byte (a member boundary)."""
        url = self.urls[shard]

        base = [0]  # the byte the stream starts at: ``seek`` where the shard could be entered

        def opened():
            f = _remote.open_stream_at(url, seek, self.remote) if seek else None
            base[0] = seek if f is not None else 0
            return f or _remote.open_stream(url, self.remote, limits=self.limits)

        try:
            f = TimedReader(opened, timeout=self.read_timeout)
            if base[0] and f.length is not None:
                f.length -= base[0]  # (a file's size: the bytes after the seek)
        except (CorruptShardError, _remote.RemoteReadError) as exc:
            yield (
                None,
                exc if isinstance(exc, CorruptShardError) else CorruptShardError(url, 0, str(exc)),
            )
            return
        except Stalled as exc:
            yield None, ShardTimeoutError(url, 0, f"opening: {exc}")
            return
        except (IsADirectoryError, NotADirectoryError) as exc:
            # a folder where a shard is named (data laid out wrong, like a garbled tar); any other
            # OSError at open (EIO, EACCES) is a system error: it propagates
            yield None, CorruptShardError(url, 0, f"{type(exc).__name__}: {exc}")
            return
        with f:
            key, start, members, seen = None, 0, [], set()
            try:
                members_of = iter_members(f, base=base[0], max_member=self.limits.max_member_bytes)
                for m in members_of:
                    split = split_member_name(m.name)
                    if split is None:
                        if m.offset < after:
                            continue
                        yield (
                            None,
                            Skip(
                                "ignored_member",
                                f"{url}:{m.name}",
                                f"tar {m.kind} member without an extension",
                            ),
                        )
                        continue
                    if split[0] != key:
                        if members:
                            if start >= after:
                                yield (
                                    (shard, start, m.offset, sample_checksum(members)),
                                    self._sample(shard, key, members, key in seen),
                                )
                            seen.add(key)
                        key, start, members = split[0], m.offset, []
                    members.append((split[1], m.data, m.kind))
                    end = m.end
            except (
                TarFormatError,
                EOFError,
                CorruptShardError,
                _remote.RemoteReadError,
                Stalled,
            ) as exc:  # (a bare OSError, a read error of the disk, propagates)
                lost = f"; sample {key!r} lost with the rest of the shard" if members else ""
                err = ShardTimeoutError if isinstance(exc, Stalled) else CorruptShardError
                f.close()  # before the error is handed on: a stalled pipe: command is killed now
                yield None, err(url, getattr(exc, "offset", getattr(exc, "at", 0)), f"{exc}{lost}")
                return
            if members and start >= after:
                yield (
                    (shard, start, end, sample_checksum(members)),
                    self._sample(shard, key, members, key in seen),
                )

    def _sample(
        self, shard: int, key: str, members: list[tuple[str, bytes, str]], duplicate: bool = False
    ):
        """Decoded sample dict, or the :class:`~prealign.schemas.errors.SampleError` that makes it a
        bad sample (an error of any other type is a bug and propagates)."""
        url = self.urls[shard]
        where = f"{url}:{key}"
        try:
            check_members(where, key, members, duplicate)
            sample: dict = {"__key__": key, "__url__": url, "__shard__": shard}
            for ext, data, _ in members:
                if ext in sample:
                    raise MissingMemberError(
                        sample=where,
                        field=ext,
                        expected="one member per extension",
                        actual="a duplicate member",
                    )
                sample[ext] = decode_member(
                    where, ext, data, image=self.image, extra=self.decoders, limits=self.limits
                )
            missing = [r for r in self.required if r not in sample]
            if missing:
                raise MissingMemberError(
                    sample=where,
                    field=missing[0],
                    expected=f"members {list(self.required)}",
                    actual=f"members {sorted(k for k in sample if not k.startswith('__'))}",
                )
            return sample
        except ConfigError:
            raise
        except (
            SampleError
        ) as exc:  # decoding errors are typed; anything else is a bug and propagates
            return exc

    # ---- random access --------------------------------------------------------------------------
    def read(self, location: Location) -> dict:
        shard, start, end = (int(x) for x in location[:3])
        buf = self._bytes(shard, start, end)
        try:
            members = [
                (*split_member_name(m.name), m.data, m.kind)
                for m in iter_members(io.BytesIO(buf), base=start, need_end_marker=False)
                if split_member_name(m.name) is not None
            ]
        except TarFormatError as exc:
            raise SourceChangedError(
                f"{self.urls[shard]} bytes {start}..{end}: {exc}; the shard changed since indexing"
            ) from exc
        keys = {k for k, _, _, _ in members}
        if len(keys) != 1:
            raise SourceChangedError(
                f"{self.urls[shard]} bytes {start}..{end}: keys {sorted(keys)} instead of one "
                f"sample; the shard changed since indexing"
            )
        key_seen = keys.pop()
        members = [(ext, data, kind) for _, ext, data, kind in members]
        if len(location) > 3 and sample_checksum(members) != int(location[3]):
            raise SourceChangedError(
                f"{self.urls[shard]} bytes {start}..{end} (sample {key_seen!r}): checksum "
                f"{sample_checksum(members)}, {int(location[3])} at indexing; the shard changed "
                f"since indexing"
            )
        sample = self._sample(shard, key_seen, members)
        if isinstance(sample, Exception):
            raise sample
        return sample

    def read_ahead(self, locations) -> None:
        """Read the byte ranges of ``locations`` (int64 ``[K, >=3]``: a micro-batch's rows) now,
        for :meth:`read` to take: when every shard is a plain local file, the opens, first-read
        checks and reads of the whole micro-batch run under ONE call of the read deadline
        (:func:`~prealign.loaders.sources.deadline.call_with_timeout`) instead of one each (a
        micro-batch over 90 one-sample shards: one handoff to the deadline's thread, not 90). It
        stops at the first read that fails or at a stall: that row and those after it are read one
        by one, as without it, so each raises what it raises there. Nothing is done when every
        shard of the rows is open and checked already (each read is then a seek and a read in this
        thread, no handoff), and rows past :data:`_AHEAD_BYTES` are left to be read one by one;
        nor for other sources (remote, ``pipe:``, ``.tar.gz``, ``read_timeout=None``)."""
        local = self._local()
        local.pop("ahead", None)
        if (
            self.read_timeout is None
            or not self.__dict__.get("local_only")
            or self.__dict__.get("_stream_only")
            or type(self)._bytes is not WebDatasetSource._bytes
            or len(locations) < 2
        ):
            return
        rows = np.asarray(locations)[:, :3].astype(np.int64)
        within = np.cumsum(rows[:, 2] - rows[:, 1]) <= _AHEAD_BYTES  # (the rest: one by one)
        rows = rows[: int(np.argmin(within)) if not within.all() else len(rows)].tolist()
        files = local.setdefault("files", OrderedDict())
        checked = local.setdefault("checked", set())
        check = self.shard_check
        if all(s in files and (check is None or s in checked) for s, _, _ in rows):
            return  # (each read a seek and a read of an open file: no handoff to save)
        stop: list = []
        ended: list = []  # (stop and ended under one lock: the side that comes second closes)
        lock = threading.Lock()
        got: dict = {}
        opened: OrderedDict = OrderedDict()  # (shard -> file this call opened)
        wholes: dict = {}  # (shard -> its bytes, read whole by its check: of the files in opened)
        new_checked: set = set()

        takes_file = getattr(check, "takes_open_file", False)

        def run() -> None:  # (in the deadline's thread: reads files and checked, changes neither)
            try:
                for shard, start, end in rows:
                    f = opened.get(shard)
                    whole = None if f is None else wholes.get(shard)
                    if f is None:
                        first = (
                            check is not None and shard not in checked and shard not in new_checked
                        )
                        f = None if first else files.get(shard)
                    if f is None:
                        if first and not takes_file:
                            return
                        f, whole = self._open(shard, first)
                        opened[shard] = f
                        if first:
                            new_checked.add(shard)
                        if whole is not None:
                            wholes[shard] = whole
                        if len(opened) > self.max_open_files:
                            gone, old = opened.popitem(last=False)
                            wholes.pop(gone, None)
                            old.close()
                    got[(shard, start, end)] = (
                        whole[start:end]
                        if whole is not None
                        else _pread(f.fileno(), end - start, start)
                    )
                    if stop:
                        return
            except Exception:  # noqa: BLE001 - read again one by one: the row raises there
                pass
            finally:
                with lock:
                    ended.append(True)
                    abandoned = bool(stop)
                if abandoned:  # (abandoned at a stall: nobody takes these)
                    for f in opened.values():
                        f.close()

        try:
            call_with_timeout(run, self.read_timeout)
        except Stalled:
            with lock:
                stop.append(True)
                late = bool(ended)
            if late:  # (it ran to its end as the deadline passed: its files are ours to close)
                for f in opened.values():
                    f.close()
            return
        checked.update(new_checked)
        for shard, f in opened.items():
            old = files.pop(shard, None)
            if old is not None:
                old.close()  # (opened before its check was set: the checked one replaces it)
            files[shard] = f
        while len(files) > self.max_open_files:
            files.popitem(last=False)[1].close()
        local["ahead"] = got

    def _bytes(self, shard: int, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a shard: a local ``seek`` + ``read`` (at most
        ``max_open_files`` files open per process, least recently used closed), a remote range read,
        or a slice of a sequential shard read whole (kept for ``remote.stream_shards`` shards); or
        what :meth:`read_ahead` read."""
        url = self.urls[shard]
        local = self._local()
        ahead = local.get("ahead")
        if ahead:
            data = ahead.pop((shard, start, end), None)
            if data is not None:
                return data
        checking = self.shard_check is not None and shard not in local.setdefault("checked", set())
        plain_file = (
            self.__dict__.get("local_only") and not self.__dict__.get("_stream_only")
        ) or not (_remote.is_sequential(url) or _remote.is_remote(url))  # (a local .tar.gz: no)
        if checking and not (plain_file and getattr(self.shard_check, "takes_open_file", False)):
            # (a stat and two 64 KiB reads, under the read deadline: a hung mount blocks in them)
            try:
                call_with_timeout(lambda: self.shard_check(self, shard), self.read_timeout)
            except Stalled as exc:
                raise ShardTimeoutError(
                    url, 0, f"checking the shard against its index: {exc}"
                ) from None
            local["checked"].add(shard)
            checking = False
        if _remote.is_sequential(url):
            streams = local.setdefault("streams", OrderedDict())
            if shard not in streams:
                streams[shard] = self._read_whole(shard, start)
                while len(streams) > self.remote.stream_shards:
                    streams.popitem(last=False)[1].close()
            streams.move_to_end(shard)
            return os.pread(streams[shard].fileno(), end - start, start)
        if _remote.is_remote(url):
            return _remote.read_range(url, start, end, self.remote)
        files = local.setdefault("files", OrderedDict())
        if checking and shard in files:  # (opened before its check was set: checked on a new open)
            files.pop(shard).close()

        def read():
            f, whole = files.get(shard), None
            if f is None:
                # the open (and at the first read, the check against the index, on the open file)
                # under the read deadline (a hung mount blocks in them), once per shard
                f, whole = call_with_timeout(
                    lambda: self._open(shard, checking),
                    self.read_timeout,
                    late=lambda opened: opened[0].close(),  # (opened after the deadline)
                )
                if checking:
                    local["checked"].add(shard)
                files[shard] = f
                while len(files) > self.max_open_files:
                    files.popitem(last=False)[1].close()
            if whole is not None:  # (the check read the shard whole: no second read)
                return whole[start:end]
            return _pread(f.fileno(), end - start, start)

        try:
            out = read()
        except Stalled as exc:
            what = "checking the shard against its index" if checking else "reading a sample"
            raise ShardTimeoutError(url, 0 if checking else start, f"{what}: {exc}") from None
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise self._gone(
                shard, start, f"no such file ({exc.strerror}); deleted since indexing?"
            ) from None
        except NotRegular as exc:
            raise self._gone(shard, start, f"{exc.kind} instead of the indexed file") from None
        files.move_to_end(shard)
        return out

    def _open(self, shard: int, check: bool):
        """``(file, whole)``: shard ``shard``'s local file, open (``open_regular``); ``check``:
        first checked against its index on the open file (``shard_check(self, shard, file)``: one
        read of a shard of up to 128 KiB, else an ``fstat`` and two; no second open), ``whole`` the
        shard's bytes when the check read all of them (a small shard: its samples are sliced from
        them), else None. A shard that cannot be opened is checked by its path, which names what is
        wrong (a :class:`MissingShardError`, ...), before the open's error is raised."""
        url = self.urls[shard]
        try:
            f = open_regular(url if self.__dict__.get("local_only") else _remote.local_path(url))
        except OSError:
            if check:
                self.shard_check(self, shard)
            raise
        whole = None
        if check:
            try:
                whole = self.shard_check(self, shard, f)
            except BaseException:
                f.close()
                raise
        return f, whole if isinstance(whole, bytes) else None

    def close_files(self) -> None:
        """Close the shard files this process holds open and drop the streams it keeps (a loader
        calls it at the end of each epoch in the process that read them, so no handle is left to the
        garbage collector); the next read opens them again. Shards already checked against their
        index stay checked."""
        local = self._local()
        files = local.pop("files", None) or {}
        streams = local.pop("streams", None) or {}
        for f in [*files.values(), *streams.values()]:
            if callable(getattr(f, "close", None)):
                f.close()

    def _read_whole(self, shard: int, start: int):
        """A sequential shard (``pipe:``, ``.tar.gz``) read whole under the read deadline into an
        anonymous temporary file (a chunk at a time: never held in memory; gzip through
        ``self.limits``); a stalled command is a :class:`ShardTimeoutError` (and killed), a deleted
        file :meth:`_gone`, a corrupt stream or one past
        the limits a :class:`CorruptShardError` naming the byte."""
        url = self.urls[shard]
        spill = tempfile.TemporaryFile(prefix="prealign-stream-")
        try:
            with TimedReader(
                lambda: _remote.open_stream(url, self.remote, limits=self.limits),
                timeout=self.read_timeout,
            ) as f:
                while chunk := f.read(_SPILL_CHUNK):
                    spill.write(chunk)
            spill.flush()
            return spill
        except BaseException as exc:
            spill.close()
            if isinstance(exc, Stalled):
                raise ShardTimeoutError(
                    url, exc.at, f"reading the stream for a sample: {exc}"
                ) from None
            if isinstance(exc, MissingShardError):
                raise self._gone(shard, start, "no such file; deleted since indexing?") from None
            if isinstance(exc, TarFormatError):
                raise CorruptShardError(
                    url, exc.offset, f"reading the stream for a sample: {exc.message}"
                ) from None
            raise

    def _gone(self, shard: int, start: int, problem: str) -> Exception:
        """A shard gone under a read: a :class:`MissingShardError` (configuration, never bad data)
        when its first read checked it against its index, as that check says before the first read;
        else a :class:`ShardGoneError` (bad data)."""
        url = self.urls[shard]
        covers = getattr(self.shard_check, "covers", None)
        if covers is not None and covers(shard):
            return MissingShardError(
                url,
                f"{problem.split(';')[0]}: gone since its first read in this run",
                "the data changed under the run: restore the shard, or re-run `prealign index`",
            )
        return ShardGoneError(url, f"{url}@{start}", problem)

    def shard_of(self, location) -> int:
        """A location ``(shard, start, end, ...)`` names its shard first."""
        return int(location[0])

    def check_locations(self, locations) -> None:
        """Rows ``(shard, start, end[, checksum])``: shards in range, byte ranges from byte 0 on
        that end after they start."""
        width = (
            np.asarray(locations).shape[1]
            if np.ndim(locations) == 2 and np.shape(locations)[1] in (3, 4)
            else 4
        )
        self._check_range(locations, width, {0: self.num_shards})
        locs = np.asarray(locations)
        if len(locs) and not bool(np.all((0 <= locs[:, 1]) & (locs[:, 1] < locs[:, 2]))):
            raise IndexFileError(
                "index locations: a byte range that starts before byte 0 or ends before it "
                "starts; the index was not built by WebDatasetSource"
            )

    def where(self, location: Location) -> str:
        return f"{self.urls[int(location[0])]}@{int(location[1])}"

    def describe(self) -> dict:
        recorded = getattr(
            self.shard_check, "sizes", None
        )  # (from the index; each shard checked at its first read)
        if (
            recorded is not None
            and recorded.min() >= 0
            and (self.__dict__.get("local_only") or not any(map(_FAR.match, self.urls)))
        ):
            return {
                "kind": self.KIND,
                "urls": list(self.urls),
                "sizes": recorded.tolist(),
                "required": list(self.required),
            }
        sizes = []
        for i, u in enumerate(self.urls):
            size = None
            if _REMOTE.match(u) and not u.startswith("file://"):
                pass
            elif recorded is not None and recorded[i] >= 0:
                size = int(recorded[i])
            else:
                try:
                    size = os.stat(_remote.local_path(u)).st_size
                except (OSError, ValueError):  # missing (or a NUL byte in the path)
                    pass
            sizes.append(size)
        return {
            "kind": self.KIND,
            "urls": list(self.urls),
            "sizes": sizes,
            "required": list(self.required),
        }
