"""Sources: datasets the loader indexes once (lengths, locations) and then reads sample by sample.

A source is split into *shards* (tar files, Hugging Face shards, or row ranges). :meth:`Source.scan`
walks one shard in order and yields ``(location, raw sample)``; :meth:`Source.read` reads one
sample back from its location (in a DataLoader worker); :meth:`Source.load` adds the ``transform``.
A location is a short tuple of ints (stored in the index as an int64 row).

``transform`` maps one decoded sample to a dict of tensors with at least ``input_ids`` int64 ``[L]``
(e.g. tokenisation; any picklable callable, including an object wrapping a Hugging Face
tokenizer). It runs once per sample at indexing (to learn lengths) and again when the sample is
loaded for a batch, so it must be deterministic.
"""

from __future__ import annotations

import abc
import itertools
import os
from collections import OrderedDict
from typing import Callable, Iterator

from prealign.loaders.errors import BadSampleError, IndexFileError, reason_of
from prealign.loaders.policy import BadRecord
from prealign.schemas.checks import int_at_least
from prealign.schemas.errors import ConfigError, PrealignError, SampleError

Location = tuple[int, ...]
Transform = Callable[[dict], dict]
TRANSFORM_ERRORS: tuple[type[BaseException], ...] = (ValueError, KeyError, IndexError, UnicodeError)
"""What a transform may raise on bad data besides a :class:`~prealign.schemas.errors.SampleError` (a
missing key, an index past a list, an unparsable value): counted as ``bad_sample``. Anything else
(``TypeError``, ``AttributeError``, ...) is a bug in the transform and propagates; any other
:class:`~prealign.schemas.errors.PrealignError` (a ``ConfigError``, a remote read or a timeout: not
bad data) and an ``OSError`` always propagate."""


def check_positive_int(name: str, value) -> int:
    """``value`` as an ``int`` when it is an int >= 1 (numpy ints too; never a bool, float or str),
    else :class:`~prealign.schemas.errors.ConfigError` naming ``name``.

    >>> check_positive_int("rows_per_shard", 64)
    64
    """
    return int_at_least(name, value, 1, ConfigError)


def check_folder(name: str, value) -> None:
    """``value`` is a folder path (a ``str`` or an ``os.PathLike``) or None, else
    :class:`~prealign.schemas.errors.ConfigError` naming ``name``."""
    if not isinstance(value, (str, os.PathLike, type(None))):
        raise ConfigError(f"{name}: expected a folder path or None, got {type(value).__name__}")


Skip = BadRecord
"""A scan record that is not a sample (a tar member without extension): a
:class:`~prealign.loaders.policy.BadRecord` without error, ``Skip(reason, where, message)``:
counted, never an error."""


class Source(abc.ABC):
    """Base class of every source. Subclasses implement the four abstract members."""

    transform: Transform | None = None
    sequential: bool = False
    """True when reads are cheap only in stream order (streaming datasets, tar shards): the loader
    then shuffles shard order plus a bounded window instead of a global permutation."""

    @property
    @abc.abstractmethod
    def num_shards(self) -> int:
        """Number of shards :meth:`scan` accepts (``0 .. num_shards-1``)."""

    @abc.abstractmethod
    def scan(self, shard: int) -> Iterator[tuple[Location | None, object]]:
        """``(location, raw sample dict)`` in stream order; ``(location, exception)`` for a sample
        that could not be read; ``(None, Skip)`` for ignored records; a
        :class:`~prealign.loaders.errors.CorruptShardError` as ``(None, error)`` ends the shard."""

    def scan_after(
        self, shard: int, ordinal: int, location: Location
    ) -> Iterator[tuple[Location | None, object]]:
        """:meth:`scan`'s records after its ``ordinal``-th (0-based), the sample at ``location``:
        where a resumed stream goes on. The default scans the shard again and drops the first
        ``ordinal + 1`` records (read and decoded again); a source that can skip without decoding
        overrides it."""
        import itertools

        return itertools.islice(self.scan(shard), ordinal + 1, None)

    @abc.abstractmethod
    def read(self, location: Location) -> dict:
        """The raw sample at ``location`` (called in DataLoader workers)."""

    @abc.abstractmethod
    def describe(self) -> dict:
        """JSON-friendly description of the data (``kind``, shard names, sizes); its ``kind`` is
        part of the loader's resume check (the index digest covers the content)."""

    def _local(self) -> dict:
        """Per-process cache (open files, stream cursors): never pickled to workers, reset after a
        fork."""
        cache = self.__dict__.get("_process_local")
        if cache is None or cache[0] != os.getpid():
            cache = self.__dict__["_process_local"] = (os.getpid(), {})
        return cache[1]

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_process_local", None)
        return state

    def check_locations(self, locations) -> None:
        """Raise :class:`~prealign.loaders.errors.IndexFileError` when int64 ``locations [N, K]``
        (an index's) cannot be this source's (another width, a shard or row out of range): an index
        of other data. The default checks nothing."""

    def shard_of(self, location) -> int | None:
        """The shard a location of this source (checked: :meth:`check_locations`) lies in, when
        its locations name their shard; None when they do not (the default: a source's own
        locations may mean anything)."""
        return None

    def _check_range(self, locations, width: int, limits: dict[int, int]) -> None:
        """``locations`` has ``width`` columns and column ``c`` lies in ``[0, limits[c])``."""
        import numpy as np

        locations = np.asarray(locations)
        if locations.ndim != 2 or locations.shape[1] != width:
            raise IndexFileError(
                f"index locations: expected [N, {width}] for {type(self).__name__}, got "
                f"{list(locations.shape)}; the index was built for another source"
            )
        for col, hi in limits.items():
            if locations.shape[0] and not (
                0 <= locations[:, col].min() and locations[:, col].max() < hi
            ):
                raise IndexFileError(
                    f"index locations column {col}: values in [{locations[:, col].min()}, "
                    f"{locations[:, col].max()}], this source has {hi}; the index was built for "
                    f"other data"
                )

    def where(self, location: Location) -> str:
        """Human-readable name of a sample for error messages."""
        return f"{type(self).__name__}{list(location)}"

    def sample_name(self, raw, location: Location) -> str:
        """The most telling name of a read sample: ``url:key`` for webdataset, else
        :meth:`where`."""
        if isinstance(raw, dict) and "__key__" in raw and "__url__" in raw:
            return f"{raw['__url__']}:{raw['__key__']}"
        return self.where(location)

    def for_indexing(self) -> "Source":
        """The source the index pass transforms with: this one, its transform replaced by the
        transform's ``for_indexing()`` where its class defines one (the same lengths, shapes and
        bad-data verdicts on what the headers show, without decoding what only pixels need: a VLM
        transform's video frames). A wrapper such as
        ``SharedMediaTransform`` is kept as it is (its sharing is the point of it)."""
        make = getattr(
            type(self.transform), "for_indexing", None
        )  # its own (a wrapper's delegation not taken)
        if make is None:
            return self
        import copy

        out = copy.copy(self)
        out.transform = make(self.transform)
        return out

    def apply_transform(self, raw: dict, location: Location) -> dict:
        """``transform(raw)``; any failure becomes a :class:`BadSampleError` naming the sample.

        A :class:`~prealign.schemas.errors.SampleError` raised by the transform keeps its field,
        expected, actual and ``reason`` (:func:`~prealign.loaders.errors.reason_of`, e.g. a
        :class:`~prealign.loaders.media.vlm.MediaError`'s ``corrupt_image``), so the index counts
        skips by cause; one of :data:`TRANSFORM_ERRORS` is reported as ``transform to succeed``
        under ``bad_sample``; anything else (a bug) and any other
        :class:`~prealign.schemas.errors.PrealignError` propagate as they are.
        """
        if self.transform is None:
            return raw
        try:
            out = self.transform(raw)
        except SampleError as exc:  # a typed problem: keep what it says, rename the sample
            raise BadSampleError(
                sample=self.sample_name(raw, location),
                field=exc.field,
                expected=exc.expected,
                actual=exc.actual,
                reason=reason_of(exc),
            ) from exc
        except (
            PrealignError
        ):  # configuration or infrastructure (a remote read, a timeout): never bad data
            raise
        except (
            TRANSFORM_ERRORS
        ) as exc:  # bad data as the transform sees it, handled by the declared policy
            raise BadSampleError(
                sample=self.sample_name(raw, location),
                field=None,
                expected="transform to succeed",
                actual=f"{type(exc).__name__}: {exc}",
            ) from exc
        if not isinstance(out, dict):
            raise BadSampleError(
                sample=self.sample_name(raw, location),
                field=None,
                expected="transform to return a dict",
                actual=type(out).__name__,
            )
        return out

    def read_ahead(self, locations) -> None:
        """A hint: the rows ``locations`` (int64 ``[K, >=3]``, a micro-batch's) are read next, one
        by one (:meth:`load`); a source may read them now, together (none by default)."""

    def load(self, location: Location) -> dict:
        """Read and transform one sample."""
        return self.apply_transform(self.read(location), location)


UNTOKENIZED_HINT = (
    "tokenize the rows first: `ds = ds.map(tokenize, remove_columns=ds.column_names)` with a "
    "function returning "
    "input_ids (and, for SFT, labels: the ids with -100 on the prompt), or HFSource(ds, "
    "transform=tokenize); the recipe is examples/hf_sft.py (docs/quickstart.md)"
)
"""What to do with text rows (prompt / response, chat messages) a loader cannot pack as they are."""


class HFSource(Source):
    """A Hugging Face ``datasets.Dataset`` (map-style) or ``datasets.IterableDataset`` (streaming).

    Map-style: a sample's location is ``(row,)``; shards are ranges of ``rows_per_shard`` rows.
    Streaming: location ``(shard, ordinal)`` over the dataset's own shards (``num_shards``); a
    worker reads each shard forward, keeping the last ``lookback`` raw rows, and opens the shard
    ``lookback`` rows before the row it is asked for (``IterableDataset.skip``: the rows before are
    not made; a node split's, ``split_dataset_by_node``, dropped) the first time and when asked for
    an older row than it keeps; a resumed stream goes on at its row (:meth:`scan_after`).
    DP ranks are split by the planner, not by ``split_dataset_by_node`` (see
    :mod:`prealign.loaders.index.build` for where the node split is used).

    >>> import datasets
    >>> src = HFSource(datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]}))
    >>> src.num_shards, [loc for loc, _ in src.scan(0)], src.load((1,))["input_ids"]
    (1, [(0,), (1,)], [3])
    """

    def __init__(
        self,
        dataset,
        *,
        transform: Transform | None = None,
        rows_per_shard: int = 4096,
        lookback: int = 8192,
        name: str | None = None,
        media_root: str | None = None,
    ):
        import datasets

        check_folder("media_root", media_root)
        if not isinstance(name, (str, type(None))):
            raise ConfigError(f"name: expected a str or None, got {type(name).__name__}")
        self.media_root = None if media_root is None else os.path.realpath(media_root)
        """Where the files an ``images`` / ``videos`` column names by relative path are read from
        (the dataset's folder: :func:`attach_media_files`); ``None``: rows carry their media
        themselves."""
        if self.media_root is not None and not os.path.isdir(self.media_root):
            raise ConfigError(f"media_root: {media_root!r} is not a folder")
        self.dataset = dataset
        self.transform = transform
        self.streaming = isinstance(dataset, datasets.IterableDataset)
        if not self.streaming and not isinstance(dataset, datasets.Dataset):
            raise ConfigError(
                f"dataset: expected a datasets.Dataset or datasets.IterableDataset, got "
                f"{type(dataset).__name__}"
            )
        self.sequential = self.streaming
        self.rows_per_shard = check_positive_int("HFSource.rows_per_shard", rows_per_shard)
        self.lookback = check_positive_int("HFSource.lookback", lookback)
        self.name = name or (getattr(getattr(dataset, "info", None), "dataset_name", None) or "hf")
        columns = getattr(dataset, "column_names", None)
        if transform is None and columns and "input_ids" not in columns:
            raise ConfigError(
                f"dataset: rows with columns {sorted(columns)} and no input_ids, and no transform; "
                f"{UNTOKENIZED_HINT}"
            )

    @property
    def num_shards(self) -> int:
        if self.streaming:
            return int(self.dataset.num_shards)
        return max(1, -(-len(self.dataset) // self.rows_per_shard))

    def scan(self, shard: int):
        return self._scan(shard, 0)

    def scan_after(self, shard: int, ordinal: int, location: Location):
        """:meth:`scan` from its record ``ordinal + 1`` on (a record a row), none before it read:
        a map-style dataset's rows by index; a streaming one's shard through
        ``IterableDataset.skip`` (its Arrow batches dropped whole: no row made of them)."""
        return self._scan(shard, ordinal + 1)

    def _scan(self, shard: int, start: int):
        if self.streaming:
            for j, row in enumerate(self._shard(shard, start), start):
                yield (shard, j), self._media((shard, j), row)
            return
        lo = shard * self.rows_per_shard
        for row in range(lo + start, min(lo + self.rows_per_shard, len(self.dataset))):
            yield (row,), self._media((row,), self.dataset[row])

    def _media(self, location: Location, row):
        """The row with the media files it names attached (with ``media_root``); a problem as the
        row's error."""
        if self.media_root is None or not isinstance(row, dict):
            return row
        try:
            return attach_media_files(row, self.media_root, self.where(location))
        except BadSampleError as exc:
            return exc

    def _shard(self, shard: int, start: int = 0):
        """Rows of one streaming shard from its row ``start`` on (``IterableDataset.skip``: the
        rows before it are not made). ``IterableDataset.iter`` (unlike ``__iter__``) does not
        split shards by DataLoader worker, so any worker can read any shard."""
        part = self.dataset.shard(num_shards=self.dataset.num_shards, index=shard, contiguous=True)
        # (a node split (``split_dataset_by_node``) skips rows before its split: they are dropped)
        drop = start if getattr(self.dataset, "_distributed", None) is not None else 0
        if start and not drop:
            part = part.skip(start)
        rows = (
            {k: v[j] for k, v in batch.items()}
            for batch in part.iter(batch_size=256)
            for j in range(len(next(iter(batch.values()))) if batch else 0)
        )
        yield from itertools.islice(rows, drop, None)

    def read(self, location: Location) -> dict:
        row = self._read_row(location)
        if self.media_root is None:
            return row
        out = self._media(location, row)
        if isinstance(out, BadSampleError):
            raise out
        return out

    def _read_row(self, location: Location) -> dict:
        if not self.streaming:
            return self.dataset[int(location[0])]
        shard, j = int(location[0]), int(location[1])
        cursors = self._local()
        cur = cursors.get(shard)
        if cur is None or (j < cur[1] and j not in cur[2]):
            # (opened ``lookback`` rows before j: rows read in a shuffled order near j are kept)
            start = max(0, j - self.lookback)
            cur = cursors[shard] = [self._shard(shard, start), start, OrderedDict()]
        it, nxt, recent = cur
        while j >= nxt:
            try:
                recent[nxt] = next(it)
            except StopIteration:
                cur[1] = nxt  # (the rows read on the way are kept)
                raise BadSampleError(
                    sample=self.where(location),
                    field=None,
                    expected="the row the index recorded",
                    actual=f"shard {shard} ends before its row {nxt}",
                ) from None
            nxt += 1
            if len(recent) > self.lookback:
                recent.popitem(last=False)
        cur[1] = nxt
        return recent[j]

    def shard_of(self, location) -> int:
        """A streaming location ``(shard, row)`` names its shard; a map-style ``(row,)`` lies in
        the shard of ``rows_per_shard`` rows that holds it."""
        if self.streaming:
            return int(location[0])
        return int(location[0]) // self.rows_per_shard

    def check_locations(self, locations) -> None:
        if self.streaming:  # (shard, row in it): a row from 0 on
            self._check_range(locations, 2, {0: self.num_shards, 1: 1 << 63})
        else:
            self._check_range(locations, 1, {0: len(self.dataset)})

    def where(self, location: Location) -> str:
        return f"{self.name}[{', '.join(map(str, location))}]"

    def describe(self) -> dict:
        n = None if self.streaming else len(self.dataset)
        return {
            "kind": "hf_streaming" if self.streaming else "hf",
            "name": self.name,
            "num_shards": self.num_shards,
            "num_rows": n,
            "fingerprint": getattr(self.dataset, "_fingerprint", None),
        }


MEDIA_COLUMNS = ("images", "videos")
MAX_MEDIA_FILE_BYTES = 1 << 32
"""The largest media file a row may name (4 GiB): a larger one is a bad sample, never read."""


def media_paths(row: dict) -> list[str]:
    """The relative file paths a row's ``images`` / ``videos`` columns name: plain strings,
    ``{"file": path}`` and the strings of a ``{"frames": [...]}`` list.

    >>> videos = [{"file": "v/c.mp4"}, {"frames": ["f0.png", "f1.png"]}]
    >>> media_paths({"images": ["a.jpg"], "videos": videos})
    ['a.jpg', 'v/c.mp4', 'f0.png', 'f1.png']
    """
    out = []
    for column in MEDIA_COLUMNS:
        value = row.get(column)
        for item in value if isinstance(value, list) else ():
            if isinstance(item, dict):
                item = item.get("file", item.get("frames"))
            for name in item if isinstance(item, list) else [item]:
                if isinstance(name, str):
                    out.append(name)
    return out


def attach_media_files(row: dict, root: str, where: str) -> dict:
    """``row`` plus ``{path: file bytes}`` for each path :func:`media_paths` finds, read from
    ``root`` (the transform then finds them as a webdataset sample's members). A path that is
    absolute, leaves ``root`` (``..``, a link out), is missing or is over
    :data:`MAX_MEDIA_FILE_BYTES` is a :class:`BadSampleError`
    (``missing_image``) naming the row and the path; nothing outside ``root`` is read."""
    files = {}
    for name in media_paths(row):
        if name in row or name in files:
            continue
        path = None if "\x00" in name else os.path.realpath(os.path.join(root, name))
        problem = None
        if path is None:  # (no file name holds a NUL byte: os.path raises a ValueError on one)
            problem = "a path with a NUL byte"
        elif os.path.isabs(name) or os.path.commonpath([root, path]) != root:
            problem = "a path outside the media root"
        elif not os.path.isfile(path):
            problem = "no such file"
        elif os.path.getsize(path) > MAX_MEDIA_FILE_BYTES:
            problem = (
                f"{os.path.getsize(path)} bytes, over {MAX_MEDIA_FILE_BYTES} (MAX_MEDIA_FILE_BYTES)"
            )
        if problem:
            raise BadSampleError(
                sample=where,
                field=name,
                reason="missing_image",
                actual=problem,
                expected=f"a file under the media root {root}",
            )
        with open(path, "rb") as f:
            files[name] = f.read()
    return {**row, **files} if files else row
