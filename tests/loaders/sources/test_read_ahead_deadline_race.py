"""The micro-batch read-ahead (issue #28) when its call ends at its deadline: the call has run to
its end (every file it opened still open, none handed over) when the deadline reports it stalled.
Those files must be closed, by whichever side comes second (review of issue #28)."""

from __future__ import annotations

import gc
import os
import time

import numpy as np

from prealign.loaders import WebDatasetSource
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.sources import deadline, webdataset
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import sample_lengths, write_shards

SCHEMA = causal_lm_schema()


def _open_shards(paths: list[str]) -> int:
    """Descriptors of this process open on one of ``paths``."""
    real = set(map(os.path.realpath, paths))
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") in real
        except OSError:
            pass
    return n


def test_files_of_a_read_ahead_that_ends_at_its_deadline_are_closed(tmp_path, monkeypatch):
    paths = write_shards(str(tmp_path), sample_lengths(8, seed=2), num_shards=8)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    source = WebDatasetSource(paths, read_timeout=0.3)
    rows = []
    for shard in range(8):  # (each shard's first sample: a row of each)
        records = source.scan(shard)
        rows.append(next(records)[0][:3])
        records.close()
    real = deadline.call_with_timeout

    def at_the_deadline(fn, timeout, **kwargs):  # (fn runs to its end; its result comes too late)
        def late():
            fn()
            time.sleep(timeout * 2)

        return real(late, timeout, **kwargs)

    monkeypatch.setattr(webdataset, "call_with_timeout", at_the_deadline)
    gc.collect()
    before = _open_shards(paths)
    source.read_ahead(np.asarray(rows, np.int64))
    time.sleep(1.0)  # (the late call has returned)
    gc.collect()
    assert _open_shards(paths) == before
