"""HTTP(S) requests over kept-alive connections (:mod:`http.client`, standard library).

One pool per process (keyed by pid): a forked DataLoader worker opens its own connections and never
writes to a socket of its parent. A request takes an idle connection to the same host (or opens one),
and hands it back once the answer's body was read to its end; a kept connection the server closed
meanwhile is replaced once, transparently. Redirects are followed; ``http_proxy`` / ``https_proxy`` /
``no_proxy`` are honoured as :mod:`urllib` does.
"""
from __future__ import annotations

import atexit
import base64
import http.client
import os
import socket
import ssl
import threading
import urllib.parse
import urllib.request

from prealign.loaders.errors import RemoteReadError

CHUNK = 1 << 20
"""Bytes asked of a socket at a time (never a size the server announced)."""
MAX_IDLE = 8
"""Idle connections kept per host and process."""
REDIRECTS = 10
_DRAIN = 1 << 16  # a body at most this long is read to its end on close (error pages, HEAD): the connection is kept
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


class Unreachable(ConnectionError):
    """No connection could be made to the host (refused, no route, unknown name)."""


class Reply:
    """An answer being read: ``status``, ``reason``, ``headers``, ``url`` (after redirects), ``read(n)``.
    Closing it hands the connection back to the pool when the body was read to its end."""

    def __init__(self, url: str, pool: "Pool", key: tuple, conn: http.client.HTTPConnection,
                 resp: http.client.HTTPResponse):
        self.url, self._pool, self._key, self._conn, self._resp = url, pool, key, conn, resp
        self.status, self.reason, self.headers = resp.status, resp.reason, resp.headers

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (``-1``: to the end, read ``CHUNK`` bytes at a time). A body that ends before
        its ``Content-Length`` (the connection dropped) is an ``http.client.IncompleteRead``, which the
        callers retry: ``http.client`` itself returns it short without a word."""
        if n is not None and n >= 0:
            data = self._resp.read(n)
            if n and not data:
                self._check_complete(b"")
            return data
        chunks = []
        while chunk := self._resp.read(CHUNK):
            chunks.append(chunk)
        data = b"".join(chunks)
        self._check_complete(data)
        return data

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
    """(pool key, request target, extra headers) of ``url``, through the environment's proxy if any."""
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


def _once(url: str, method: str, headers: dict, timeout: float) -> Reply:
    key, target, extra = _route(url)
    p = pool()
    while True:
        conn, kept = p.take(key, timeout)
        try:
            if conn.sock is None:
                try:
                    conn.connect()
                except (socket.timeout, TimeoutError):
                    raise
                except OSError as exc:
                    raise Unreachable(f"{key[1]}:{key[2]}: {exc}") from exc
            conn.request(method, target, headers={**headers, **extra})
            resp = conn.getresponse()
        except _STALE:
            conn.close()
            if kept:  # the server closed a kept connection while it was idle: again, on the next one
                continue
            raise
        except BaseException:
            conn.close()
            raise
        return Reply(url, p, key, conn, resp)


def request(url: str, method: str = "GET", headers: dict | None = None, *, timeout: float = 30.0) -> Reply:
    """The answer to ``method url`` (redirects followed, at most ``REDIRECTS``), whatever its status.
    Connection failures raise :class:`Unreachable`; a stall past ``timeout`` s, ``TimeoutError``."""
    headers = dict(headers or {})
    for _ in range(REDIRECTS + 1):
        reply = _once(url, method, headers, timeout)
        location = reply.headers.get("Location")
        if reply.status not in (301, 302, 303, 307, 308) or not location:
            return reply
        reply.close()
        if reply.status == 303 and method != "HEAD":
            method = "GET"
        url = urllib.parse.urljoin(url, location)
    raise RemoteReadError(url, f"more than {REDIRECTS} redirects")
