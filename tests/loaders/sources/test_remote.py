"""Remote shards (issue #7, item 3) against real servers on 127.0.0.1: an HTTP server honouring
``Range`` (started here) and moto's S3 server spoken to by the real s3fs / botocore client."""

from __future__ import annotations

import functools
import gc
import gzip
import http.server
import multiprocessing
import os
import re
import shutil
import socket
import threading
import time
import warnings

import pytest
import torch

from prealign.loaders import LoadingOptions, PackedLoader, ShuffleOptions, WebDatasetSource
from prealign.loaders.errors import (
    ChangedShardError,
    MissingShardError,
    RangeIgnoredWarning,
    RemotePermissionError,
    RemoteReadError,
)
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.sources.remote import RemoteOptions, RemoteStallError, read_range
from prealign.schemas import ParallelLayout
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import sample_lengths, write_shards

SCHEMA = causal_lm_schema()
FAST = RemoteOptions(retries=1, backoff=0.01, timeout=5.0)


class _Counting:
    """Counts the connections a server accepts (``server.connections``); sends without Nagle's delay
    (as servers keeping connections alive do: a header and a body written apart would wait for a
    delayed ACK)."""

    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def setup(self):
        with self.server.lock:
            self.server.connections += 1
        self.timeout = getattr(
            self.server, "idle_timeout", None
        )  # a connection idle this long is closed
        super().setup()


class _Handler(_Counting, http.server.BaseHTTPRequestHandler):
    """Serves ``server.root`` with ``Range`` support (ignored when ``server.ignore_range``), keeping
    connections alive; counts the bytes of each path it sends; answers ``server.deny[name]`` (401,
    403) for a name there."""

    protocol_version = "HTTP/1.1"

    def _file(self):
        name = self.path.lstrip("/").split("?")[0]
        path = os.path.join(self.server.root, name)
        status = self.server.deny.get(name, 404)
        if status != 404 or not os.path.isfile(path):
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None, None
        return path, os.path.getsize(path)

    def handle_one_request(self):  # counts the requests in flight at once (server.max_inflight)
        srv = self.server
        with srv.lock:
            srv.inflight += 1
            srv.max_inflight = max(srv.max_inflight, srv.inflight)
        try:
            time.sleep(srv.delay)
            super().handle_one_request()
        finally:
            with srv.lock:
                srv.inflight -= 1

    def do_HEAD(self):
        path, size = self._file()
        if path:
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()

    def do_GET(self):
        if self.server.stall:
            time.sleep(self.server.stall)
        path, size = self._file()
        if not path:
            return
        lo, hi = 0, size
        m = (
            None
            if self.server.ignore_range
            else re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        )
        with open(path, "rb") as f:
            if m:
                lo, hi = int(m.group(1)), min(int(m.group(2)) + 1 if m.group(2) else size, size)
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{size}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(hi - lo))
            self.end_headers()
            f.seek(lo)
            data = f.read(hi - lo)
        if self.server.cut:  # the connection drops halfway through the body
            self.server.cut -= 1
            self.wfile.write(data[: len(data) // 2])
            self.close_connection = True
            return
        self.server.served[os.path.basename(path)] = self.server.served.get(
            os.path.basename(path), 0
        ) + len(data)
        self.wfile.write(data)


class _PlainHandler(_Counting, http.server.SimpleHTTPRequestHandler):
    """``python -m http.server``'s own handler (HTTP/1.0, ignores ``Range``), counting the bytes it
    sends."""

    def copyfile(self, source, outputfile):
        data = source.read()
        name = os.path.basename(self.path.split("?")[0])
        with self.server.lock:
            self.server.served[name] = self.server.served.get(name, 0) + len(data)
        outputfile.write(data)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a client that stops reading a body it refused (broken pipe) is no failure here


def _serve(tmp_path, handler=_Handler):
    root = tmp_path / "www"
    root.mkdir()
    if handler is _PlainHandler:
        handler = functools.partial(_PlainHandler, directory=str(root))
    server = _Server(("127.0.0.1", 0), handler)
    server.root, server.served, server.stall, server.ignore_range, server.deny = (
        str(root),
        {},
        0.0,
        False,
        {},
    )
    server.lock, server.inflight, server.max_inflight, server.delay = threading.Lock(), 0, 0, 0.0
    server.connections, server.cut = 0, 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def http_server(tmp_path):
    server, base = _serve(tmp_path)
    yield server, base
    server.shutdown()
    server.server_close()


def _loader(src, **kw):
    """A prepared loader (shards checked, the index pass run)."""
    return PackedLoader(
        src,
        schema=SCHEMA,
        layout=ParallelLayout(),
        token_budget=512,
        shuffle=ShuffleOptions(window=32),
        seed=1,
        **kw,
    ).prepare()


def _same_batches(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert torch.equal(x[k], y[k]), k
            else:
                assert x[k] == y[k], k
        n += 1
    return n


def test_http_batches_equal_local_and_first_batch_reads_a_quarter(tmp_path, http_server):
    server, base = http_server
    paths = write_shards(server.root, sample_lengths(400, low=100, high=300), num_shards=1)
    write_sidecars(
        WebDatasetSource(paths), SCHEMA
    )  # the sidecar sits beside the shard, on the server too
    url = f"{base}/shard-000.tar"
    remote = _loader(WebDatasetSource(url, remote=FAST))
    # built: HEAD + sidecar + the 64 KiB probes + one sample of the data signature checked against
    # the schema
    assert server.served.get("shard-000.tar", 0) <= 2 * 65536 + FAST.block_size
    it = iter(remote)
    next(it)
    size = os.path.getsize(paths[0])
    assert 0 < server.served["shard-000.tar"] <= size / 4
    rest = list(it)
    local = list(_loader(WebDatasetSource(paths)))
    assert (
        _same_batches([next(iter(_loader(WebDatasetSource(url, remote=FAST))))] + rest, local)
        == len(local)
        > 5
    )


def test_shards_are_checked_over_overlapping_requests(tmp_path, http_server):
    """Building a loader over many remote shards (a sidecar each; each shard checked at its first
    read) overlaps the round trips instead of making them one after another (hundreds of shards on
    an object store)."""
    server, base = http_server
    paths = write_shards(server.root, sample_lengths(160), num_shards=8)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    server.delay = 0.02
    remote = _loader(WebDatasetSource(f"{base}/shard-{{000..007}}.tar", remote=FAST))
    assert len(remote.index) == 160
    assert server.max_inflight > 1


@pytest.mark.slow
def test_http_without_sidecars_and_with_a_bounded_cache(tmp_path, http_server):
    server, base = http_server
    write_shards(server.root, sample_lengths(120), num_shards=2)
    urls = f"{base}/shard-{{000..001}}.tar"
    cache = str(tmp_path / "cache")
    opts = RemoteOptions(
        cache_dir=cache, cache_limit=20_000, block_size=4096, retries=1, backoff=0.01
    )
    remote = list(_loader(WebDatasetSource(urls, remote=opts), num_workers=2))
    local = list(
        _loader(WebDatasetSource([os.path.join(server.root, f"shard-00{i}.tar") for i in (0, 1)]))
    )
    assert _same_batches(remote, local) == len(local) > 3
    assert 0 < sum(os.path.getsize(os.path.join(cache, f)) for f in os.listdir(cache)) <= 20_000


def test_unreachable_missing_and_stalled_urls(tmp_path, http_server):
    server, base = http_server
    write_shards(server.root, sample_lengths(20), num_shards=1)
    with pytest.raises(MissingShardError, match="shard-001.tar.*404"):
        _loader(WebDatasetSource(f"{base}/shard-{{000..001}}.tar", remote=FAST), bad_data=None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    with pytest.raises(MissingShardError, match=f"127.0.0.1:{port}/x.tar.*unreachable"):
        _loader(WebDatasetSource(f"http://127.0.0.1:{port}/x.tar", remote=FAST))
    server.stall = 1.0
    with pytest.raises(RemoteStallError, match="shard-000.tar"):
        read_range(
            f"{base}/shard-000.tar", 0, 512, RemoteOptions(retries=1, backoff=0.01, timeout=0.3)
        )


@pytest.mark.slow
def test_tar_gz_and_pipe_shards_read_sequentially(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(60), num_shards=2)
    gz = []
    for p in paths:
        with open(p, "rb") as f, gzip.open(p + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        gz.append(p + ".gz")
    local = list(_loader(WebDatasetSource(paths)))
    assert (
        _same_batches(list(_loader(WebDatasetSource(gz), num_workers=2)), local) == len(local) > 2
    )
    assert _same_batches(
        list(_loader(WebDatasetSource([f"pipe:cat {p}" for p in paths]))), local
    ) == len(local)


def test_s3_batches_equal_local_through_moto_server(tmp_path):
    pytest.importorskip("s3fs")
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        creds = {
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
            "region_name": "us-east-1",
        }
        client = boto3.client("s3", endpoint_url=endpoint, **creds)
        client.create_bucket(Bucket="data")
        paths = write_shards(str(tmp_path), sample_lengths(90, low=50, high=200), num_shards=2)
        write_sidecars(WebDatasetSource(paths), SCHEMA)
        for p in paths:
            for name in (p, p + ".prealign-index.npz"):
                client.upload_file(name, "data", os.path.basename(name))
        opts = RemoteOptions(
            retries=1,
            backoff=0.01,
            storage_options={
                "key": "testing",
                "secret": "testing",
                "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            },
        )
        remote = list(_loader(WebDatasetSource("s3://data/shard-{000..001}.tar", remote=opts)))
        local = list(_loader(WebDatasetSource(paths)))
        assert _same_batches(remote, local) == len(local) > 3
        with pytest.raises(MissingShardError, match="s3://data/shard-002.tar"):
            _loader(WebDatasetSource("s3://data/shard-{000..002}.tar", remote=opts))
    finally:
        server.stop()


def test_a_replaced_object_is_seen_through_a_warm_block_cache(tmp_path, http_server):
    """The build-time check reads the shard's ends from the server, never from the block cache: a
    shard replaced by another of the same size is a ChangedShardError even when the cache holds its
    old bytes."""
    server, base = http_server
    paths = write_shards(server.root, sample_lengths(60, low=20, high=40), num_shards=1)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    url = f"{base}/shard-000.tar"
    opts = RemoteOptions(
        cache_dir=str(tmp_path / "cache"), block_size=4096, retries=1, backoff=0.01
    )
    assert (
        len(list(_loader(WebDatasetSource(url, remote=opts)))) > 0
    )  # the cache now holds every block
    size = os.path.getsize(paths[0])
    with open(paths[0], "r+b") as f:  # same size, other first bytes: a replaced object
        head = bytearray(f.read(512))
        head[:8] = b"replaced"
        f.seek(0)
        f.write(bytes(head))
    assert os.path.getsize(paths[0]) == size
    with pytest.raises(ChangedShardError, match="shard-000.tar"):
        _loader(WebDatasetSource(url, remote=opts))


def _moved(server) -> int:
    """Bytes of shards (``.tar``) the server sent."""
    return sum(n for name, n in server.served.items() if name.endswith(".tar"))


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "handler", [_PlainHandler, _Handler], ids=["python-m-http.server", "keep-alive"]
)
def test_a_server_ignoring_range_sends_each_shard_about_once(tmp_path, handler, num_workers):
    """A server answering a ranged GET with 200 and the whole object (``python -m http.server``,
    many mirrors): each shard is downloaded once and kept, two epochs move at most 3x the shards'
    bytes (not one shard per sample), the batches equal local ones, and a warning names the
    server."""
    server, base = _serve(tmp_path, handler)
    server.ignore_range = True
    try:
        paths = write_shards(server.root, sample_lengths(300, low=100, high=300), num_shards=2)
        write_sidecars(WebDatasetSource(paths), SCHEMA)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            remote = _loader(
                WebDatasetSource(f"{base}/shard-{{000..001}}.tar", remote=FAST),
                num_workers=num_workers,
            )
            local = _loader(WebDatasetSource(paths))
            for _ in range(2):
                want = list(local)
                assert _same_batches(list(remote), want) == len(want) > 5
        shard_bytes = sum(os.path.getsize(p) for p in paths)
        assert _moved(server) <= 3 * shard_bytes, (_moved(server), shard_bytes)
        ignored = [str(w.message) for w in seen if issubclass(w.category, RangeIgnoredWarning)]
        assert len(ignored) == 1 and re.match(f"{base[7:]} ignores HTTP Range", ignored[0]), ignored
    finally:
        server.shutdown()
        server.server_close()


def test_a_range_ignoring_object_past_cache_limit_is_refused(tmp_path, http_server):
    server, base = http_server
    server.ignore_range = True
    write_shards(server.root, sample_lengths(40), num_shards=1)
    with pytest.raises(RemoteReadError, match=r"shard-000.tar: .*ignores Range.*cache_limit"):
        read_range(
            f"{base}/shard-000.tar",
            0,
            512,
            RemoteOptions(cache_limit=4096, retries=1, backoff=0.01),
        )


def _read_spans(url: str, spans, data: bytes, out) -> None:
    out.put(all(read_range(url, a, b, FAST) == data[a:b] for a, b in spans))


@pytest.mark.slow
def test_reads_reuse_a_connection_per_process(tmp_path, http_server):
    """Reads of one host reuse one kept-alive connection; a forked process (a DataLoader worker)
    opens its own, never the parent's socket."""
    server, base = http_server
    paths = write_shards(server.root, sample_lengths(40), num_shards=1)
    url = f"{base}/shard-000.tar"
    with open(paths[0], "rb") as f:
        data = f.read()
    spans = [(i * 97, i * 97 + 700) for i in range(60)]
    assert all(read_range(url, a, b, FAST) == data[a:b] for a, b in spans)
    assert server.connections == 1
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_read_spans, args=(url, spans, data, out))
    child.start()
    assert out.get(timeout=60) is True
    child.join(60)
    assert all(read_range(url, a, b, FAST) == data[a:b] for a, b in spans)
    assert server.connections == 2  # 180 reads: the parent's connection and the child's


def test_401_and_403_are_permission_errors_not_missing_shards(tmp_path, http_server):
    server, base = http_server
    write_shards(server.root, sample_lengths(20), num_shards=2)
    server.deny = {"shard-000.tar": 401, "shard-001.tar": 403}
    for name, code in server.deny.items():
        url = f"{base}/{name}"
        with pytest.raises(
            RemotePermissionError, match=f"{re.escape(url)}: permission denied.*HTTP {code}"
        ) as err:
            _loader(WebDatasetSource(url, remote=FAST))
        assert (err.value.url, err.value.status) == (url, code) and not isinstance(
            err.value, MissingShardError
        )
        with pytest.raises(RemotePermissionError, match=f"HTTP {code}"):
            read_range(url, 0, 512, FAST)


def test_a_refused_sidecar_is_no_sidecar(tmp_path, http_server):
    """A sidecar is optional: one the server refuses (S3 answers 403 for an absent key of a bucket
    it will not list) is looked past, and the loader indexes the shard itself."""
    server, base = http_server
    paths = write_shards(server.root, sample_lengths(40), num_shards=1)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    server.deny = {"shard-000.tar.prealign-index.npz": 403}
    local = list(_loader(WebDatasetSource(paths)))
    assert _same_batches(
        list(_loader(WebDatasetSource(f"{base}/shard-000.tar", remote=FAST))), local
    ) == len(local)


def test_a_kept_connection_the_server_closed_is_replaced(tmp_path, http_server):
    """Servers close idle kept-alive connections: the next read opens a new one, without costing a
    retry."""
    server, base = http_server
    paths = write_shards(server.root, sample_lengths(20), num_shards=1)
    with open(paths[0], "rb") as f:
        data = f.read()
    url, once = f"{base}/shard-000.tar", RemoteOptions(retries=0, timeout=5.0)
    server.idle_timeout = 0.2
    for i in range(3):
        assert read_range(url, 100 * i, 100 * i + 900, once) == data[100 * i : 100 * i + 900]
        time.sleep(0.5)
    assert server.connections == 3


@pytest.mark.parametrize("ignore_range", [False, True])
def test_a_body_cut_short_is_retried_and_never_kept_short(tmp_path, http_server, ignore_range):
    """A connection dropped mid-body (206, or a Range-ignoring server's whole object) is an
    incomplete read, retried; a body kept whole is never a short one, so every later read is exact
    too."""
    server, base = http_server
    data = bytes(range(256)) * 12288  # 3 MiB
    (tmp_path / "www" / "obj.bin").write_bytes(data)
    server.ignore_range, server.cut = ignore_range, 1
    opts = RemoteOptions(retries=2, backoff=0.01, timeout=5.0, block_size=1 << 20)
    url = f"{base}/obj.bin"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RangeIgnoredWarning)
        for start, end in [
            (1000, 201000),
            (1_258_291, 1_887_436),
            (3 * (1 << 20) - 10, 3 * (1 << 20)),
        ]:
            assert read_range(url, start, end, opts) == data[start:end]


def test_a_cache_dir_holding_other_files_keeps_them(tmp_path, http_server):
    """The block cache evicts only its own blocks: a user's files in the folder given as cache_dir
    stay."""
    server, base = http_server
    (tmp_path / "www" / "obj.bin").write_bytes(os.urandom(3 << 20))
    cache = tmp_path / "my-folder"
    cache.mkdir()
    mine = {"thesis.tex": b"x" * 5000, "notes.txt": b"y", "train_config.yaml": b"z" * 100}
    for name, content in mine.items():
        (cache / name).write_bytes(content)
    os.utime(
        cache / "thesis.tex", (1, 1)
    )  # the oldest file in the folder: first out under an LRU over everything
    opts = RemoteOptions(cache_dir=str(cache), cache_limit=1 << 20, block_size=1 << 19, retries=0)
    for start in range(0, 3 << 20, 1 << 19):
        read_range(f"{base}/obj.bin", start, start + 100, opts, total=3 << 20)
    assert {name: (cache / name).read_bytes() for name in mine} == mine
    assert (cache / ".prealign-block-cache").is_file()  # the folder is marked as a block cache
    assert (
        sum(p.stat().st_size for p in cache.iterdir() if p.name not in mine and p.name[0] != ".")
        <= 1 << 20
    )


@pytest.mark.slow
def test_range_ignoring_objects_go_to_one_folder_the_source_made(tmp_path):
    """Without cache_dir, whole objects are kept in a folder the source's process made (its workers
    write there; removed when that process exits): persistent workers leave no folder of their own
    behind."""
    import tempfile

    from prealign.loaders.sources import remote

    server, base = _serve(tmp_path)
    server.ignore_range = True
    paths = write_shards(str(tmp_path / "www"), sample_lengths(120), num_shards=2)
    urls = [f"{base}/{os.path.basename(p)}" for p in paths]
    before = set(os.listdir(tempfile.gettempdir()))
    src = WebDatasetSource(urls, sidecars=False, remote=FAST)
    assert src.remote.private_dir == remote.private_folder() and os.path.isdir(
        src.remote.private_dir
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RangeIgnoredWarning)
        loader = _loader(src, num_workers=2, loading=LoadingOptions(persistent_workers=True))
        for _ in range(2):
            list(loader)
        del loader
    gc.collect()
    made = {
        n
        for n in set(os.listdir(tempfile.gettempdir())) - before
        if n.startswith("prealign-remote-")
    }
    assert made <= {os.path.basename(src.remote.private_dir)}
    server.shutdown()
    server.server_close()
