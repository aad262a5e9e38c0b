"""Remote shards read by byte range, never copied whole.

    http(s)://host/shard.tar   http.client over kept-alive connections (:mod:`.http_pool`):
                               ``HEAD`` for the size, ``GET`` with ``Range``
    s3://bucket/shard.tar      fsspec (``pip install prealign[remote]``: fsspec + s3fs / gcsfs)
    gs://bucket/shard.tar      fsspec ``cat_file(url, start, end)``
    pipe:cmd ...               webdataset's ``pipe:``: the command's stdout, read sequentially
    *.tar.gz, *.tgz            a gzip stream, read sequentially

A sample is one ``read_range(url, start, end)``: with sidecars, the first batch costs the bytes of
its own samples, not the shard. ``RemoteOptions.cache_dir`` + ``cache_limit`` keep fetched blocks
(``block_size`` bytes, aligned) on local disk, least recently used out past ``cache_limit`` bytes,
named by URL and the object's identity (ETag, else Last-Modified and size, from the HEAD each loader
build makes): an object replaced on the server never reads the old one's blocks. Bodies are read a
``recv`` at a time, bounded by what was asked (a range, ``cache_limit``, a sidecar's limit), never
by an announced ``Content-Length``. Transient errors (connection reset, 5xx, 429) are retried
``retries`` times with exponential backoff; a read that stalls longer than ``timeout`` seconds (no
byte arrives), or an HTTP request still running past ``request_deadline`` seconds (plus one per
``min_rate`` bytes received: a server dripping bytes), is retried too and then raises
:class:`RemoteStallError` naming the URL; a shard that does not exist is a
:class:`~prealign.loaders.errors.MissingShardError` (a configuration error), one the server refuses
(HTTP 401/403, access denied) a :class:`~prealign.loaders.errors.RemotePermissionError`.

A server that ignores ``Range`` (``python -m http.server``, many mirrors) answers a ranged read with
the whole object: that body is read once, in blocks, into the block cache (``cache_dir``, else a
private temporary folder of the process, removed when it exits, shared with the processes it forks
later: the DataLoader workers of a loader built over sidecars read what the build's checks kept) and
later ranges are served from there, with one :class:`~prealign.loaders.errors.RangeIgnoredWarning`
per server. An object larger than ``cache_limit`` is refused
(:class:`~prealign.loaders.errors.RemoteReadError` naming Range), never downloaded once per sample.
A body kept by this process is dropped when a later ``HEAD`` (each loader build makes one) answers
another size, ``ETag`` or ``Last-Modified`` (or neither of the latter).

Sequential shards (``pipe:``, gzip) cannot be read by range: a worker that needs a sample of one
reads the whole shard once (decompressing it; a dropped or stalled HTTP body is a typed error) into
an anonymous temporary file (never into memory) and keeps the last ``stream_shards`` such shards, so
a shuffled epoch costs one sequential read per shard per worker, and temporary disk of one
uncompressed shard per kept shard. Every gzip stream is read through :class:`BoundedGzip`:
decompressed bytes per shard and the ratio to compressed bytes are capped (``DecodeLimits``), and
tar members are capped by ``DecodeLimits.max_member_bytes`` before they are read.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import itertools
import json
import multiprocessing.util
import numbers
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import warnings
import zlib
from dataclasses import dataclass
from typing import Mapping

from prealign.loaders.errors import (
    MissingShardError,
    RangeIgnoredWarning,
    RemotePermissionError,
    RemoteReadError,
    RemoteStallError,
)
from prealign.loaders.sources import http_pool
from prealign.loaders.sources.source import check_folder
from prealign.loaders.sources.tar_decode import DEFAULT_LIMITS, DecodeLimits
from prealign.loaders.sources.tar_reader import TarFormatError
from prealign.schemas.errors import ConfigError, PrealignError

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*):")


@dataclass(frozen=True, kw_only=True)
class RemoteOptions:
    """How remote shards are read (picklable: DataLoader workers get a copy)."""

    cache_dir: str | None = None
    """Local directory for fetched blocks (``None``: no cache, every read goes to the server)."""
    cache_limit: int = 8 << 30
    """Bytes the cache may hold; the least recently used blocks go first."""
    block_size: int = 1 << 20
    """Cached reads fetch aligned blocks of this many bytes."""
    retries: int = 4
    backoff: float = 0.25
    """Seconds before the first retry; doubled each time."""
    timeout: float = 30.0
    """Seconds without a byte before a read counts as stalled."""
    request_deadline: float = 300.0
    """Seconds an HTTP request may take in all (a server sending a byte now and then never trips
    ``timeout``), plus one second per ``min_rate`` bytes received: past it the request is stalled
    (retried, then :class:`RemoteStallError`)."""
    min_rate: float = 64 << 10
    """Bytes per second a long HTTP body must average to run past ``request_deadline``."""
    stream_shards: int = 2
    """Sequential (``pipe:``, gzip) shards each worker keeps decompressed (in anonymous temporary
    files)."""
    storage_options: dict | None = None
    """Passed to ``fsspec.filesystem`` for ``s3://`` / ``gs://`` (endpoint, credentials)."""
    private_dir: str | None = None
    """Where objects of a server that ignores Range are kept when there is no ``cache_dir``: a
    folder made by :func:`private_folder` in the process that built the source (its DataLoader
    workers share it) and removed when that process exits. ``None``: made on first need by the
    reading process."""

    def __post_init__(self):
        _check_number(self, "cache_limit", 0, ints=True, whole_floats=True)  # (8e9 bytes)
        for name, low in (("block_size", 1), ("retries", 0)):
            _check_number(self, name, low, ints=True)
        _check_number(self, "stream_shards", 1, ints=True)
        _check_number(self, "backoff", 0, high=threading.TIMEOUT_MAX)
        for name in ("timeout", "request_deadline"):  # (a socket timeout: at most TIMEOUT_MAX)
            _check_number(self, name, 0, high=threading.TIMEOUT_MAX, above=True)
        _check_number(self, "min_rate", 0)
        for name in ("cache_dir", "private_dir"):
            check_folder(f"RemoteOptions.{name}", getattr(self, name))
        if not isinstance(self.storage_options, (Mapping, type(None))):  # (a DictConfig too)
            raise ConfigError(
                f"RemoteOptions.storage_options: expected a dict or None, got "
                f"{type(self.storage_options).__name__}"
            )
        if self.storage_options is not None:  # (a dict: picklable for the DataLoader workers)
            object.__setattr__(self, "storage_options", dict(self.storage_options))


def _check_number(
    options, name, low, *, ints=False, whole_floats=False, high=float("inf"), above=False
) -> None:
    """``RemoteOptions.<name>``: an int (``ints``: numpy's too; with ``whole_floats`` a float of an
    integer value, ``1e9`` bytes) or a real number, ``>= low`` (``> low`` when ``above``) and
    ``<= high`` (NaN never), a numpy one stored as a Python ``int`` / ``float``; else
    :class:`ConfigError` naming it."""
    value = getattr(options, name)
    if whole_floats and isinstance(value, float) and value.is_integer():
        value = int(value)
    if (
        isinstance(value, bool)  # (np.bool_ is no number either)
        or not isinstance(value, numbers.Integral if ints else numbers.Real)
        or not ((value > low) if above else (value >= low))
        or not value <= high
    ):
        want = "an int" if ints else "a number of seconds" if high < float("inf") else "a number"
        bound = f" and <= {high:g}" if high < float("inf") else ""
        raise ConfigError(
            f"RemoteOptions.{name}: expected {want} {'>' if above else '>='} {low}{bound}, got "
            f"{value!r}"
        )
    if ints or not isinstance(value, (int, float)):  # (np.float32 -> float; an int stays one)
        object.__setattr__(options, name, int(value) if ints else float(value))


DEFAULT = RemoteOptions()


def scheme(url: str) -> str:
    m = _SCHEME.match(url)
    return m.group(1).lower() if m and len(m.group(1)) > 1 else ""


def local_path(url: str) -> str:
    """The file path of a local shard (``file://`` dropped).

    >>> local_path("file:///d/x.tar"), local_path("/d/x.tar")
    ('/d/x.tar', '/d/x.tar')
    """
    return url[len("file://") :] if url.startswith("file://") else url


def is_remote(url: str) -> bool:
    """True for URLs other than local paths and ``file://``.

    >>> is_remote("s3://b/x.tar"), is_remote("/data/x.tar")
    (True, False)
    >>> is_remote("file:///x.tar"), is_remote("C:/x.tar")
    (False, False)
    """
    return scheme(url) not in ("", "file")


def is_sequential(url: str) -> bool:
    """Shards only readable front to back: ``pipe:`` commands and gzip-compressed tars.

    >>> is_sequential("pipe:cat a.tar"), is_sequential("http://h/a.tar.gz"), is_sequential("a.tgz")
    (True, True, True)
    """
    path = url.split("?", 1)[0]
    return scheme(url) == "pipe" or path.endswith((".tar.gz", ".tgz"))


# ---- retries
# ---------------------------------------------------------------------------------------
class _Transient(OSError):
    """An HTTP status worth retrying (429, 5xx)."""


def _retrying(url: str, opts: RemoteOptions, fn):
    """``fn()``, transient failures retried; typed errors (missing, permission, Range refused)
    raised at once."""
    delay = opts.backoff
    for attempt in range(opts.retries + 1):
        try:
            return fn()
        except (
            PrealignError
        ):  # typed already (a RemoteReadError is an OSError): never retried, never re-wrapped
            raise
        except PermissionError as exc:  # fsspec's access denied (s3fs: AccessDenied, 403)
            raise RemotePermissionError(url, None, f"{type(exc).__name__}: {exc}") from None
        except FileNotFoundError as exc:
            raise MissingShardError(url, f"not found ({exc})") from None
        except http_pool.DeadlineExceeded as exc:
            last: BaseException = RemoteStallError(
                url,
                f"{exc} (request_deadline={opts.request_deadline} s, min_rate={opts.min_rate} B/s)",
            )
        except (socket.timeout, TimeoutError) as exc:
            last = RemoteStallError(url, f"no byte for {opts.timeout} s ({exc})")
        except (OSError, http.client.HTTPException) as exc:
            last = exc
        if attempt < opts.retries:
            time.sleep(delay)
            delay *= 2
    if isinstance(last, RemoteStallError):
        raise RemoteStallError(
            url, f"{last.args[0].split(': ', 1)[-1]} after {opts.retries} retries"
        )
    if isinstance(last, http_pool.Unreachable):
        raise MissingShardError(
            url,
            f"unreachable after {opts.retries} retries ({last})",
            "check the host and the network",
        ) from None
    what = str(last) if isinstance(last, _Transient) else f"{type(last).__name__}: {last}"
    raise RemoteReadError(url, f"{what} after {opts.retries} retries")


def _fs(url: str, opts: RemoteOptions):
    try:
        import fsspec
    except ImportError:
        from prealign.schemas.errors import ConfigError

        raise ConfigError(
            f"{url}: reading {scheme(url)}:// needs fsspec and its backend "
            f"(pip install 'prealign[remote]')"
        ) from None
    return fsspec.filesystem(scheme(url), **(opts.storage_options or {}))


def _http(
    url: str,
    opts: RemoteOptions,
    *,
    method: str = "GET",
    start: int | None = None,
    end: int | None = None,
) -> http_pool.Reply:
    """A 2xx answer to ``method url`` (bytes ``[start, end)`` asked when given); other answers
    raise: 401/403 :class:`RemotePermissionError`, other 4xx :class:`MissingShardError`, 429/5xx a
    retried error."""
    headers = {}
    if start is not None:
        headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
    reply = http_pool.request(
        url,
        method,
        headers,
        timeout=opts.timeout,
        deadline=opts.request_deadline,
        min_rate=opts.min_rate,
    )
    if 200 <= reply.status < 300:
        return reply
    reply.close()
    answer = f"HTTP {reply.status} {reply.reason}"
    if reply.status in (401, 403):
        raise RemotePermissionError(url, reply.status, answer)
    if reply.status == 429 or reply.status >= 500:
        raise _Transient(answer)
    if 400 <= reply.status < 500:
        raise MissingShardError(url, answer)
    raise RemoteReadError(url, f"{answer}: expected 200 (206 for a range)")


# ---- size, small files, ranges
# ----------------------------------------------------------------------
def size(url: str, opts: RemoteOptions | None = None) -> int:
    """Size in bytes of a remote object; :class:`MissingShardError` when it does not exist."""
    opts = opts or DEFAULT
    s = scheme(url)
    if s in ("http", "https"):

        def head():
            with _http(url, opts, method="HEAD") as r:
                n = r.headers.get("Content-Length")
                if n is None or not n.isdigit():
                    raise MissingShardError(url, f"the server gives no size (Content-Length {n!r})")
                _check_kept(url, int(n), r.headers)
                _identity[url] = _tag(r.headers.get("ETag"), r.headers.get("Last-Modified"), int(n))
                return int(n)

        return _retrying(url, opts, head)
    if s == "pipe":
        return -1  # unknown without running the command
    fs = _fs(url, opts)

    def info():
        if not fs.exists(url):
            raise MissingShardError(url, "no such object")
        meta = fs.info(url)
        n = int(meta["size"])
        etag = meta.get("ETag") or meta.get("etag") or meta.get("md5Hash")
        _identity[url] = _tag(
            etag and str(etag),
            str(
                meta.get("LastModified")
                or meta.get("mtime")
                or meta.get("updated")
                or meta.get("generation")
                or ""
            ),
            n,
        )
        return n

    return _retrying(url, opts, info)


SMALL_LIMIT = 256 << 20
"""Bytes a small remote file (a sidecar) may have: a larger body is refused, never read whole."""


def read_small(url: str, opts: RemoteOptions | None = None) -> bytes | None:
    """A whole small remote file (a sidecar, optional), or None when it does not exist or the server
    refuses it (S3 answers 403 for an absent key of a bucket the caller cannot list)."""
    opts = opts or DEFAULT
    try:
        if scheme(url) in ("http", "https"):

            def get():
                with _http(url, opts) as r:
                    data = _read_upto(
                        r, SMALL_LIMIT + 1
                    )  # never trust Content-Length: count what comes
                if len(data) > SMALL_LIMIT:
                    raise RemoteReadError(
                        url, f"a sidecar of more than {SMALL_LIMIT} bytes: not one prealign wrote"
                    )
                return data

            return _retrying(url, opts, get)
        fs = _fs(url, opts)
        return _retrying(url, opts, lambda: fs.cat_file(url))
    except (MissingShardError, RemotePermissionError):
        return None


def _read_upto(reply: http_pool.Reply, n: int) -> bytes:
    """The next ``n`` bytes of a body (fewer at its end), asked ``CHUNK`` bytes at a time."""
    chunks, left = [], n
    while left > 0 and (chunk := reply.read(min(left, http_pool.CHUNK))):
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _get_range(url: str, start: int, end: int, opts: RemoteOptions) -> bytes:
    with _http(url, opts, start=start, end=end) as r:
        if r.status == 200:
            return _keep_whole(url, r, start, end, opts)
        sent = r.headers.get("Content-Range", "")
        m = re.match(r"bytes (\d+)-", sent)
        if r.status != 206 or (m and int(m.group(1)) != start):
            raise RemoteReadError(
                url,
                f"asked bytes {start}..{end} (Range), the server answered HTTP {r.status} "
                f"{r.reason} (Content-Range {sent!r})",
            )
        whole = re.search(r"/(\d+)$", sent)
        etag, modified = r.headers.get("ETag"), r.headers.get("Last-Modified")
        if whole and url in _identity and (etag or modified or _identity[url].startswith("m|")):
            _identity[url] = _tag(
                etag, modified, int(whole.group(1))
            )  # as this answer gives it (it may have changed)
        return _read_upto(r, end - start)


def _fetch(url: str, start: int, end: int, opts: RemoteOptions) -> bytes:
    if scheme(url) in ("http", "https"):
        data = _retrying(url, opts, lambda: _get_range(url, start, end, opts))
    else:
        fs = _fs(url, opts)
        data = _retrying(url, opts, lambda: fs.cat_file(url, start=start, end=end))
    if len(data) != end - start:
        raise RemoteReadError(url, f"bytes {start}..{end}: got {len(data)} bytes")
    return data


MARKER = ".prealign-block-cache"
"""The file a :class:`BlockCache` writes in its folder (made or adopted): the folder holds
prealign's blocks."""


class BlockCache:
    """Fetched blocks on local disk (``<dir>/<sha1(url, identity)[:16]>-<block size>-<block>``, the
    identity being the object's ETag, else its Last-Modified and size: a changed object never reads
    the old one's blocks), least recently used (by modification time, touched on each hit) out past
    ``limit`` bytes. Processes may share the directory: each eviction pass looks at what is really
    there, and a block evicted under a reader is fetched again. A pass walks the whole folder, so
    one is made only when this process's count of its bytes (the last pass's total and what it put
    since) passes ``limit``, or it put :attr:`slack` bytes since its last pass; a pass evicts down
    to ``limit - slack``. So a process keeps the folder within
    ``limit`` after each put, at a number of passes that grows with the bytes put, not with the
    blocks held times the blocks put; ``P`` processes sharing it between them may pass it by at most
    ``P * slack`` between their passes. An object kept whole (a server ignoring Range), at most
    ``limit`` bytes, loses none of its blocks to the passes of its own download (``keep``): only
    other blocks go below ``limit``. The folder is marked as a block cache (:data:`MARKER`); one
    removed under a run is made again."""

    SLACK_FRACTION = 64
    """:attr:`slack` is ``limit`` over this (an 8 GiB cache: walked once per 128 MiB put)."""

    def __init__(self, directory: str, limit: int):
        self.dir, self.limit, self.lock = directory, int(limit), threading.Lock()
        self.slack = self.limit // self.SLACK_FRACTION
        """Bytes put between two passes at most; what a pass over ``limit`` evicts below it."""
        self._held: int | None = None  # (bytes held as last counted, and put since; None: unknown)
        self._since = 0  # (bytes put since the last pass)
        self._own()

    def _own(self) -> None:
        """Make (or adopt) the folder and mark it as a block cache."""
        try:
            os.makedirs(self.dir, exist_ok=True)
            marker = os.path.join(self.dir, MARKER)
            if not os.path.exists(marker):
                with open(marker, "w") as f:
                    f.write(
                        "prealign block cache: files named <16 hex>-<block size>-<block> are "
                        "fetched blocks, "
                        "evicted least recently used first; nothing else here is ever removed\n"
                    )
        except OSError as exc:
            raise RemoteReadError(
                self.dir,
                f"the block cache folder cannot be made or written "
                f"({type(exc).__name__}: {exc}); check RemoteOptions.cache_dir",
            ) from None

    def get(self, name: str) -> bytes | None:
        path = os.path.join(self.dir, name)
        try:
            with open(path, "rb") as f:
                data = f.read()
            os.utime(path)
            return data
        except OSError:
            return None

    def put(self, name: str, data: bytes, *, evict: bool = True, keep: str = "") -> None:
        """Keep ``data`` as ``name`` (``evict=False``: the caller calls :meth:`evict` later;
        ``keep``: see :meth:`evict`)."""
        if len(data) > self.limit:
            return
        tmp = os.path.join(self.dir, f"{name}.{os.getpid()}.{threading.get_ident()}.part")
        for again in (True, False):
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, os.path.join(self.dir, name))
                break
            except FileNotFoundError:  # the folder was removed under the run: made again, once
                if not again:
                    raise RemoteReadError(
                        self.dir,
                        "the block cache folder keeps vanishing while blocks are written to it",
                    ) from None
                self._own()
        with self.lock:
            self._since += len(data)
            if self._held is not None:
                self._held += len(data)
        if evict:
            self.evict(keep)

    def drop(self, name: str) -> None:
        """Forget block ``name`` (a read found it wrong)."""
        if _BLOCK_NAME.fullmatch(name):
            try:
                os.remove(os.path.join(self.dir, name))
            except OSError:
                pass

    def evict(self, keep: str = "") -> None:
        """Least recently used blocks out until this cache's blocks take at most ``limit`` bytes
        (a pass over the folder when due: see the class). Only files named as blocks are counted
        and removed: nothing else in the folder (the user's ``cache_dir`` may hold other files) is
        ever deleted. ``keep``: blocks whose name starts with it (an object being kept whole,
        at most ``limit`` bytes) go only while the blocks take more than ``limit``, not down to
        ``limit - slack``: else an object within the limit lost its first blocks to its own pass."""
        with self.lock:
            if self._held is None or self._held > self.limit or self._since >= max(self.slack, 1):
                self._held, self._since = self._evict(keep), 0

    def _evict(self, keep: str = "") -> int:
        """One pass: the blocks counted, the least recently used removed while they take more than
        ``limit - slack`` (so the next pass is ``slack`` bytes of puts away; those named ``keep...``
        only past ``limit``); the bytes left."""
        entries = []
        try:
            found = list(os.scandir(self.dir))
        except FileNotFoundError:  # removed under the run: nothing to evict, the folder made again
            self._own()
            return 0
        for e in found:
            if not _BLOCK_NAME.fullmatch(e.name) or not e.is_file(follow_symlinks=False):
                continue
            try:
                st = e.stat()
            except OSError:
                continue
            entries.append((st.st_mtime_ns, e.name, st.st_size))
        total = sum(n for _, _, n in entries)
        if total <= self.limit - self.slack:
            return total
        for _, name, n in sorted(entries):
            if total <= self.limit - self.slack:
                break
            if keep and name.startswith(keep) and total <= self.limit:
                continue
            try:
                os.remove(os.path.join(self.dir, name))
            except OSError:
                pass
            total -= n
        return total


_caches: dict[tuple, BlockCache] = {}
_BLOCK_NAME = re.compile(r"[0-9a-f]{16}-\d+-\d+")
"""What :func:`_block_name` writes: the only files a :class:`BlockCache` ever removes."""


def _block_cache(directory: str, limit: int) -> BlockCache:
    """This process's :class:`BlockCache` over ``directory`` (its own lock, never one inherited
    across fork)."""
    key = (os.getpid(), directory, limit)
    if key not in _caches:
        _caches[key] = BlockCache(directory, limit)
    return _caches[key]


def _cache(opts: RemoteOptions) -> BlockCache | None:
    return _block_cache(opts.cache_dir, opts.cache_limit) if opts.cache_dir else None


def _block_name(url: str, ident: str, block_size: int, block: int) -> str:
    """A block's file name: the URL and the object's identity (:func:`_tag`) hashed, so a changed
    object (another ETag, Last-Modified or size) never reads the blocks of the one before it."""
    digest = hashlib.sha1((url + "\n" + ident).encode()).hexdigest()[:16]
    return f"{digest}-{block_size}-{block}"


_identity: dict[str, str] = {}
"""URL -> the object's identity as this process last saw it (a HEAD, object-store metadata, a 206
answer)."""


def _tag(etag: str | None, modified: str | None, size) -> str:
    """An object's identity: its ETag, else its Last-Modified and size."""
    return f"e{etag}" if etag else f"m{modified or ''}|{size}"


def _ident(url: str, opts: RemoteOptions) -> str:
    """The identity of ``url``'s object in this process (one ``HEAD``, or metadata read, the first
    time)."""
    if url not in _identity:
        size(url, opts)
    return _identity.get(url, "")


# ---- servers that ignore Range
# -----------------------------------------------------------------------
@dataclass(frozen=True)
class _Kept:
    """An object this process read whole (its server ignores Range), kept in blocks in a cache
    folder."""

    directory: str
    limit: int
    block_size: int
    size: int
    validators: tuple
    """(ETag, Last-Modified) of the answer that brought it."""
    ident: str
    """The identity its blocks are named under (:func:`_block_name`)."""


_kept: dict[str, _Kept] = {}
_private: list[str] = []
_warned: set[str] = set()


def _kept_name(url: str) -> str:
    return "kept-" + hashlib.sha1(url.encode()).hexdigest()[:16]


def _share_kept(url: str, kept: _Kept, opts: RemoteOptions) -> None:
    """Record ``url``'s kept object in the run's private folder, so the other processes of this run
    (the DataLoader workers of this and later epochs, each checking the shards it opens) read it
    from there instead of downloading it again. Only there: that folder lives as long as the run,
    and holds only what its processes downloaded."""
    if opts.private_dir and kept.directory == _block_cache(opts.private_dir, opts.cache_limit).dir:
        record = {
            "limit": kept.limit,
            "block_size": kept.block_size,
            "size": kept.size,
            "validators": list(kept.validators),
            "ident": kept.ident,
        }
        _block_cache(kept.directory, kept.limit).put(
            _kept_name(url), json.dumps(record).encode(), evict=False
        )  # (no pass: a record is no block, and one would trim the object just kept)


def _kept_of(url: str, opts: RemoteOptions) -> _Kept | None:
    """The object this process keeps for ``url``, or one another process of the run kept
    (:func:`_share_kept`), when this process saw no other identity of it (a ``HEAD``)."""
    kept = _kept.get(url)
    if kept is not None or not opts.private_dir:
        return kept
    cache = _block_cache(opts.private_dir, opts.cache_limit)
    data = cache.get(_kept_name(url))
    if data is None:
        return None
    try:
        r = json.loads(data)
        kept = _Kept(
            cache.dir,
            int(r["limit"]),
            int(r["block_size"]),
            int(r["size"]),
            tuple(r["validators"]),
            str(r["ident"]),
        )
    except (ValueError, KeyError, TypeError):
        return None
    seen = _identity.get(url)
    if seen is not None and seen != kept.ident and seen != _tag(*kept.validators, kept.size):
        return None  # this process saw another version of the object
    _kept[url] = kept
    return kept


def _validators(headers) -> tuple:
    return headers.get("ETag"), headers.get("Last-Modified")


def _check_kept(url: str, n: int, headers) -> None:
    """Drop the body kept for ``url`` unless a ``HEAD`` now answers its size and validators."""
    kept = _kept.get(url)
    if kept is not None and (
        kept.size != n or not any(kept.validators) or kept.validators != _validators(headers)
    ):
        _kept.pop(url, None)


def private_folder() -> str:
    """This process's temporary folder for the objects of servers that ignore Range (made once,
    removed when the process exits; processes it forks or spawns write into it through
    ``RemoteOptions.private_dir``)."""
    if not _private:
        _private.append(tempfile.mkdtemp(prefix="prealign-remote-"))
        multiprocessing.util.Finalize(
            None, _remove_private, args=(_private[-1], os.getpid()), exitpriority=0
        )
    return _private[0]


def _private_cache(opts: RemoteOptions) -> BlockCache:
    """The block cache of objects kept whole when there is no ``cache_dir``: ``opts.private_dir``
    (the source's process made it, so a worker's copies outlive neither that process nor one
    another), else this process's."""
    return _block_cache(opts.private_dir or private_folder(), opts.cache_limit)


def _remove_private(directory: str, owner: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(directory, ignore_errors=True)


def _keep_whole(
    url: str, reply: http_pool.Reply, start: int, end: int, opts: RemoteOptions
) -> bytes:
    """Bytes ``[start, end)`` of the whole object a server sent to a ranged GET: the body is read
    once into the block cache (``opts.cache_dir``, else :func:`_private_cache`) and later ranges are
    read from there; one larger than ``cache_limit`` is refused (announced or counted, never
    allocated by its announced size)."""
    cache = _cache(opts) or _private_cache(opts)
    parts = urllib.parse.urlsplit(url)
    server = f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)
    refused = (
        f"{server} ignores Range (it answered a ranged GET with 200 and the whole object, {{}}): "
        f"an object is kept whole only up to cache_limit={cache.limit} bytes; raise "
        f"RemoteOptions.cache_limit or serve the shards from a server that honours Range"
    )
    announced = reply.headers.get("Content-Length", "")
    if announced.isdigit() and int(announced) > cache.limit:
        raise RemoteReadError(url, refused.format(f"{announced} bytes"))
    bs, total, out = opts.block_size, 0, []
    ident = _tag(reply.headers.get("ETag"), reply.headers.get("Last-Modified"), announced or "?")
    for block in itertools.count():
        data = _read_upto(reply, bs)
        total += len(data)
        if total > cache.limit:
            raise RemoteReadError(url, refused.format(f"more than {cache.limit} bytes"))
        name = _block_name(url, ident, bs, block)
        if data:  # (this object's blocks, sharing its name's prefix, kept within the limit)
            cache.put(name, data, evict=block % 64 == 63, keep=name[:17])
        lo = block * bs
        out.append(data[max(start - lo, 0) : max(end - lo, 0)])
        if len(data) < bs:
            break
    if announced.isdigit() and total != int(
        announced
    ):  # a body without Content-Length that stopped early
        raise RemoteReadError(url, f"the whole object announced {announced} bytes, {total} came")
    cache.evict(keep=_block_name(url, ident, bs, 0)[:17])
    _kept[url] = _Kept(cache.dir, cache.limit, bs, total, _validators(reply.headers), ident)
    _share_kept(url, _kept[url], opts)
    if server not in _warned:
        _warned.add(server)
        warnings.warn(
            f"{server} ignores HTTP Range (it answered a ranged GET of {url} with 200 and the "
            f"whole "
            f"object): each object from it is downloaded whole once and kept in {cache.dir} (at "
            f"most cache_limit={cache.limit} bytes); a server that honours Range sends only the "
            f"samples' bytes",
            RangeIgnoredWarning,
            stacklevel=2,
        )
    return b"".join(out)


def read_range(
    url: str, start: int, end: int, opts: RemoteOptions | None = None, *, total: int | None = None
) -> bytes:
    """Bytes ``[start, end)`` of a remote object (through the block cache when ``opts.cache_dir``,
    or when this process keeps the object whole because its server ignores Range)."""
    opts = opts or DEFAULT
    kept = _kept_of(url, opts)
    cache = _block_cache(kept.directory, kept.limit) if kept else _cache(opts)
    if cache is None:
        return _fetch(url, start, end, opts)
    bs = kept.block_size if kept else opts.block_size
    total = kept.size if kept else total
    ident = kept.ident if kept else _ident(url, opts)
    out, names = [], []
    for block in range(start // bs, (end - 1) // bs + 1):
        name = _block_name(url, ident, bs, block)
        data = cache.get(name)
        if data is None and kept is not None and url not in _warned:
            _warned.add(url)
            warnings.warn(
                f"{url}: a block of this object, kept whole because its server ignores Range, was "
                f"evicted "
                f"from the block cache (cache_limit={kept.limit} bytes is less than the objects "
                f"read together): each such miss downloads the whole object again; raise "
                f"RemoteOptions.cache_limit",
                RangeIgnoredWarning,
                stacklevel=2,
            )
        if data is None:
            lo = block * bs
            hi = lo + bs if total is None else min(lo + bs, total)
            data = (
                _fetch(url, lo, hi, opts) if total is not None else _fetch_upto(url, lo, hi, opts)
            )
            if (
                kept is None and _identity.get(url, ident) != ident
            ):  # the object changed: its blocks under the new
                ident = _identity[url]
                name = _block_name(url, ident, bs, block)
            if _kept.get(url) is kept:  # (else the fetch kept it whole: its blocks are put)
                cache.put(name, data)
        out.append(data)
        names.append(name)
    buf = b"".join(out)
    off = start - (start // bs) * bs
    data = buf[off : off + end - start]
    if (
        len(data) != end - start
    ):  # a short block in the cache (another process's, or a size that changed)
        for name in names:
            cache.drop(name)
        _kept.pop(url, None)
        raise RemoteReadError(
            url,
            f"bytes {start}..{end}: the block cache held {len(data)} bytes of them (dropped; "
            f"read again)",
        )
    return data


def _fetch_upto(url: str, lo: int, hi: int, opts: RemoteOptions) -> bytes:
    """Block ``[lo, hi)`` that may run past the end of the object (size unknown): fetch the size
    once."""
    n = size(url, opts)
    return _fetch(url, lo, min(hi, n), opts)


# ---- sequential streams
# ------------------------------------------------------------------------------
def open_stream(
    url: str,
    opts: RemoteOptions | None = None,
    *,
    paced_by_reader: bool = True,
    limits: DecodeLimits | None = None,
):
    """A file object reading the whole shard front to back (gzip decompressed for
    ``.tar.gz``/``.tgz``, through :class:`BoundedGzip` capped by ``limits``). ``paced_by_reader``:
    read as the caller consumes it (a scan feeding training), so an HTTP body has no total deadline,
    only the per-read stall timeout; False (read at
    once, :func:`read_whole`): the request's deadline."""
    opts = opts or DEFAULT
    s = scheme(url)
    if s == "pipe":
        # the user's own command, in its own process group: a stalled one is killed whole
        # (deadline.kill_stream)
        proc = subprocess.Popen(
            url[len("pipe:") :], shell=True, stdout=subprocess.PIPE, start_new_session=True
        )
        f = _PipeFile(proc, url)
    elif s in ("http", "https"):
        f = _HttpStream(url, _retrying(url, opts, lambda: _http(url, opts)), opts, paced_by_reader)
    elif s in ("", "file"):
        path = local_path(url)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise MissingShardError(url, "no such shard") from None
    else:
        fs = _fs(url, opts)
        f = _retrying(url, opts, lambda: fs.open(url, "rb", block_size=opts.block_size))
    if url.split("?", 1)[0].endswith((".tar.gz", ".tgz")):
        return BoundedGzip(f, url, limits or DEFAULT_LIMITS)
    return f


def open_stream_at(url: str, start: int, opts: RemoteOptions | None = None):
    """A file object reading the shard from byte ``start`` to its end (a file seek; an HTTP GET of
    ``Range: bytes=start-``), or None where the shard cannot be entered there: a compressed shard,
    a ``pipe:``, a server that ignores ``Range`` (the caller reads it from the start)."""
    opts = opts or DEFAULT
    s = scheme(url)
    if s == "pipe" or url.split("?", 1)[0].endswith((".tar.gz", ".tgz")):
        return None
    if s in ("http", "https"):
        reply = _retrying(url, opts, lambda: _http(url, opts, start=start))
        sent = re.match(r"bytes (\d+)-", reply.headers.get("Content-Range", ""))
        if reply.status != 206 or not sent or int(sent.group(1)) != start:
            reply.close()
            return None
        f = _HttpStream(url, reply, opts)
        f.pos = start
        return f
    if s in ("", "file"):
        try:
            f = open(local_path(url), "rb")
        except FileNotFoundError:
            raise MissingShardError(url, "no such shard") from None
    else:
        fs = _fs(url, opts)
        f = _retrying(url, opts, lambda: fs.open(url, "rb", block_size=opts.block_size))
    f.seek(start)
    return f


_RATIO_FROM = 64 << 20
"""Decompressed bytes past which :attr:`DecodeLimits.max_ratio` is checked (a small shard's headers
compress far better than its data)."""


class _Counted:
    """``raw`` with the bytes read from it counted (``count``); its other attributes are ``raw``'s
    (``proc`` of a ``pipe:`` stream, ``fileno``)."""

    def __init__(self, raw):
        self.raw, self.count = raw, 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.count += len(data)
        return data

    def __getattr__(self, name: str):
        return getattr(self.raw, name)


class BoundedGzip(gzip.GzipFile):
    """A gzip stream whose decompressed bytes are counted and capped by ``limits``
    (:class:`~prealign.loaders.sources.tar_decode.DecodeLimits`: ``max_shard_bytes``,
    ``max_ratio``); past a cap, or on a corrupt or truncated stream, a read raises a
    :class:`~prealign.loaders.sources.tar_reader.TarFormatError` at the decompressed byte offset it
    reached (the tar offset; its caller names the shard and the member: a ``corrupt_shard``), never
    more memory or a bare ``EOFError`` at byte 0."""

    def __init__(self, raw, url: str, limits: DecodeLimits):
        self.counted = _Counted(raw)
        super().__init__(fileobj=self.counted, mode="rb")
        self.url, self.limits, self.decompressed = url, limits, 0
        self.failed: TarFormatError | None = None

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            parts = []
            while part := self.read(1 << 20):
                parts.append(part)
            return b"".join(parts)
        if self.failed is not None:
            raise self.failed
        parts, got = [], 0
        while got < size:
            try:
                data = super().read1(size - got)  # (read() would drop what came before a failure)
            except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
                error = TarFormatError(
                    self.decompressed,
                    f"corrupt or truncated gzip stream after "
                    f"{self.counted.count} compressed bytes ({type(exc).__name__}: {exc})",
                )
                if not got:
                    raise error from None
                self.failed = error  # the bytes before it first, the error at the next read
                break
            if not data:
                break
            parts.append(data)
            got += len(data)
            self.decompressed += len(data)
            self._check(len(data))
        return b"".join(parts)

    def _check(self, last: int) -> None:
        limits, n, packed = self.limits, self.decompressed, max(self.counted.count, 1)
        if n > limits.max_shard_bytes:
            raise TarFormatError(
                n - last,
                f"decompressed past DecodeLimits.max_shard_bytes ({limits.max_shard_bytes} bytes)",
            )
        if n > _RATIO_FROM and n > limits.max_ratio * packed:
            raise TarFormatError(
                n - last,
                f"{n} bytes decompressed from {packed}: past DecodeLimits.max_ratio "
                f"({limits.max_ratio}; a decompression bomb?)",
            )

    def read1(self, size: int = -1) -> bytes:
        return self.read(size if size and size > 0 else 1 << 20)


class _HttpStream:
    """The body of an HTTP GET read front to back. A connection dropped or stalled mid-body is taken
    up again where it stopped (a ``Range`` GET from that byte, ``If-Range`` the object's validators)
    up to ``retries`` times per stream, with backoff; past them, or from a server that cannot resume
    (it ignores Range, the object changed), it is a :class:`RemoteReadError` /
    :class:`RemoteStallError` naming the URL and the byte, never a bare ``TimeoutError``
    or ``IncompleteRead``."""

    def __init__(self, url: str, reply: http_pool.Reply, opts: RemoteOptions, paced: bool = True):
        self.url, self.opts, self.pos, self.resumes, self.paced = url, opts, 0, 0, paced
        self.reply = reply.paced_by_reader() if paced else reply
        self.validator = reply.headers.get("ETag") or reply.headers.get("Last-Modified")

    def read(self, n: int = -1) -> bytes:
        while True:
            try:
                data = self.reply.read(n)
            except (OSError, http.client.HTTPException) as exc:
                error = self._typed(exc)
                if self.resumes >= self.opts.retries:
                    raise error from None
                time.sleep(self.opts.backoff * 2**self.resumes)
                self.resumes += 1
                if not self._resume():
                    raise error from None
                continue
            self.pos += len(data)
            return data

    def _typed(self, exc: BaseException) -> RemoteReadError:
        at, opts = f"at byte {self.pos}", self.opts
        if isinstance(exc, http_pool.DeadlineExceeded):
            return RemoteStallError(
                self.url,
                f"{at}: {exc} (request_deadline={opts.request_deadline} s, "
                f"min_rate={opts.min_rate} B/s)",
            )
        if isinstance(exc, (socket.timeout, TimeoutError)):
            return RemoteStallError(self.url, f"{at}: no byte for {opts.timeout} s ({exc})")
        return RemoteReadError(self.url, f"{at}: the body stopped ({type(exc).__name__}: {exc})")

    def _resume(self) -> bool:
        """The body again from byte ``pos`` (True), or False when the server cannot give it."""
        self.reply.close()
        headers = {"Range": f"bytes={self.pos}-"}
        if self.validator:
            headers["If-Range"] = self.validator
        try:
            reply = http_pool.request(
                self.url,
                "GET",
                headers,
                timeout=self.opts.timeout,
                deadline=self.opts.request_deadline,
                min_rate=self.opts.min_rate,
            )
        except (OSError, http.client.HTTPException, RemoteReadError):
            return False
        m = re.match(r"bytes (\d+)-", reply.headers.get("Content-Range", ""))
        if not (
            reply.status == 206
            and m
            and int(m.group(1)) == self.pos
            or reply.status == 200
            and self.pos == 0
        ):
            reply.close()
            return False
        self.reply = reply.paced_by_reader() if self.paced else reply
        return True

    def close(self) -> None:
        self.reply.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _PipeFile:
    """stdout of a ``pipe:`` command; a non-zero exit at the end is a :class:`RemoteReadError`."""

    def __init__(self, proc, url: str):
        self.proc, self.url = proc, url

    def read(self, n: int = -1) -> bytes:
        data = self.proc.stdout.read(n)
        if not data and n != 0:
            rc = self.proc.wait()
            if rc:
                raise RemoteReadError(self.url, f"command exited with status {rc}")
        return data

    def close(self) -> None:
        self.proc.stdout.close()
        self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_whole(url: str, opts: RemoteOptions | None = None) -> bytes:
    """A sequential shard, decompressed, as one bytes object (under the request's total
    deadline)."""
    with open_stream(url, opts, paced_by_reader=False) as f:
        chunks = []
        while chunk := f.read(1 << 20):
            chunks.append(chunk)
    return b"".join(chunks)
