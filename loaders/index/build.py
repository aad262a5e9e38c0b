"""The length index: one pass over a source that learns every sample's token length and location.

    shards ──split by worker (DataLoader workers)──► scan ─► transform ─► validate (the schema)
                                                                          │ good: (location, length)
                                                                          │ bad: failure record
    main process: merge shards in order ─► bad-data policy (raise / skip+count) ─► SampleIndex

Validation is the collator's own: the real :class:`~prealign.collate.thd.THDCollator` (unsharded)
runs on each chunk of samples, and on each sample alone when a chunk fails, so shapes, dtypes and
value bounds (``finite``, ``min_value``, ``max_value``) are checked on every row. The named dense
dims (``K`` of a top-k field, ...) are recorded: the first accepted sample fixes them, and a later
sample with another value is bad data (``dim_mismatch``), since no micro-batch could hold both.
So a sample that enters the index is one the collator accepts, alone or with any other. The policy
runs in the main process over the records in shard order, so its consecutive-failure count and its
error are the same whatever the number of workers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Callable

import numpy as np

from prealign.loaders.errors import BadSampleError
from prealign.loaders.index.apply_policy import (
    apply_policy,
    records_of_results,
    records_of_sidecars,
)
from prealign.loaders.index.merged import merged_index, merged_records, read_merged
from prealign.loaders.index.sample_checks import (
    FIELDS_KEY,
    VALIDATION_CHUNK,
    bad_row_event,
    has_media,
    media_keys,
    optional_keys,
    signature_verdicts,
    validated,
    value_errors,
)
from prealign.loaders.index.sample_index import SampleIndex
from prealign.loaders.index.sidecar_bulk import sidecars_merged
from prealign.loaders.index.source_index import check_source
from prealign.loaders.policy import BadDataPolicy, BadRecord
from prealign.loaders.sources.source import Source
from prealign.schemas.errors import PrealignError, SampleError
from prealign.schemas.schema import BatchSchema


def _name(source: Source, shard: int, loc, item) -> str:
    """The most telling name of a scan record: ``url:key`` for webdataset, else the source's."""
    if isinstance(item, SampleError) and isinstance(item.sample, str):
        return item.sample
    return source.sample_name(item, loc) if loc is not None else f"shard {shard}"


class ShardRecord:
    """What the per-sample pass keeps of one shard, in stream order: :meth:`bad` appends a bad or
    skipped sample's record, :meth:`transformed` a transformed sample, validated with the collator
    in chunks of :data:`~prealign.loaders.index.sample_checks.VALIDATION_CHUNK` (:meth:`flush`: the
    chunk pending; every record waits for the samples before it), :meth:`record` is the shard's
    record."""

    def __init__(self, schema: BatchSchema, shard: int):
        self.schema, self.shard = schema, shard
        self.keys, self.optional = media_keys(schema), optional_keys(schema)
        self.locations, self.lengths, self.media, self.events = [], [], [], []
        self.dims: list[dict[str, int]] = []
        self.dim_ids: list[int] = []
        self.pending: list[tuple[tuple, str, dict]] = []  # transformed, waiting for validation

    def bad(self, record: BadRecord) -> None:
        self.flush()
        self.events.append(record)

    def transformed(self, loc: tuple, where: str, sample: dict) -> None:
        self.pending.append((loc, where, sample))
        if len(self.pending) >= VALIDATION_CHUNK:
            self.flush()

    def flush(self) -> None:
        pending, dims = self.pending, self.dims
        results = validated([p[2] for p in pending], self.schema)
        for (loc, where, sample), result in zip(pending, results):
            if isinstance(
                result, SampleError
            ):  # the collator's checks name sample 0 of a one-sample batch
                err = BadSampleError(
                    sample=where, field=result.field, expected=result.expected, actual=result.actual
                )
                self.events.append(BadRecord.of_error(err, where))
                continue
            signature = {**result[1], FIELDS_KEY: ",".join(k for k in self.optional if k in sample)}
            if signature not in dims:
                dims.append(signature)
            self.locations.append(list(loc))
            self.lengths.append(result[0])
            self.media.append(has_media(sample, self.keys))
            self.dim_ids.append(dims.index(signature))
            self.events.append(None)
        pending.clear()

    def record(self) -> dict:
        self.flush()
        return {
            "shard": self.shard,
            "locations": self.locations,
            "lengths": self.lengths,
            "media": self.media,
            "dims": self.dims,
            "dim_ids": self.dim_ids,
            "events": self.events,
        }


def index_shard(source: Source, schema: BatchSchema, shard: int) -> dict:
    """Scan one shard: ``{"shard", "locations", "lengths", "media", "dims", "dim_ids", "events"}``;
    ``dims`` lists the distinct named-dim dicts of the shard's good samples, ``dim_ids`` (one per
    good sample) points into it; events are, in stream order, None (a good sample) or the
    :class:`~prealign.loaders.policy.BadRecord` of a bad or skipped one."""
    out = ShardRecord(schema, shard)
    indexing = (
        source.for_indexing() if hasattr(source, "for_indexing") else source
    )  # lengths without pixels
    for loc, item in source.scan(shard):
        if isinstance(item, BadRecord):  # (a member that is not a sample: counted)
            out.bad(item)
            continue
        where = _name(source, shard, loc, item)
        if isinstance(item, Exception):
            out.bad(BadRecord.of_error(item, where))
            continue
        try:
            sample = indexing.apply_transform(item, loc)
        except SampleError as exc:
            out.bad(BadRecord.of_error(exc, where))
            continue
        out.transformed(loc, where, sample)
    return out.record()


def scan_shards(
    source: Source,
    schema: BatchSchema,
    shards: list[int],
    *,
    num_workers: int = 0,
    progress: Callable[[], None] | None = None,
) -> list[dict]:
    """:func:`index_shard` over ``shards`` with ``num_workers`` DataLoader workers, in shard order;
    ``progress()`` is called as each shard is done."""
    if not shards:  # (every shard known from its sidecar: no DataLoader, no torch)
        return []
    from prealign.loaders.index.shard_workers import map_shards

    return map_shards(
        functools.partial(index_shard, source, schema),
        shards,
        num_workers=num_workers,
        progress=progress,
    )


def merge_shards(
    results: list[dict],
    policy: BadDataPolicy,
    width: int,
    *,
    where: Callable[[tuple], str] | None = None,
    schema: BatchSchema | None = None,
) -> SampleIndex:
    """The index of :func:`index_shard` results in shard order:
    :func:`~prealign.loaders.index.apply_policy. apply_policy` (the bad-data policy; the first good
    sample with a named dim, ``K``, ..., fixes its size, and a later one with another size is a bad
    sample, reason ``dim_mismatch``, named by ``where(location)`` and, with
    ``schema``, by the first field declaring the dim)."""
    name = where or (lambda loc: f"location {list(loc)}")
    return apply_policy(records_of_results(results, width), policy, schema, where=name)


def resolve_signatures(
    records: dict[int, dict], source: Source, schema: BatchSchema
) -> dict[int, dict]:
    """Sidecar records made this schema's. A sidecar keeps each sample's data signature (member
    dtypes and shape patterns, :mod:`~prealign.loaders.index.header_pass`), not a schema's verdict:
    the signatures are checked over all shards at once
    (:func:`~prealign.loaders.index.sample_checks.signature_verdicts`: rows of a signature tried
    until one passes; a value error is its row's, a structure error its signature's), then every
    sample's recorded id bounds against the schema's, vectorised
    (:func:`~prealign.loaders.index.sample_checks. value_errors`: the suspects loaded and checked
    exactly). Bad rows become bad records, in place, for the
    bad-data policy; the other values (finite log-probs, vision placeholders, ...) are checked when
    loaded."""
    shards = sorted(records)
    keys: dict[str, int] = {}
    signatures: list[dict] = []
    local: dict[int, np.ndarray] = {}  # shard -> its dims' rows in ``signatures``
    for s in shards:
        ids = []
        for sig in records[s]["dims"]:
            key = json.dumps(sig, sort_keys=True)
            if key not in keys:
                keys[key] = len(signatures)
                signatures.append(sig)
            ids.append(keys[key])
        local[s] = np.asarray(ids, np.int64)
    counts = [len(records[s]["lengths"]) for s in shards]
    dim_ids = (
        np.concatenate(
            [
                local[s][np.asarray(records[s]["dim_ids"], np.int64)]
                if counts[i]
                else np.zeros(0, np.int64)
                for i, s in enumerate(shards)
            ]
        )
        if shards
        else np.zeros(0, np.int64)
    )
    locations = (
        np.concatenate(
            [
                np.concatenate(
                    [
                        np.full((n, 1), s, np.int64),
                        np.asarray(records[s]["spans"], np.int64).reshape(n, 3),
                    ],
                    axis=1,
                )
                for s, n in zip(shards, counts)
            ]
        )
        if shards
        else np.zeros((0, 4), np.int64)
    )
    lengths = (
        np.concatenate([np.asarray(records[s]["lengths"], np.int64) for s in shards])
        if shards
        else dim_ids
    )
    bounds = (
        np.concatenate(
            [np.asarray(records[s]["bounds"], np.int64).reshape(-1, 3, 4) for s in shards]
        )
        if shards
        else np.zeros((0, 3, 4), np.int64)
    )
    verdicts, errors = signature_verdicts(source, schema, signatures, dim_ids, locations, lengths)
    errors.update(value_errors(source, schema, bounds, locations, dim_ids, verdicts, errors))
    bad_rows = np.asarray(sorted(errors), np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)])
    out = {}
    for i, s in enumerate(shards):
        lo, hi = np.searchsorted(bad_rows, [starts[i], starts[i + 1]])
        mine = {int(row - starts[i]): errors[int(row)] for row in bad_rows[lo:hi]}
        r = {**records[s], "dims": [verdicts[g] or {} for g in local[s].tolist()]}
        out[s] = _with_bad_rows(r, mine) if mine else r
    return out


def _with_bad_rows(r: dict, errors: dict[int, BadSampleError]) -> dict:
    """Record ``r`` with the good samples at rows ``errors`` turned into bad records (each named,
    with its error)."""
    drop = np.zeros(len(r["lengths"]), dtype=bool)
    drop[list(errors)] = True
    events = list(r["events"])
    at = np.flatnonzero([ev is None for ev in events])  # event position of each good sample
    for i in sorted(errors):
        events[int(at[i])] = bad_row_event(errors[i])
    keep = ~drop
    return {
        **r,
        "spans": r["spans"][keep],
        "lengths": np.asarray(r["lengths"])[keep],
        "media": np.asarray(r["media"])[keep],
        "dim_ids": np.asarray(r["dim_ids"])[keep],
        "bounds": np.asarray(r["bounds"]).reshape(-1, 3, 4)[keep],
        "events": events,
        "bad_events": [[p, ev] for p, ev in enumerate(events) if ev is not None],
    }


def build_index(
    source: Source,
    schema: BatchSchema,
    *,
    policy: BadDataPolicy | None = None,
    num_workers: int = 0,
    distributed: bool = False,
    group=None,
    progress: Callable[[], None] | None = None,
) -> SampleIndex:
    """Index every shard of ``source`` (see the module docstring). Raises the first bad sample's
    typed error under ``OnBadSample.RAISE``; counts it under ``SKIP``.

    ``distributed=True`` with an initialised process group splits the pass by node: rank ``r`` of
    ``W`` (in ``group``) scans shards ``r, r+W, ...`` (the shard split ``split_dataset_by_node``
    makes) and the ranks exchange their records, so every rank ends with the same full index.
    ``progress()`` is called as each shard without a sidecar is scanned (on this rank).
    """
    found = read_merged(source, schema)  # (read once: the per-shard path below reuses it)
    # else every shard's sidecar, read and checked at once, in the form of a merged index
    every = sidecars_merged(source, schema) if found is None else None
    index = merged_index(source, schema, policy or BadDataPolicy(), found=found or every)
    if index is not None:  # one merged file, or a sidecar for every shard: no pass, no exchange
        return _checked_non_empty(index)
    from prealign.schemas.distributed import all_gather_objects, process_rank_world  # (torch)

    rank, world = process_rank_world(group) if distributed else (0, 1)
    known: dict = {}
    checked = None
    failure: BaseException | None = None
    try:
        # sidecar records (one merged file, or a sidecar per shard); unreachable / changed shards
        # raise here
        known, checked = check_source(
            source, schema, merged_records(source, schema, found=found) if found else None
        )
        known = resolve_signatures(
            known, source, schema
        )  # the data's signatures checked against this schema
        shards = [s for s in range(source.num_shards) if s not in known]
        mine: dict = {
            "results": scan_shards(
                source, schema, shards[rank::world], num_workers=num_workers, progress=progress
            )
        }
    except Exception as exc:  # noqa: BLE001 - re-raised below: every rank must reach the exchange first
        if world == 1:
            raise
        failure = exc
        typed = (
            exc if isinstance(exc, PrealignError) else PrealignError(f"{type(exc).__name__}: {exc}")
        )
        mine = {"rank": rank, "error": typed}
    parts = all_gather_objects(mine, group) if world > 1 else [mine]
    failed = [p for p in parts if "error" in p]
    if failure is not None:
        raise failure
    if failed:  # another rank's error, as its own type, on every rank
        err = failed[0]["error"]
        err.args = (
            f"index pass failed on rank {failed[0]['rank']}: {err.args[0] if err.args else ''}",
            *err.args[1:],
        )
        raise err
    results = sorted(
        [*known.values(), *(r for p in parts for r in p["results"])], key=lambda r: r["shard"]
    )
    if (
        known
    ):  # some shards from their sidecars (merge_records falls back to merge_shards unless all are)
        index = merge_records(results, policy or BadDataPolicy(), where=source.where, schema=schema)
    else:
        index = merge_shards(
            results, policy or BadDataPolicy(), width=1, where=source.where, schema=schema
        )
    return _checked_non_empty(dataclasses.replace(index, source_shards=checked))


def _checked_non_empty(index: SampleIndex) -> SampleIndex:
    if len(index) == 0:
        raise BadSampleError(
            sample=None,
            field=None,
            expected="at least one good sample in the source",
            actual=f"none ({index.report.to_dict()['counts']})",
        )
    return index


def merge_records(results: list[dict], policy, *, where, schema):
    """:func:`merge_shards` for records read from sidecars, vectorised
    (:func:`~prealign.loaders.index. apply_policy.records_of_sidecars`: a cost per shard and per bad
    record, not per sample): the same index and
    report. Records some of which come from the pass in process go through the per-sample
    adapter."""
    if all(r.get("sidecar") for r in results):
        return apply_policy(records_of_sidecars(results), policy, schema, where=where)
    return merge_shards(
        [_with_locations(r) for r in results], policy, width=4, where=where, schema=schema
    )


def _with_locations(record: dict) -> dict:
    """A record with ``locations [N, 4]`` (shard, start, end, checksum): a sidecar's gets them from
    its spans."""
    if "locations" in record:
        return record
    n = len(record["lengths"])
    return {
        **record,
        "locations": np.concatenate(
            [np.full((n, 1), record["shard"], np.int64), record["spans"]], axis=1
        ),
    }
