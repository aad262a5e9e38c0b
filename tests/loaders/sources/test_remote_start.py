"""A start over remote shards makes no request per shard (issue #28): each object is checked against
its index by the process that first reads it (a ``HEAD`` and the 64 KiB probes), before any of
its samples is served, whatever the shard count. Counted against a real HTTP server on 127.0.0.1, at
two shard counts."""

from __future__ import annotations

import os

import pytest

from prealign.loaders import PackedLoader, WebDatasetSource
from prealign.loaders.errors import ChangedShardError
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.index.merged import merge_sidecars
from prealign.loaders.index.sidecar import PROBE
from prealign.schemas import ParallelLayout
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import sample_lengths, write_shards
from tests.loaders.sources.test_remote import FAST, _Handler, _serve

SCHEMA = causal_lm_schema()


class _Logged(_Handler):
    """:class:`_Handler` that logs every request: ``server.log`` ``[(method, name, Range
    header)]``."""

    def _log(self):
        with self.server.lock:
            self.server.log.append((self.command, self.path.lstrip("/"), self.headers.get("Range")))

    def do_HEAD(self):
        self._log()
        super().do_HEAD()

    def do_GET(self):
        self._log()
        super().do_GET()


@pytest.fixture
def server(tmp_path):
    srv, base = _serve(tmp_path, _Logged)
    srv.log = []
    yield srv, base
    srv.shutdown()
    srv.server_close()


def _data(server, base, n: int) -> tuple[str, list[str]]:
    """``n`` shards of 3 samples each on the server, a sidecar each and one merged index beside
    them."""
    root = os.path.join(server.root, f"n{n}")
    paths = write_shards(root, sample_lengths(3 * n, seed=n), num_shards=n)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    merge_sidecars(WebDatasetSource(paths))
    return f"{base}/n{n}/shard-{{000..{n - 1:03d}}}.tar", paths


def _loader(url: str) -> PackedLoader:
    return PackedLoader(
        WebDatasetSource(url, remote=FAST),
        schema=SCHEMA,
        layout=ParallelLayout(),
        token_budget=256,
        seed=1,
    )


def _shard_requests(log) -> list[tuple]:
    return [r for r in log if r[1].endswith(".tar")]


def test_a_start_sends_no_request_per_shard(server):
    srv, base = server
    starts = {}
    for n in (4, 40):
        url, _ = _data(srv, base, n)
        srv.log.clear()
        _loader(url).prepare()
        starts[n] = list(srv.log)
    # the same requests at 40 shards as at 4: the merged index, and the shard of the one sample
    # whose data signature is checked against the schema (its check included: a HEAD and two probes,
    # then its bytes)
    assert len(starts[40]) == len(starts[4]) <= 6, starts
    assert len({name for _, name, _ in _shard_requests(starts[40])}) <= 1, starts[40]


def test_a_changed_shard_is_caught_by_its_first_read_before_any_of_its_data(server):
    srv, base = server
    url, paths = _data(srv, base, 8)
    loader = _loader(url).prepare()
    victim = 5
    name = os.path.basename(paths[victim])
    size = os.path.getsize(paths[victim])
    with open(paths[victim], "r+b") as f:  # same size, other first bytes: a replaced object
        head = bytearray(f.read(512))
        head[:8] = b"replaced"
        f.seek(0)
        f.write(bytes(head))
    assert os.path.getsize(paths[victim]) == size
    srv.log.clear()
    with pytest.raises(
        ChangedShardError, match=f"{name}.*first or last 64 KiB differ.*prealign index"
    ):
        list(loader)
    theirs = [(m, r) for m, n, r in _shard_requests(srv.log) if n.endswith(name)]
    # its check: the size, then the probe (a shard under 128 KiB: one request of its bytes, each
    # hashed once); no read of a sample's bytes
    assert size <= 2 * PROBE and theirs == [("HEAD", None), ("GET", f"bytes=0-{size - 1}")], theirs


def test_a_shard_of_another_size_is_caught_by_its_head_alone(server):
    srv, base = server
    url, paths = _data(srv, base, 8)
    loader = _loader(url).prepare()
    name = os.path.basename(paths[3])
    with open(paths[3], "ab") as f:
        f.write(bytes(10240))
    srv.log.clear()
    with pytest.raises(ChangedShardError, match=f"{name}.*bytes now.*when indexed.*prealign index"):
        list(loader)
    assert [m for m, n, _ in _shard_requests(srv.log) if n.endswith(name)] == ["HEAD"]
