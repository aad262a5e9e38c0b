"""The merged index's version 3 (issue #28): shard names as one UTF-8 text with a length per name,
probes as a ``[S,16]`` byte array, read in a few C calls instead of a JSON list of 100k names.
Any name round-trips (newlines, NUL, lone surrogates of undecodable file names, very long names);
a corrupt file is a StaleIndexError naming it; version 2 files are still read and give the same
loader; version 1 is refused with the command that rewrites it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prealign.loaders.errors import StaleIndexError
from prealign.loaders.index.merged import NAME, _parse, decode_names, encode_names
from tests.conftest import examples
from tests.loaders.index.test_merged_hardening import _load, _merged, _save

_HOSTILE = ["\n", "\x00", "\ud800", "\udc00", "\udcff", "/", "é", "\U0001f600", "\r", ""]
_CHARS = st.one_of(st.characters(), st.sampled_from(_HOSTILE))
_NAME = st.lists(_CHARS, max_size=40).map("".join)


@examples(300)
@given(st.lists(_NAME, min_size=1, max_size=30))
def test_any_names_round_trip(names):
    """Names with newlines (one inside a name, or one name just a newline), NUL, lone surrogates
    (what ``os.listdir`` gives for a name that is not UTF-8), empty names."""
    arrays = encode_names(names)
    assert arrays["names"].dtype == np.uint8 and arrays["name_bytes"].shape == (len(names),)
    assert decode_names(arrays["names"], arrays["name_bytes"]) == names


def test_very_long_names_and_many_names_round_trip():
    names = ["x" * 100_000, "a\nb" * 5_000, "\udcff" * 1_000] + [
        f"s-{i:06d}.tar" for i in range(10**5)
    ]
    arrays = encode_names(names)
    assert decode_names(arrays["names"], arrays["name_bytes"]) == names


def test_a_surrogate_pair_stays_two_code_points_and_a_name_may_be_just_a_newline():
    names = ["\ud800\udc00", "\n", "a\udcff\n", "\x00", ""]
    arrays = encode_names(names)
    assert arrays["name_bytes"].tolist() == [6, 1, 5, 1, 0]
    back = decode_names(arrays["names"], arrays["name_bytes"])
    assert back == names and len(back[0]) == 2


@examples(40)
@given(st.lists(_NAME, min_size=3, max_size=3))
def test_hostile_names_round_trip_through_a_merged_file(tmp_path_factory, names):
    tmp_path = tmp_path_factory.mktemp("m")
    paths, path, a, meta = _merged(tmp_path)
    assert meta["version"] == 3 and "names" not in meta and "probes" not in meta
    a.update(encode_names(names))
    parsed, _ = _parse(_save(path, a, meta), path)
    assert parsed["names"] == names


@pytest.mark.parametrize(
    "corrupt",
    [
        "lengths_short",
        "lengths_long",
        "length_negative",
        "lengths_float",
        "not_utf8",
        "no_names",
        "probes_not_ascii",
        "probes_shape",
        "probes_int64",
        "member_missing",
        "v2_member_left",
    ],
)
def test_a_corrupt_version_3_file_is_a_typed_error_naming_it(tmp_path, corrupt):
    paths, path, a, meta = _merged(tmp_path)
    names = a["names"].tobytes().split(b"\n")
    if corrupt == "lengths_short":
        a["name_bytes"] = a["name_bytes"] - np.array([1, 0, 0])
    elif corrupt == "lengths_long":
        a["name_bytes"] = a["name_bytes"] + np.array([0, 0, 1])
    elif corrupt == "length_negative":
        a["name_bytes"] = np.array([-1, len(names[0]) + len(names[1]) + 2, len(names[2])])
    elif corrupt == "lengths_float":
        a["name_bytes"] = a["name_bytes"].astype(np.float64)
    elif corrupt == "not_utf8":
        a["names"] = np.frombuffer(b"\n".join([b"\xff" + names[0][1:], *names[1:]]), np.uint8)
    elif corrupt == "no_names":
        a["names"], a["name_bytes"] = np.zeros(0, np.uint8), np.zeros(0, np.int64)
    elif corrupt == "probes_not_ascii":
        a["probes"] = a["probes"].copy()
        a["probes"][1, 3] = 0xC3
    elif corrupt == "probes_shape":
        a["probes"] = a["probes"][:2]
    elif corrupt == "probes_int64":
        a["probes"] = a["probes"].astype(np.int64)
    elif corrupt == "member_missing":
        del a["name_bytes"]
    else:  # a v3 file with the JSON names of version 2 as well
        meta["names"] = [n.decode() for n in names]
        a = {k: v for k, v in a.items() if k != "probes"}
    with pytest.raises(StaleIndexError, match="merged index unreadable") as err:
        _parse(_save(path, a, meta), path)
    assert NAME in str(err.value) and "prealign index --merge" in str(err.value)


def _as_version_2(a: dict, meta: dict) -> tuple[dict, dict]:
    """The same index as version 2 wrote it: names and probes as JSON lists in ``meta``."""
    names = decode_names(a["names"], a["name_bytes"])
    probes = [p.decode() for p in np.ascontiguousarray(a["probes"]).view("S16")[:, 0]]
    old = {k: v for k, v in a.items() if k not in ("names", "name_bytes", "probes")}
    return old, {**meta, "version": 2, "names": names, "probes": probes}


def test_a_version_2_file_is_still_read_the_same(tmp_path):
    paths, path, a, meta = _merged(tmp_path)
    new_meta, _ = _parse(_save(path, a, meta), path)
    new = _load(paths)
    old_meta, _ = _parse(_save(path, *_as_version_2(a, meta)), path)
    assert old_meta["names"] == new_meta["names"]
    assert old_meta["probes"].tolist() == new_meta["probes"].tolist()
    assert all(len(p) == 16 for p in new_meta["probes"].tolist())
    old = _load(paths)
    assert old[0] == new[0] == 30
    assert [{k: v.tolist() for k, v in b.items() if hasattr(v, "tolist")} for b in old[1]] == [
        {k: v.tolist() for k, v in b.items() if hasattr(v, "tolist")} for b in new[1]
    ]


def test_a_version_1_file_is_refused_with_the_command_that_rewrites_it(tmp_path):
    paths, path, a, meta = _merged(tmp_path)
    old, meta2 = _as_version_2(a, meta)
    raw = json.dumps({**meta2, "version": 1})
    with pytest.raises(StaleIndexError, match="version 1.*prealign index --merge") as err:
        _parse(_save(path, old, json.loads(raw)), path)
    assert NAME in str(err.value)
