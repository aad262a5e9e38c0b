"""Every row accounted for (issue #31): a good row removed next to a bad sample (its counts
adjusted) leaves a gap that the bad sample's record seemed to explain; the shard's first read counts
the samples in that gap, so the loader refuses the index instead of serving 8 of 9 good samples. The
same through a merged index and through a shard's own sidecar."""

from __future__ import annotations

import os

import numpy as np
import pytest

from prealign.loaders import BadDataPolicy, PackedLoader, WebDatasetSource
from prealign.loaders.errors import BadSampleError, CorruptShardError, StaleIndexError
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.index.merged import merge_sidecars
from prealign.loaders.index.tiling import bad_regions, count_samples
from prealign.loaders.policy import BadRecord
from prealign.loaders.sources.shard_files import SUFFIX
from prealign.schemas import ParallelLayout
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import add_member, npz_meta, sample_lengths, save_npz_meta, write_shards
from tests.loaders.index.old_sidecars import as_version_3

SCHEMA = causal_lm_schema()
SKIP = BadDataPolicy(on_error="skip", max_consecutive=50)
_ROWS = ("spans", "lengths", "media", "dim_ids", "bounds")


def _bad(at):
    def extra(i, tf):
        if i in at:
            add_member(tf, f"{i:06d}.input_ids.npy", b"not an npy")

    return extra


def _served(paths) -> int:
    loader = PackedLoader(
        WebDatasetSource(paths),
        schema=SCHEMA,
        layout=ParallelLayout(),
        token_budget=128,
        seed=3,
        bad_data=SKIP,
    )
    return sum(len(b["sample_index"]) for b in loader)


@pytest.mark.parametrize("version", [3, 4, 5])
@pytest.mark.parametrize("side", ["after", "before"])
def test_a_row_removed_next_to_a_bad_sample_in_a_merged_index_is_refused(tmp_path, side, version):
    paths = write_shards(str(tmp_path), sample_lengths(30), num_shards=3, extra=_bad({14}))
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    if version < 5:  # (the older probe: version 3 sidecars)
        as_version_3(WebDatasetSource(paths))
    path = merge_sidecars(WebDatasetSource(paths), version=version)["path"]
    for p in paths:  # the loader reads the merged file alone
        os.remove(p + SUFFIX)
    assert _served(paths) == 29
    a, meta = npz_meta(path)
    assert meta["events"][0][:2] == [1, 4]  # shard 1's fifth record is the bad sample 14
    row = 10 + (4 if side == "after" else 3)  # good sample 15 (or 13): shard 1's row next to it
    keep = np.arange(len(a["lengths"])) != row
    for key in _ROWS:
        a[key] = a[key][keep]
    if version == 3:
        a["shards"][1, 1:3] -= 1  # the counts adjusted: one row and one record fewer
    else:
        a["rows"][1] -= 1  # (version 4 counts the records: the rows and the events)
    if side == "before":
        meta["events"][0][1] -= 1
    save_npz_meta(path, a, meta)
    with pytest.raises(StaleIndexError, match="shard-001.tar.*1 bad sample.*hold 2.*removed row"):
        _served(paths)


def test_a_row_removed_next_to_a_bad_sample_in_a_sidecar_is_refused(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(30), num_shards=3, extra=_bad({14, 19}))
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    assert _served(paths) == 28
    a, meta = npz_meta(paths[1] + SUFFIX)
    assert [e[0] for e in meta["events"]] == [4, 9]
    keep = np.arange(len(a["lengths"])) != 7  # good sample 18, just before the bad last sample 19
    for key in _ROWS:
        a[key] = a[key][keep]
    meta["num_events"] -= 1
    meta["events"][1][0] -= 1
    save_npz_meta(paths[1] + SUFFIX, a, meta)
    with pytest.raises(StaleIndexError, match="shard-001.tar.*hold 2.*removed row"):
        _served(paths)


def test_bad_regions_name_the_bytes_around_each_run_of_bad_records():
    spans = np.asarray([[0, 10, 0], [10, 20, 0], [30, 40, 0], [50, 60, 0]], np.int64)
    skip = BadRecord("ignored_member", "w", "m")
    bad = BadRecord.of_error(BadSampleError(sample="w", field=None, expected="x", actual="y"))
    corrupt = BadRecord.of_error(CorruptShardError("s.tar", 5, "truncated"), "shard 0")
    events = [[2, bad], [3, skip], [5, bad]]  # records: ok ok bad skip ok bad ok
    assert bad_regions(spans, events, 7) == [(20, 30, 1), (40, 50, 1)]
    assert bad_regions(spans[1:3], [[0, bad], [3, skip]], 4) == [(0, 10, 1), (40, -1, 0)]
    assert bad_regions(spans, [[2, bad], [3, corrupt]], 6) == []  # unreadable past a corrupt record


def test_count_samples_counts_runs_of_one_key(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(6), num_shards=1, extra=_bad({2}))
    data = open(paths[0], "rb").read()
    assert count_samples(data, 0) == 6
    assert count_samples(b"not a tar" * 100, 0) is None
