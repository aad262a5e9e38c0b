"""``SampleIndex``: every good sample of a source (length, location, shard, media), saved and loaded
as a checked ``.npz`` (never unpickled)."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Callable

import numpy as np

from prealign.loaders.errors import IndexFileError, StaleIndexError
from prealign.loaders.policy import BadDataReport
from prealign.loaders.sources.shard_files import ListLike


class LazyList(ListLike):
    """A list made by ``make()`` when an item is first asked for; ``len`` without making it. What
    a merged index's start keeps per shard (``source_shards``' 100,000 names and sizes): made only
    by what reads them (a saved index, the check of a reused one), never at a start. Equal to any
    sequence of the same items; pickled as the list."""

    def __init__(self, make: Callable[[], list], length: int):
        self._make, self._length, self._items = make, int(length), None

    def _list(self) -> list:
        if self._items is None:
            self._items = list(self._make())
            self._make = None
        return self._items

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, i):
        return self._list()[i]

    def __reduce__(self):
        return list, (self._list(),)


def _plain(value):
    """``value`` with each :class:`LazyList` made a list (for JSON)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return list(value) if isinstance(value, LazyList) else value


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
    source when the index is reused (:func:`~prealign.loaders.index.sidecar.check_index`); not in
    the digest."""

    def __post_init__(self) -> None:
        for a in (
            self.lengths,
            self.locations,
            self.shards,
            self.media,
        ):  # the cached digest never goes stale
            if isinstance(a, np.ndarray):
                a.setflags(write=False)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @functools.cached_property
    def digest(self) -> str:
        """16 hex digits over lengths, locations, (when any sample has media) the media flags and
        (when any) the named dims: changes when the data does. Computed once per index (it is
        immutable: ``dataclasses.replace`` makes a new one), so a checkpoint's ``state_dict`` never
        rehashes it."""
        h = hashlib.sha256()
        arrays = [self.lengths, self.locations, self.shards]
        if self.media is not None and bool(
            np.any(self.media)
        ):  # text-only data: the same digest as before
            arrays.append(self.media)
        for a in arrays:
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        if self.dims:  # no named dims: the same digest as before
            h.update(json.dumps(self.dims, sort_keys=True).encode())
        return h.hexdigest()[:16]

    def save(self, path: str) -> None:
        """Write as an ``.npz`` archive (arrays only, no pickle) at exactly ``path`` (no suffix
        added), for reuse across runs (``PackedLoader(...,
        indexing=IndexOptions(prebuilt=path))``)."""
        extra = {} if self.media is None else {"media": np.asarray(self.media, dtype=bool)}
        if self.dims is not None:
            extra["dims"] = np.frombuffer(
                json.dumps(self.dims, sort_keys=True).encode(), dtype=np.uint8
            )
        if self.source_shards is not None:
            extra["source_shards"] = np.frombuffer(
                json.dumps(_plain(self.source_shards)).encode(), dtype=np.uint8
            )
        with open(path, "wb") as f:
            np.savez(
                f,
                lengths=self.lengths,
                locations=self.locations,
                shards=self.shards,
                report=np.frombuffer(json.dumps(self.report.to_dict()).encode(), dtype=np.uint8),
                **extra,
            )

    @classmethod
    def load(cls, path: str) -> "SampleIndex":
        """Read a file written by :meth:`save`; anything else (no such file, another format, missing
        or extra keys, wrong dtypes or shapes, inconsistent row counts, an undecodable report) is an
        :class:`~prealign.loaders.errors.IndexFileError` (a configuration error, a
        :class:`~prealign.loaders.errors.StaleIndexError`) naming the path and the key. Never
        unpickles."""
        from prealign.loaders.index.sidecar import read_regular
        from prealign.loaders.sources.npy import ArrayTooLarge, NpyFormatError, read_npz

        try:
            data = read_regular(path, "index", _MAX_INDEX_FILE)
        except (StaleIndexError, OSError) as exc:
            raise IndexFileError(
                f"index {path}: not an .npz index ({type(exc).__name__}: {exc})"
            ) from None
        if data is None:
            raise IndexFileError(f"index {path}: no such file")
        if data[:6] == b"\x93NUMPY":
            raise IndexFileError(
                f"index {path}: a bare array, not an .npz index written by SampleIndex.save"
            )
        # every entry's declared size checked before anything is inflated: a 1 MB file never
        # inflates GiBs
        try:
            arrays = read_npz(data, max_bytes=64 * len(data) + (1 << 20), member=f"index {path}")
        except NpyFormatError as exc:
            key = exc.member[:-4] if exc.member.endswith(".npy") else None
            if key in _INDEX_KEYS:  # e.g. an object (pickled) array: never unpickled
                raise IndexFileError(f"index {path}: key {key!r} unreadable ({exc})") from None
            raise IndexFileError(f"index {path}: not an .npz index ({exc})") from None
        except ArrayTooLarge as exc:
            raise IndexFileError(f"index {path}: more than the file can hold ({exc})") from None
        except Exception as exc:  # noqa: BLE001 - any failure to parse a crafted file is a typed error
            raise IndexFileError(
                f"index {path}: not an .npz index ({type(exc).__name__}: {exc})"
            ) from None
        return _checked_index(path, _Arrays(arrays))


class _Arrays(dict):
    """The entries of an index file, read as ``np.load``'s ``NpzFile`` is (``.files``,
    ``[key]``)."""

    @property
    def files(self) -> list[str]:
        return list(self)


_MAX_INDEX_FILE = 1 << 40
"""Largest index file read (a regular file; a sample takes at most ~50 bytes of one)."""
_INDEX_KEYS = {"lengths", "locations", "shards", "report", "media", "dims", "source_shards"}


def _index_array(path: str, z, key: str, kind: str, ndim: int, rows: int | None) -> np.ndarray:
    """``z[key]`` checked: dtype kind (``"i"`` integer, ``"b"`` bool, ``"u1"`` bytes), rank,
    rows."""
    try:
        a = z[key]
    except (ValueError, OSError, EOFError) as exc:  # object arrays (pickles) are refused here
        raise IndexFileError(
            f"index {path}: key {key!r} unreadable ({type(exc).__name__}: {exc})"
        ) from None
    ok = {
        "i": a.dtype.kind in "iu" and a.dtype != np.uint64,
        "b": a.dtype == np.bool_,
        "u1": a.dtype == np.uint8,
    }[kind]
    if not ok or a.ndim != ndim or (rows is not None and a.shape[0] != rows):
        want = {"i": "an integer", "b": "a bool", "u1": "a uint8"}[kind]
        raise IndexFileError(
            f"index {path}: key {key!r}: expected {want} array of rank {ndim}"
            f"{'' if rows is None else f' with {rows} rows'}, got {a.dtype} {list(a.shape)}"
        )
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
        raise IndexFileError(
            f"index {path}: expected keys lengths, locations, shards, report (+ media, dims, "
            f"source_shards), missing {sorted(missing)}, unknown {sorted(extra)}"
        )
    lengths = _index_array(path, z, "lengths", "i", 1, None).astype(np.int64)
    n = lengths.shape[0]
    locations = _index_array(path, z, "locations", "i", 2, n).astype(np.int64)
    shards = _index_array(path, z, "shards", "i", 1, n).astype(np.int64)
    if n and (lengths.min() < 1 or locations.min() < 0 or shards.min() < 0):
        raise IndexFileError(
            f"index {path}: lengths must be >= 1, locations and shards >= 0 (got minima "
            f"{lengths.min()}, {locations.min()}, {shards.min()})"
        )
    rep = _json_of(path, z, "report")
    try:  # (examples as BadRecords, or the [where, reason, message] lists of older files)
        report = BadDataReport.from_dict(rep)
    except ValueError as exc:
        raise IndexFileError(
            f"index {path}: key 'report': expected {{'counts': {{reason: int}}, 'examples': "
            f"[bad-data record, ...]}} ({exc}), got {str(rep)[:120]}"
        ) from None
    media = _index_array(path, z, "media", "b", 1, n) if "media" in files else None
    dims = _json_of(path, z, "dims") if "dims" in files else None
    if dims is not None and not (
        isinstance(dims, dict)
        and all(
            isinstance(k, str)
            and (isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)))
            for k, v in dims.items()
        )
    ):
        raise IndexFileError(
            f"index {path}: key 'dims': expected {{name: int or dtype name}}, got {str(dims)[:120]}"
        )
    source_shards = _json_of(path, z, "source_shards") if "source_shards" in files else None
    if source_shards is not None:
        _check_source_shards(path, source_shards, shards)
    return SampleIndex(
        lengths=lengths,
        locations=locations,
        shards=shards,
        report=report,
        media=media,
        dims=dims,
        source_shards=source_shards,
    )


def _check_source_shards(path: str, rec, shards: np.ndarray) -> None:
    """Key ``source_shards`` (written by :meth:`SampleIndex.save` for webdataset sources):
    ``{"names": [str], "sizes": [int or None]}`` of equal lengths, covering every shard the rows
    name."""

    def _size(v) -> bool:
        return v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= -1)

    names, sizes = (rec.get("names"), rec.get("sizes")) if isinstance(rec, dict) else (None, None)
    if not (
        isinstance(rec, dict)
        and set(rec) <= {"names", "sizes"}
        and isinstance(names, list)
        and isinstance(sizes, list)
        and len(names) == len(sizes)
        and all(isinstance(x, str) for x in names)
        and all(_size(v) for v in sizes)
    ):
        raise IndexFileError(
            f"index {path}: key 'source_shards': expected {{'names': [str], 'sizes': [int]}} of "
            f"equal lengths, got {str(rec)[:120]}"
        )
    if shards.size and names and int(shards.max()) >= len(names):
        raise IndexFileError(
            f"index {path}: key 'source_shards': {len(names)} shard(s) recorded, rows name "
            f"shard {int(shards.max())}"
        )
