"""Reads that cannot hang: a shard stream read by a daemon thread, handed over chunk by chunk, with
a deadline on every chunk (a FIFO, a hung network mount, a stuck ``pipe:``).

    opener() ──thread: open, fstat, read 1 MiB chunks──► queue
             ──read(n), at most ``timeout`` s per chunk──► caller

A stalled read raises :class:`Stalled` in the caller; the thread stays blocked in the kernel call
(nothing can interrupt it) but is a daemon and holds only its file, so the process goes on and can
exit. ``timeout=None`` reads directly (no thread). A ``pipe:`` command whose stream stalls is killed
with its whole process group when the reader is closed (:func:`kill_stream`): no orphan keeps
running.

:func:`call_with_timeout` runs one short call (a sample's ``open`` + ``seek`` + ``read``) under the
same deadline, in a per-process daemon thread.

>>> import io
>>> r = TimedReader(lambda: io.BytesIO(b"abcdef"), timeout=5.0)
>>> r.read(4), r.read(4), r.read(4), r.length
(b'abcd', b'ef', b'', 6)
"""

from __future__ import annotations

import collections
import gzip
import os
import queue
import signal
import stat
import threading
import zlib
from typing import BinaryIO, Callable

from prealign.loaders.sources.tar_reader import TarFormatError
from prealign.schemas.errors import PrealignError

_CHUNK = 1 << 20


class Stalled(Exception):
    """Internal: no progress within the deadline (the caller turns it into a typed error)."""

    def __init__(self, seconds: float, at: int):
        self.seconds, self.at = seconds, at
        super().__init__(
            f"no data for {seconds:g} s at byte {at} (a stalled read: FIFO, hung mount?)"
        )


def _length(f) -> int | None:
    """Size of a regular file (None for pipes, sockets, BytesIO without a descriptor, and a gzip
    stream, whose decompressed size is not its file's)."""
    if isinstance(f, gzip.GzipFile):
        return None
    try:
        st = os.fstat(f.fileno())
    except (OSError, AttributeError, ValueError):
        getbuffer = getattr(f, "getbuffer", None)
        return len(getbuffer()) - f.tell() if getbuffer is not None else None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


class TimedReader:
    """A forward-only binary reader over ``opener()`` whose every chunk arrives within ``timeout``
    s.

    ``length``: bytes in the file when it is a regular file, else None; ``pos``: bytes read so far
    (:func:`prealign.loaders.sources.tar_reader.iter_members` bounds member sizes by ``length -
    pos``). Errors of ``opener`` or of a read (``OSError``) are re-raised in the caller.
    """

    def __init__(self, opener: Callable[[], BinaryIO], *, timeout: float | None):
        self.timeout, self.length, self.pos = timeout, None, 0
        self._parts: collections.deque[bytes] = collections.deque()
        self._off = 0
        self._have, self._eof, self._stop = 0, False, threading.Event()
        self._failed: Exception | None = None
        if timeout is None:
            self._f = opener()
            self.length = _length(self._f)
            return
        self._f = self._opened = None
        self._q: queue.Queue = queue.Queue(maxsize=4)
        self._thread = threading.Thread(
            target=self._pump, args=(opener,), daemon=True, name="prealign-read"
        )
        self._thread.start()
        try:
            self._take()  # the first message: the length (or the opener's error)
        except BaseException:
            self.close()
            raise

    def _pump(self, opener) -> None:
        pumped = 0
        try:
            with opener() as f:
                self._opened = f
                if self._stop.is_set():  # closed (timed out) while opening: end a pipe command now
                    kill_stream(f)
                self._put(("length", _length(f)))
                while not self._stop.is_set():
                    chunk = f.read(_CHUNK)
                    pumped += len(chunk)
                    self._put(("data", chunk))
                    if not chunk:
                        return
        except (
            OSError,
            EOFError,
            PrealignError,
        ) as exc:  # the caller decides what an unreadable shard is
            self._put(("error", exc))
        except zlib.error as exc:  # corrupt deflate data in a .tar.gz: bad data (never an OSError)
            self._put(("error", TarFormatError(pumped, f"corrupt compressed data ({exc})")))
        except (
            BaseException
        ) as exc:  # anything else is raised in the caller: a dead reader never looks stalled
            self._put(("error", exc))

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def _take(self) -> None:
        try:
            kind, value = self._q.get(timeout=self.timeout)
        except queue.Empty:
            raise Stalled(self.timeout, self.pos + self._have) from None
        if kind == "error":
            raise value
        if kind == "length":
            self.length = value
        elif value:
            self._parts.append(value)
            self._have += len(value)
        else:
            self._eof = True

    def read(self, n: int = -1) -> bytes:
        if self._f is not None:
            out = self._f.read(n)
        else:
            if self._failed is not None and not self._have:
                raise self._failed
            try:
                while (n < 0 or self._have < n) and not self._eof:
                    self._take()
            except (
                Exception
            ) as exc:  # the bytes before a failure are read first (a truncated stream's samples)
                if not self._have or isinstance(exc, Stalled):
                    raise
                self._failed = exc
            want = self._have if n < 0 else min(n, self._have)
            pieces = []
            while want:
                head = self._parts[0]
                piece = head[self._off : self._off + want]
                pieces.append(piece)
                want -= len(piece)
                self._have -= len(piece)
                self._off += len(piece)
                if self._off == len(head):
                    self._parts.popleft()
                    self._off = 0
            out = b"".join(pieces) if len(pieces) != 1 else pieces[0]
        self.pos += len(out)
        return out

    def close(self) -> None:
        """Stop reading; a reader thread still blocked in a read (a stalled ``pipe:`` command) has
        its command killed (:func:`kill_stream`), so the thread ends and no process is left
        behind."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._f is not None:
            self._f.close()
        elif self._thread.is_alive() and self._opened is not None:
            kill_stream(self._opened)

    def __enter__(self) -> "TimedReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def kill_stream(f) -> None:
    """Kill the command behind a ``pipe:`` stream (``f.proc``, or a gzip stream's
    ``f.fileobj.proc``) and its process group when it has its own (``start_new_session``): a stalled
    command would otherwise outlive the reader. Anything else is left alone (a blocked regular read
    cannot be interrupted)."""
    proc = getattr(f, "proc", None) or getattr(getattr(f, "fileobj", None), "proc", None)
    if proc is None or proc.poll() is not None:
        return
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass


def map_with_timeout(fn: Callable[[object], object], items, timeout: float | None) -> list:
    """``[fn(x) for x in items]`` computed in one daemon thread, an exception kept as the item's
    result. An item that takes over ``timeout`` s gives a :class:`Stalled` and ends the map there
    (the items after it stay ``None``): a dead mount stalls every stat, so waiting on each would
    cost ``timeout`` apiece. One thread for the whole list, not one per item: a stat per shard over
    thousands of shards costs the stats.

    >>> map_with_timeout(len, ["ab", "c"], 1.0)
    [2, 1]
    """
    items = list(items)
    if timeout is None:
        return [_or_error(fn, x) for x in items]
    out: list = [None] * len(items)
    results: queue.SimpleQueue = queue.SimpleQueue()

    def run():
        for j, x in enumerate(items):
            results.put((j, _or_error(fn, x)))

    threading.Thread(target=run, daemon=True, name="prealign-map").start()
    for i in range(len(items)):
        try:
            j, out[i] = results.get(timeout=timeout)
        except queue.Empty:
            out[i] = Stalled(timeout, 0)
            break
    return out


def _or_error(fn: Callable[[object], object], x):
    try:
        return fn(x)
    except Exception as exc:  # noqa: BLE001 - handed to the caller, which names the item
        return exc


class _Caller:
    """One daemon thread of this process running calls handed to it; abandoned (and replaced by the
    next call) when a call outlives its deadline, since a blocked kernel call cannot be
    interrupted."""

    def __init__(self):
        self.pid, self.jobs = os.getpid(), queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name="prealign-call").start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                out = (True, job.fn())
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                out = (False, exc)
            with job.lock:
                if not job.abandoned:
                    job.done.put(out)
                    continue
            if out[0] and job.late is not None:  # (nobody takes it: e.g. a file to close)
                try:
                    job.late(out[1])
                except Exception:  # noqa: BLE001 - nobody to tell; the call was given up
                    pass


class _Job:
    """A call handed to the :class:`_Caller`: ``fn``, where its ``(ok, value)`` goes (``done``),
    whether the caller gave up on it (``abandoned``, set under ``lock``) and what to do with a
    value that came after that (``late``)."""

    def __init__(self, fn: Callable[[], object], late: Callable[[object], None] | None):
        self.fn, self.late = fn, late
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.abandoned = False


_caller: _Caller | None = None
_caller_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) starts with no caller thread and a free lock, even when
    the parent forked while one of its threads was inside :func:`call_with_timeout`."""
    global _caller, _caller_lock
    _caller, _caller_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def call_with_timeout(
    fn: Callable[[], object],
    timeout: float | None,
    late: Callable[[object], None] | None = None,
):
    """``fn()``, raising :class:`Stalled` when it has not returned within ``timeout`` s (``None``:
    called directly). For short blocking calls (a local shard's ``open`` + ``seek`` + ``read``): a
    FIFO put in a shard's place, a hung mount. Calls run one at a time in one daemon thread per
    process; one that stalls is left blocked there and the next call gets a fresh thread. Its
    exceptions are re-raised here. ``late``: called in that thread with what ``fn`` returns after
    its deadline passed (nobody else takes it: a file it opened is closed there).

    >>> call_with_timeout(lambda: 6 * 7, 1.0)
    42
    """
    global _caller
    if timeout is None:
        return fn()
    with _caller_lock:
        if _caller is None or _caller.pid != os.getpid():
            _caller = _Caller()
        caller = _caller
        job = _Job(fn, late)
        caller.jobs.put(job)
        try:
            ok, value = job.done.get(timeout=timeout)
        except queue.Empty:
            with job.lock:
                job.abandoned = True
                finished = not job.done.empty()  # (it ended as the deadline passed: taken)
            if not finished:
                _caller = None  # that thread is stuck in the call: the next one starts another
                raise Stalled(timeout, 0) from None
            ok, value = job.done.get()
    if not ok:
        raise value
    return value
