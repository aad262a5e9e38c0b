"""The one place an index is assembled: the bad-data policy and the fixed-dims rule applied to the
records of a stream of samples, whichever way they were read (the in-process pass, a sidecar per
shard, one merged index; the streaming loader applies the same :class:`FixedDims` rule sample by
sample).

    per-sample pass ─records_of_results─────┐
    per-shard sidecars ─records_of_sidecars─┼─► Records
    merged index ─Records(...)──────────────┘
        ─► apply_policy(records, policy, schema) ─► SampleIndex

:class:`Records` is columnar: the good rows as arrays, the bad and skipped records by stream
position, so a policy costs per data signature and per bad record, never per sample.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import numpy as np

from prealign.loaders.errors import BadSampleError
from prealign.loaders.index.sample_checks import FIELDS_KEY
from prealign.loaders.index.sample_index import SampleIndex
from prealign.loaders.policy import BadDataGate, BadDataPolicy, BadRecord
from prealign.schemas.schema import BatchSchema, Role


@dataclass(frozen=True)
class Records:
    """The records of a stream of samples (shard after shard, stream order inside).

    ``lengths`` int64 ``[N]``, ``locations`` int64 ``[N, W]``, ``shards`` int64 ``[N]``, ``media``
    bool ``[N]`` of the good rows; ``dim_ids`` int64 ``[N]`` the row of ``signatures`` (named dims,
    and under :data:`~prealign.loaders.index.sample_checks.FIELDS_KEY` the optional fields present)
    of each; ``good_at`` int64 ``[N]`` the stream position of each good row; ``events`` ``(position,
    record)`` of each bad or skipped sample's :class:`~prealign.loaders.policy.BadRecord`, in order.
    """

    lengths: np.ndarray
    locations: np.ndarray
    shards: np.ndarray
    media: np.ndarray
    dim_ids: np.ndarray
    signatures: list
    good_at: np.ndarray
    events: list


class FixedDims:
    """The rule that keeps every micro-batch collatable: the first accepted sample with a named
    dense dim (``K`` of a top-k field, a field's dtype) fixes it, and the first with optional fields
    fixes which it has; a later sample with another size is bad data (``dim_mismatch``), one with
    other optional fields too (``field_mismatch``). :meth:`admit` is called in stream order (a
    sample, or the first sample of a data signature: the verdict of a signature never changes later,
    since what is fixed only grows)."""

    def __init__(self, schema: BatchSchema | None = None):
        self.schema, self.fixed, self.fixed_by, self.fields = schema, {}, {}, None

    @property
    def dims(self) -> dict:
        """The named dims fixed so far (without the optional-fields record)."""
        return dict(self.fixed)

    def admit(self, dims: dict, who: str) -> Callable[[str], BadSampleError] | None:
        """None when a sample with ``dims`` fits what is fixed (and fixes what it adds), else a
        function of a sample's name giving its :class:`BadSampleError`."""
        dims = dict(dims)
        has = dims.pop(FIELDS_KEY, None)
        if has is not None and self.fields is not None and has != self.fields[0]:
            mine, first = (
                set(filter(None, has.split(","))),
                set(filter(None, self.fields[0].split(","))),
            )
            expected = (
                f"optional fields {sorted(first)} like the first indexed sample "
                f"({self.fields[1]}): a micro-batch cannot mix samples with and without a field"
            )
            return lambda sample: BadSampleError(
                sample=sample,
                field=sorted(mine ^ first)[0],
                reason="field_mismatch",
                expected=expected,
                actual=f"fields {sorted(mine)}",
            )
        clash = next((d for d, n in dims.items() if self.fixed.get(d, n) != n), None)
        if clash is not None:
            roles = self.schema.of_role(Role.TOKEN) if self.schema is not None else ()
            field = next(
                (f.name for f in roles if clash in (*f.leading_shape, *f.dense_shape)), None
            )
            expected = (
                f"{clash} = {self.fixed[clash]} (fixed by the first indexed sample with "
                f"it, {self.fixed_by[clash]})"
            )
            actual = f"{clash} = {dims[clash]}"
            return lambda sample: BadSampleError(
                sample=sample, field=field, reason="dim_mismatch", expected=expected, actual=actual
            )
        if has is not None and self.fields is None:
            self.fields = (has, who)
        for d in dims.keys() - self.fixed.keys():
            self.fixed[d], self.fixed_by[d] = dims[d], who
        return None


def apply_policy(
    records: Records,
    policy: BadDataPolicy | None,
    schema: BatchSchema | None,
    *,
    where: Callable[[tuple], str],
) -> SampleIndex:
    """The :class:`SampleIndex` of ``records``: :class:`FixedDims` per data signature (in the order
    their first samples come), then the bad-data policy over every bad record in stream order (an ok
    record between two bad ones resets the consecutive count; raises the first bad record's typed
    error under ``raise``). ``where(location)`` names a sample."""
    rule, n = FixedDims(schema), len(records.lengths)
    keep = np.ones(n, bool)
    found: list[tuple[int, BadRecord]] = []
    if n and records.signatures:
        ids = np.asarray(records.dim_ids, np.int64)
        _, first = np.unique(ids, return_index=True)
        for row in np.sort(first).tolist():  # signatures in the order of their first sample
            sig = records.signatures[int(ids[row])] or {}
            refuse = rule.admit(sig, where(tuple(records.locations[row].tolist())))
            if refuse is None:
                continue
            rows = np.flatnonzero(ids == ids[row])
            keep[rows] = False
            found += [
                (
                    int(records.good_at[r]),
                    BadRecord.of_error(refuse(where(tuple(records.locations[r].tolist())))),
                )
                for r in rows.tolist()
            ]
    events = records.events if not found else sorted([*records.events, *found], key=lambda e: e[0])
    gate, last = BadDataGate(policy or BadDataPolicy()), -1
    for at, rec in events:
        if at > last + 1:
            gate.good()  # an ok record between bad ones
        last = at
        if rec.is_error:
            gate.bad(rec)
        else:  # (an ignored member: counted, never an error)
            gate.report.add(rec)
    return SampleIndex(
        lengths=records.lengths[keep],
        locations=records.locations[keep],
        shards=records.shards[keep],
        report=gate.report,
        media=records.media[keep],
        dims=rule.dims,
    )


def records_of_results(results: list[dict], width: int) -> Records:
    """:class:`Records` of :func:`~prealign.loaders.index.build.index_shard` results (the per-sample
    pass: events None in place of each good sample, ``locations`` lists, ``dims`` per shard)."""
    signatures, keys = [], {}
    lengths, locations, shards, media, dim_ids, good_at, events = [], [], [], [], [], [], []
    pos = 0
    for res in results:
        k = 0
        for ev in res["events"]:
            if ev is None:
                sig = res["dims"][res["dim_ids"][k]] if res.get("dims") else {}
                key = json.dumps(sig, sort_keys=True)
                if key not in keys:
                    keys[key] = len(signatures)
                    signatures.append(sig)
                dim_ids.append(keys[key])
                locations.append(list(res["locations"][k]))
                lengths.append(res["lengths"][k])
                media.append(bool(res["media"][k]))
                shards.append(res["shard"])
                good_at.append(pos)
                k += 1
            else:
                events.append((pos, ev))
            pos += 1
    n = len(lengths)
    width = max((len(loc) for loc in locations), default=width)
    return Records(
        lengths=np.asarray(lengths, np.int64).reshape(n),
        locations=np.asarray(locations, np.int64).reshape(n, width),
        shards=np.asarray(shards, np.int64).reshape(n),
        media=np.asarray(media, bool).reshape(n),
        dim_ids=np.asarray(dim_ids, np.int64).reshape(n),
        signatures=signatures,
        good_at=np.asarray(good_at, np.int64).reshape(n),
        events=events,
    )


def records_of_sidecars(results: list[dict]) -> Records:
    """:class:`Records` of sidecar records (:func:`~prealign.loaders.index.sidecar.record_of`, made
    this schema's by :func:`~prealign.loaders.index.build.resolve_signatures`), vectorised: a cost
    per shard and per bad record."""
    signatures, keys, local = [], {}, []
    for r in results:
        ids = []
        for sig in r["dims"]:
            key = json.dumps(sig, sort_keys=True)
            if key not in keys:
                keys[key] = len(signatures)
                signatures.append(sig)
            ids.append(keys[key])
        local.append(np.asarray(ids, np.int64))
    counts = np.asarray([len(r["lengths"]) for r in results], np.int64)
    records = np.asarray([len(r["events"]) for r in results], np.int64)
    offset = np.concatenate([[0], np.cumsum(records)])
    events = [
        (int(offset[i]) + pos, ev)
        for i, r in enumerate(results)
        for pos, ev in r.get(
            "bad_events", [[p, e] for p, e in enumerate(r["events"]) if e is not None]
        )
    ]
    is_event = np.zeros(int(offset[-1]), bool)
    is_event[[at for at, _ in events]] = True
    n = int(counts.sum())

    def cat(key: str, dtype) -> np.ndarray:
        return (
            np.concatenate([np.asarray(r[key], dtype) for r in results])
            if results
            else np.zeros(0, dtype)
        )

    shards = np.repeat(np.asarray([r["shard"] for r in results], np.int64), counts)
    locations = np.empty((n, 4), np.int64)
    locations[:, 0] = shards
    if n:
        np.concatenate(
            [np.asarray(r["spans"], np.int64).reshape(-1, 3) for r in results], out=locations[:, 1:]
        )
    dim_ids = (
        np.concatenate(
            [
                ids[np.asarray(r["dim_ids"], np.int64)]
                if len(r["lengths"])
                else np.zeros(0, np.int64)
                for ids, r in zip(local, results)
            ]
        )
        if results
        else np.zeros(0, np.int64)
    )
    return Records(
        lengths=cat("lengths", np.int64),
        locations=locations,
        shards=shards,
        media=cat("media", bool),
        dim_ids=dim_ids,
        signatures=signatures,
        good_at=np.flatnonzero(~is_event),
        events=events,
    )
