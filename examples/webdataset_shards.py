"""Webdataset shards: write them with ``ShardWriter`` (sidecar indexes included), check them with
``prealign index --check``, load them locally and over http, and get the same batches both ways.

    samples ──ShardWriter──► shard-000000.tar + shard-000000.tar.prealign-index.npz, ...
            ──PackedLoader(WebDatasetSource(paths))──► batches
            ──PackedLoader(WebDatasetSource("http://127.0.0.1:PORT/shard-{000000..000003}.tar"))
              ──► same batches

The http server is started by this script on 127.0.0.1 (the standard library's, taught to answer
``Range`` requests, as nginx, S3 or GCS do: only the samples' bytes travel). Run:

    python examples/webdataset_shards.py
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import threading
from http import HTTPStatus
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch

from prealign.loaders import PackedLoader, ShardWriter, WebDatasetSource
from prealign.schemas import ParallelLayout, causal_lm_schema


def write(folder: str, n: int = 400, topk: int = 4) -> list[str]:
    """``n`` pre-tokenized samples with teacher top-k, in shards of about 1 MiB."""
    rng = np.random.default_rng(0)
    with ShardWriter(os.path.join(folder, "shard-%06d.tar"), max_bytes=1 << 20) as writer:
        for i in range(n):
            ids = rng.integers(1, 32000, int(rng.integers(8, 200)))
            writer.write(
                {
                    "__key__": f"sample{i:06d}",
                    "input_ids": ids,
                    "teacher_topk_log_probs": -rng.random((ids.size, topk), dtype=np.float32),
                    "teacher_topk_ids": rng.integers(0, 32000, (ids.size, topk)),
                    "json": {"source": "example", "row": i},
                }
            )
    return writer.shards


class RangeHandler(SimpleHTTPRequestHandler):
    """``http.server`` plus ``Range: bytes=a-b`` (what an object store answers): 206 and just those
    bytes."""

    def send_head(self):
        spec = self.headers.get("Range", "")
        path = self.translate_path(self.path)
        if not spec.startswith("bytes=") or not os.path.isfile(path):
            return super().send_head()
        size = os.path.getsize(path)
        first, _, last = spec[6:].partition("-")
        start, end = int(first), min(int(last) if last else size - 1, size - 1)
        f = open(path, "rb")
        f.seek(start)
        self.send_response(HTTPStatus.PARTIAL_CONTENT)
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        self.range_left = end - start + 1
        return f

    def copyfile(self, source, outputfile):
        left = getattr(self, "range_left", None)
        if left is None:
            return super().copyfile(source, outputfile)
        outputfile.write(source.read(left))

    def log_message(self, *args):  # quiet
        pass


def batches(urls, schema, layout) -> list[dict]:
    loader = PackedLoader(
        WebDatasetSource(urls), schema=schema, layout=layout, token_budget=2048, cp_rank=0, seed=7
    )
    return list(loader)


def main() -> dict:
    with tempfile.TemporaryDirectory() as folder:
        shards = write(folder)
        check = subprocess.run(
            [
                sys.executable,
                "-m",
                "prealign.loaders.cli.main",
                "index",
                "--text",
                "--check",
                *shards,
            ],
            capture_output=True,
            text=True,
        )  # `prealign index --text --check SHARDS`
        assert check.returncode == 0, check.stderr
        schema = causal_lm_schema(pad_token_id=0, topk=4, vocab_size=32000)
        layout = ParallelLayout(tp=2, cp=2)
        local = batches(shards, schema, layout)

        server = ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(RangeHandler, directory=folder)
        )
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            url = (
                f"http://127.0.0.1:{server.server_port}/shard-{{000000..{len(shards) - 1:06d}}}.tar"
            )
            remote = batches(url, schema, layout)
        finally:
            server.shutdown()
            server.server_close()
    assert len(remote) == len(local) > 0
    for a, b in zip(local, remote):  # the same micro-batches, element for element
        assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
    return {
        "shards": len(shards),
        "micro_batches": len(local),
        "check": check.stderr.strip().splitlines()[-1],
        "first_batch": {
            k: tuple(v.shape) for k, v in local[0].items() if isinstance(v, torch.Tensor)
        },
    }


if __name__ == "__main__":
    for key, value in main().items():
        print(f"{key}: {value}")
