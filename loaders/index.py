"""The length index: one pass over a source that learns every sample's token length and location.

    shards ──split by worker (DataLoader workers)──► scan ─► transform ─► validate against the schema
                                                                            │ good: (location, length)
                                                                            │ bad: failure record
    main process: merge shards in order ─► bad-data policy (raise / skip+count) ─► SampleIndex

Validation is the collator's own: the real :class:`~prealign.collate.thd.THDCollator` (unsharded) runs on
each chunk of samples, and on each sample alone when a chunk fails, so shapes, dtypes and value
bounds (``finite``, ``min_value``, ``max_value``) are checked on every row. The named dense dims
(``K`` of a top-k field, ...) are recorded: the first accepted sample fixes them, and a later
sample with another value is bad data (``dim_mismatch``), since no micro-batch could hold both.
So a sample that enters the index is one the collator accepts, alone or with any other. The policy
runs in the main process over the records in shard order, so its consecutive-failure count and its
error are the same whatever the number of workers.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from prealign.collate.samples import flatten, sample_token_keys
from prealign.collate.thd import THDCollator
from prealign.schemas.errors import ConfigError, PrealignError, SampleError
from prealign.schemas.layout import ParallelLayout
from prealign.schemas.schema import BatchSchema, Role
from .errors import BadSampleError, CorruptShardError, IndexFileError, reason_of
from .policy import BadDataGate, BadDataPolicy, BadDataReport
from .sources import Skip, Source
from .workers import Carried, carry


@dataclass(frozen=True, kw_only=True)
class SampleIndex:
    """Every good sample of a source, in canonical order (shard by shard, stream order inside).

    ``lengths`` int64 ``[N]`` token lengths; ``locations`` int64 ``[N, K]`` (a source location per
    row); ``shards`` int64 ``[N]`` shard of each sample; ``report`` what was skipped and why (counts
    by cause: ``bad_sample``, ``corrupt_image``, ``corrupt_shard``, ...); ``media`` bool ``[N]``
    whether the sample carries media (a MEDIA-role field, e.g. ``pixel_values``, with at least one
    row): such a sample is never truncated (``None``: not recorded, e.g. an index built elsewhere);
    ``dims`` the named dense dims every indexed sample has (``{"K": 64}`` for top-k teacher fields;
    fixed by the first accepted sample, ``None``: not recorded).
    """

    lengths: np.ndarray
    locations: np.ndarray
    shards: np.ndarray
    report: BadDataReport
    media: np.ndarray | None = None
    dims: dict[str, int] | None = None
    source_shards: dict | None = None
    """``{"names": [...], "sizes": [...]}`` of the shards indexed (webdataset), checked against the
    source when the index is reused (:func:`~prealign.loaders.sidecar.check_index`); not in the digest."""

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def digest(self) -> str:
        """16 hex digits over lengths, locations, (when any sample has media) the media flags and
        (when any) the named dims: changes when the data does."""
        h = hashlib.sha256()
        arrays = [self.lengths, self.locations, self.shards]
        if self.media is not None and bool(np.any(self.media)):  # text-only data: the same digest as before
            arrays.append(self.media)
        for a in arrays:
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        if self.dims:  # no named dims: the same digest as before
            h.update(json.dumps(self.dims, sort_keys=True).encode())
        return h.hexdigest()[:16]

    def save(self, path: str) -> None:
        """Write as an ``.npz`` archive (arrays only, no pickle) at exactly ``path`` (no suffix added), for
        reuse across runs (``PackedLoader(..., indexing=IndexOptions(prebuilt=path))``)."""
        extra = {} if self.media is None else {"media": np.asarray(self.media, dtype=bool)}
        if self.dims is not None:
            extra["dims"] = np.frombuffer(json.dumps(self.dims, sort_keys=True).encode(), dtype=np.uint8)
        if self.source_shards is not None:
            extra["source_shards"] = np.frombuffer(json.dumps(self.source_shards).encode(), dtype=np.uint8)
        with open(path, "wb") as f:
            np.savez(f, lengths=self.lengths, locations=self.locations, shards=self.shards,
                 report=np.frombuffer(json.dumps(self.report.to_dict()).encode(), dtype=np.uint8), **extra)

    @classmethod
    def load(cls, path: str) -> "SampleIndex":
        """Read a file written by :meth:`save`; anything else (no such file, another format, missing or
        extra keys, wrong dtypes or shapes, inconsistent row counts, an undecodable report) is an
        :class:`~prealign.loaders.errors.IndexFileError` (a configuration error, a
        :class:`~prealign.loaders.errors.StaleIndexError`) naming the path and the key. Never unpickles."""
        try:
            z = np.load(path, allow_pickle=False)
        except FileNotFoundError:
            raise IndexFileError(f"index {path}: no such file") from None
        except (OSError, ValueError, EOFError) as exc:
            raise IndexFileError(f"index {path}: not an .npz index ({type(exc).__name__}: {exc})") from None
        if not hasattr(z, "files"):
            raise IndexFileError(f"index {path}: a bare array, not an .npz index written by SampleIndex.save")
        with z:
            return _checked_index(path, z)


_INDEX_KEYS = {"lengths", "locations", "shards", "report", "media", "dims", "source_shards"}


def _index_array(path: str, z, key: str, kind: str, ndim: int, rows: int | None) -> np.ndarray:
    """``z[key]`` checked: dtype kind (``"i"`` integer, ``"b"`` bool, ``"u1"`` bytes), rank, rows."""
    try:
        a = z[key]
    except (ValueError, OSError, EOFError) as exc:  # object arrays (pickles) are refused here
        raise IndexFileError(f"index {path}: key {key!r} unreadable ({type(exc).__name__}: {exc})") from None
    ok = {"i": a.dtype.kind in "iu" and a.dtype != np.uint64, "b": a.dtype == np.bool_,
          "u1": a.dtype == np.uint8}[kind]
    if not ok or a.ndim != ndim or (rows is not None and a.shape[0] != rows):
        want = {"i": "an integer", "b": "a bool", "u1": "a uint8"}[kind]
        raise IndexFileError(f"index {path}: key {key!r}: expected {want} array of rank {ndim}"
                             f"{'' if rows is None else f' with {rows} rows'}, got {a.dtype} {list(a.shape)}")
    return a


def _json_of(path: str, z, key: str):
    raw = _index_array(path, z, key, "u1", 1, None)
    try:
        return json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise IndexFileError(f"index {path}: key {key!r}: not JSON text ({exc})") from None


def _checked_index(path: str, z) -> SampleIndex:
    files = set(z.files)
    missing, extra = {"lengths", "locations", "shards", "report"} - files, files - _INDEX_KEYS
    if missing or extra:
        raise IndexFileError(f"index {path}: expected keys lengths, locations, shards, report (+ media, dims, "
                             f"source_shards), "
                             f"missing {sorted(missing)}, unknown {sorted(extra)}")
    lengths = _index_array(path, z, "lengths", "i", 1, None).astype(np.int64)
    n = lengths.shape[0]
    locations = _index_array(path, z, "locations", "i", 2, n).astype(np.int64)
    shards = _index_array(path, z, "shards", "i", 1, n).astype(np.int64)
    if n and (lengths.min() < 1 or locations.min() < 0 or shards.min() < 0):
        raise IndexFileError(f"index {path}: lengths must be >= 1, locations and shards >= 0 (got minima "
                             f"{lengths.min()}, {locations.min()}, {shards.min()})")
    rep = _json_of(path, z, "report")
    if not (isinstance(rep, dict) and isinstance(rep.get("counts"), dict) and isinstance(rep.get("examples"), list)
            and all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                    for k, v in rep["counts"].items())
            and all(isinstance(e, list) and len(e) == 3 and all(isinstance(x, str) for x in e)
                    for e in rep["examples"])):
        raise IndexFileError(f"index {path}: key 'report': expected {{'counts': {{reason: int}}, 'examples': "
                             f"[[where, reason, message], ...]}}, got {str(rep)[:120]}")
    report = BadDataReport(counts=dict(rep["counts"]), examples=[tuple(e) for e in rep["examples"]])
    media = _index_array(path, z, "media", "b", 1, n) if "media" in files else None
    dims = _json_of(path, z, "dims") if "dims" in files else None
    if dims is not None and not (isinstance(dims, dict) and all(
            isinstance(k, str) and (isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)))
            for k, v in dims.items())):
        raise IndexFileError(f"index {path}: key 'dims': expected {{name: int or dtype name}}, got {str(dims)[:120]}")
    source_shards = _json_of(path, z, "source_shards") if "source_shards" in files else None
    if source_shards is not None:
        _check_source_shards(path, source_shards, shards)
    return SampleIndex(lengths=lengths, locations=locations, shards=shards, report=report, media=media, dims=dims,
                       source_shards=source_shards)


def _check_source_shards(path: str, rec, shards: np.ndarray) -> None:
    """Key ``source_shards`` (written by :meth:`SampleIndex.save` for webdataset sources): ``{"names": [str],
    "sizes": [int or None]}`` of equal lengths, covering every shard the rows name."""
    def _size(v) -> bool:
        return v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= -1)

    names, sizes = (rec.get("names"), rec.get("sizes")) if isinstance(rec, dict) else (None, None)
    if not (isinstance(rec, dict) and set(rec) <= {"names", "sizes"} and isinstance(names, list)
            and isinstance(sizes, list) and len(names) == len(sizes)
            and all(isinstance(x, str) for x in names) and all(_size(v) for v in sizes)):
        raise IndexFileError(f"index {path}: key 'source_shards': expected {{'names': [str], 'sizes': [int]}} of "
                             f"equal lengths, got {str(rec)[:120]}")
    if shards.size and names and int(shards.max()) >= len(names):
        raise IndexFileError(f"index {path}: key 'source_shards': {len(names)} shard(s) recorded, rows name "
                             f"shard {int(shards.max())}")


def _freeze(exc: Exception) -> dict:
    """An exception as plain data (typed errors do not survive pickling through DataLoader workers);
    a sample's keeps its cause (:func:`~prealign.loaders.errors.reason_of`) and its message."""
    if isinstance(exc, CorruptShardError):
        return {"type": "shard", "cls": type(exc).__name__, "shard": exc.shard, "offset": exc.offset,
                "cause": exc.cause, "reason": exc.reason}
    if not isinstance(exc, SampleError):  # sources yield typed errors only; anything else is a bug of ours
        raise TypeError(f"a scan record holds {type(exc).__name__}: {exc}") from exc
    return {"type": "sample", "cls": type(exc).__name__, "sample": exc.sample, "field": exc.field,
            "expected": exc.expected, "actual": exc.actual, "reason": reason_of(exc), "message": str(exc)}


def _thaw(rec: dict) -> PrealignError:
    from . import errors

    if rec["type"] == "shard":
        shard_cls = getattr(errors, rec.get("cls", ""), None)
        if not (isinstance(shard_cls, type) and issubclass(shard_cls, CorruptShardError)):
            shard_cls = CorruptShardError
        return shard_cls(rec["shard"], rec["offset"], rec["cause"])
    cls = getattr(errors, rec["cls"], None)
    if not (isinstance(cls, type) and issubclass(cls, SampleError)):
        cls = SampleError if rec["cls"] == "SampleError" else BadSampleError
    err = cls(sample=rec["sample"], field=rec["field"], expected=rec["expected"], actual=rec["actual"])
    err.reason = _reason(rec)
    if rec.get("message"):
        err.args = (rec["message"],)
    return err


def _reason(rec: dict) -> str:
    """The cause a record is counted under in the bad-data report."""
    if rec["type"] == "shard":
        return rec.get("reason") or CorruptShardError.reason
    return rec.get("reason") or BadSampleError.reason


def _name(source: Source, shard: int, loc, item) -> str:
    """The most telling name of a scan record: ``url:key`` for webdataset, else the source's."""
    if isinstance(item, SampleError) and isinstance(item.sample, str):
        return item.sample
    return source.sample_name(item, loc) if loc is not None else f"shard {shard}"


def media_keys(schema: BatchSchema) -> tuple[str, ...]:
    """Sample keys of the schema's MEDIA fields (``pixel_values``, ``image_grid_thw``, ...)."""
    return tuple(spec.name for spec in schema.of_role(Role.MEDIA))


def has_media(sample: dict, keys: tuple[str, ...]) -> bool:
    """True when a MEDIA field (``keys``, see :func:`media_keys`) of ``sample`` has at least one row
    (an image, a video, ...); a text-only VLM sample (``pixel_values [0, patch_dim]``) has none."""
    for key in keys:
        value = sample.get(key)
        if value is None:
            continue
        shape = getattr(value, "shape", None)
        shape = tuple(np.shape(value)) if shape is None else tuple(shape)
        if not shape or shape[0] > 0:
            return True
    return False


_CHUNK = 64
_FIELDS = "fields"
"""Key of the per-sample record of which optional sample fields it has (not kept in ``SampleIndex.dims``)."""


def optional_keys(schema: BatchSchema) -> tuple[str, ...]:
    """Sample keys the collator reads that a sample may have or lack (``labels``, ``loss_mask``, ...):
    every sample of one index must agree on them, since a micro-batch cannot mix them."""
    keys = {k for k, _ in sample_token_keys(schema)}
    for spec in schema.of_role(Role.TOKEN):
        keys.update(spec.sample_keys)
    return tuple(sorted(keys - {"input_ids"}))


def _collate_check(samples: list[dict], schema: BatchSchema) -> tuple[list[int], dict[str, int]]:
    """Run the loader's collator on ``samples`` as one unsharded micro-batch (shapes, dtypes, value
    bounds of every row): their token lengths and what they fix for every later sample: the named
    dims (``{"K": 64}``) and each field's dtype (``{"dtype[teacher_topk_log_probs]": "bfloat16"}``;
    a batch never mixes dtypes). Raises the collator's :class:`SampleError` (or anything else)."""
    THDCollator(schema=schema, layout=ParallelLayout(), cp_rank=None)(samples)
    flat = flatten(samples, schema, check_values=False)  # passed the same checks above: lengths and dims
    return flat.lengths.tolist(), {**flat.dims, **{f"dtype[{k}]": v for k, v in flat.dtypes.items()}}


def _validated(samples: list[dict], schema: BatchSchema) -> list[tuple[int, dict[str, int]] | SampleError]:
    """(token length, named dims) of each sample, or the collator's error for it. One collator call
    for the whole chunk on the happy path; one per sample (the same function) only when the chunk
    fails (or its samples' tensors differ in dtype or rank, which a concatenation could hide by
    type promotion). Samples accepted alone may still disagree on a named dim: the dims returned let
    :func:`merge_shards` hold each to the first accepted sample's."""
    if not samples:
        return []
    first = samples[0]
    sig = {k: (v.dtype, v.ndim) for k, v in first.items() if isinstance(v, torch.Tensor)}
    if all(len(s) == len(first) and all(isinstance(s.get(k), torch.Tensor) and (s[k].dtype, s[k].ndim) == d
                                        for k, d in sig.items()) for s in samples):
        try:
            lengths, dims = _collate_check(samples, schema)
            return [(n, dims) for n in lengths]
        except Exception:  # noqa: BLE001 - diagnosed sample by sample below
            pass
    out: list[tuple[int, dict[str, int]] | SampleError] = []
    for s in samples:
        try:
            lengths, dims = _collate_check([s], schema)
            out.append((lengths[0], dims))
        except ConfigError:
            raise
        except SampleError as exc:  # anything else the collator raises is a bug, and propagates
            out.append(exc)
    return out


def index_shard(source: Source, schema: BatchSchema, shard: int) -> dict:
    """Scan one shard: ``{"shard", "locations", "lengths", "media", "dims", "dim_ids", "events"}``;
    ``dims`` lists the distinct named-dim dicts of the shard's good samples, ``dim_ids`` (one per good
    sample) points into it; events are, in stream order, ``["ok"]``, ``["bad", where, frozen error]``
    or ``["skip", reason, where, message]``."""
    locations, lengths, media, events = [], [], [], []
    dims: list[dict[str, int]] = []
    dim_ids: list[int] = []
    keys = media_keys(schema)
    optional = optional_keys(schema)
    pending: list[tuple[tuple, str, dict]] = []  # transformed samples waiting for chunked validation

    def flush() -> None:
        for (loc, where, transformed), result in zip(pending, _validated([p[2] for p in pending], schema)):
            if isinstance(result, SampleError):  # the collator's checks name sample 0 of a one-sample batch
                err = BadSampleError(sample=where, field=result.field, expected=result.expected, actual=result.actual)
                events.append(["bad", where, _freeze(err)])
            else:
                present = {_FIELDS: ",".join(k for k in optional if k in transformed)}
                result = (result[0], {**result[1], **present})
                if result[1] not in dims:
                    dims.append(result[1])
                locations.append(list(loc))
                lengths.append(result[0])
                media.append(has_media(transformed, keys))
                dim_ids.append(dims.index(result[1]))
                events.append(["ok"])
        pending.clear()

    for loc, item in source.scan(shard):
        if isinstance(item, Skip):
            flush()
            events.append(["skip", item.reason, item.where, item.message])
            continue
        where = _name(source, shard, loc, item)
        if isinstance(item, Exception):
            flush()
            events.append(["bad", where, _freeze(item)])
            continue
        try:
            sample = source.apply_transform(item, loc)
        except SampleError as exc:
            flush()
            events.append(["bad", where, _freeze(exc)])
            continue
        pending.append((loc, where, sample))
        if len(pending) >= _CHUNK:
            flush()
    flush()
    return {"shard": shard, "locations": locations, "lengths": lengths, "media": media, "dims": dims,
            "dim_ids": dim_ids, "events": events}


class _ShardScan(IterableDataset):
    """Shards split over DataLoader workers (worker w takes shards w, w+W, ...)."""

    def __init__(self, source: Source, schema: BatchSchema, shards: list[int]):
        self.source, self.schema, self.shards = source, schema, shards

    def __iter__(self):
        info = get_worker_info()
        mine = self.shards if info is None else self.shards[info.id::info.num_workers]
        for shard in mine:
            try:
                yield index_shard(self.source, self.schema, shard)
            except PrealignError as exc:  # typed: re-raised as the same type in the main process
                if info is None:
                    raise
                yield carry(exc)
                return


def scan_shards(source: Source, schema: BatchSchema, shards: list[int], *, num_workers: int = 0) -> list[dict]:
    """:func:`index_shard` over ``shards`` with ``num_workers`` DataLoader workers, in shard order."""
    loader = DataLoader(_ShardScan(source, schema, shards), batch_size=None, num_workers=min(num_workers, len(shards)))
    results = {}
    for r in loader:
        if isinstance(r, Carried):
            raise r.rebuild()
        results[r["shard"]] = r
    return [results[s] for s in shards]


def _dim_mismatch(fixed: dict[str, int], dims: dict[str, int]) -> str | None:
    """The first named dim of ``dims`` whose size differs from ``fixed``'s, or None."""
    return next((d for d, n in dims.items() if fixed.get(d, n) != n), None)


def merge_shards(results: list[dict], policy: BadDataPolicy, width: int, *,
                 where: Callable[[tuple], str] | None = None, schema: BatchSchema | None = None) -> SampleIndex:
    """Apply the bad-data policy over the records in shard order and build the index.

    The first good sample with a named dim (``K``, ...) fixes its size; a later one with another
    size is a bad sample (reason ``dim_mismatch``: no micro-batch could hold both), named by
    ``where(location)`` and, with ``schema``, by the first field declaring the dim."""
    name = where or (lambda loc: f"location {list(loc)}")
    gate = BadDataGate(policy)
    fixed: dict[str, int] = {}
    fixed_by: dict[str, str] = {}
    dropped: list[set[int]] = []  # per shard result: good-sample positions left out (dim_mismatch)
    fields: tuple[str, str] | None = None  # (optional fields present, the sample that fixed them)
    for res in results:
        out: set[int] = set()
        k = 0
        for ev in res["events"]:
            if ev[0] == "ok":
                dims = dict(res["dims"][res["dim_ids"][k]]) if res.get("dims") else {}
                has = dims.pop(_FIELDS, None)
                bad = _dim_mismatch(fixed, dims)
                if has is not None and fields is not None and has != fields[0]:
                    out.add(k)
                    who = name(tuple(res["locations"][k]))
                    mine, first = set(filter(None, has.split(","))), set(filter(None, fields[0].split(",")))
                    gate.bad("field_mismatch", who, BadSampleError(
                        sample=who, field=sorted(mine ^ first)[0], reason="field_mismatch",
                        expected=f"optional fields {sorted(first)} like the first indexed sample ({fields[1]}): a "
                                 f"micro-batch cannot mix samples with and without a field",
                        actual=f"fields {sorted(mine)}"))
                elif bad is None:
                    if has is not None and fields is None:
                        fields = (has, name(tuple(res["locations"][k])))
                    for d in dims.keys() - fixed.keys():
                        fixed[d], fixed_by[d] = dims[d], name(tuple(res["locations"][k]))
                    gate.good()
                else:
                    out.add(k)
                    who = name(tuple(res["locations"][k]))
                    field = next((f.name for f in (schema.of_role(Role.TOKEN) if schema is not None else ())
                                  if bad in (*f.leading_shape, *f.dense_shape)), None)
                    gate.bad("dim_mismatch", who, BadSampleError(
                        sample=who, field=field, reason="dim_mismatch", actual=f"{bad} = {dims[bad]}",
                        expected=f"{bad} = {fixed[bad]} (fixed by the first indexed sample with it, {fixed_by[bad]})"))
                k += 1
            elif ev[0] == "skip":
                gate.report.add(ev[1], ev[2], ev[3])
            else:
                gate.bad(_reason(ev[2]), ev[1], _thaw(ev[2]))
        dropped.append(out)

    def good(key: str):
        return (v for r, out in zip(results, dropped) for k, v in enumerate(r[key]) if k not in out)

    locs = list(good("locations"))
    n = len(locs)
    width = max((len(loc) for loc in locs), default=width)
    return SampleIndex(lengths=np.fromiter(good("lengths"), np.int64, n),
                       locations=np.asarray(locs, dtype=np.int64).reshape(n, width),
                       shards=np.fromiter((r["shard"] for r, out in zip(results, dropped)
                                           for k in range(len(r["lengths"])) if k not in out), np.int64, n),
                       report=gate.report, media=np.fromiter((bool(m) for m in good("media")), bool, n), dims=fixed)


def build_index(source: Source, schema: BatchSchema, *, policy: BadDataPolicy | None = None,
                num_workers: int = 0, distributed: bool = False, group=None) -> SampleIndex:
    """Index every shard of ``source`` (see the module docstring). Raises the first bad sample's
    typed error under ``OnBadSample.RAISE``; counts it under ``SKIP``.

    ``distributed=True`` with an initialised process group splits the pass by node: rank ``r`` of
    ``W`` (in ``group``) scans shards ``r, r+W, ...`` (the shard split ``split_dataset_by_node``
    makes) and the ranks exchange their records, so every rank ends with the same full index.
    """
    from prealign.schemas.distributed import all_gather_objects, process_rank_world

    from .sidecar import check_source

    rank, world = process_rank_world(group) if distributed else (0, 1)
    known: dict = {}
    checked = None
    failure: BaseException | None = None
    try:
        known, checked = check_source(source, schema)  # unreachable / changed shards raise here; sidecar records
        shards = [s for s in range(source.num_shards) if s not in known]
        mine: dict = {"results": scan_shards(source, schema, shards[rank::world], num_workers=num_workers)}
    except Exception as exc:  # noqa: BLE001 - re-raised below: every rank must reach the exchange first
        if world == 1:
            raise
        failure = exc
        typed = exc if isinstance(exc, PrealignError) else PrealignError(f"{type(exc).__name__}: {exc}")
        mine = {"rank": rank, "error": carry(typed)}
    parts = all_gather_objects(mine, group) if world > 1 else [mine]
    failed = [p for p in parts if "error" in p]
    if failure is not None:
        raise failure
    if failed:  # another rank's error, as its own type, on every rank
        err = failed[0]["error"].rebuild()
        err.args = (f"index pass failed on rank {failed[0]['rank']}: {err.args[0] if err.args else ''}", *err.args[1:])
        raise err
    results = sorted([*known.values(), *(r for p in parts for r in p["results"])], key=lambda r: r["shard"])
    if known:  # some shards from their sidecars (merge_records falls back to merge_shards unless all are)
        from .sidecar import merge_records

        index = merge_records(results, policy or BadDataPolicy(), where=source.where, schema=schema)
    else:
        index = merge_shards(results, policy or BadDataPolicy(), width=1, where=source.where, schema=schema)
    index = dataclasses.replace(index, source_shards=checked)
    if len(index) == 0:
        raise BadSampleError(sample=None, field=None, expected="at least one good sample in the source",
                             actual=f"none ({index.report.to_dict()['counts']})")
    return index
