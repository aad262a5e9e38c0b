"""Per-shard sidecar indexes: what the index pass learns about a shard, kept beside it.

    shard-000.tar  ──prealign index──►  shard-000.tar.prealign-index.npz
                                        (or DIR/<name>.prealign-index.npz)

A sidecar is an ``.npz`` read with ``allow_pickle=False``:

===========  =========  ============================================================================
key          dtype /    meaning
             shape
===========  =========  ============================================================================
``meta``     uint8      UTF-8 JSON: ``format``, ``version``, ``shard`` (file name), ``size``
             ``[B]``    (bytes), ``hash`` (blake2b-128 of every byte read), ``probe`` (blake2b-64 of
                        the first and last 64 KiB, each byte once: :data:`PROBE_VERSION`;
                        version 3's hashed twice the bytes the two share), ``config`` (key of
                        the transform it was built for, never of a schema), ``transform`` (the
                        fields of that key, named when
                        they differ), ``dims`` (the distinct data signatures: ``{member:
                        "dtype:shape"}``, ``L`` for the token dim when no other dim equals it),
                        ``events`` (``[position, record]`` of each data-level skip / bad record
                        (``BadRecord.to_json()``): a corrupt tar, an undecodable member, a missing
                        ``input_ids``)
``spans``    int64      ``start, end, checksum`` of each good sample (byte range, crc32)
             ``[N,3]``
``lengths``  int64      token lengths
             ``[N]``
``media``    bool       the sample carries media
             ``[N]``
``dim_ids``  int64      row of ``meta.dims`` (the data signature) each sample has
             ``[N]``
``bounds``   int64      per sample, for ``input_ids``, ``labels``, ``teacher_topk_ids``: the
             [N,3,4]    maximum, the smallest value ``>= 0``, the smallest and largest negative
                        values (:func:`~prealign.loaders.index.sample_checks.value_bounds`)
===========  =========  ============================================================================

A sidecar describes the data, not one training configuration: it serves a loader with any schema,
layout, token budget, pad id or vocabulary. What depends on the schema is decided when a loader
reads it (:func:`~prealign.loaders.index.sample_checks.signature_verdicts`): the samples of each
data signature run through the loader's collator until one passes (shapes, dtypes, named dims,
optional fields; a value error is its sample's alone, a structure error its signature's), and every
other sample's values (ids below the vocabulary, label rules, finite log-probs) are checked when it
is loaded, under the bad-data policy (counted under ``skip``). Only the transform that turns a
sample's members into tokens is part of the key (``config``): a VLM's lengths depend on its
tokenizer and image processor. A loader with another transform gets a
:class:`~prealign.loaders.errors.StaleIndexError` naming the field that differs and the ``prealign
index`` command that rebuilds the sidecars for it. Sidecars of version 1 (keyed by the schema) and 2
(whose shape patterns could collide: ``[4, 4]`` and ``[60, 60]`` were both ``LxL``), and of a
version from the future, are refused by version, with that command. Version 3 is read as it is: it
differs from version 4 only by its probe's definition (:data:`PROBE_VERSION`), and each shard is
checked against the probe its own sidecar recorded.

A sidecar turns back into exactly the per-shard record
:func:`~prealign.loaders.index.build.index_shard` returns, so the index (and the plan) is the same
whether it came from sidecars or from the pass in process. Every key, dtype and shape is checked on
reading; anything else is a :class:`~prealign.loaders.errors.StaleIndexError` (a
:class:`ConfigError`) naming the shard.

When the loader is built, each sidecar is read and checked: local ones all at once, compared with a
few read alone (:mod:`~prealign.loaders.index.sidecar_bulk`), URLs one by one on up to 16 threads
(:func:`per_shard`); or all of them from one merged file (:mod:`~prealign.loaders.index.merged`).
A shard itself
is checked against its sidecar when it is first read, in the process that reads it, before any of
its samples is served (:class:`ShardChecks`, local or remote, whatever the shard count): it must
exist, have the recorded size (a ``stat``, or one ``HEAD`` for a URL) and the same first and last 64
KiB (the ``probe``: two reads, one for a shard of up to 128 KiB). So a loader starts without
touching its local shards;
:func:`check_all_shards` checks them all at once. A byte changed elsewhere in place (same size) is
caught when the sample is read: the crc32 of its members recorded at indexing no longer matches
(:class:`~prealign.loaders.errors.SourceChangedError`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from prealign.loaders.errors import (
    ChangedShardError,
    MissingShardError,
    NotRegularFileError,
    ShardTimeoutError,
    StaleIndexError,
)
from prealign.loaders.handoff import identity
from prealign.loaders.handoff.identity import identity_digest, index_fields
from prealign.loaders.index.events import parse_event
from prealign.loaders.index.tiling import check_tiling
from prealign.loaders.sources import remote
from prealign.loaders.sources.deadline import Stalled, map_with_timeout
from prealign.loaders.sources.npy import read_npz
from prealign.loaders.sources.shard_files import (
    NotRegular,
    file_kind,
    open_regular,
    sidecar_path,
    write_atomically,
)
from prealign.schemas.lazy import is_instance  # (not importing torch: see indexed_transform)

FORMAT = "prealign-sidecar"
VERSION = 4
READS = (3, 4)
"""The sidecar versions this prealign reads: 4 (what it writes) and 3, whose only difference is the
probe's definition (:func:`probe_version`)."""
_ARRAYS = {
    "spans": (np.int64, 2),
    "lengths": (np.int64, 1),
    "media": (np.bool_, 1),
    "dim_ids": (np.int64, 1),
    "bounds": (np.int64, 3),
}
KEYS = frozenset({"meta", *_ARRAYS})
"""The entries of a sidecar (without ``.npy``)."""
_MAX_META = 64 << 20
_BUFFER = 1 << 20
_ROW_BYTES = 8 * 3 + 8 + 1 + 8 + 8 * 12  # spans, lengths, media, dim_ids, bounds


def regular_stat(path: str, what: str) -> os.stat_result | None:
    """``os.stat`` of ``path`` (symlinks followed; never opened, so a FIFO cannot block), None when
    it does not exist; :class:`NotRegularFileError` naming it when it is anything but a regular
    file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFileError(
            path, f"{what} is not a regular file ({file_kind(st.st_mode)})", "give a plain file"
        )
    return st


def read_regular(path: str, what: str, limit) -> bytes | None:
    """The bytes of the regular file ``path`` (None when it does not exist), opened without blocking
    (a FIFO is refused, never waited on) and checked after the open (``fstat``: no swap between
    check and open); anything but a regular file, or more than ``limit`` bytes, is a
    :class:`StaleIndexError` naming it (never an unbounded read). ``limit``: an int, or a function
    of the file's size giving it."""
    try:
        f = open_regular(path)
    except FileNotFoundError:
        return None
    except NotRegular as exc:
        raise StaleIndexError(
            path,
            f"{what} is not a regular file ({exc.kind})",
            "not a file prealign wrote: remove it and re-run `prealign index`",
        ) from None
    with f:
        st = os.fstat(f.fileno())
        if callable(limit):
            limit = limit(st.st_size)
        if st.st_size > limit:
            raise StaleIndexError(
                path,
                f"{what} of {st.st_size} bytes, more than the {limit} bytes one can hold",
                "not a file prealign wrote: re-run `prealign index`",
            )
        parts, got = [], 0  # (never read(limit): that allocates the limit up front)
        while got <= limit and (
            part := f.read(min(max(st.st_size - got, 0) + 1, limit + 1 - got, 64 << 20))
        ):
            parts.append(part)
            got += len(part)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
    if len(data) > limit:  # grew while read
        raise StaleIndexError(path, f"{what} of more than {limit} bytes", "re-run `prealign index`")
    return data


class Fingerprint:
    """Counts and hashes the bytes of a file object as they are read, serving small reads (tar
    headers) from a buffer of at most :data:`_BUFFER` bytes. ``length``: the bytes the file holds
    when known (a local regular file), so a tar reader can bound member sizes by what is left
    (``length - pos``); ``name`` names the shard in errors."""

    def __init__(self, f, length: int | None = None, name: str | None = None):
        self.f, self.size, self.hash, self.length, self.name = (
            f,
            0,
            hashlib.blake2b(digest_size=16),
            length,
            name,
        )
        self._buf, self._at = b"", 0

    @property
    def pos(self) -> int:
        """Bytes handed to the caller so far."""
        return self.size - (len(self._buf) - self._at)

    def _pull(self, n: int) -> bytes:
        data = self.f.read(n)
        self.size += len(data)
        self.hash.update(data)
        if self.length is not None and self.size > self.length:
            raise ChangedShardError(
                self.name,
                f"grew past its {self.length} bytes while it was indexed",
                "index it once it is written",
            )
        return data

    def read(self, n: int = -1) -> bytes:
        have = len(self._buf) - self._at
        if n is None or n < 0:
            parts = [self._buf[self._at :]]
            while chunk := self._pull(_BUFFER):
                parts.append(chunk)
            self._buf, self._at = b"", 0
            return b"".join(parts)
        if n <= have:  # the common case: a tar header from the buffer
            out = self._buf[self._at : self._at + n]
            self._at += n
            return out
        parts, need = (
            [],
            n,
        )  # filled to n bytes unless the file ends (a stream may answer short reads)
        while need > 0:
            have = len(self._buf) - self._at
            if have:
                take = min(have, need)
                parts.append(self._buf[self._at : self._at + take])
                self._at += take
                need -= take
            elif need >= _BUFFER:  # a big member: straight from the file, never through the buffer
                chunk = self._pull(need)
                if not chunk:
                    break
                parts.append(chunk)
                need -= len(chunk)
            else:
                self._buf, self._at = self._pull(_BUFFER), 0
                if not self._buf:
                    break
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def finish(self) -> dict:
        """Drain what is left (a shard's trailing padding) and return ``{"size", "hash"}``."""
        self._buf, self._at = b"", 0
        while self._pull(1 << 20):
            pass
        return {"size": self.size, "hash": self.hash.hexdigest()}


# ---- writing / reading
# ------------------------------------------------------------------------------
def write_sidecar(
    path: str,
    record: dict,
    *,
    shard: str,
    fingerprint: dict,
    config: str,
    extra: dict | None = None,
) -> None:
    """Write ``record`` (an :func:`~prealign.loaders.index.build.index_shard` result) as the sidecar
    ``path`` (atomically: a temporary file renamed)."""
    n = len(record["lengths"])
    locs = np.asarray(record["locations"], dtype=np.int64).reshape(n, -1 if n else 4)
    if locs.shape[1] != 4:
        raise StaleIndexError(
            shard, f"locations of width {locs.shape[1]}, expected (shard, start, end, checksum)"
        )
    events = [[i, ev.to_json()] for i, ev in enumerate(record["events"]) if ev is not None]
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "shard": shard,
        "size": int(fingerprint["size"]),
        "hash": str(fingerprint["hash"]),
        "config": config,
        "dims": record["dims"],
        "events": events,
        "num_events": len(record["events"]),
        **(extra or {}),
    }
    buf = io.BytesIO()
    np.savez(
        buf,
        meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
        spans=locs[:, 1:].copy(),
        lengths=np.asarray(record["lengths"], dtype=np.int64),
        media=np.asarray(record["media"], dtype=bool).reshape(-1),
        dim_ids=np.asarray(record["dim_ids"], dtype=np.int64).reshape(-1),
        bounds=np.asarray(record["bounds"], dtype=np.int64).reshape(n, 3, 4),
    )
    write_atomically(path, buf.getvalue())


_MAX_COUNT = 2**62  # a shard's size in bytes, its records: far past any real one, inside int64


def parse_sidecar(
    data: bytes, *, shard: str, fix: str | Callable[[], str] | None = None, values: bool = True
) -> tuple[dict, dict[str, np.ndarray]]:
    """``(meta, arrays)`` of sidecar bytes, every key, dtype and shape checked (never unpickled;
    ``size`` and ``num_events`` within 0..2**62).
    Raises :class:`StaleIndexError` naming ``shard`` on anything unexpected, with ``fix``: the
    command that rebuilds it, or a function giving it (called only then:
    :func:`~prealign.loaders.index.hints.index_hint` walks every shard name, never to be paid by a
    healthy sidecar). ``values=False``: the checks of the arrays' values (dim ids, byte ranges,
    lengths, the tiling) are left to the caller, who makes them for many sidecars
    at once (:func:`check_values`) and, when they fail, parses each again with ``values=True`` to
    name it."""

    def hint() -> str:
        if fix is None:
            return (
                "re-run `prealign index --force` on it, with the flags that built it (--text, "
                "--tokenizer DIR, ...)"
            )
        return fix() if callable(fix) else fix

    def bad(what: str) -> StaleIndexError:
        return StaleIndexError(shard, f"sidecar index unreadable: {what}", hint())

    try:
        # views of data (never unpickled); members may not declare far more than the file holds
        members = read_npz(
            data,
            max_bytes=64 * len(data) + (1 << 20),
            member=shard,
            copy=False,
            names=KEYS,
        )
        if set(members) != {"meta", *_ARRAYS}:
            raise bad(f"keys {sorted(members)}, expected {sorted({'meta', *_ARRAYS})}")
        raw_meta = members["meta"]
        arrays = {k: members[k] for k in _ARRAYS}
    except StaleIndexError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to parse a crafted file is a typed error
        raise bad(f"{type(exc).__name__}: {exc}") from None
    if raw_meta.dtype != np.uint8 or raw_meta.ndim != 1 or raw_meta.size > _MAX_META:
        raise bad(f"meta of dtype {raw_meta.dtype} shape {raw_meta.shape}")
    try:
        meta = json.loads(raw_meta.tobytes().decode())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise bad(f"meta is not JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise bad("not a prealign sidecar")
    if meta.get("version") not in READS or isinstance(meta.get("version"), bool):
        raise StaleIndexError(
            shard,
            f"sidecar format version {meta.get('version')!r}, this prealign reads "
            f"versions {list(READS)} (sidecars from version 3 on serve any schema; their shape "
            "patterns never collide)",
            hint(),
        )
    types = {
        "shard": str,
        "size": int,
        "hash": str,
        "config": str,
        "dims": list,
        "events": list,
        "num_events": int,
    }
    for key, typ in types.items():
        if not isinstance(meta.get(key), typ) or isinstance(meta.get(key), bool):
            raise bad(f"meta {key!r} is {type(meta.get(key)).__name__}, expected {typ.__name__}")
    for key in ("size", "num_events"):  # (int64 in the checks over many sidecars)
        if not 0 <= meta[key] <= _MAX_COUNT:
            raise bad(f"meta {key!r} is {meta[key]}, expected 0..2**62")
    n = None
    for key, (dtype, ndim) in _ARRAYS.items():
        a = arrays[key]
        if (
            a.dtype != dtype
            or a.ndim != ndim
            or (key == "spans" and a.shape[1] != 3)
            or (key == "bounds" and a.shape[1:] != (3, 4))
        ):
            raise bad(f"{key} of dtype {a.dtype} shape {a.shape}")
        if n is None:
            n = a.shape[0]
        elif a.shape[0] != n:
            raise bad(f"{key} has {a.shape[0]} rows, spans {n}")
    dims = meta["dims"]
    if not dims_ok(dims):
        raise bad("meta 'dims' is not a list of {name: size} dicts")
    events = meta["events"]
    if values:
        ids = arrays["dim_ids"]
        if n and (ids.min() < 0 or ids.max() >= len(dims)):
            raise bad("dim_ids outside meta 'dims'")
        spans = arrays["spans"]
        if n and (
            spans[:, 0].min() < 0
            or np.any(spans[:, 1] <= spans[:, 0])
            or spans[:, 1].max() > meta["size"]
            or arrays["lengths"].min() < 0
        ):
            raise bad("byte ranges or lengths out of bounds")
    if not all(
        isinstance(e, list) and len(e) == 2 and isinstance(e[0], int) and not isinstance(e[0], bool)
        for e in events
    ) or meta["num_events"] != n + len(events):
        raise bad("malformed events")
    try:  # (each a BadRecord from here on)
        meta["events"] = events = [[pos, parse_event(ev)] for pos, ev in events]
    except ValueError:
        raise bad("malformed events") from None
    if values:
        _check_spans(arrays["spans"], events, meta["num_events"], bad)
    return meta, arrays


def check_values(parsed: list[tuple[dict, dict[str, np.ndarray]]]) -> bool:
    """Whether the value checks :func:`parse_sidecar` leaves out with ``values=False`` all pass for
    these ``(meta, arrays)`` of many sidecars: a few numpy calls over all of them (a start over
    2,000 sidecars), no call per shard but the gathering of their arrays."""
    if not parsed:
        return True
    metas = [m for m, _ in parsed]

    def per_shard(key: str) -> np.ndarray:
        return np.fromiter((m[key] for m in metas), np.int64, len(parsed))

    return (
        joint_values(
            {k: np.concatenate([a[k] for _, a in parsed]) for k in ("spans", "lengths", "dim_ids")},
            rows=np.fromiter((len(a["lengths"]) for _, a in parsed), np.int64, len(parsed)),
            ndims=np.fromiter((len(m["dims"]) for m in metas), np.int64, len(parsed)),
            sizes=per_shard("size"),
            num_events=per_shard("num_events"),
            events=[(s, e[0]) for s, m in enumerate(metas) for e in m["events"]],
        )
        is not None
    )


class _Untiled(Exception):
    pass


def _untiled(what: str) -> Exception:
    return _Untiled(what)


def joint_values(
    arrays: dict[str, np.ndarray],
    *,
    rows: np.ndarray,
    ndims: np.ndarray,
    sizes: np.ndarray,
    num_events: np.ndarray,
    events: list[tuple[int, int]],
) -> tuple[np.ndarray, np.ndarray] | None:
    """The value checks :func:`parse_sidecar` leaves out with ``values=False``, for many sidecars
    at once: ``arrays`` ``spans [N, 3]``, ``lengths [N]``, ``dim_ids [N]`` (rows of each shard's own
    dims) shard after shard; per shard int64 ``[S]`` its ``rows``, ``ndims`` (dims), ``sizes``,
    ``num_events``; ``events`` ``(shard, position)`` of each bad record (few), in order. Returns
    ``(first, last)`` of each shard (:func:`~prealign.loaders.index.tiling.check_tiling`) when all
    pass, else None (the caller parses each again with ``values=True`` to name the first at
    fault)."""
    owner = np.repeat(np.arange(len(rows)), rows)
    spans, ids = arrays["spans"], arrays["dim_ids"]
    if owner.size and (
        ids.min() < 0
        or np.any(ids >= ndims[owner])
        or spans[:, 0].min() < 0
        or np.any(spans[:, 1] <= spans[:, 0])
        or np.any(spans[:, 1] > sizes[owner])
        or arrays["lengths"].min() < 0
    ):
        return None
    if any(not 0 <= p < num_events[s] for s, p in events) or any(
        b <= a for a, b in zip(events, events[1:])
    ):
        return None
    try:
        return check_tiling(spans, owner, num_events, events, _untiled)
    except _Untiled:
        return None


def dims_ok(dims) -> bool:
    """``dims`` is a list of ``{name: size}`` dicts (names str, sizes int or str)."""
    return isinstance(dims, list) and all(
        isinstance(d, dict)
        and all(
            isinstance(k, str) and isinstance(v, (int, str)) and not isinstance(v, bool)
            for k, v in d.items()
        )
        for d in dims
    )


def _check_spans(spans: np.ndarray, events: list, num_events: int, bad) -> None:
    """The good samples' byte ranges tile the shard as the index pass found them
    (:func:`~prealign.loaders.index.tiling.check_tiling`, the merged index's check, for one
    shard)."""
    positions = [e[0] for e in events]
    if any(not 0 <= p < num_events for p in positions) or any(
        b <= a for a, b in zip(positions, positions[1:])
    ):
        raise bad("event positions out of range or out of order")
    check_tiling(
        spans,
        np.zeros(len(spans), np.int64),
        np.asarray([num_events], np.int64),
        [(0, p) for p in positions],
        bad,
    )


def record_of(meta: dict, arrays: dict[str, np.ndarray], shard: int) -> dict:
    """The :func:`~prealign.loaders.index.build.index_shard` record a sidecar holds, for shard
    number ``shard`` (arrays instead of lists; ``spans [N, 3]`` instead of ``locations``, which
    :func:`merge_records` builds once for all shards; ``"sidecar": True`` lets it take the
    vectorised path)."""
    events: list = [None] * meta["num_events"]
    for pos, ev in meta["events"]:
        if not 0 <= pos < len(events):
            raise StaleIndexError(
                str(meta["shard"]), "sidecar index unreadable: event position out of range"
            )
        events[pos] = ev
    return {
        "shard": shard,
        "spans": arrays["spans"],
        "lengths": arrays["lengths"],
        "media": arrays["media"],
        "dims": meta["dims"],
        "dim_ids": arrays["dim_ids"],
        "bounds": arrays["bounds"],
        "events": events,
        "sidecar": True,
        "bad_events": meta["events"],
    }


# ---- the configuration a sidecar was built for
# -----------------------------------------------------
def indexed_transform(transform):
    """The transform whose lengths an index records: a
    :class:`~prealign.loaders.handoff.media_share.SharedMediaTransform`
    shares its inner transform's results across a CP group without changing them, so it is looked
    through."""

    while is_instance(transform, "prealign.loaders.handoff.media_share", "SharedMediaTransform"):
        transform = transform.transform
    return transform


def describe_transform(transform) -> str:
    """A stable description of what decides the lengths a transform gives (its index fields,
    :func:`~prealign.loaders.handoff.identity.index_fields`): ``none``, ``numpy_fields``, else its
    qualified name and the digest of its fields (its code, the globals it reads, its state; a VLM's
    tokenizer and processor)."""
    fields = index_fields(indexed_transform(transform), owner="the index key")
    return (
        fields["transform"]
        if len(fields) == 1
        else f"{fields['transform']}:{identity_digest(fields)}"
    )


def transform_name(transform) -> str:
    """A short name of a transform for messages: ``numpy_fields``, ``mymodule.tokenize``,
    ``VLMSampleTransform (tokenizer HFChatTokenizer of Qwen2TokenizerFast)``."""
    transform = indexed_transform(transform)
    if is_instance(transform, "prealign.loaders.media.vlm", "VLMSampleTransform"):
        tok = transform.tokenizer
        inner = getattr(tok, "tokenizer", None)
        return (
            f"VLMSampleTransform (tokenizer {type(tok).__qualname__}"
            f"{f' of {type(inner).__qualname__}' if inner is not None else ''})"
        )
    return describe_transform(transform)


def tokenizer_definition(tok) -> str:
    """16 hex digits of everything that decides how ``tok`` encodes
    (:func:`prealign.loaders.handoff.identity.tokenizer_definition`, which this is)."""
    return identity.tokenizer_definition(tok)


def transform_fields(source) -> dict[str, str]:
    """What an index's lengths and data signatures depend on, field by field: the members the source
    requires and the transform's index fields
    (:func:`~prealign.loaders.handoff.identity.index_fields`: a function's code and the globals it
    reads, an instance's class and state; a VLM's tokenizer class, vocabulary, vision tokens, a
    probe of its encoding and a hash of its whole definition (never its folder), image processor
    options, text member, top-k, the family's grids). Never the schema: pad id, vocabulary bound,
    ignore index and fields are checked when a loader reads the sidecar and loads the samples."""
    fields = {
        "required": json.dumps(sorted(getattr(source, "required", ()))),
        "limits": repr(getattr(source, "limits", None)),
    }  # (the decode limits decide which samples are bad)
    fields.update(index_fields(indexed_transform(source.transform), owner="the index key"))
    return fields


def config_key(source, schema=None) -> str:
    """16 hex digits naming what a sidecar depends on: the digest of :func:`transform_fields`
    (``schema`` is not part of it: a sidecar serves any schema; the argument is accepted for callers
    that pass it)."""
    return identity_digest(transform_fields(source))


def transform_difference(meta: dict, source) -> str:
    """The first field of :func:`transform_fields` in which a sidecar's ``meta`` differs from
    ``source``'s."""
    then, now = meta.get("transform") or {}, transform_fields(source)
    if not isinstance(then, dict):  # (a crafted sidecar: no field to name)
        return f"the transform key differs (its recorded transform is a {type(then).__name__})"
    for field in sorted(set(then) | set(now)):
        if then.get(field) != now.get(field):
            return f"{field}: indexed with {then.get(field)!r}, this loader has {now.get(field)!r}"
    return "the transform key differs"


# ---- checks against the data
# ------------------------------------------------------------------------
def shard_sizes(source, shards=None) -> list[int]:
    """Size in bytes of each of ``shards`` (default: all) of a :class:`WebDatasetSource` (a ``stat``
    each, bounded by the source's ``read_timeout``; one request per URL, overlapping). Every local
    shard that does not exist or is a folder is listed in one :class:`MissingShardError` (a brace
    range naming absent files); an unreachable URL raises its own; a ``stat`` that hangs (a dead
    mount) is a :class:`ShardTimeoutError` naming the shard. ``-1``: no size (a ``pipe:`` command's
    output)."""

    urls = source.urls
    shards = list(range(len(urls))) if shards is None else list(shards)
    local = [s for s in shards if not remote.is_remote(urls[s])]
    stats = map_with_timeout(
        _local_size, [remote.local_path(urls[s]) for s in local], source.read_timeout
    )
    for s, size in zip(local, stats):
        if isinstance(size, Stalled):
            raise ShardTimeoutError(
                urls[s], 0, f"stat made no progress in {source.read_timeout} s (a hung mount?)"
            )
    missing = [
        urls[s] for s, size in zip(local, stats) if not isinstance(size, int)
    ]  # (None, or a path stat refuses)
    if missing:
        raise MissingShardError(
            None,
            f"{len(missing)} of {len(shards)} shard file(s) do not exist (or are folders): "
            f"{missing[:10]}{' ...' if len(missing) > 10 else ''}; check the path or brace "
            f"range given as urls=",
        )
    sizes = dict(zip(local, stats))
    far = [s for s in shards if s not in sizes]
    sizes.update(zip(far, per_shard(source, lambda s: remote.size(urls[s], source.remote), far)))
    return [sizes[s] for s in shards]


def shard_size(source, shard: int) -> int:
    """:func:`shard_sizes` of one shard."""
    return shard_sizes(source, [shard])[0]


def _local_size(path: str) -> int | None:
    """Size of a regular file, None when it is missing or a folder."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):  # ValueError: a NUL byte in the path
        return None
    return None if stat.S_ISDIR(st.st_mode) else st.st_size


def shard_size_now(source, shard: int) -> int | None:
    """A shard's size now (``-1``: none, a ``pipe:`` command's output), None when it does not
    exist."""
    url = source.urls[shard]
    if remote.is_remote(url) or remote.scheme(url) == "pipe":
        try:
            return remote.size(url, source.remote)
        except MissingShardError:
            return None
    st = regular_stat(remote.local_path(url), "shard")
    return None if st is None else st.st_size


PROBE = 1 << 16
PROBE_VERSION = 2
"""The probe :func:`read_probe` computes unless told otherwise (what sidecar version 4 and merged
version 5 record): blake2b-64 of a shard's bytes ``[0, min(PROBE, size))`` then
``[max(size - PROBE, min(PROBE, size)), size)``, the first :data:`PROBE` bytes then the last
:data:`PROBE` bytes not hashed already (each byte once: a shard of up to ``2 * PROBE`` bytes is
hashed whole, once). Version 1 (sidecar version 3, merged up to 4) hashes the first then the last
:data:`PROBE` bytes, so a shard under ``2 * PROBE`` bytes has bytes hashed twice; from ``2 *
PROBE`` bytes on (and at 0) the two are the same digest."""


def probe_version(sidecar_version: int) -> int:
    """The probe definition a sidecar of ``sidecar_version`` (3 or 4) records: 1 or 2."""
    return 1 if sidecar_version == 3 else 2


def probe_digest(first: bytes, last: bytes, size: int, version: int = PROBE_VERSION) -> str:
    """The probe (16 hex digits) of a shard of ``size`` bytes from ``first``, its bytes ``[0,
    min(PROBE, size))``, and ``last``, its bytes ``[max(size - PROBE, 0), size)`` (the two may
    overlap: version 2 hashes the overlap once, from ``first``; :data:`PROBE_VERSION`)."""
    h = hashlib.blake2b(first, digest_size=8)
    skip = min(PROBE, size) - max(size - PROBE, 0) if version >= 2 else 0
    h.update(memoryview(last)[skip:] if skip > 0 else last)  # (no copy)
    return h.hexdigest()


def shard_probe(source, shard: int, size: int, version: int = PROBE_VERSION) -> str:
    """The probe of a shard (:data:`PROBE_VERSION`; ``version`` 1: the older one): with the size,
    what the build-time check compares. One read of a shard of up to ``2 * PROBE`` bytes, else
    two. A shard read only front to back (``pipe:``) has none (``""``)."""
    return read_probe(source, shard, size, version)[0]


def read_probe(
    source, shard: int, size: int, version: int = PROBE_VERSION
) -> tuple[str, bytes, bytes]:
    """``(shard_probe, the first PROBE bytes read, the last PROBE bytes read)``: one read (one range
    request of a remote object) of a shard of up to ``2 * PROBE`` bytes, both spans cut from it
    (none for an empty one), else two."""

    url = source.urls[shard]
    if size < 0 or remote.scheme(url) == "pipe":
        return "", b"", b""
    far = remote.is_remote(url)
    # (never through the block cache: it may hold the object's old bytes)
    uncached = dataclasses.replace(source.remote, cache_dir=None) if far else None

    def read(lo: int, hi: int) -> bytes:
        if far:
            return remote.read_range(url, lo, hi, uncached)
        with open(remote.local_path(url), "rb") as f:
            f.seek(lo)
            return f.read(hi - lo)

    if size <= 2 * PROBE:  # the spans overlap or touch: one read
        whole = read(0, size) if size else b""
        first, last = whole[:PROBE], whole[max(size - PROBE, 0) :]
    else:
        first, last = read(0, PROBE), read(size - PROBE, size)
    return probe_digest(first, last, size, version), first, last


def sidecar_limit(size: int | None) -> int:
    """Most bytes the sidecar of a shard of ``size`` bytes can hold (``None`` or ``-1``: size
    unknown): its meta (at most 64 MiB), a row of 41 bytes per sample (a sample takes at least one
    512-byte tar header; with no size, a shard of 1 TiB) and the zip's own framing."""
    shard = (1 << 40) if size is None or size < 0 else size
    return _MAX_META + (1 << 20) + _ROW_BYTES * (shard // 512 + 1)


def read_sidecar_bytes(source, shard: int, size: int | None = None) -> bytes | None:
    """The sidecar of shard ``shard`` (local file or URL), or None when there is none. A local
    sidecar must be a regular file (a FIFO is refused, never waited on; a link to ``/dev/zero`` is
    refused) of at most :func:`sidecar_limit` of the shard's ``size`` bytes, else
    :class:`StaleIndexError`."""

    if remote.scheme(source.urls[shard]) == "pipe" and not getattr(source, "index_dir", None):
        return None  # a command's output has no "beside": give index_dir
    path = sidecar_path(source.urls[shard], getattr(source, "index_dir", None))

    def limit(
        n: int,
    ) -> int:  # (with no size given, the shard's only for a sidecar bigger than an empty shard's)
        if size is not None:
            return sidecar_limit(size)
        return sidecar_limit(shard_size_now(source, shard)) if n > sidecar_limit(0) else n

    if remote.is_remote(path):
        data = remote.read_small(path, source.remote)
        if data is not None and len(data) > sidecar_limit(size):
            raise StaleIndexError(
                path,
                f"sidecar of {len(data)} bytes, more than the {sidecar_limit(size)} bytes "
                f"one can hold",
                "re-run `prealign index`",
            )
        return data
    return read_regular(remote.local_path(path), "sidecar", limit)


def expected_of(meta: dict, spans: np.ndarray) -> tuple[int, str, int, int, int]:
    """What a shard's first read checks (:class:`ShardChecks`): ``(size, probe, first, last,
    probe_version)``; ``first`` the byte where its first good sample starts when that is its first
    record (else -1), ``last`` where its last good sample ends when that is its last record (else
    -1); ``probe_version`` the definition of ``probe`` (:func:`probe_version`)."""
    events = meta["events"]
    first = int(spans[0, 0]) if len(spans) and not (events and events[0][0] == 0) else -1
    last = (
        int(spans[-1, 1])
        if len(spans) and not (events and events[-1][0] == meta["num_events"] - 1)
        else -1
    )
    return (
        int(meta["size"]),
        str(meta.get("probe", "")),
        first,
        last,
        probe_version(meta["version"]),
    )


def per_shard(source, fn, shards=None, *, threads: int = 0) -> list:
    """``[fn(s) for s in shards]`` (default: every shard), the first failure in shard order raised.
    With URLs each call is a round trip or two, so they overlap on 16 threads (a thousand shards on
    an object store cost a thousand round trips at once, not in a row). Local files are read in a
    row: from a local disk or the page cache that is faster than threads contending for the GIL
    (2,000 sidecars: 0.20 s in a row, 0.25 s on 4 threads, 0.35 s on 16). With ``threads``, the
    first :data:`_TIMED_CALLS` calls are timed, and when they show a file system's latency (a median
    over :data:`_SLOW_CALL` s: a parallel file system's
    metadata round trips, not a loaded machine's preemptions), the rest run on up to ``threads``
    threads."""

    shards = list(range(source.num_shards)) if shards is None else list(shards)
    if len(shards) > 1 and any(remote.is_remote(source.urls[s]) for s in shards):
        return _threaded(fn, shards, 16)
    if threads < 2 or len(shards) <= _TIMED_CALLS:
        return [fn(s) for s in shards]
    head, took = [], []
    for s in shards[:_TIMED_CALLS]:
        t0 = time.perf_counter()
        head.append(fn(s))
        took.append(time.perf_counter() - t0)
    slow = (
        sorted(took)[len(took) // 2] > _SLOW_CALL
    )  # the median: a busy machine's preemptions hit a few calls
    rest = shards[_TIMED_CALLS:]
    return head + (_threaded(fn, rest, threads) if slow else [fn(s) for s in rest])


SIDECAR_THREADS = 8
"""Threads sidecars and shard checks are read on when the file system is slow
(:func:`per_shard`)."""
_TIMED_CALLS = 32
_SLOW_CALL = 1e-3


def _threaded(fn, shards: list, threads: int) -> list:
    with ThreadPoolExecutor(
        max_workers=min(threads, len(shards)), thread_name_prefix="prealign-shard"
    ) as pool:
        return list(pool.map(fn, shards))
