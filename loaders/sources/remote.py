"""Remote shards read by byte range, never copied whole.

    http(s)://host/shard.tar   urllib (standard library): ``HEAD`` for the size, ``GET`` with ``Range``
    s3://bucket/shard.tar      fsspec (``pip install prealign[remote]``: fsspec + s3fs / gcsfs)
    gs://bucket/shard.tar      fsspec ``cat_file(url, start, end)``
    pipe:cmd ...               webdataset's ``pipe:``: the command's stdout, read sequentially
    *.tar.gz, *.tgz            a gzip stream, read sequentially

A sample is one ``read_range(url, start, end)``: with sidecars, the first batch costs the bytes of
its own samples, not the shard. ``RemoteOptions.cache_dir`` + ``cache_limit`` keep fetched blocks
(``block_size`` bytes, aligned) on local disk, least recently used out past ``cache_limit`` bytes.
Transient errors (connection reset, 5xx, 429) are retried ``retries`` times with exponential backoff;
a read that stalls longer than ``timeout`` seconds (no byte arrives) is retried too and then raises
:class:`RemoteStallError` naming the URL; a shard that does not exist is a
:class:`~prealign.loaders.errors.MissingShardError` (a configuration error).

Sequential shards (``pipe:``, gzip) cannot be read by range: a worker that needs a sample of one
reads the whole shard once (decompressing it) into memory and keeps the last ``stream_shards`` such
shards, so a shuffled epoch costs one sequential read per shard per worker, and memory of one
uncompressed shard per kept shard.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import re
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from prealign.loaders.errors import MissingShardError
from prealign.schemas.errors import PrealignError

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*):")


class RemoteReadError(PrealignError):
    """A remote shard could not be read (after the retries): ``.url`` names it."""

    def __init__(self, url: str, message: str):
        self.url = url
        super().__init__(f"{url}: {message}")


class RemoteStallError(RemoteReadError):
    """A remote read received no byte for longer than ``RemoteOptions.timeout`` seconds (after the retries)."""


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
    stream_shards: int = 2
    """Sequential (``pipe:``, gzip) shards each worker keeps decompressed in memory."""
    storage_options: dict | None = None
    """Passed to ``fsspec.filesystem`` for ``s3://`` / ``gs://`` (endpoint, credentials)."""


DEFAULT = RemoteOptions()


def scheme(url: str) -> str:
    m = _SCHEME.match(url)
    return m.group(1).lower() if m and len(m.group(1)) > 1 else ""


def local_path(url: str) -> str:
    """The file path of a local shard (``file://`` dropped).

    >>> local_path("file:///d/x.tar"), local_path("/d/x.tar")
    ('/d/x.tar', '/d/x.tar')
    """
    return url[len("file://"):] if url.startswith("file://") else url


def is_remote(url: str) -> bool:
    """True for URLs other than local paths and ``file://``.

    >>> is_remote("s3://b/x.tar"), is_remote("/data/x.tar"), is_remote("file:///x.tar"), is_remote("C:/x.tar")
    (True, False, False, False)
    """
    return scheme(url) not in ("", "file")


def is_sequential(url: str) -> bool:
    """Shards only readable front to back: ``pipe:`` commands and gzip-compressed tars.

    >>> is_sequential("pipe:cat a.tar"), is_sequential("http://h/a.tar.gz"), is_sequential("a.tgz")
    (True, True, True)
    """
    path = url.split("?", 1)[0]
    return scheme(url) == "pipe" or path.endswith((".tar.gz", ".tgz"))


# ---- retries ---------------------------------------------------------------------------------------
def _retrying(url: str, opts: RemoteOptions, fn):
    delay = opts.backoff
    for attempt in range(opts.retries + 1):
        try:
            return fn()
        except MissingShardError:
            raise
        except urllib.error.HTTPError as exc:
            if exc.code in (404, 403, 410, 416) or (400 <= exc.code < 500 and exc.code != 429):
                raise MissingShardError(url, f"HTTP {exc.code} {exc.reason}") from None
            last: BaseException = exc
        except FileNotFoundError as exc:
            raise MissingShardError(url, f"not found ({exc})") from None
        except (socket.timeout, TimeoutError) as exc:
            last = RemoteStallError(url, f"no byte for {opts.timeout} s ({exc})")
        except (OSError, urllib.error.URLError, ConnectionError) as exc:
            last = exc
        if attempt < opts.retries:
            time.sleep(delay)
            delay *= 2
    if isinstance(last, RemoteStallError):
        raise RemoteStallError(url, f"{last.args[0].split(': ', 1)[-1]} after {opts.retries} retries")
    if isinstance(last, urllib.error.URLError) and not isinstance(last, urllib.error.HTTPError):
        raise MissingShardError(url, f"unreachable after {opts.retries} retries ({last.reason})",
                                "check the host and the network") from None
    raise RemoteReadError(url, f"{type(last).__name__}: {last} after {opts.retries} retries")


def _fs(url: str, opts: RemoteOptions):
    try:
        import fsspec
    except ImportError:
        from prealign.schemas.errors import ConfigError

        raise ConfigError(f"{url}: reading {scheme(url)}:// needs fsspec and its backend "
                          f"(pip install 'prealign[remote]')") from None
    return fsspec.filesystem(scheme(url), **(opts.storage_options or {}))


def _http(url: str, opts: RemoteOptions, *, method: str = "GET", start: int | None = None, end: int | None = None):
    headers = {"Range": f"bytes={start}-{end - 1}"} if start is not None else {}
    req = urllib.request.Request(url, method=method, headers=headers)
    return urllib.request.urlopen(req, timeout=opts.timeout)


# ---- size, small files, ranges ----------------------------------------------------------------------
def size(url: str, opts: RemoteOptions | None = None) -> int:
    """Size in bytes of a remote object; :class:`MissingShardError` when it does not exist."""
    opts = opts or DEFAULT
    s = scheme(url)
    if s in ("http", "https"):
        def head():
            with _http(url, opts, method="HEAD") as r:
                n = r.headers.get("Content-Length")
                if n is None:
                    raise MissingShardError(url, "the server gives no Content-Length")
                return int(n)
        return _retrying(url, opts, head)
    if s == "pipe":
        return -1  # unknown without running the command
    fs = _fs(url, opts)

    def info():
        if not fs.exists(url):
            raise MissingShardError(url, "no such object")
        return int(fs.size(url))
    return _retrying(url, opts, info)


def read_small(url: str, opts: RemoteOptions | None = None) -> bytes | None:
    """A whole small remote file (a sidecar), or None when it does not exist."""
    opts = opts or DEFAULT
    try:
        if scheme(url) in ("http", "https"):
            def get():
                with _http(url, opts) as r:
                    return r.read()
            return _retrying(url, opts, get)
        fs = _fs(url, opts)
        return _retrying(url, opts, lambda: fs.cat_file(url))
    except MissingShardError:
        return None


def _fetch(url: str, start: int, end: int, opts: RemoteOptions) -> bytes:
    if scheme(url) in ("http", "https"):
        def get():
            with _http(url, opts, start=start, end=end) as r:
                data = r.read()
                if r.status == 200 and len(data) != end - start:  # a server ignoring Range: cut it here
                    data = data[start:end]
                return data
        data = _retrying(url, opts, get)
    else:
        fs = _fs(url, opts)
        data = _retrying(url, opts, lambda: fs.cat_file(url, start=start, end=end))
    if len(data) != end - start:
        raise RemoteReadError(url, f"bytes {start}..{end}: got {len(data)} bytes")
    return data


class BlockCache:
    """Fetched blocks on local disk (``<dir>/<sha1(url)[:16]>-<block>``), least recently used (by
    modification time, touched on each hit) out past ``limit`` bytes. Processes may share the directory:
    each eviction pass looks at what is really there, and a block evicted under a reader is fetched again."""

    def __init__(self, directory: str, limit: int):
        self.dir, self.limit, self.lock = directory, int(limit), threading.Lock()
        os.makedirs(directory, exist_ok=True)

    def get(self, name: str) -> bytes | None:
        path = os.path.join(self.dir, name)
        try:
            with open(path, "rb") as f:
                data = f.read()
            os.utime(path)
            return data
        except OSError:
            return None

    def put(self, name: str, data: bytes) -> None:
        if len(data) > self.limit:
            return
        tmp = os.path.join(self.dir, f"{name}.{os.getpid()}.{threading.get_ident()}.part")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(self.dir, name))
        with self.lock:
            self._evict()

    def _evict(self) -> None:
        entries = []
        for e in os.scandir(self.dir):
            if e.name.endswith(".part"):
                continue
            try:
                st = e.stat()
            except OSError:
                continue
            entries.append((st.st_mtime_ns, e.name, st.st_size))
        total = sum(n for _, _, n in entries)
        for _, name, n in sorted(entries):
            if total <= self.limit:
                break
            try:
                os.remove(os.path.join(self.dir, name))
            except OSError:
                pass
            total -= n


_caches: dict[tuple, BlockCache] = {}


def _cache(opts: RemoteOptions) -> BlockCache | None:
    if not opts.cache_dir:
        return None
    key = (os.getpid(), opts.cache_dir, opts.cache_limit)
    if key not in _caches:
        _caches[key] = BlockCache(opts.cache_dir, opts.cache_limit)
    return _caches[key]


def read_range(url: str, start: int, end: int, opts: RemoteOptions | None = None, *, total: int | None = None
               ) -> bytes:
    """Bytes ``[start, end)`` of a remote object (through the block cache when ``opts.cache_dir``)."""
    opts = opts or DEFAULT
    cache = _cache(opts)
    if cache is None:
        return _fetch(url, start, end, opts)
    bs = opts.block_size
    tag = hashlib.sha1(url.encode()).hexdigest()[:16]
    out = []
    for block in range(start // bs, (end - 1) // bs + 1):
        name = f"{tag}-{block}"
        data = cache.get(name)
        if data is None:
            lo = block * bs
            hi = lo + bs if total is None else min(lo + bs, total)
            data = _fetch(url, lo, hi, opts) if total is not None else _fetch_upto(url, lo, hi, opts)
            cache.put(name, data)
        out.append(data)
    buf = b"".join(out)
    off = start - (start // bs) * bs
    return buf[off:off + end - start]


def _fetch_upto(url: str, lo: int, hi: int, opts: RemoteOptions) -> bytes:
    """Block ``[lo, hi)`` that may run past the end of the object (size unknown): fetch the size once."""
    n = size(url, opts)
    return _fetch(url, lo, min(hi, n), opts)


# ---- sequential streams ------------------------------------------------------------------------------
def open_stream(url: str, opts: RemoteOptions | None = None):
    """A file object reading the whole shard front to back (gzip decompressed for ``.tar.gz``/``.tgz``)."""
    opts = opts or DEFAULT
    s = scheme(url)
    if s == "pipe":
        proc = subprocess.Popen(url[len("pipe:"):], shell=True, stdout=subprocess.PIPE)  # the user's own command
        f = _PipeFile(proc, url)
    elif s in ("http", "https"):
        f = _retrying(url, opts, lambda: _http(url, opts))
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
        return gzip.GzipFile(fileobj=f, mode="rb")
    return f


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
    """A sequential shard, decompressed, as one bytes object."""
    with open_stream(url, opts) as f:
        chunks = []
        while chunk := f.read(1 << 20):
            chunks.append(chunk)
    return b"".join(chunks)
