"""A shard's first read checks it on the file it opens (one read of a small shard, which also gives
the sample's bytes: issue #28) and says exactly what the check by its path says: the same error
type and message, naming the same shard, or nothing, for shards below, between and above the
probe's two 64 KiB spans, changed in every way the check looks at."""

from __future__ import annotations

import os

import numpy as np
import pytest

from prealign.loaders import build_index
from prealign.loaders.errors import ChangedShardError, MissingShardError, StaleIndexError
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.index.shard_checks import ShardChecks
from prealign.loaders.index.sidecar import PROBE
from prealign.loaders.sources.webdataset import WebDatasetSource
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import sample_lengths, write_shards

CHECK_ERRORS = (ChangedShardError, MissingShardError, StaleIndexError)


def _flip(at):
    def change(data: bytes) -> bytes:
        out = bytearray(data)
        out[at % len(out)] ^= 0x5A
        return bytes(out)

    return change


CHANGES = {
    "unchanged": lambda data: data,
    "first byte": _flip(0),
    "middle byte": lambda data: _flip(len(data) // 2)(data),
    "last byte": _flip(-1),
    "grown by a block": lambda data: data + bytes(512),
    "grown by a byte": lambda data: data + b"x",
    "end marker cut": lambda data: data[:-1024],
    "emptied": lambda data: b"",
    "deleted": None,
}


def _outcome(run):
    """``None`` when ``run()`` passes the check, else the check's error as ``(type, message)``
    (an error of the sample's own, past the check, counts as passing it)."""
    try:
        run()
    except CHECK_ERRORS as exc:
        return type(exc).__name__, str(exc)
    except Exception:  # noqa: BLE001 - the sample's bytes changed; the shard check passed
        return None
    return None


@pytest.fixture(scope="module", params=[8, 40, 110], ids=["small", "between", "large"])
def indexed(request, tmp_path_factory):
    """One shard of 8 (< PROBE bytes), 40 (PROBE..2*PROBE) or 110 samples (> 2*PROBE), its
    sidecar, its checks and its rows."""
    root = str(tmp_path_factory.mktemp(f"s{request.param}"))
    (path,) = write_shards(root, sample_lengths(request.param), num_shards=1)
    write_sidecars(WebDatasetSource([path]), causal_lm_schema())
    built = WebDatasetSource([path])
    rows = np.asarray(build_index(built, causal_lm_schema()).locations)
    with open(path, "rb") as f:
        data = f.read()
    low, high = {8: (0, PROBE), 40: (PROBE, 2 * PROBE), 110: (2 * PROBE, 1 << 30)}[request.param]
    assert low < len(data) <= high and isinstance(built.shard_check, ShardChecks)
    return path, data, built.shard_check, rows


def _verdicts(path: str, checks, rows) -> tuple:
    """The check by path, the first read one by one and the micro-batch's read-ahead then its
    first read."""
    by_path = _outcome(lambda: checks(WebDatasetSource([path]), 0))

    def one_by_one():
        source = WebDatasetSource([path])
        source.shard_check = checks
        source.load(tuple(rows[0]))

    def read_ahead():
        source = WebDatasetSource([path])
        source.shard_check = checks
        source.read_ahead(rows[:4])
        source.load(tuple(rows[0]))

    return by_path, _outcome(one_by_one), _outcome(read_ahead)


@pytest.mark.parametrize("change", list(CHANGES))
def test_the_first_read_says_what_the_check_by_path_says(indexed, change, tmp_path):
    original, data, checks, rows = indexed
    path = str(tmp_path / os.path.basename(original))
    changed = CHANGES[change]
    if changed is not None:
        with open(path, "wb") as f:
            f.write(changed(data))
    by_path, one_by_one, ahead = _verdicts(path, checks, rows)
    assert one_by_one == by_path and ahead == by_path, (change, by_path, one_by_one, ahead)
    if change == "unchanged":
        assert by_path is None
    elif change in ("deleted",):
        assert by_path[0] == "MissingShardError"
    elif change != "middle byte" or len(data) <= 2 * PROBE:  # (between the spans: not checked)
        assert by_path is not None and path in by_path[1], by_path


@pytest.mark.parametrize("moved", ["first", "last"])
def test_an_index_that_misplaces_the_first_or_last_sample_is_stale_either_way(
    indexed, moved, tmp_path
):
    """The sidecar's first sample recorded a block later (a member then precedes it), or its last
    ending a block early (a member's header then follows it): the head and tail checks, made from
    the probe's bytes, refuse it on the open file as by path."""
    original, data, checks, rows = indexed
    path = str(tmp_path / os.path.basename(original))
    with open(path, "wb") as f:
        f.write(data)
    first, last = int(checks.first[0]), int(checks.last[0])
    assert first == 0 and 0 < last < len(data)
    stale = ShardChecks.of_arrays(
        checks.sizes,
        checks.probes,
        np.asarray([first + 512 * (moved == "first")], np.int64),
        np.asarray([last - 512 * (moved == "last")], np.int64),
    )
    verdicts = _verdicts(path, stale, rows)
    assert len(set(verdicts)) == 1 and verdicts[0][0] == "StaleIndexError", verdicts
    assert path in verdicts[0][1]
