"""A source's index as a loader's start reads it: the sidecar of each shard read and checked
(:func:`sidecar_records`), the shard list checked (:func:`check_source`), or a saved
:class:`~prealign.loaders.index.sample_index.SampleIndex` checked against the source
(:func:`check_index`).

Nothing here reads a shard: each is checked against its index at its first read
(:mod:`~prealign.loaders.index.shard_checks`). The work is a constant per shard: a fix hint (which
names every shard) is built only when an error is raised (:mod:`~prealign.loaders.index.hints`).
"""

from __future__ import annotations

import warnings

import numpy as np

from prealign.loaders.errors import ExtraShardError, IndexFileError, StaleIndexError
from prealign.loaders.index.hints import index_hint, merge_command
from prealign.loaders.index.shard_checks import ShardChecks
from prealign.loaders.index.sidecar import (
    SIDECAR_THREADS,
    check_values,
    config_key,
    expected_of,
    parse_sidecar,
    per_shard,
    read_sidecar_bytes,
    record_of,
    shard_sizes,
    transform_difference,
)
from prealign.loaders.index.tiling import bad_regions
from prealign.loaders.sources import remote
from prealign.loaders.sources.shard_files import shard_name, shard_names


def sidecar_records(source, schema) -> dict[int, dict]:
    """``{shard: record}`` for every shard of ``source`` with a sidecar, each checked for itself
    (format, keys, dtypes, shapes, the shard it names) and against this loader's transform (the
    schema: :func:`~prealign.loaders.index.build.resolve_signatures`); the shard itself is not read
    here (:class:`ShardChecks`: at its first read). Sidecars are read on up to 8 threads when the
    first reads show a file system's latency (:func:`per_shard`). Raises :class:`StaleIndexError`
    naming the shard and the difference. (The path of URLs, and of sources some of whose shards
    have no sidecar: when every local shard has one, the loader reads them all at once,
    :func:`~prealign.loaders.index.sidecar_bulk.sidecars_merged`.)"""
    if not getattr(source, "sidecars", False):
        return {}
    key = config_key(source, schema)

    def parse(shard: int) -> tuple[dict, dict] | None:
        url = source.urls[shard]
        data = read_sidecar_bytes(source, shard)
        if data is None:
            return None
        meta, arrays = parse_sidecar(data, shard=url, fix=lambda: index_hint(source), values=False)
        check_meta(source, url, meta, key)
        return meta, arrays

    parsed = per_shard(source, parse, threads=SIDECAR_THREADS)
    found = {shard: p for shard, p in enumerate(parsed) if p is not None}
    if not check_values(list(found.values())):  # the first one at fault names itself
        for shard in found:
            parse_sidecar(
                read_sidecar_bytes(source, shard),
                shard=source.urls[shard],
                fix=lambda: index_hint(source),
            )
        raise StaleIndexError(
            source.urls[0], "sidecar indexes inconsistent", index_hint(source)
        )  # (not reached)
    records = {}
    for shard, (meta, arrays) in found.items():
        regions = (
            bad_regions(arrays["spans"], meta["events"], meta["num_events"])
            if meta["events"]
            else []
        )
        records[shard] = {
            **record_of(meta, arrays, shard),
            "check": expected_of(meta, arrays["spans"]),
            "regions": regions,
        }
    if len(records) >= MERGE_ADVICE_SHARDS:
        advise_merge(source)
    return records


MERGE_ADVICE_SHARDS = 1000
"""From this many sidecars read one by one, a loader's start says once that a merged index would be
faster."""


class MergedIndexWarning(UserWarning):
    """A loader read a sidecar per shard where one merged index (``prealign index --merge``) would
    be one read."""


_ADVISED: set[tuple] = set()


def advise_merge(source) -> None:
    """Warn once per process and data set (the shard list): the command that writes its merged
    index."""
    key = (len(source.urls), source.urls[0], source.urls[-1], getattr(source, "index_dir", None))
    if key in _ADVISED:
        return
    _ADVISED.add(key)
    warnings.warn(
        MergedIndexWarning(
            f"read {len(source.urls):,} sidecar indexes one by one at the start; one merged index "
            f"is a single read "
            f"(a start over 100k shards as fast as over 100): run `{merge_command(source)}` once"
        ),
        stacklevel=2,
    )


def check_meta(source, url: str, meta: dict, key: str) -> None:
    """A sidecar's ``meta`` is that of shard ``url`` of ``source`` and built for this loader's
    transform (``key``: :func:`config_key`); a mismatch names the field that differs and the command
    that fixes it."""
    if meta["shard"] != shard_name(url):
        raise StaleIndexError(
            url, f"its sidecar describes shard {meta['shard']!r}", "a sidecar of another shard"
        )
    if meta["config"] != key:
        raise StaleIndexError(
            url,
            f"sidecar built for another transform ({transform_difference(meta, source)})",
            index_hint(source),
        )


def check_source(
    source, schema, records: dict[int, dict] | None = None
) -> tuple[dict[int, dict], dict | None]:
    """Checks run when a loader is built, before any batch, whatever the bad-data policy, for a
    :class:`~prealign.loaders.sources.webdataset.WebDatasetSource` (other sources: ``{}, None``):
    each sidecar read and checked (:func:`sidecar_records`), and every shard without one (to be
    indexed now) exists (a brace range naming absent files, an unreachable URL:
    :class:`MissingShardError`). A shard with a sidecar is not touched here: ``source.shard_check``
    (:class:`ShardChecks`) checks it when it is first read. Returns the sidecar records (``{shard:
    record}``; ``records``: read already, from a merged index) and ``{"names",
    "sizes"}`` of the shards (sizes as recorded)."""
    if not hasattr(source, "urls"):
        return {}, None
    records = sidecar_records(source, schema) if records is None else records
    rest = [s for s in range(source.num_shards) if s not in records]
    sizes = dict(zip(rest, shard_sizes(source, rest))) if rest else {}
    expected = {s: r.pop("check") for s, r in records.items()}
    regions = {s: g for s, r in records.items() if (g := r.pop("regions", None))}
    sizes.update(
        (s, -1 if remote.scheme(source.urls[s]) == "pipe" else e[0]) for s, e in expected.items()
    )
    source.shard_check = ShardChecks(source.num_shards, expected) if expected else None
    if regions:
        source.shard_check.regions = regions
    names = shard_names(source.urls)
    return records, {"names": names, "sizes": [sizes[s] for s in range(source.num_shards)]}


def check_index(index, source) -> None:
    """A reused :class:`~prealign.loaders.index.sample_index.SampleIndex` against ``source``, before
    any batch: its locations can be this source's
    (:meth:`~prealign.loaders.sources.source.Source.check_locations`: width, shards and rows in
    range, else an :class:`~prealign.loaders.errors.IndexFileError`), the shard list (and, when the
    index recorded them, the shard names and sizes). Raises an :class:`IndexMismatchError` subclass
    naming the shard and the difference (:class:`ExtraShardError`, also an ``IndexFileError``, when
    the index and the source name other shards)."""

    n = source.num_shards
    recorded = getattr(index, "source_shards", None) or {}
    names, sizes = recorded.get("names") or [], recorded.get("sizes") or []
    urls = getattr(source, "urls", None)
    try:
        source.check_locations(index.locations)
    except IndexFileError as exc:
        if not names or urls is None or len(names) == len(urls):
            raise
        here = [shard_name(u) for u in urls]
        extra = [f"{m} (in the index, not in the source)" for m in names if m not in here] or ["?"]
        raise ExtraShardError(
            extra[0], f"{exc}; the index covers {len(names)} shard(s), the source names {len(urls)}"
        ) from None
    if names and urls is not None and len(names) != len(urls):
        here = [shard_name(u) for u in urls]
        extra = [f"{m} (in the index, not in the source)" for m in names if m not in here] or [
            f"{u} (in the source, not in the index)" for u in urls if shard_name(u) not in names
        ]
        raise ExtraShardError(
            extra[0] if extra else "?",
            f"the index covers {len(names)} shard(s), the source names {len(urls)}",
        )
    shards = np.asarray(index.shards)
    if shards.size and int(shards.max()) >= n:
        raise ExtraShardError(
            f"#{int(shards.max())}",
            f"the index has samples of shard {int(shards.max())}, the source has {n} shard(s)",
            "an index of other data",
        )
    if not names or urls is None:
        return
    for shard, (url, name) in enumerate(zip(urls, names)):
        if shard_name(url) != name:
            raise ExtraShardError(
                url, f"the index has {name!r} at position {shard}", "an index of other shards"
            )
    recorded = [sizes[s] if s < len(sizes) else None for s in range(n)]
    if hasattr(source, "shard_check") and getattr(source, "shard_check", None) is None:
        source.shard_check = ShardChecks.of_sizes(
            recorded
        )  # each shard's size checked at its first read
