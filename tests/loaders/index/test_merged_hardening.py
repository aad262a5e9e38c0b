"""A merged index is checked as strictly as the sidecars it stands for (review of issue #22): rows
removed, repeated or reordered with the counts adjusted, a malformed event or dims entry, a size
that would switch off a shard's first-read check; each a StaleIndexError naming the merged file,
never a sample silently lost."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

from prealign.loaders import BadDataPolicy, PackedLoader, WebDatasetSource
from prealign.loaders.errors import StaleIndexError
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.index.merged import NAME, _parse, merge_sidecars
from prealign.schemas import ParallelLayout
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import add_member, sample_lengths, write_shards
from tests.loaders.index.old_sidecars import as_version_3

SCHEMA = causal_lm_schema()
_ROWS = ("spans", "lengths", "media", "dim_ids", "bounds")


def _merged(tmp_path, extra=None, version=3):
    """A merged index of 3 shards of 10 samples, written as ``version`` (3: the per-shard table
    these tests edit; version 4's own: tests/loaders/index/test_merged_v4.py)."""
    paths = write_shards(str(tmp_path), sample_lengths(30), num_shards=3, extra=extra)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    if version < 5:  # (what an older prealign merged: sidecars of version 3, their older probe)
        as_version_3(WebDatasetSource(paths))
    path = merge_sidecars(WebDatasetSource(paths), version=version)["path"]
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    return paths, path, arrays, json.loads(arrays["meta"].tobytes())


def _save(path, arrays, meta) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **{**arrays, "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)})
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    return buf.getvalue()


def _load(paths):
    for p in paths:  # the loader reads the merged file alone
        if os.path.exists(p + ".prealign-index.npz"):
            os.remove(p + ".prealign-index.npz")
    loader = PackedLoader(
        WebDatasetSource(paths),
        schema=SCHEMA,
        layout=ParallelLayout(),
        token_budget=128,
        seed=3,
        bad_data=BadDataPolicy(on_error="skip", max_consecutive=50),
    ).prepare()
    return len(loader.index), list(loader)


@pytest.mark.parametrize(
    "edit", ["removed", "repeated", "swapped", "first_removed", "last_removed", "past_the_end"]
)
def test_a_merged_index_with_rows_edited_and_counts_adjusted_is_refused(tmp_path, edit):
    paths, path, a, meta = _merged(tmp_path)
    assert a["shards"][:, 1].tolist() == [10, 10, 10] and not meta["events"]
    rows = edited_rows(edit)
    for key in _ROWS:
        a[key] = a[key][rows]
    a["shards"][1, 1:3] += len(rows) - 30
    if edit == "past_the_end":
        a["spans"][19, 1] = a["shards"][1, 0] + 512
    data = _save(path, a, meta)
    with pytest.raises(StaleIndexError, match=NAME):
        _parse(data, path)
    with pytest.raises(StaleIndexError, match=NAME):
        _load(paths)


def edited_rows(edit: str) -> list[int]:
    """The rows kept of the 30 of :func:`_merged` (3 shards of 10) after ``edit``."""
    keep = list(range(30))
    return {
        "removed": keep[:15] + keep[16:],
        "repeated": keep[:15] + [14] + keep[15:],
        "swapped": keep[:14] + [15, 14] + keep[16:],
        "first_removed": keep[:10] + keep[11:],
        "last_removed": keep[:19] + keep[20:],
        "past_the_end": keep,
    }[edit]


def test_first_and_last_bytes_must_be_those_of_the_samples(tmp_path):
    """A crafted ``first = -1`` would switch off the check of the bytes before a shard's first
    sample."""
    paths, path, a, meta = _merged(tmp_path)
    a["shards"][0, 3] = -1
    with pytest.raises(StaleIndexError, match="first / last byte"):
        _parse(_save(path, a, meta), path)


@pytest.mark.parametrize(
    "hostile",
    ["skip_short", "bad_no_record", "event_twice", "event_past", "event_shard", "dims", "dims_bool"]
    + ["size"],
)
def test_a_crafted_merged_index_is_a_typed_error_naming_the_field(tmp_path, hostile):
    paths, path, a, meta = _merged(tmp_path)
    field = {
        "skip_short": "malformed event",
        "bad_no_record": "malformed event",
        "event_twice": "events",
        "event_past": r"malformed event \[1, 12\] \(past its shard's records\)",
        "event_shard": "malformed event",
        "dims": "dims",
        "dims_bool": "dims",
        "size": "shard sizes",
    }[hostile]
    if hostile in ("event_past", "event_shard"):  # one more record than the counts hold
        a["shards"][1, 2] += 1
        meta["events"] += [[1 if hostile == "event_past" else -2, 12, ["skip", "r", "w", "m"]]]
    elif hostile in ("skip_short", "bad_no_record", "event_twice"):
        ev = {
            "skip_short": ["skip"],
            "bad_no_record": ["bad", "x", {"type": "sample"}],
            "event_twice": ["skip", "r", "w", "m"],
        }[hostile]
        extra = 2 if hostile == "event_twice" else 1
        a["shards"][1, 2] += extra
        meta["events"] += [[1, 10, ev]] * extra
    elif hostile.startswith("dims"):
        meta["dims"] = [{"foo": [1, {"x": None}]}] if hostile == "dims" else [{"foo": True}]
    else:  # a shard with no samples whose size says "not checked"
        a["shards"][1, 0] = -2
    with pytest.raises(StaleIndexError, match=field) as err:
        _parse(_save(path, a, meta), path)
    assert NAME in str(err.value)


def test_a_real_merged_index_with_bad_samples_still_loads(tmp_path):
    """Gaps where bad samples were (a shard's first and last too) are explained by their events."""

    def extra(i, tf):
        if i in (0, 9, 14):
            add_member(tf, f"{i:06d}.input_ids.npy", b"not an npy")

    paths, path, a, meta = _merged(tmp_path, extra)
    assert len(meta["events"]) == 3
    _parse(open(path, "rb").read(), path)
    assert _load(paths)[0] == 27


def test_a_merged_index_that_inflates_past_its_size_is_refused_before_inflating(tmp_path):
    """``merge_sidecars`` stores members uncompressed: a deflated file that inflates to more than
    twice its size (a zip bomb) is refused."""
    paths, path, a, meta = _merged(tmp_path)
    a["dim_ids"] = np.random.default_rng(0).integers(0, 4, 1 << 19)  # 4 MiB that deflate ~20x
    buf = io.BytesIO()
    np.savez_compressed(buf, **a)
    with pytest.raises(StaleIndexError, match=NAME):
        _parse(buf.getvalue(), path)
    with pytest.raises(StaleIndexError, match="declare"):
        _parse(buf.getvalue(), path)
