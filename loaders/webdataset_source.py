"""webdataset tar shards as a :class:`~prealign.loaders.sources.Source`.

A sample is the run of consecutive members sharing a key (``0001.input_ids.npy``, ``0001.json``
-> key ``0001``), decoded safely by :mod:`prealign.loaders.tar_decode` (never unpickled). Indexing walks
each tar once and records each sample's byte range, so a worker reads one sample with one
``seek`` + ``read``. Remote shards (``http(s)://``, ``s3://``, ``gs://``) are read by byte range, never
copied whole; ``pipe:`` and ``.tar.gz`` shards front to back (:mod:`prealign.loaders.remote`). Sidecar
indexes (``prealign index``, :mod:`prealign.loaders.sidecar`) beside the shards, or in ``index_dir``, are
found and used by themselves. A location is ``(shard, start, end, checksum)``: a read whose members
no longer have the checksum recorded at indexing raises :class:`SourceChangedError`.

Sample dict: ``{"__key__": str, "__url__": str, "__shard__": int, <extension>: decoded value}``.
Without a ``transform``, every ``<name>.npy`` member becomes a tensor field ``<name>``.
"""
from __future__ import annotations

import io
import os
import re
from collections import OrderedDict
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from . import remote as _remote
from .errors import CorruptShardError, MissingMemberError, SourceChangedError
from .sidecar import sample_checksum
from .sources import Location, Skip, Source, Transform
from .tar_decode import decode_member, split_member_name
from .tar_reader import TarFormatError, iter_members

_REMOTE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def expand_urls(urls: str | Sequence[str]) -> list[str]:
    """Brace-expanded list of shard URLs/paths (``"shard-{000..002}.tar"`` -> three names).

    >>> expand_urls("s-{0..2}.tar")
    ['s-0.tar', 's-1.tar', 's-2.tar']
    """
    import braceexpand

    items = [urls] if isinstance(urls, str) else list(urls)
    out = [u for item in items for u in braceexpand.braceexpand(str(item))]
    if not out:
        raise CorruptShardError("<none>", 0, "no shard URLs given")
    return out


def numpy_fields(sample: dict) -> dict:
    """Default transform: every ``<name>.npy`` member -> tensor ``<name>``; other keys kept as they are."""
    out = {}
    for k, v in sample.items():
        if isinstance(v, np.ndarray) and k.endswith(".npy"):
            out[k[:-4]] = torch.from_numpy(v)
        else:
            out[k] = v
    return out


class WebDatasetSource(Source):
    """webdataset shards (local paths, ``file://`` or remote URLs).

    ``required``: member extensions every sample must have (``("input_ids.npy",)``); a sample
    without one is a :class:`~prealign.loaders.errors.MissingMemberError` (handled by the loader's bad-data
    policy). ``image``: ``"pil"`` or ``"bytes"``. ``decoders``: extra ``{extension: bytes -> value}``
    decoders (pickle-like extensions stay refused).
    """

    sequential = True

    def __init__(self, urls: str | Sequence[str], *, transform: Transform | None = numpy_fields,
                 required: Sequence[str] = (), image: str = "pil",
                 decoders: Mapping[str, Callable[[bytes], object]] | None = None, cache_dir: str | None = None,
                 cache_limit: int | None = None, index_dir: str | None = None, sidecars: bool = True,
                 remote: "_remote.RemoteOptions | None" = None, max_open_files: int = 16):
        if image not in ("pil", "bytes"):
            raise ValueError(f"image: expected 'pil' or 'bytes', got {image!r}")
        self.urls = expand_urls(urls)
        self.transform = transform
        self.required = tuple(required)
        self.image = image
        self.decoders = dict(decoders or {})
        self.cache_dir = cache_dir
        self.index_dir, self.sidecars, self.max_open_files = index_dir, bool(sidecars), max(int(max_open_files), 1)
        """Sidecars: looked up beside each shard (or in ``index_dir``) when ``sidecars``."""
        if remote is None:
            limit = {} if cache_limit is None else {"cache_limit": int(cache_limit)}
            remote = _remote.RemoteOptions(cache_dir=cache_dir, **limit)
        self.remote = remote

    # ---- shards ---------------------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return len(self.urls)

    @property
    def stream_only(self) -> bool:
        """True when some shard can only be read front to back (``pipe:``, ``.tar.gz``): the loader then
        shuffles micro-batches within a bounded window of steps, not over the whole epoch."""
        return any(_remote.is_sequential(u) for u in self.urls)

    # ---- scanning -------------------------------------------------------------------------------
    def scan(self, shard: int):
        url = self.urls[shard]
        try:
            f = _remote.open_stream(url, self.remote)
        except (CorruptShardError, _remote.RemoteReadError) as exc:
            yield None, exc if isinstance(exc, CorruptShardError) else CorruptShardError(url, 0, str(exc))
            return
        except OSError as exc:
            yield None, CorruptShardError(url, 0, f"{type(exc).__name__}: {exc}")
            return
        with f:
            key, start, members = None, 0, []
            try:
                for m in iter_members(f):
                    split = split_member_name(m.name)
                    if split is None:
                        yield None, Skip("ignored_member", f"{url}:{m.name}", "tar member without an extension")
                        continue
                    if split[0] != key:
                        if members:
                            yield (shard, start, m.offset, sample_checksum(members)), self._sample(shard, key, members)
                        key, start, members = split[0], m.offset, []
                    members.append((split[1], m.data))
                    end = m.end
            except (TarFormatError, OSError, EOFError, _remote.RemoteReadError) as exc:
                lost = f"; sample {key!r} lost with the rest of the shard" if members else ""
                yield None, CorruptShardError(url, getattr(exc, "offset", 0), f"{exc}{lost}")
                return
            if members:
                yield (shard, start, end, sample_checksum(members)), self._sample(shard, key, members)

    def _sample(self, shard: int, key: str, members: list[tuple[str, bytes]]):
        """Decoded sample dict, or the exception that makes it a bad sample."""
        url = self.urls[shard]
        where = f"{url}:{key}"
        try:
            sample: dict = {"__key__": key, "__url__": url, "__shard__": shard}
            for ext, data in members:
                if ext in sample:
                    raise MissingMemberError(sample=where, field=ext, expected="one member per extension",
                                             actual="a duplicate member")
                sample[ext] = decode_member(where, ext, data, image=self.image, extra=self.decoders)
            missing = [r for r in self.required if r not in sample]
            if missing:
                raise MissingMemberError(sample=where, field=missing[0], expected=f"members {list(self.required)}",
                                         actual=f"members {sorted(k for k in sample if not k.startswith('__'))}")
            return sample
        except Exception as exc:  # decoding errors are typed; anything else is reported as such
            return exc

    # ---- random access --------------------------------------------------------------------------
    def read(self, location: Location) -> dict:
        shard, start, end = (int(x) for x in location[:3])
        buf = self._bytes(shard, start, end)
        try:
            members = [(*split_member_name(m.name), m.data)
                       for m in iter_members(io.BytesIO(buf), base=start, need_end_marker=False)
                       if split_member_name(m.name) is not None]
        except TarFormatError as exc:
            raise SourceChangedError(f"{self.urls[shard]} bytes {start}..{end}: {exc}; the shard changed "
                                     f"since indexing") from exc
        keys = {k for k, _, _ in members}
        if len(keys) != 1:
            raise SourceChangedError(f"{self.urls[shard]} bytes {start}..{end}: keys {sorted(keys)} instead of one "
                                     f"sample; the shard changed since indexing")
        key_seen = keys.pop()
        members = [(ext, data) for _, ext, data in members]
        if len(location) > 3 and sample_checksum(members) != int(location[3]):
            raise SourceChangedError(f"{self.urls[shard]} bytes {start}..{end} (sample {key_seen!r}): checksum "
                                     f"{sample_checksum(members)}, {int(location[3])} at indexing; the shard changed "
                                     f"since indexing")
        sample = self._sample(shard, key_seen, members)
        if isinstance(sample, Exception):
            raise sample
        return sample

    def _bytes(self, shard: int, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a shard: a local ``seek`` + ``read`` (at most ``max_open_files`` files
        open per process, least recently used closed), a remote range read, or a slice of a sequential
        shard read whole (kept for ``remote.stream_shards`` shards)."""
        url = self.urls[shard]
        local = self._local()
        if _remote.is_sequential(url):
            streams = local.setdefault("streams", OrderedDict())
            if shard not in streams:
                streams[shard] = _remote.read_whole(url, self.remote)
                while len(streams) > self.remote.stream_shards:
                    streams.popitem(last=False)
            streams.move_to_end(shard)
            return streams[shard][start:end]
        if _remote.is_remote(url):
            return _remote.read_range(url, start, end, self.remote)
        files = local.setdefault("files", OrderedDict())
        f = files.get(shard)
        if f is None:
            f = files[shard] = open(url[len("file://"):] if url.startswith("file://") else url, "rb")
            while len(files) > self.max_open_files:
                files.popitem(last=False)[1].close()
        files.move_to_end(shard)
        f.seek(start)
        return f.read(end - start)

    def where(self, location: Location) -> str:
        return f"{self.urls[int(location[0])]}@{int(location[1])}"

    def describe(self) -> dict:
        sizes = []
        for u in self.urls:
            p = u[len("file://"):] if u.startswith("file://") else u
            local = not _REMOTE.match(u) or u.startswith("file://")
            sizes.append(os.path.getsize(p) if local and os.path.exists(p) else None)
        return {"kind": "webdataset", "urls": self.urls, "sizes": sizes, "required": list(self.required)}
