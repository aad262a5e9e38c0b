"""HTTP(S) requests over kept-alive connections (:mod:`http.client`, standard library).

One pool per process (keyed by pid): a forked DataLoader worker opens its own connections and never
writes to a socket of its parent. A request takes an idle connection to the same host (or opens
one), and hands it back once the answer's body was read to its end; a kept connection the server
closed meanwhile is replaced once, transparently. Redirects are followed; ``http_proxy`` /
``https_proxy`` / ``no_proxy`` are honoured as :mod:`urllib` does.
"""

from __future__ import annotations

import atexit
import base64
import heapq
import http.client
import itertools
import os
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request

from prealign.loaders.errors import RemoteReadError

CHUNK = 1 << 20
"""Bytes asked of a socket at a time (never a size the server announced)."""
MAX_IDLE = 8
"""Idle connections kept per host and process."""
REDIRECTS = 10
_DRAIN = (
    1 << 16
    # a body at most this long is read to its end on close (error pages, HEAD): the connection is
    # kept
)
_STALE = (
    http.client.RemoteDisconnected,
    ConnectionResetError,
    ConnectionAbortedError,
    BrokenPipeError,
)


class Unreachable(ConnectionError):
    """No connection could be made to the host (refused, no route, unknown name)."""


class DeadlineExceeded(TimeoutError):
    """A request ran past its total deadline (a server sending a byte now and then never trips the
    per-recv ``timeout``): ``deadline`` seconds plus one second per ``min_rate`` bytes received."""


_PIECE = (
    1 << 18
)  # bytes asked of one recv: a read returns what came, the deadline is checked between


class Reply:
    """An answer being read: ``status``, ``reason``, ``headers``, ``url`` (after redirects),
    ``read(n)``. Closing it hands the connection back to the pool when the body was read to its end.
    Its body is read one ``recv`` at a time (at most ``_PIECE`` bytes, never a size the server
    announced), each under ``timeout`` and the request's total deadline (:class:`DeadlineExceeded`
    past it)."""

    def __init__(
        self,
        url: str,
        pool: "Pool",
        key: tuple,
        conn: http.client.HTTPConnection,
        resp: http.client.HTTPResponse,
        *,
        sock=None,
        timeout: float = 30.0,
        deadline: float | None = None,
        min_rate: float = 0.0,
    ):
        self.url, self._pool, self._key, self._conn, self._resp = url, pool, key, conn, resp
        self.status, self.reason, self.headers = resp.status, resp.reason, resp.headers
        self._sock, self._timeout, self._deadline, self._min_rate, self._got = (
            sock,
            timeout,
            deadline,
            min_rate,
            0,
        )

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes, fewer only at the body's end (``-1``: to the end). A body that ends
        before its ``Content-Length`` (the connection dropped) is an ``http.client.IncompleteRead``,
        which the callers retry: ``http.client`` itself returns it short without a word."""
        chunks, left = [], (n if n is not None and n >= 0 else None)
        while left is None or left > 0:
            chunk = self._read_some(_PIECE if left is None else min(left, _PIECE))
            if not chunk:
                break
            chunks.append(chunk)
            if left is not None:
                left -= len(chunk)
        data = b"".join(chunks)
        if left is None or (n and not data):  # the whole body asked, or none of n bytes came
            self._check_complete(data)
        return data

    def paced_by_reader(self) -> "Reply":
        """Read at the reader's pace (a shard streamed as training consumes it): the body has no
        total deadline, only the per-read ``timeout`` (a stall); the headers already came within
        theirs."""
        self._deadline = None
        return self

    def _left(self) -> float | None:
        """Seconds left before the request's deadline (None: no deadline)."""
        if self._deadline is None:
            return None
        return (
            self._deadline
            + (self._got / self._min_rate if self._min_rate > 0 else 0.0)
            - time.monotonic()
        )

    def _read_some(self, k: int) -> bytes:
        """What one ``recv`` brings (at most ``k`` bytes)."""
        left = self._left()
        if left is not None and left <= 0:
            raise DeadlineExceeded(f"past the request deadline ({self._got} bytes came)")
        if self._sock is not None:
            try:
                self._sock.settimeout(self._timeout if left is None else min(self._timeout, left))
            except OSError:
                pass
        try:
            chunk = self._resp.read1(k)
        except (socket.timeout, TimeoutError):
            left = self._left()
            if left is not None and left <= 0:
                raise DeadlineExceeded(
                    f"past the request deadline ({self._got} bytes came)"
                ) from None
            raise
        self._got += len(chunk)
        if self._resp.length == 0:
            self._resp.read(
                0
            )  # the body's end: http.client releases the connection (read1 alone does not)
        return chunk

    def _check_complete(self, partial: bytes) -> None:
        """Raise when the body stopped with bytes of its announced length still due."""
        left = self._resp.length
        if left:  # None: no Content-Length (chunked or to the close); 0: all of it came
            raise http.client.IncompleteRead(partial, left)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        resp = self._resp
        try:
            if not resp.isclosed() and resp.length is not None and resp.length <= _DRAIN:
                resp.read()
        except (OSError, http.client.HTTPException):
            pass
        if resp.isclosed() and not resp.will_close:
            self._pool.give(self._key, conn)
        else:
            conn.close()

    def __enter__(self) -> "Reply":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Pool:
    """Idle connections of one process, by (scheme, host, port, proxy)."""

    def __init__(self):
        self.idle: dict[tuple, list] = {}
        self.lock = threading.Lock()

    def take(self, key: tuple, timeout: float) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection (True: kept from an earlier request) or a new one (False)."""
        with self.lock:
            idle = self.idle.get(key)
            conn = idle.pop() if idle else None
        if conn is None:
            return _connection(key, timeout), False
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn, True

    def close(self) -> None:
        """Close every idle connection (at exit: nothing left for the interpreter to warn about)."""
        with self.lock:
            conns = [c for idle in self.idle.values() for c in idle]
            self.idle.clear()
        for conn in conns:
            conn.close()

    def give(self, key: tuple, conn: http.client.HTTPConnection) -> None:
        with self.lock:
            idle = self.idle.setdefault(key, [])
            if len(idle) < MAX_IDLE:
                idle.append(conn)
                return
        conn.close()


class _Watchdog:
    """Shuts down the socket of a request whose answer's headers have not come by its deadline (a
    server dripping its headers a byte at a time never trips the per-recv timeout). One thread per
    process, started on first use."""

    def __init__(self):
        self.cv, self.heap, self.seq, self.thread = (
            threading.Condition(),
            [],
            itertools.count(),
            None,
        )

    def arm(self, when: float, sock) -> list:
        entry = [
            when,
            next(self.seq),
            sock,
            False,
        ]  # [deadline, order, socket (None: disarmed), fired]
        with self.cv:
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, name="prealign-http-deadline", daemon=True
                )
                self.thread.start()
            heapq.heappush(self.heap, entry)
            self.cv.notify()
        return entry

    def disarm(self, entry: list) -> bool:
        """Stop watching; True when the deadline had already fired (the socket was shut down)."""
        with self.cv:
            entry[2] = None
            return entry[3]

    def _run(self) -> None:
        while True:
            with self.cv:
                while self.heap and self.heap[0][2] is None:
                    heapq.heappop(self.heap)
                if not self.heap:
                    self.cv.wait()
                    continue
                wait = self.heap[0][0] - time.monotonic()
                if wait > 0:
                    self.cv.wait(wait)
                    continue
                entry = heapq.heappop(self.heap)
                sock, entry[3] = entry[2], True
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


_watchdogs: dict[int, _Watchdog] = {}


def _watchdog() -> _Watchdog:
    """This process's watchdog (a forked child starts its own thread)."""
    return _watchdogs.setdefault(os.getpid(), _Watchdog())


_pools: dict[int, Pool] = {}
_tls: list = []


@atexit.register
def _close_own_pool() -> None:
    own = _pools.get(os.getpid())
    if own is not None:
        own.close()


def pool() -> Pool:
    """This process's pool (a forked child drops its parent's, never using those sockets)."""
    pid = os.getpid()
    p = _pools.get(pid)
    if p is None:
        for other in [k for k in _pools if k != pid]:
            _pools.pop(other, None)
        p = _pools.setdefault(pid, Pool())
    return p


def _ssl_context() -> ssl.SSLContext:
    if not _tls:
        _tls.append(ssl.create_default_context())
    return _tls[0]


def _route(url: str) -> tuple[tuple, str, dict]:
    """(pool key, request target, extra headers) of ``url``, through the environment's proxy if
    any."""
    parts = urllib.parse.urlsplit(url)
    scheme, host = parts.scheme.lower(), parts.hostname or ""
    port = parts.port or (443 if scheme == "https" else 80)
    target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
    proxy = urllib.request.getproxies().get(scheme)
    if not proxy or urllib.request.proxy_bypass(host):
        return (scheme, host, port, None), target, {}
    p = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    auth = {}
    if p.username:
        token = f"{urllib.parse.unquote(p.username)}:{urllib.parse.unquote(p.password or '')}"
        auth = {"Proxy-Authorization": "Basic " + base64.b64encode(token.encode()).decode()}
    via = (p.hostname or "", p.port or 80, tuple(auth.items()))
    if scheme == "http":  # the proxy gets the absolute URL
        return ("http", *via[:2], via), urllib.parse.urlunsplit(parts._replace(fragment="")), auth
    return (scheme, host, port, via), target, {}  # https: a CONNECT tunnel


def _connection(key: tuple, timeout: float) -> http.client.HTTPConnection:
    scheme, host, port, via = key
    if via is None:
        if scheme == "https":
            return http.client.HTTPSConnection(host, port, timeout=timeout, context=_ssl_context())
        return http.client.HTTPConnection(host, port, timeout=timeout)
    if scheme == "http":
        return http.client.HTTPConnection(via[0], via[1], timeout=timeout)
    conn = http.client.HTTPSConnection(via[0], via[1], timeout=timeout, context=_ssl_context())
    conn.set_tunnel(host, port, headers=dict(via[2]))
    return conn


def _once(
    url: str, method: str, headers: dict, timeout: float, deadline: float | None, min_rate: float
) -> Reply:
    key, target, extra = _route(url)
    p = pool()
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise DeadlineExceeded("past the request deadline before the answer's headers came")
        conn, kept = p.take(key, timeout if left is None else min(timeout, left))
        try:
            if conn.sock is None:
                try:
                    conn.connect()
                except (socket.timeout, TimeoutError):
                    raise
                except OSError as exc:
                    raise Unreachable(f"{key[1]}:{key[2]}: {exc}") from exc
            sock = conn.sock  # kept: http.client drops it from a connection that will close
            watch = None if deadline is None else _watchdog().arm(deadline, sock)
            try:
                conn.request(method, target, headers={**headers, **extra})
                resp = conn.getresponse()
            finally:
                if watch is not None and _watchdog().disarm(watch):
                    conn.close()
                    raise DeadlineExceeded(
                        "past the request deadline before the answer's headers came"
                    )
        except DeadlineExceeded:
            raise
        except _STALE:
            conn.close()
            if (
                kept
            ):  # the server closed a kept connection while it was idle: again, on the next one
                continue
            raise
        except BaseException:
            conn.close()
            raise
        return Reply(
            url,
            p,
            key,
            conn,
            resp,
            sock=sock,
            timeout=timeout,
            deadline=deadline,
            min_rate=min_rate,
        )


def request(
    url: str,
    method: str = "GET",
    headers: dict | None = None,
    *,
    timeout: float = 30.0,
    deadline: float | None = None,
    min_rate: float = 0.0,
) -> Reply:
    """The answer to ``method url`` (redirects followed, at most ``REDIRECTS``), whatever its
    status. Connection failures raise :class:`Unreachable`; a stall past ``timeout`` s,
    ``TimeoutError``; a request still running ``deadline`` s (plus one per ``min_rate`` bytes of
    body received) after it began, :class:`DeadlineExceeded` (a ``TimeoutError``)."""
    headers = dict(headers or {})
    end = None if deadline is None else time.monotonic() + deadline
    for _ in range(REDIRECTS + 1):
        reply = _once(url, method, headers, timeout, end, min_rate)
        location = reply.headers.get("Location")
        if reply.status not in (301, 302, 303, 307, 308) or not location:
            return reply
        reply.close()
        if reply.status == 303 and method != "HEAD":
            method = "GET"
        url = urllib.parse.urljoin(url, location)
    raise RemoteReadError(url, f"more than {REDIRECTS} redirects")
