"""Remote reads against hostile or changing servers (issue #18), real servers on 127.0.0.1: an
object replaced under a warm block cache, a cache folder removed mid-run, absurd ``Content-Length``
announcements, a server dripping one byte at a time, a connection dropped under a sequential
(``.tar.gz``) stream."""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import time
import tracemalloc

import pytest

from prealign.loaders import WebDatasetSource
from prealign.loaders.errors import RemoteReadError, RemoteStallError
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.sources.remote import (
    RemoteOptions,
    open_stream,
    read_range,
    read_small,
    read_whole,
    size,
)
from tests.loader_helpers import sample_lengths, write_shards
from tests.loaders.sources.test_remote import SCHEMA, _Handler, _loader, _same_batches, _serve


class _ETagHandler(_Handler):
    """:class:`_Handler` that names each version of a file with an ETag (its content's hash), as
    object stores do."""

    def end_headers(self):
        name = self.path.lstrip("/").split("?")[0]
        path = os.path.join(self.server.root, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                self.send_header("ETag", f'"{hashlib.md5(f.read()).hexdigest()}"')
        super().end_headers()


class _Hostile(_Handler):
    """Answers GETs as ``server.mode`` says: ``huge`` announces ``Content-Length: 10**15`` (206, or
    200 when ``server.ignore_range``) and sends ``server.send`` bytes, then holds (``server.hold``
    s) and closes; ``drip`` announces the true length and sends one byte every ``server.drip``
    seconds; ``drip_headers`` sends its headers so."""

    def do_GET(self):
        srv = self.server
        if srv.mode is None:
            return super().do_GET()
        path, n = self._file()
        if not path:
            return
        with open(path, "rb") as f:
            data = f.read()
        if srv.mode == "drip_headers":  # the status line, then a header one byte at a time
            data = b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 1000
        if srv.mode == "huge":
            self.send_response(200 if srv.ignore_range else 206)
            if not srv.ignore_range:
                self.send_header("Content-Range", f"bytes 0-{10**15 - 1}/{10**15}")
            self.send_header("Content-Length", str(10**15))
            self.end_headers()
            self.wfile.write(data[: srv.send])
            self.wfile.flush()
            time.sleep(srv.hold)
            self.close_connection = True
            return
        if srv.mode == "drip":  # the whole object, one byte at a time
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
        deadline = time.monotonic() + 30
        for i in range(len(data)):
            if time.monotonic() > deadline:
                break
            try:
                self.wfile.write(data[i : i + 1])
                self.wfile.flush()
            except OSError:
                break
            time.sleep(srv.drip)
        self.close_connection = True


@pytest.fixture
def hostile(tmp_path):
    server, base = _serve(tmp_path, _Hostile)
    server.mode, server.send, server.hold, server.drip = None, 0, 0.0, 0.2
    yield server, base
    server.shutdown()
    server.server_close()


# ---- 1. stale cache
# ---------------------------------------------------------------------------------------
def test_a_changed_object_never_reads_the_old_objects_blocks(tmp_path):
    """Same URL, same size, new content (a new ETag): once the object is looked at again (a loader
    build makes a HEAD), reads through a warm block cache return the new bytes, never the old
    blocks."""
    server, base = _serve(tmp_path, _ETagHandler)
    try:
        obj = tmp_path / "www" / "obj.bin"
        old, new = os.urandom(20_000), os.urandom(20_000)
        obj.write_bytes(old)
        url = f"{base}/obj.bin"
        opts = RemoteOptions(cache_dir=str(tmp_path / "cache"), block_size=4096, retries=0)
        assert read_range(url, 100, 9000, opts) == old[100:9000]
        obj.write_bytes(new)
        assert size(url, opts) == 20_000  # what re-indexing / building a loader does first
        assert read_range(url, 100, 9000, opts) == new[100:9000]
    finally:
        server.shutdown()
        server.server_close()


def test_a_reindexed_shard_is_read_through_a_warm_cache(tmp_path):
    """A shard replaced on the server and indexed again: a loader over the same cache_dir yields the
    new shard's batches (before: the old blocks were served, SourceChangedError until the cache was
    deleted)."""
    server, base = _serve(tmp_path, _ETagHandler)
    try:
        url = f"{base}/shard-000.tar"
        opts = RemoteOptions(
            cache_dir=str(tmp_path / "cache"), block_size=4096, retries=1, backoff=0.01
        )
        for seed in (0, 1):
            paths = write_shards(
                server.root, sample_lengths(60, seed=seed, low=20, high=80), num_shards=1
            )
            write_sidecars(WebDatasetSource(paths), SCHEMA)
            local = list(_loader(WebDatasetSource(paths)))
            assert (
                _same_batches(list(_loader(WebDatasetSource(url, remote=opts))), local)
                == len(local)
                > 2
            )
    finally:
        server.shutdown()
        server.server_close()


def test_a_cache_folder_removed_mid_run_is_made_again(tmp_path, hostile):
    server, base = hostile
    data = os.urandom(40_000)
    (tmp_path / "www" / "obj.bin").write_bytes(data)
    cache = tmp_path / "cache"
    opts = RemoteOptions(cache_dir=str(cache), block_size=4096, retries=0)
    url = f"{base}/obj.bin"
    assert read_range(url, 0, 5000, opts) == data[:5000]
    assert (cache / ".prealign-block-cache").is_file()  # the folder is marked as a block cache
    shutil.rmtree(cache)
    assert read_range(url, 10_000, 30_000, opts) == data[10_000:30_000]
    assert (cache / ".prealign-block-cache").is_file() and len(os.listdir(cache)) > 1


# ---- 2. bounded bodies
# ------------------------------------------------------------------------------------
@pytest.mark.parametrize("ignore_range", [False, True])
def test_a_huge_content_length_never_allocates(hostile, tmp_path, ignore_range):
    """``Content-Length: 10**15`` with a few bytes sent: every read is a typed error or the bytes
    asked, with memory bounded by what was asked (never the announced size)."""
    server, base = hostile
    data = os.urandom(200_000)
    (tmp_path / "www" / "obj.bin").write_bytes(data)
    server.mode, server.ignore_range, server.send = "huge", ignore_range, 100_000
    url = f"{base}/obj.bin"
    opts = RemoteOptions(retries=1, backoff=0.01, timeout=5.0, cache_limit=1 << 20)
    tracemalloc.start()
    try:
        if ignore_range:  # a whole object announced past cache_limit: refused
            with pytest.raises(RemoteReadError, match="ignores Range"):
                read_range(url, 0, 512, opts)
        else:  # more bytes than asked came: only the range is read
            assert read_range(url, 0, 512, opts) == data[:512]
            with pytest.raises(
                RemoteReadError, match="obj.bin"
            ):  # fewer than asked: cut short, typed
                read_range(url, 0, 150_000, opts)
        with pytest.raises(
            RemoteReadError, match="obj.bin"
        ):  # a "sidecar" announced at 10**15 bytes
            read_small(url, opts)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak


# ---- 3. total deadline per request
# ------------------------------------------------------------------------
def test_a_dripping_server_is_stalled_past_the_request_deadline(hostile, tmp_path):
    """One byte every 0.2 s never trips the 5 s per-recv timeout; the request deadline ends each
    try."""
    server, base = hostile
    (tmp_path / "www" / "obj.bin").write_bytes(os.urandom(4096))
    server.mode = "drip"
    opts = RemoteOptions(
        retries=1, backoff=0.01, timeout=5.0, request_deadline=1.0, min_rate=1 << 20
    )
    t0 = time.monotonic()
    with pytest.raises(RemoteStallError, match="obj.bin.*deadline"):
        read_range(f"{base}/obj.bin", 0, 4096, opts)
    assert time.monotonic() - t0 < 1.0 * (opts.retries + 1) + 2.0


def test_headers_dripping_in_are_stalled_past_the_request_deadline(hostile, tmp_path):
    server, base = hostile
    (tmp_path / "www" / "obj.bin").write_bytes(os.urandom(4096))
    server.mode = "drip_headers"
    opts = RemoteOptions(retries=1, backoff=0.01, timeout=5.0, request_deadline=1.0)
    t0 = time.monotonic()
    with pytest.raises(RemoteStallError, match="obj.bin.*deadline"):
        read_range(f"{base}/obj.bin", 0, 4096, opts)
    assert time.monotonic() - t0 < 1.0 * (opts.retries + 1) + 2.0


def test_a_body_arriving_at_min_rate_runs_past_the_deadline(hostile, tmp_path):
    """The deadline grows with the bytes received (one second per ``min_rate`` bytes): a slow body
    that keeps up ``min_rate`` is never cut, however long it takes."""
    server, base = hostile
    data = os.urandom(100)
    (tmp_path / "www" / "obj.bin").write_bytes(data)
    server.mode, server.drip = "drip", 0.01  # ~1 s for the body, a byte every 0.01 s
    opts = RemoteOptions(
        retries=0, timeout=5.0, request_deadline=0.3, min_rate=40.0
    )  # a byte: 0.025 s more
    t0 = time.monotonic()
    assert read_small(f"{base}/obj.bin", opts) == data
    assert time.monotonic() - t0 > 0.5


# ---- 4. sequential streams over http
# ----------------------------------------------------------------------
def _gz(tmp_path) -> bytes:
    raw = os.urandom(1 << 20)
    (tmp_path / "www" / "obj.tar.gz").write_bytes(gzip.compress(raw))
    return raw


def test_a_dropped_tar_gz_stream_is_resumed_or_a_typed_error(hostile, tmp_path):
    server, base = hostile
    raw = _gz(tmp_path)
    url = f"{base}/obj.tar.gz"
    opts = RemoteOptions(retries=1, backoff=0.01, timeout=5.0)
    assert read_whole(url, opts) == raw
    server.cut = (
        1  # the connection drops halfway through the body: taken up again from where it stopped
    )
    assert read_whole(url, opts) == raw and server.cut == 0
    server.cut = 2  # past the retries
    with pytest.raises(
        RemoteReadError, match=r"obj.tar.gz: at byte \d+: the body stopped.*IncompleteRead"
    ):
        read_whole(url, opts)
    server.cut, server.ignore_range = 1, True  # a server that cannot resume: no retry helps
    with pytest.raises(
        RemoteReadError, match=r"obj.tar.gz: at byte \d+: the body stopped.*IncompleteRead"
    ):
        read_whole(url, RemoteOptions(retries=3, backoff=0.01, timeout=5.0))


def test_a_stalled_tar_gz_stream_is_a_stall_error(hostile, tmp_path):
    server, base = hostile
    _gz(tmp_path)
    server.mode = "drip"
    t0 = time.monotonic()
    with pytest.raises(RemoteStallError, match="obj.tar.gz.*deadline"):
        read_whole(
            f"{base}/obj.tar.gz",
            RemoteOptions(retries=0, timeout=3.0, request_deadline=0.8, min_rate=1 << 20),
        )
    server.drip = 1.0  # a byte a second: the per-recv timeout (0.3 s) trips first
    with pytest.raises(RemoteStallError, match="obj.tar.gz.*no byte"):
        with open_stream(f"{base}/obj.tar.gz", RemoteOptions(retries=0, timeout=0.3)) as f:
            f.read(1 << 16)
    assert time.monotonic() - t0 < 6.0


def test_a_stream_read_at_the_readers_pace_has_no_total_deadline(tmp_path):
    """A shard scanned as training consumes it (slower than min_rate) reads to its end: the total
    deadline is for requests read at once, a stalled stream is caught by the per-read timeout."""
    server, base = _serve(tmp_path, _Handler)
    write_shards(
        str(tmp_path / "www"), sample_lengths(3000, high=400), num_shards=1
    )  # ~10 MB: past the read-ahead
    src = WebDatasetSource(
        [f"{base}/shard-000.tar"],
        remote=RemoteOptions(request_deadline=0.2, min_rate=64 << 20, retries=0),
    )
    read = 0
    for location, item in src.scan(0):
        assert location is not None, item
        read += 1
        time.sleep(0.001)  # 3000 samples, 3 s: past the deadline (0.2 s + 10 MB at 64 MiB/s)
    assert read == 3000
    server.shutdown()
    server.server_close()
