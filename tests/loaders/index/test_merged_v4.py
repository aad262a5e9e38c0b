"""The merged index's version 4 (issue #28, 100k shards): a shard's size and sample count alone
(``sizes`` int64, ``rows`` int32), its record count and first / last bytes found from the samples
and events as a version 3 file's were checked against them, the names' lengths kept only when a name
holds a newline. As strict as version 3: rows removed, repeated or reordered with the counts
adjusted, events past a shard's records, a crafted size or member, each a StaleIndexError naming the
file; a version 3 file of the same shards gives the same loader; a version from the future is
refused with the command that rewrites it."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prealign.loaders import WebDatasetSource
from prealign.loaders.errors import StaleIndexError
from prealign.loaders.index.merged import (
    NAME,
    VERSION,
    _encode_names_v4,
    _parse,
    _same_names,
    merge_sidecars,
    merged_records,
    read_merged,
)
from tests.conftest import examples
from tests.loaders.index.test_merged_hardening import (
    SCHEMA,
    _load,
    _merged,
    _save,
    edited_rows,
)
from tests.loaders.index.test_merged_names_columns import _meta
from tests.loaders.index.test_merged_v3 import _NAME

_ROWS = ("spans", "lengths", "media", "dim_ids", "bounds")


def test_version_4_has_no_per_shard_table(tmp_path):
    paths, path, a, meta = _merged(tmp_path, version=4)
    assert meta["version"] == 4 and VERSION == 5 and "names" not in meta and "probes" not in meta
    assert set(a) == {"meta", "names", "probes", "sizes", "rows", *_ROWS}
    assert a["rows"].dtype == np.int32 and a["rows"].tolist() == [10, 10, 10]
    assert a["sizes"].dtype == np.int64 and a["names"].tobytes().split(b"\n") == [
        p.rsplit("/", 1)[1].encode() for p in paths
    ]


def test_version_4_and_version_3_of_the_same_shards_give_the_same_records_and_loader(tmp_path):
    def extra(i, tf):  # bad samples: a shard's first and last, and one inside
        if i in (0, 9, 14):
            from tests.loader_helpers import add_member

            add_member(tf, f"{i:06d}.input_ids.npy", b"not an npy")

    paths, path, a, meta = _merged(tmp_path, extra, version=3)
    other = str(tmp_path / "v4.npz")
    merge_sidecars(WebDatasetSource(paths), other, version=4)
    found = {v: _parse(open(f, "rb").read(), f) for v, f in ((3, path), (4, other))}
    assert [found[v][0]["version"] for v in (3, 4)] == [3, 4]
    v3, v4 = (merged_records(WebDatasetSource(paths), SCHEMA, found=found[v]) for v in (3, 4))
    assert v3.keys() == v4.keys() and len(v3) == 3
    for s in v3:
        assert v3[s]["check"] == v4[s]["check"] and v3[s]["regions"] == v4[s]["regions"]
        for key in ("spans", "lengths", "dim_ids", "bounds"):
            assert np.array_equal(v3[s][key], v4[s][key])
        assert str(v3[s]["events"]) == str(v4[s]["events"]) and v3[s]["shard"] == v4[s]["shard"]
    old = _load(paths)
    os.replace(other, path)
    new = _load(paths)
    assert old[0] == new[0] == 27
    assert [{k: v.tolist() for k, v in b.items() if hasattr(v, "tolist")} for b in old[1]] == [
        {k: v.tolist() for k, v in b.items() if hasattr(v, "tolist")} for b in new[1]
    ]


@pytest.mark.parametrize(
    "edit", ["removed", "repeated", "swapped", "first_removed", "last_removed", "past_the_end"]
)
def test_rows_edited_and_the_count_adjusted_are_refused(tmp_path, edit):
    paths, path, a, meta = _merged(tmp_path, version=4)
    rows = edited_rows(edit)
    for key in _ROWS:
        a[key] = a[key][rows]
    a["rows"][1] += len(rows) - 30
    if edit == "past_the_end":
        a["spans"][19, 1] = a["sizes"][1] + 512
    data = _save(path, a, meta)
    if edit in ("first_removed", "last_removed"):
        # (version 4 keeps no first / last byte to compare with: the file is consistent, and the
        # shard's first read finds the bytes its index no longer accounts for, as with a sidecar)
        _parse(data, path)
        with pytest.raises(StaleIndexError, match="shard-001.tar.*does not account for"):
            _load(paths)
        return
    with pytest.raises(StaleIndexError, match=NAME):
        _parse(data, path)
    with pytest.raises(StaleIndexError, match=NAME):
        _load(paths)


@pytest.mark.parametrize(
    "crafted",
    [
        "event_past_the_records",
        "event_twice",
        "event_no_shard",
        "size",
        "rows_negative",
        "rows_float",
        "sizes_2d",
        "rows_short",
        "names_fewer",
        "name_bytes_int64",
        "name_bytes_short",
        "table_too",
        "not_utf8",
    ],
)
def test_a_crafted_version_4_file_is_a_typed_error_naming_it(tmp_path, crafted):
    paths, path, a, meta = _merged(tmp_path, version=4)
    field = "merged index unreadable"
    if crafted == "event_past_the_records":  # shard 1 has 10 records: position 10 is past them
        meta["events"] = [[1, 11, ["skip", "r", "w", "m"]]]
        field = "malformed event"
    elif crafted == "event_twice":
        meta["events"] = [[1, 10, ["skip", "r", "w", "m"]]] * 2
        field = "events"
    elif crafted == "event_no_shard":
        meta["events"] = [[3, 0, ["skip", "r", "w", "m"]]]
        field = "malformed event"
    elif crafted == "size":
        a["sizes"][1] = -2
        field = "shard sizes"
    elif crafted == "rows_negative":
        a["rows"][0], a["rows"][1] = -1, 21
        field = "rows"
    elif crafted == "rows_float":
        a["rows"] = a["rows"].astype(np.float64)
        field = "rows of dtype float64"
    elif crafted == "sizes_2d":
        a["sizes"] = a["sizes"][:, None]
        field = "sizes of dtype"
    elif crafted == "rows_short":
        a["rows"] = a["rows"][:2]
        field = "rows of dtype"
    elif crafted == "names_fewer":
        a["names"] = np.frombuffer(a["names"].tobytes().replace(b"\n", b"_", 1), np.uint8)
        field = "names: 2 names for 3 shards"
    elif crafted == "name_bytes_int64":  # (version 4 writes int32)
        a.update(_encode_names_v4(["a\nb", "c", "d"]))
        a["name_bytes"] = a["name_bytes"].astype(np.int64)
        field = "name_bytes of dtype int64"
    elif crafted == "name_bytes_short":
        a.update(_encode_names_v4(["a\nb", "c", "d"]))
        a["name_bytes"] = a["name_bytes"] - np.array([1, 0, 0], np.int32)
        field = "names:"
    elif crafted == "table_too":  # version 3's table in a version 4 file
        a["shards"] = np.zeros((3, 5), np.int64)
        field = "members"
    else:
        a["names"] = np.concatenate([[0xFF], a["names"][1:]]).astype(np.uint8)
        field = "names:"
    with pytest.raises(StaleIndexError, match=field) as err:
        _parse(_save(path, a, meta), path)
    assert NAME in str(err.value) and "prealign index --merge" in str(err.value)


@examples(40)
@given(st.lists(_NAME, min_size=3, max_size=3))
def test_any_names_round_trip_through_a_version_4_file(tmp_path_factory, names):
    """Names with newlines keep their lengths (int32); others are split at the newlines."""
    tmp_path = tmp_path_factory.mktemp("m")
    paths, path, a, meta = _merged(tmp_path, version=4)
    arrays = _encode_names_v4(names)
    assert ("name_bytes" in arrays) == any("\n" in n for n in names)
    a.update(arrays)
    parsed, _ = _parse(_save(path, a, meta), path)
    assert parsed["names"] == names


def test_a_version_from_the_future_is_refused_with_the_command_that_rewrites_it(tmp_path):
    paths, path, a, meta = _merged(tmp_path, version=4)
    with pytest.raises(StaleIndexError, match=r"version 6.*\[2, 3, 4, 5\].*prealign index --merge"):
        _parse(_save(path, a, {**meta, "version": 6}), path)
    with pytest.raises(StaleIndexError, match="version 6"):
        read_merged(WebDatasetSource(paths), SCHEMA)
    with pytest.raises(ValueError, match=r"writes versions \[3, 4, 5\]"):
        merge_sidecars(WebDatasetSource(paths), version=2)


@examples(300)
@given(
    st.integers(1, 6),
    st.integers(8, 20),
    st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from("x\n/é")), max_size=3),
)
def test_long_names_compared_as_words_answer_as_the_text_does(count, width, edits):
    """Names of 8 bytes or more (compared a word at a time, the last word overlapping): any byte
    changed, inserted or removed anywhere (lengths that still add up included) is found."""
    source = WebDatasetSource([f"/data/{i:0{width}d}" for i in range(count)])
    names = [u[6:] for u in source.urls]
    text = "\n".join(names)
    for at, char in edits:  # (a change, or an insertion and a removal: the length kept or not)
        at %= len(text)
        text = text[:at] + char + text[at + (at % 2) :]
        if len(text) > 1 and at % 3 == 0:
            cut = (at * 7) % len(text)
            text = text[:cut] + text[cut + 1 :]
    for candidate in (names, text.split("\n")):
        meta, encoded = _meta(candidate)
        by_words = _same_names(meta, source, encoded)
        by_text = _same_names(meta, source)  # (no stored names: the text comparison)
        assert by_words == by_text == (candidate == names)
