"""Review of the block cache's passes (issue #28): an object kept whole because its server ignores
Range, and no larger than ``cache_limit``, stays whole in the cache (a pass trims to
``limit - slack`` only what is past that of other objects, never the object just kept within the
limit): else each read of an evicted block downloads the whole object again."""

from __future__ import annotations

import functools
import http.server
import os
import threading
import warnings

import pytest

from prealign.loaders.errors import RangeIgnoredWarning
from prealign.loaders.sources.remote import RemoteOptions, read_range


class _IgnoresRange(http.server.SimpleHTTPRequestHandler):
    """``python -m http.server``: a ranged GET answered with 200 and the whole object; GETs
    counted."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.server.gets += 1
        super().do_GET()


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    srv = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_IgnoresRange, directory=str(root))
    )
    srv.gets, srv.root = 0, root
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("below", [1, 2048, 8192])
def test_an_object_within_the_limit_is_downloaded_once(tmp_path, server, below):
    srv, base = server
    block, limit = 4096, 64 * 4096 * 4  # (slack: 4 blocks)
    size = limit - below
    data = os.urandom(size)
    (srv.root / "obj.bin").write_bytes(data)
    opts = RemoteOptions(cache_dir=str(tmp_path / "c"), cache_limit=limit, block_size=block)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RangeIgnoredWarning)
        for _ in range(2):
            for start in range(0, size - 100, block):  # (every block read)
                assert (
                    read_range(f"{base}/obj.bin", start, start + 100, opts)
                    == data[start : start + 100]
                )
    assert srv.gets == 1, srv.gets


def _held(folder: str) -> int:
    from prealign.loaders.sources import remote

    total = 0
    for e in os.scandir(folder):
        if remote._BLOCK_NAME.fullmatch(e.name):
            try:
                total += e.stat().st_size
            except OSError:  # (evicted by another process meanwhile)
                pass
    return total


def _put_many(folder: str, limit: int, k: int, puts: int, out) -> None:
    from prealign.loaders.sources.remote import BlockCache

    cache, most = BlockCache(folder, limit), 0
    for i in range(puts):
        cache.put(f"{k:08x}{i:08x}-100-{i}", bytes(1 + (i * 37 + k) % 100))
        most = max(most, _held(folder))
    out.put(most)


@pytest.mark.slow
def test_processes_sharing_a_folder_stay_within_limit_and_their_slack(tmp_path):
    """Real processes putting at once: the folder never holds more than ``limit + P * slack``
    (each process puts less than ``slack`` between its passes, blocks of at most 100 bytes, a
    pass trims to ``limit - slack``), and none of another's files is lost to an error."""
    import multiprocessing

    limit, procs = 64 * 1_000, 3  # (slack: 1,000 bytes)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    workers = [
        ctx.Process(target=_put_many, args=(str(tmp_path), limit, k, 1_500, out))
        for k in range(procs)
    ]
    for w in workers:
        w.start()
    most = [out.get(timeout=300) for _ in workers]
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == 0
    assert max(most) <= limit + procs * (limit // 64), most
    assert _held(str(tmp_path)) <= limit + (procs - 1) * (limit // 64)
