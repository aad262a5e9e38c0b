"""One bad-data record type (issue #27): :class:`BadRecord` round-trips through its JSON form
exactly, turns back into the typed error it was made from, and reads the untyped forms files written
before it hold (sidecar and merged-index events, a saved index's report), so no file needs
rebuilding."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prealign.loaders import BadDataPolicy, WebDatasetSource, build_index
from prealign.loaders.errors import (
    BadSampleError,
    CorruptShardError,
    MissingMemberError,
    ShardGoneError,
    ShardTimeoutError,
    StaleIndexError,
    UnsafeMemberError,
    error_record,
    reason_of,
)
from prealign.loaders.index.events import parse_event
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.index.merged import merge_sidecars, merged_path
from prealign.loaders.index.sample_index import SampleIndex
from prealign.loaders.policy import BadDataReport, BadRecord
from prealign.loaders.sources.shard_files import SUFFIX
from prealign.schemas.errors import SampleError
from prealign.schemas.schema import causal_lm_schema
from tests.conftest import examples
from tests.loader_helpers import add_member, npz_meta, sample_lengths, save_npz_meta, write_shards

SCHEMA = causal_lm_schema()
SKIP = BadDataPolicy(on_error="skip", max_consecutive=50, warn=False)

ERRORS = [
    BadSampleError(sample="s.tar:000003", field="input_ids", expected="an npy", actual="b'not'"),
    BadSampleError(
        sample="s.tar:000004", field=None, expected="text", actual="bytes", reason="unreadable_text"
    ),
    MissingMemberError(
        sample="s.tar:000005", field="json", expected="members ['json']", actual="members []"
    ),
    UnsafeMemberError(
        sample="s.tar:000006", field="pkl", expected="no pickle", actual="a .pkl member"
    ),
    SampleError(sample=7, field="labels", expected="int64", actual="float32"),
    CorruptShardError("s.tar", 10240, "truncated archive"),
    ShardTimeoutError("s.tar", 0, "no byte for 30 s"),
]


@pytest.mark.parametrize("exc", ERRORS, ids=lambda e: type(e).__name__)
def test_a_record_turns_back_into_its_typed_error(exc):
    rec = BadRecord.of_error(exc)
    assert (
        rec.is_error
        and rec.message == str(exc)
        and rec.is_shard == isinstance(exc, CorruptShardError)
    )
    assert pickle.loads(pickle.dumps(rec)) == rec  # (records cross DataLoader workers)
    again = BadRecord.from_json(json.loads(json.dumps(rec.to_json()))).to_error()
    assert type(again) is type(exc) and str(again) == str(exc)
    assert reason_of(again) == reason_of(exc)
    for name in ("sample", "field", "expected", "actual", "shard", "offset", "cause"):
        assert getattr(again, name, None) == getattr(exc, name, None), name


def test_a_load_time_record_of_an_error_with_its_own_constructor_turns_back_too():
    exc = ShardGoneError("s.tar", "s.tar@512", "deleted since indexing")
    rec = BadRecord.of_error(exc, "s.tar@512 (index row 3)")
    assert (rec.reason, rec.where) == ("missing_shard", "s.tar@512 (index row 3)")
    again = rec.to_error()
    assert (
        isinstance(again, BadSampleError)
        and str(again) == str(exc)
        and again.reason == "missing_shard"
    )


def test_a_counted_record_is_no_error():
    rec = BadRecord("ignored_member", "s.tar:README", "tar file member without an extension")
    assert not rec.is_error and not rec.is_shard and BadRecord.from_json(rec.to_json()) == rec
    with pytest.raises(ValueError, match="not an error"):
        rec.to_error()


_text = st.text(max_size=40)
_json_value = st.one_of(st.none(), st.integers(-(2**53), 2**53), _text)


@examples(60)
@given(
    reason=_text,
    where=_text,
    message=_text,
    sample=_json_value,
    field=st.one_of(st.none(), _text),
    cls=st.sampled_from(["BadSampleError", "MissingMemberError", "MediaError", "SampleError"]),
    shard=st.booleans(),
    offset=st.integers(0, 2**53),
)
def test_the_json_form_round_trips_exactly(
    reason, where, message, sample, field, cls, shard, offset
):
    error = (
        {
            "type": "shard",
            "cls": "CorruptShardError",
            "shard": where,
            "offset": offset,
            "cause": message,
            "reason": reason,
        }
        if shard
        else {
            "type": "sample",
            "cls": cls,
            "sample": sample,
            "field": field,
            "expected": message,
            "actual": where,
            "reason": reason,
            "message": message,
        }
    )
    for rec in (BadRecord(reason, where, message), BadRecord(reason, where, message, error)):
        back = BadRecord.from_json(json.loads(json.dumps(rec.to_json())))
        assert back == rec and back.error == rec.error and back.to_json() == rec.to_json()
    report = BadDataReport()
    report.add(BadRecord(reason, where, message, error))
    report.add(BadRecord("ignored_member", where, message))
    assert BadDataReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report


@pytest.mark.parametrize(
    "hostile",
    [
        None,
        [],
        "skip",
        {"reason": "r", "where": "w"},
        {"reason": 1, "where": "w", "message": "m"},
        {"reason": "r", "where": "w", "message": "m", "extra": 1},
        {"reason": "r", "where": "w", "message": "m", "error": {"type": "sample"}},
        {"reason": "r", "where": "w", "message": "m", "error": {"type": "shard", "shard": "s"}},
        {
            "reason": "r",
            "where": "w",
            "message": "m",
            "error": {"type": "pickle", "cls": "os.system"},
        },
        ["skip"],
        ["skip", "r", "w"],
        ["skip", "r", "w", 3],
        ["bad", "x", {"type": "sample"}],
        ["bad", "x"],
        [
            "bad",
            "x",
            {"type": "sample", "cls": 3, "sample": 1, "field": None, "expected": "", "actual": ""},
        ],
        ["ok"],
    ],
)
def test_a_malformed_stored_record_is_refused(hostile):
    with pytest.raises(ValueError):
        parse_event(hostile)


@pytest.mark.parametrize("exc", ERRORS, ids=lambda e: type(e).__name__)
def test_the_untyped_events_of_older_files_read_as_the_same_records(exc):
    rec = BadRecord.of_error(exc, "shard 0" if isinstance(exc, CorruptShardError) else None)
    assert parse_event(["bad", rec.where, error_record(exc)]) == rec
    assert parse_event(rec.to_json()) == rec
    assert parse_event(["skip", "ignored_member", "s.tar:README", "m"]) == BadRecord(
        "ignored_member", "s.tar:README", "m"
    )


# ---- files written before records were typed ---------------------------------------------------
def _untyped(ev: dict) -> list:
    """An event as files stored it before records were typed."""
    if "error" in ev:
        return ["bad", ev["where"], ev["error"]]
    return ["skip", ev["reason"], ev["where"], ev["message"]]


def _bad_data(root: str) -> list[str]:
    def extra(i, tf):
        if i == 11:
            add_member(tf, "README", b"not a sample")
        if i in (3, 4, 17):
            add_member(tf, f"{i:06d}.input_ids.npy", b"not an npy")
            return True
        return False

    paths = write_shards(root, sample_lengths(30), num_shards=3, extra=extra)
    with open(paths[2], "r+b") as f:  # the last shard cut short: a corrupt_shard record
        f.truncate(os.path.getsize(paths[2]) // 3)
    return paths


def _index(paths):
    return build_index(WebDatasetSource(paths), SCHEMA, policy=SKIP)


def test_sidecars_and_a_merged_index_of_the_untyped_form_give_the_same_index(tmp_path):
    paths = _bad_data(str(tmp_path))
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    typed = _index(paths)
    assert typed.report.counts == {"bad_sample": 3, "corrupt_shard": 1, "ignored_member": 1}
    assert all(e.error is not None for e in typed.report.examples if e.reason != "ignored_member")
    for p in paths:  # written in the typed form; rewritten as older prealign wrote them
        arrays, meta = npz_meta(p + SUFFIX)
        assert all(isinstance(ev, dict) for _, ev in meta["events"])
        meta["events"] = [[pos, _untyped(ev)] for pos, ev in meta["events"]]
        save_npz_meta(p + SUFFIX, arrays, meta)
    untyped = _index(paths)
    assert untyped.report == typed.report and untyped.digest == typed.digest

    merge_sidecars(WebDatasetSource(paths))  # (from the untyped sidecars: the merged file is typed)
    for p in paths:
        os.rename(p + SUFFIX, p + SUFFIX + ".away")
    assert _index(paths).report == typed.report
    arrays, meta = npz_meta(merged_path(WebDatasetSource(paths)))
    assert all(isinstance(ev, dict) for _, _, ev in meta["events"])
    meta["events"] = [[s, pos, _untyped(ev)] for s, pos, ev in meta["events"]]
    save_npz_meta(merged_path(WebDatasetSource(paths)), arrays, meta)
    merged = _index(paths)
    assert merged.report == typed.report and merged.digest == typed.digest

    meta["events"][0][2] = [
        "bad",
        "x",
        {"type": "sample"},
    ]  # and a malformed one is refused, as before
    save_npz_meta(merged_path(WebDatasetSource(paths)), arrays, meta)
    with pytest.raises(StaleIndexError, match="malformed event"):
        _index(paths)


def test_a_saved_index_of_the_untyped_report_loads(tmp_path):
    paths = _bad_data(str(tmp_path))
    index = build_index(WebDatasetSource(paths, sidecars=False), SCHEMA, policy=SKIP)
    path = str(tmp_path / "index.npz")
    index.save(path)
    assert SampleIndex.load(path).report == index.report
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    report = json.loads(arrays["report"].tobytes())
    report["examples"] = [[e["where"], e["reason"], e["message"]] for e in report["examples"]]
    arrays["report"] = np.frombuffer(json.dumps(report).encode(), np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    old = SampleIndex.load(path).report
    assert old.counts == index.report.counts
    assert [(e.reason, e.where, e.message) for e in old.examples] == [
        (e.reason, e.where, e.message) for e in index.report.examples
    ]


# ---- untrusted stored events: any JSON in any field ---------------------------------------------
_VALID_ERRORS = {
    "sample": {
        "type": "sample",
        "cls": "BadSampleError",
        "sample": "s.tar:000003",
        "field": "input_ids",
        "expected": "an npy",
        "actual": "b'not'",
        "reason": "bad_sample",
        "message": "sample s.tar:000003: not an npy",
    },
    "shard": {
        "type": "shard",
        "cls": "CorruptShardError",
        "shard": "s.tar",
        "offset": 512,
        "cause": "truncated",
        "reason": "corrupt_shard",
    },
}
_FIELDS = sorted({k for e in _VALID_ERRORS.values() for k in e} | {"zzz"})
_DROP = object()  # the key left out
_any_json = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False),
        st.text(max_size=20),
        st.sampled_from(["sample", "shard", "x" * 200_000]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def _stored(kind: str, where: str, key: str, value, typed: bool):
    """A valid stored event of an error of ``kind`` with ``where`` (``"error"``: its error record,
    ``"outer"``: the record itself) ``[key]`` set to ``value`` (left out for ``_DROP``), in the
    typed or the untyped form."""
    error = dict(_VALID_ERRORS[kind])
    event = {"reason": error["reason"], "where": "s.tar:000003", "message": "m", "error": error}
    target = error if where == "error" else event
    if value is _DROP:
        target.pop(key, None)
    else:
        target[key] = value
    if typed:
        return event
    return ["bad", event.get("where"), event.get("error")]


def _check_valid(rec: BadRecord) -> None:
    """``rec`` is a record whose every field has its documented type, and it round-trips."""
    assert all(isinstance(x, str) for x in (rec.reason, rec.where, rec.message))
    back = BadRecord.from_json(json.loads(json.dumps(rec.to_json())))
    assert back == rec and back.error == rec.error
    if not rec.is_error:
        return
    err = rec.to_error()
    assert isinstance(err, (BadSampleError, SampleError, CorruptShardError)) and str(err)
    if rec.is_shard:
        assert isinstance(err.shard, (str, type(None))) and isinstance(err.cause, (str, type(None)))
        assert err.offset is None or (type(err.offset) is int), err.offset
    else:
        assert err.sample is None or type(err.sample) in (str, int), err.sample
        for name in ("field", "expected", "actual"):
            assert isinstance(getattr(err, name), (str, type(None))), name


def _parse_or_refuse(obj) -> None:
    try:
        rec = parse_event(obj)
    except ValueError:
        return
    _check_valid(rec)


@pytest.mark.parametrize(
    "kind, where, key, value",
    [
        ("shard", "error", "type", ["shard"]),
        ("sample", "error", "type", {"a": 1}),
        ("shard", "error", "shard", [1]),
        ("shard", "error", "offset", {}),
        ("shard", "error", "offset", True),
        ("shard", "error", "cause", 5),
        ("sample", "error", "message", 7),
        ("sample", "error", "sample", {"a": 1}),
        ("sample", "error", "field", [1]),
        ("sample", "error", "expected", 1.5),
        ("sample", "error", "zzz", 1),
        ("sample", "error", "reason", ["bad_sample"]),
    ],
)
@pytest.mark.parametrize("typed", [True, False], ids=["typed", "untyped"])
def test_a_stored_event_with_a_field_of_the_wrong_type_is_refused(kind, where, key, value, typed):
    with pytest.raises(ValueError):
        parse_event(_stored(kind, where, key, value, typed))


@pytest.mark.slow
@examples(400)
@given(
    kind=st.sampled_from(sorted(_VALID_ERRORS)),
    where=st.sampled_from(["error", "outer"]),
    key=st.sampled_from(_FIELDS),
    value=st.one_of(st.just(_DROP), _any_json),
    typed=st.booleans(),
)
def test_any_json_in_any_field_of_a_stored_event_is_refused_or_a_valid_record(
    kind, where, key, value, typed
):
    """A stored event (read from a sidecar or a merged index: untrusted) with any JSON value in one
    field: a ``ValueError`` (what the sidecar readers turn into ``StaleIndexError``) or a record
    whose every field has its documented type, never another exception."""
    _parse_or_refuse(_stored(kind, where, key, value, typed))


def test_an_error_with_fields_of_other_types_is_written_as_it_is_read_back():
    """A transform's own SampleError with an int ``actual`` or a tuple sample: written as
    ``str``, so the sidecar it goes into reads back (never refused as malformed)."""
    exc = SampleError(sample=(1, 2), field="labels", expected=3, actual=4)
    rec = BadRecord.from_json(json.loads(json.dumps(BadRecord.of_error(exc, "w").to_json())))
    again = rec.to_error()
    assert (again.sample, again.expected, again.actual) == ("(1, 2)", "3", "4")
    assert str(again) == str(exc)
