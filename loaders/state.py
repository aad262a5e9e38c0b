"""Loader state: small, versioned, JSON-friendly; resume by replaying the deterministic plan (or
stream).

One format for both loaders (``kind`` names which wrote it). The state is the same on every rank of
a run (no rank id in it): save it once, load it everywhere. ``data`` holds fingerprints of the data
computed once, when the loader prepares: taking a state touches no file.

    {"version": 2, "kind": "prealign.PackedLoader", "epoch": 3, "position": 17,
     "config": {"seed": 0, "shuffle": true, "dp_size": 4, "token_budget": 8192,
                "layout": {...}, "schema": "<fingerprint>", "planner": {...},
                "shuffle_window": 1024},
     "data": {"source": "webdataset", "num_samples": 7473, "digest": "<16 hex>"}}
    {"version": 2, "kind": "prealign.StreamingPackedLoader", ..., "config": {..., "num_workers": 2},
     "data": {"source": "webdataset", "num_shards": 200, "digest": "<16 hex>"}}

A run resumed with another ``dp_size`` (or ``microbatches_per_step``; ``num_workers`` for a stream)
serves the rest of its epoch as a new segment (:mod:`prealign.loaders.plan.elastic`); until that
epoch ends its state is version 3, with the earlier segments of the epoch (``position`` is then
within the last one, ``config``'s):

    {"version": 3, ..., "position": 4, "config": {..., "dp_size": 3, ...},
     "segments": [{"dp_size": 4, "microbatches_per_step": 1, "num_workers": null, "position": 17}]}

A streaming state taken with ``state_dict(cursors=True)`` is version 4 and holds one rank's
reader cursors, so that this rank seeks instead of replaying its stream (``docs/resume.md``); it
is that rank's (other ranks replay):

    {"version": 4, "kind": "prealign.StreamingPackedLoader", ..., "position": 917,
     "cursors": {"dp_rank": 0, "dp_size": 1, "num_workers": 2, "next": 1, "readers": [
         {"at": [3, 1721, [3, 882176, 883200, 51273]], "k": 0, "done": false, "gate": 0,
          "rule": [{}, {}, null], "buffer": [[id, aligned size, *location], ...],
          "bins": [[[id, aligned size, *location], ...], ...]},
         ...]}}

A :class:`~prealign.loaders.Mixture` stream's reader cursor adds ``"mix": {"state": {"used",
"recent", "ended"}, "streams": [{"at", "k", "done"}, ...]}``: the interleave's state and each
component stream's own cursor (one per component).

A streaming state taken with ``state_dict(cursors="all")`` (or merged from every rank's
``cursors=True`` state) is version 6 (version 5 with each reader's samples packed into one int
array, :func:`pack_cursor`; version 5 still loads): every DP rank's cursors and what earlier
segments of the epoch consumed (``skip``), so that any topology resumes it without replaying:

    {"version": 6, "kind": "prealign.StreamingPackedLoader", ..., "position": 917,
     "stream": {"dp_size": 2, "num_workers": 0, "offset": 0, "skip": null | {"done": [...],
                "partial": [[shard, ordinal, location], ...], "extra": [...], "returns": [...]},
                "ranks": [{"next": 0, "readers": [{..., "packed": {"rows": 733, "width": 6,
                           "split": [366, 42, ...], "ints": "<base64>"}}, ...]} | null, ...]}}
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import zlib
from dataclasses import dataclass

import numpy as np

from prealign.loaders.errors import ResumeError
from prealign.loaders.plan.elastic import Segment
from prealign.loaders.plan.stream_skip import INT64, int_list

STATE_VERSION = 2
"""2: epochs planned a chunk at a time (``PlannerConfig.chunk_size``), which serves micro-batches in
another order than version 1's single plan: a version-1 state cannot be resumed exactly. (The
streaming loader's own version 1 format, without ``data``, is refused too.)"""
ELASTIC_VERSION = 3
"""3: a state with earlier segments of its epoch (a resize); written only then, so that a prealign
that cannot honour them refuses the state instead of resuming the wrong samples."""
CURSOR_VERSION = 4
"""4: a streaming state with one rank's reader ``cursors`` (where each reader goes on: shard,
record, the samples its buffer holds), written only by ``state_dict(cursors=True)``; it may hold
``segments`` too. A prealign without cursors refuses it (version 2 and 3 states still load and
replay)."""
STREAM_VERSION = 5
"""5: a streaming state with ``stream``: the reader cursors of every DP rank of the run (those it
was given: ``state_dict(cursors="all")`` gathers them, :func:`~prealign.loaders.streaming.
merge_rank_states` merges per-rank states) and what earlier segments of the epoch consumed
(``skip``, :mod:`prealign.loaders.plan.stream_skip`), so that a resume under another
``dp_size`` or ``num_workers`` skips the consumed shards and seeks into the partly consumed ones
instead of replaying. A prealign without it refuses it (versions 2 to 4 still load)."""
PACKED_VERSION = 6
"""6: a version-5 state whose reader cursors hold their samples packed (:func:`pack_cursor`: one
int array per reader, about 4x smaller than version 5's lists), what ``state_dict(cursors="all")``
and :func:`~prealign.loaders.streaming.merge_rank_states` write. A prealign without it refuses it
(versions 2 to 5 still load)."""
STATE_KIND = "prealign.PackedLoader"
STREAM_STATE_KIND = "prealign.StreamingPackedLoader"

_WHY = {
    "dp_size": "micro-batches are dealt to dp_size ranks; another dp_size would repeat or lose "
    "samples",
    "layout": "the layout sets the padded lengths, so the plan (which samples fit together) "
    "changes",
    "token_budget": "the budget sets which samples fit together",
    "schema": "batches would not have the saved run's fields",
    "planner": "another planner configuration gives another plan",
    "seed": "another seed gives another sample order",
    "shuffle": "another sample order",
    "shuffle_window": "another sample order",
}


def _without(config: dict, keys: tuple[str, ...]) -> dict:
    """A copy of ``config`` without ``keys`` (``"a.b"``: key ``b`` of the object under ``a``).

    >>> _without({"a": {"b": 1, "c": 2}, "d": 3}, ("a.b", "d"))
    {'a': {'c': 2}}
    """
    out = dict(config)
    for key in keys:
        head, _, rest = key.partition(".")
        if rest and isinstance(out.get(head), dict):
            out[head] = _without(out[head], (rest,))
        elif not rest:
            out.pop(head, None)
    return out


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


ANY_INT = frozenset({"config.seed"})
"""State keys whose int may lie past int64 (every other int of a state lies in
``[-INT64, INT64)``: it becomes an int64 in numpy, torch, seeks): a seed is any int >= 0
(``np.random.default_rng`` takes any; ``SeedSequence().entropy`` is 128 bits), only compared with
this run's."""


MAX_DEPTH = 32
"""Most levels of objects and lists a state nests (a saved one: up to 10): anything deeper is
refused before any of it is compared or printed (a hostile state nested 10^5 deep would otherwise
exhaust Python's recursion limit)."""


_LEAVES = frozenset({int, float, str, bool, type(None)})
"""The types of a state's values that hold nothing (JSON's)."""
_SMALL = 16
"""Values of a dict or list from which its numbers are checked by C loops (fewer: one by one)."""


def _scan(state) -> tuple[str | None, str | None]:
    """``(deep, bad)`` of a state: the path of a dict or list nested in it past :data:`MAX_DEPTH`
    (the walk stops there), and the path of a non-finite float or an int past int64 (but in
    :data:`ANY_INT`) found in it; None for none. Iterative, a Python step per dict or list: the
    values of one of more than :data:`_SMALL` are checked by C loops (their types; the least and
    greatest of its ints, or each float's finiteness), one by one only when it fails them."""
    if not isinstance(state, (dict, list)):
        return None, None
    bad, stack = None, [("", state, 0)]
    while stack:
        path, v, depth = stack.pop()
        if depth > MAX_DEPTH:
            return path, bad
        if len(v) > _SMALL:
            values = list(v.values()) if isinstance(v, dict) else v
            kinds = set(map(type, values))
            if bad is None and not _scalars_ok(values, kinds):
                bad = _first_bad(path, _items(v))
            if kinds <= _LEAVES:
                continue
        elif bad is None:
            bad = _first_bad(path, _items(v))
        for k, x in _items(v):
            if isinstance(x, (dict, list)):
                stack.append((_path(path, k), x, depth + 1))
    return None, bad


def _items(v):
    """``(key, value)`` of each item of a dict or list."""
    return v.items() if isinstance(v, dict) else enumerate(v)


def _scalars_ok(values: list, kinds: set) -> bool:
    """Every int of ``values`` (``kinds``: the types of them all) lies in int64 and every float is
    finite, checked by C loops when they are all ints or all floats; False when both are there (then
    each is looked at: :func:`_first_bad`)."""
    ints = {k for k in kinds if issubclass(k, int)}
    floats = {k for k in kinds if issubclass(k, float)}
    if ints and floats:
        return False
    if ints:
        numbers = values if kinds <= ints else [x for x in values if type(x) in ints]
        return -INT64 <= min(numbers) and max(numbers) < INT64
    if floats:
        numbers = values if kinds <= floats else [x for x in values if type(x) in floats]
        return all(map(math.isfinite, numbers))
    return True


def _first_bad(path: str, items) -> str | None:
    """The path of the first non-finite float or int past int64 (but in :data:`ANY_INT`) among
    ``items`` (``(key, value)``) of the dict or list at ``path``."""
    for key, x in items:
        if isinstance(x, float) and not math.isfinite(x):
            return _path(path, key)
        if isinstance(x, int) and not -INT64 <= x < INT64 and _path(path, key) not in ANY_INT:
            return _path(path, key)
    return None


def _path(parent: str, key) -> str:
    """A state key's path (``"stream.readers[0]"``) from its parent's and its own key."""
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else str(key)


@dataclass(frozen=True, kw_only=True)
class LoaderState:
    """Where a loader stands: ``position`` micro-batches of ``epoch`` already yielded on every
    rank."""

    epoch: int
    position: int
    config: dict
    data: dict
    kind: str = STATE_KIND
    segments: tuple[Segment, ...] = ()
    """Earlier segments of ``epoch``, served under other configurations
    (:mod:`prealign.loaders.plan.elastic`)."""
    cursors: dict | None = None
    """One rank's reader cursors (a stream's, version 4): checked by the loader that reads them."""
    stream: dict | None = None
    """Every rank's cursors and the epoch's consumed shards (a stream's, version 5): checked by the
    loader that reads them."""

    def to_dict(self) -> dict:
        version = (
            (PACKED_VERSION if _has_packed(self.stream) else STREAM_VERSION)
            if self.stream is not None
            else CURSOR_VERSION
            if self.cursors is not None
            else ELASTIC_VERSION
            if self.segments
            else STATE_VERSION
        )
        out = {
            "version": version,
            "kind": self.kind,
            "epoch": self.epoch,
            "position": self.position,
            "config": self.config,
            "data": self.data,
        }
        if self.segments:
            out["segments"] = [s.to_dict() for s in self.segments]
        if self.cursors is not None:
            out["cursors"] = self.cursors
        if self.stream is not None:
            out["stream"] = self.stream
        return out

    @classmethod
    def from_dict(cls, state, kind: str = STATE_KIND) -> "LoaderState":
        """Parse a saved state (a dict, or its JSON text) strictly: :class:`ResumeError` naming the
        key for non-JSON text, another kind or version, a missing key, ``epoch`` / ``position`` that
        are not non-negative ints (``2.7``, ``"3"``, ``True``, ``inf`` and ``NaN`` are refused,
        never coerced), ``config`` / ``data`` that are not objects, or non-finite numbers
        anywhere."""
        if isinstance(state, (bytes, bytearray)):
            try:
                state = bytes(state).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ResumeError(f"loader state: not UTF-8 text ({exc})") from None
        if isinstance(state, str):
            try:
                state = json.loads(state, parse_constant=_refuse_constant)
            except (ValueError, RecursionError) as exc:
                raise ResumeError(f"loader state: not JSON text ({exc}): {state[:80]!r}") from None
        deep, bad = _scan(state)
        if deep is not None:
            raise ResumeError(
                f"loader state: key {deep!r}: nested more than {MAX_DEPTH} levels deep (a saved "
                f"state nests up to 10 levels)"
            )
        if not isinstance(state, dict) or state.get("kind") != kind:
            raise ResumeError(f"loader state: key 'kind': not a {kind} state: {str(state)[:200]}")
        version = state.get("version")
        known = (STATE_VERSION, ELASTIC_VERSION)
        known += (
            (CURSOR_VERSION, STREAM_VERSION, PACKED_VERSION) if kind == STREAM_STATE_KIND else ()
        )
        if isinstance(version, bool) or version not in known:
            raise ResumeError(
                f"loader state: key 'version': version {version!r} is not supported (this "
                f"prealign writes and reads versions {', '.join(map(str, known))} of a {kind} "
                f"state); a state of an older prealign cannot be resumed exactly: "
                f"start the epoch afresh (set_epoch)"
            )
        missing = [k for k in ("epoch", "position", "config", "data") if k not in state]
        if missing:
            raise ResumeError(f"loader state: missing key(s) {missing}")
        for key in ("epoch", "position"):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < INT64:
                raise ResumeError(
                    f"loader state: key {key!r}: expected an int >= 0, got {value!r} "
                    f"({type(value).__name__}; an int64); a state is never coerced"
                )
        for key in ("config", "data"):
            if not isinstance(state[key], dict):
                raise ResumeError(
                    f"loader state: key {key!r}: expected an object, got "
                    f"{type(state[key]).__name__}"
                )
        if bad is not None:  # (config, data, cursors, a mixture's entry...: _scan)
            raise ResumeError(
                f"loader state: key {bad!r}: a non-finite number or an int past int64"
            )
        cursors = state.get("cursors")
        if (version == CURSOR_VERSION) != ("cursors" in state) or (
            cursors is not None and not isinstance(cursors, dict)
        ):
            raise ResumeError(
                f"loader state: key 'cursors': an object in a version "
                f"{CURSOR_VERSION} state and only there; got {str(cursors)[:200]} in "
                f"version {version}"
            )
        stream = state.get("stream")
        streamed = version in (STREAM_VERSION, PACKED_VERSION)
        if (
            streamed != ("stream" in state)
            or not isinstance(stream, dict if streamed else type(None))
            or (streamed and ("segments" in state or "cursors" in state))
        ):
            raise ResumeError(
                f"loader state: key 'stream': an object in a version {STREAM_VERSION} state (which "
                f"has no 'segments' nor 'cursors') and only there; got {str(stream)[:200]} in "
                f"version {version}"
            )
        segments = state.get("segments")
        wants_segments = version == ELASTIC_VERSION or (
            version == CURSOR_VERSION and "segments" in state
        )
        if wants_segments != ("segments" in state) or (
            wants_segments and not (isinstance(segments, list) and segments)
        ):
            raise ResumeError(
                f"loader state: key 'segments': a non-empty list in a version {ELASTIC_VERSION} "
                f"state (or {CURSOR_VERSION}) and only there; got {str(segments)[:200]} in "
                f"version {version}"
            )
        return cls(
            epoch=state["epoch"],
            position=state["position"],
            config=dict(state["config"]),
            data=dict(state["data"]),
            kind=kind,
            cursors=None if cursors is None else dict(cursors),
            stream=None if stream is None else dict(stream),
            segments=tuple(
                Segment.from_dict(s, f"segments[{i}]") for i, s in enumerate(segments or ())
            ),
        )

    def check_compatible(self, config: dict, data: dict, elastic: tuple[str, ...] = ()) -> None:
        """Raise :class:`ResumeError` listing every difference with this run's ``config`` /
        ``data``, but in the ``elastic`` keys (``"planner.microbatches_per_step"`` for a nested
        one): those the loader re-plans the rest of the epoch for."""
        problems = []
        saved_config, config = _without(self.config, elastic), _without(config, elastic)
        for key in sorted(set(config) | set(saved_config)):
            saved, here = saved_config.get(key), config.get(key)
            if saved != here:
                problems.append(
                    f"{key}: saved {saved!r}, this run {here!r} "
                    f"({_WHY.get(key, 'changes the plan')})"
                )
        for key in sorted(set(data) | set(self.data)):
            if self.data.get(key) != data.get(key):
                problems.append(
                    f"data {key}: saved {self.data.get(key)!r}, this run {data.get(key)!r} "
                    f"(the source or its transform changed)"
                )
        if problems:
            raise ResumeError(
                "cannot resume this loader state:\n  "
                + "\n  ".join(problems)
                + "\nresume with the saved run's configuration, or start a fresh loader"
            )


_PACK_LIMIT = 1 << 28
"""Most ints a packed cursor may hold (2 GiB unpacked) where its reader's bound is not given: a
bigger one is not a state this writes."""
_PACK_WIDTH = 64
"""Most ints a packed record may hold (``[id, aligned size, *location]``: a location is a few
ints)."""


def _has_packed(stream: dict | None) -> bool:
    ranks = (stream or {}).get("ranks")
    return isinstance(ranks, list) and any(
        isinstance(c, dict) and "packed" in c
        for e in ranks
        if isinstance(e, dict) and isinstance(e.get("readers"), list)
        for c in e["readers"]
    )


def pack_cursor(cursor: dict | None) -> dict | None:
    """A reader cursor with its ``buffer`` and ``bins`` (``[id, aligned size, *location]`` lists)
    as one int64 array ``[rows, width]``, each column delta-coded along the rows, zlib-compressed
    and base64 text (``"packed": {"rows", "width", "split", "ints"}``; ``split``: the buffer's
    length, then each bin's). The same cursor when it is already packed, is ``None``, or holds
    records of different widths.

    >>> c = {"k": 0, "buffer": [[4294967297, 64, 1, 0, 512, 9]], "bins": [[[4294967298, 32, 1,
    ...      512, 1024, 7]], []]}
    >>> unpack_cursor(pack_cursor(c), "readers[0]") == c
    True
    """
    if cursor is None or "packed" in cursor:
        return cursor
    records = [*cursor["buffer"], *(r for b in cursor["bins"] for r in b)]
    widths = {len(r) for r in records}
    if len(widths) > 1:
        return cursor
    a = np.asarray(records, dtype=np.int64).reshape(len(records), widths.pop() if widths else 0)
    deltas = np.diff(a, axis=0, prepend=np.zeros((1, a.shape[1]), np.int64))
    ints = base64.b64encode(zlib.compress(deltas.T.astype("<i8").tobytes(), 6)).decode("ascii")
    split = [len(cursor["buffer"]), *(len(b) for b in cursor["bins"])]
    out = {k: v for k, v in cursor.items() if k not in ("buffer", "bins")}
    out["packed"] = {"rows": a.shape[0], "width": a.shape[1], "split": split, "ints": ints}
    return out


def unpack_cursor(cursor: dict | None, where: str, limit: int | None = None) -> dict | None:
    """:func:`pack_cursor` undone (a cursor with ``buffer`` and ``bins`` is returned as it is); a
    malformed ``packed``, or one of more than ``limit`` samples (what its reader can hold: the
    loader's ``buffer_size`` and the samples read back first), is a :class:`ResumeError` naming
    ``where`` before anything is inflated."""
    if not isinstance(cursor, dict) or "packed" not in cursor:
        return cursor
    p = cursor["packed"]

    def bad(why: str):
        raise ResumeError(f"loader state: key '{where}.packed': {why}")

    if not (isinstance(p, dict) and set(p) == {"rows", "width", "split", "ints"}):
        bad(f"expected rows, width, split and ints, got {str(p)[:200]}")
    rows, width, split = p["rows"], p["width"], p["split"]
    if not (
        all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (rows, width))
        and rows * width <= _PACK_LIMIT
        and (width > 0 or rows == 0)  # (else rows empty records, bounded by nothing)
        and isinstance(split, list)
        and split
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in split)
        and sum(split) == rows
        and isinstance(p["ints"], str)
    ):
        bad(f"rows {rows!r} x width {width!r} split {str(split)[:100]}: not a packed cursor")
    if width > _PACK_WIDTH or (limit is not None and rows > limit):
        bad(
            f"{rows} samples of {width} ints; expected at most {limit} samples (what the reader "
            f"holds) of at most {_PACK_WIDTH} ints"
        )
    try:
        inflate = zlib.decompressobj()
        raw = inflate.decompress(base64.b64decode(p["ints"], validate=True), rows * width * 8 + 1)
    except (binascii.Error, ValueError, zlib.error) as exc:
        bad(f"not base64 zlib text ({exc})")
    if len(raw) != rows * width * 8 or inflate.unconsumed_tail:
        bad(f"{len(raw)} bytes unpacked, expected {rows * width * 8} ({rows} x {width} int64)")
    deltas = np.frombuffer(raw, dtype="<i8").reshape(width, rows).T
    records = np.cumsum(deltas, axis=0, dtype=np.int64).tolist()
    out = {k: v for k, v in cursor.items() if k != "packed"}
    bounds = np.cumsum([0, *split]).tolist()
    out["buffer"] = records[: bounds[1]]
    out["bins"] = [records[lo:hi] for lo, hi in zip(bounds[1:-1], bounds[2:])]
    return out


def _got(value) -> str:
    return f"got {str(value)[:120]} ({type(value).__name__})"


def _at_problem(c) -> tuple[str, str] | None:
    """``(key, what is wrong)`` with the ``at`` / ``k`` / ``done`` of a (component) stream cursor,
    else None."""
    if not isinstance(c, dict) or not {"at", "k", "done"} <= set(c):
        return "", f"expected an object with at, k and done, {_got(c)}"
    at, k, done = c["at"], c["k"], c["done"]
    if not (
        isinstance(at, list)
        and len(at) == 3
        and int_list(at[:1])
        and int_list(at[1:2], -1, 1 << 32)
        and (at[2] is None or (int_list(at[2], -INT64) and at[2]))  # (a location: its source's)
    ):
        return "at", f"expected [shard position, ordinal, location (int64s) or null], {_got(at)}"
    if at[1] == -1 and (at[0] or at[2] is not None):
        return "at", f"ordinal -1 (nothing read yet) is at position 0, no location, {_got(at)}"
    if not int_list([k]):
        return "k", f"expected an int >= 0, {_got(k)}"
    if not isinstance(done, bool):
        return "done", f"expected a bool, {_got(done)}"
    return None


def _records_problem(records) -> str | None:
    """What is wrong with a cursor's list of ``[id, aligned size, *location]``, else None."""
    if not isinstance(records, list):
        return f"expected a list of [id, aligned size, *location], {_got(records)}"
    for r in records:
        if not (isinstance(r, list) and len(r) > 2 and int_list(r[:2]) and int_list(r[2:], -INT64)):
            return f"expected [id, aligned size, *location] (ints >= 0, int64s), {_got(r)}"
    return None


def _rule_problem(rule) -> str | None:
    """What is wrong with a cursor's ``rule`` (``[fixed dims, fixed by, fields or null]``)."""
    fixed, by, fields = rule if isinstance(rule, list) and len(rule) == 3 else (None, None, 0)
    if not (
        isinstance(fixed, dict)
        and all(isinstance(v, str) or int_list([v]) for v in fixed.values())
        and isinstance(by, dict)
        and set(by) == set(fixed)
        and all(isinstance(v, str) for v in by.values())
        and (
            fields is None or (isinstance(fields, list) and all(isinstance(f, str) for f in fields))
        )
    ):
        return f"expected [{{dim: int >= 0 or str}}, {{dim: sample}}, null or [str]], {_got(rule)}"
    return None


def _mix_problem(mix, n: int) -> tuple[str, str] | None:
    """``(key, what is wrong)`` with a :class:`Mixture` reader's ``mix`` over ``n`` components,
    else None."""
    if not (isinstance(mix, dict) and set(mix) == {"state", "streams"}):
        return "mix", f"expected the interleave's state and {n} component cursors, {_got(mix)}"
    state, streams = mix["state"], mix["streams"]
    if not (isinstance(state, dict) and set(state) == {"used", "recent", "ended"}):
        return "mix.state", f"expected used, recent and ended of {n} streams, {_got(state)}"
    for key in ("used", "recent", "ended"):
        v = state[key]
        if key == "ended":
            ok = isinstance(v, list) and all(isinstance(x, bool) for x in v)
        else:  # (units: >= 0 so far, > 0 the last item's)
            ok = isinstance(v, list) and all(
                isinstance(x, (int, float))
                and not isinstance(x, bool)
                and math.isfinite(x)
                and (x >= 0 if key == "used" else x > 0)
                for x in v
            )
        if not (ok and len(v) == n):
            what = "bools" if key == "ended" else "finite numbers (units)"
            return f"mix.state.{key}", f"expected {n} {what}, one per component, {_got(v)}"
    if not (isinstance(streams, list) and len(streams) == n):
        return "mix.streams", f"expected {n} component cursors, {_got(streams)}"
    for i, sub in enumerate(streams):
        if (bad := _at_problem(sub)) is not None:
            return f"mix.streams[{i}]{'.' if bad[0] else ''}{bad[0]}", bad[1]
        if sub["done"] != state["ended"][i]:
            return f"mix.streams[{i}].done", f"expected state.ended[{i}], {_got(sub['done'])}"
    return None


def check_cursor(cursor, where: str, components: int | None = None) -> None:
    """A reader cursor (unpacked, as :meth:`~prealign.loaders.streaming._Packer.cursor` writes it)
    of the types and ranges it is written with, else a :class:`ResumeError` naming the key under
    ``where``, what was expected and what came; ``components``: a :class:`Mixture`'s number of
    components (its ``mix``). The loader checks that its positions and locations are its source's.
    """
    keys = {"at", "k", "done", "gate", "rule", "buffer", "bins"} | (
        {"mix"} if components else set()
    )
    if not isinstance(cursor, dict):
        raise ResumeError(f"loader state: key '{where}': expected a reader cursor, {_got(cursor)}")
    for key in sorted(keys ^ set(cursor)):
        raise ResumeError(
            f"loader state: key '{where}.{key}': "
            + ("missing" if key in keys else "not a key of a reader cursor")
            + (" (a Mixture reader's cursor has it)" if key == "mix" else "")
        )
    bins = cursor["bins"]
    gate = cursor["gate"]
    checks = (
        _at_problem(cursor) or ("at", None),
        ("gate", None if int_list([gate]) else f"expected an int >= 0, {_got(gate)}"),
        ("rule", _rule_problem(cursor["rule"])),
        ("buffer", _records_problem(cursor["buffer"])),
        (
            "bins",
            next(filter(None, map(_records_problem, bins)), None)
            if isinstance(bins, list)
            else f"expected a list of micro-batches, {_got(bins)}",
        ),
        (components and _mix_problem(cursor["mix"], components)) or ("mix", None),
    )
    for key, why in checks:
        if why is not None:
            raise ResumeError(f"loader state: key '{where}.{key}': {why}")
