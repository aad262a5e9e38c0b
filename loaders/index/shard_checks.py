"""A shard checked against its index when it is first read (:class:`ShardChecks`), in the process
that reads it, local or remote, whatever the shard count: a loader's start makes no request and no
``stat`` per shard, on any rank. The whole data set at once on request (:func:`check_all_shards`).

What is checked: the shard exists, has the recorded size (a ``stat``, or one ``HEAD`` for a URL) and
the same first and last 64 KiB (the ``probe``: two reads, one for a shard of up to 128 KiB; by the
definition its index recorded, :data:`~prealign.loaders.index.sidecar.PROBE_VERSION`), and its index
accounts for the bytes before its first and after its last sample (a removed first or last row).
Never bad data: raised under every bad-data policy.
"""

from __future__ import annotations

import os

import numpy as np

from prealign.loaders.errors import ChangedShardError, MissingShardError, StaleIndexError
from prealign.loaders.index.hints import index_hint
from prealign.loaders.index.sidecar import (
    PROBE,
    PROBE_VERSION,
    SIDECAR_THREADS,
    per_shard,
    probe_digest,
    read_probe,
    shard_size_now,
)
from prealign.loaders.index.tiling import MAX_REGION, count_samples
from prealign.loaders.sources import remote


class ShardChecks:
    """A shard checked against its sidecar when it is first read, in the process that reads it (a
    DataLoader worker or the main process), before any of its samples is served: it exists (else
    :class:`MissingShardError`), has the recorded size and the same first and last 64 KiB (its
    probe, by the definition its index recorded; else
    :class:`ChangedShardError`), and its sidecar accounts for the bytes before its first and after
    its last sample (else :class:`StaleIndexError`). Never bad data: raised under every bad-data
    policy. Set on a :class:`~prealign.loaders.sources.webdataset.WebDatasetSource` as
    ``shard_check`` by the index pass; the loader's start costs no read of any shard. ``sizes``
    int64 ``[S]`` (``-2``: shard not checked, e.g. indexed
    in process), ``probes`` ``S16 [S]`` (hex, ``b""``: none), ``first`` / ``last`` int64 ``[S]``
    (see :func:`expected_of`), ``probe_versions`` uint8 ``[S]``: the definition of each probe
    (:data:`~prealign.loaders.index.sidecar.PROBE_VERSION`, 1 for sidecars of version 3 and merged
    indexes up to 4)."""

    UNCHECKED = -2
    takes_open_file = True
    """Called as ``check(source, shard, file)`` with a local shard's file open already (the
    source's first read opens it once, for the check and its samples)."""

    def __init__(self, num_shards: int, expected: dict[int, tuple]):
        """``expected``: ``{shard: (size, probe, first, last[, probe_version])}``
        (:func:`~prealign.loaders.index.sidecar.expected_of`; no version: the current one)."""
        self.sizes = np.full(num_shards, self.UNCHECKED, np.int64)
        self.first = np.full(num_shards, -1, np.int64)
        self.last = np.full(num_shards, -1, np.int64)
        self.probes = np.zeros(
            num_shards, "S16"
        )  # (fixed-width: 1.6 MB at 100k shards, pickled to each worker)
        self.probed = np.ones(num_shards, bool)
        self.probe_versions = np.full(num_shards, PROBE_VERSION, np.uint8)
        for shard, (size, probe, first, last, *version) in expected.items():
            self.sizes[shard], self.probes[shard], self.first[shard], self.last[shard] = (
                size,
                probe,
                first,
                last,
            )
            if version:
                self.probe_versions[shard] = version[0]

    @classmethod
    def of_arrays(cls, sizes, probes, first, last, probe_versions=PROBE_VERSION) -> "ShardChecks":
        """Checks of every shard from the index's arrays as they are (no copy: a merged index's
        columns): ``sizes``, ``first``, ``last`` int64 ``[S]``, ``probes`` ``S16 [S]``,
        ``probe_versions`` uint8 ``[S]`` or one for all."""
        checks = cls.__new__(cls)
        checks.sizes, checks.first, checks.last = sizes, first, last
        checks.probes = np.asarray(probes, "S16")  # (hex text: a list of them, from sidecars)
        checks.probed = np.ones(len(sizes), bool)
        versions = np.asarray(probe_versions, np.uint8)
        checks.probe_versions = versions if versions.ndim else np.full(len(sizes), versions)
        return checks

    @classmethod
    def of_sizes(cls, sizes) -> "ShardChecks":
        """Checks of the sizes alone (a saved
        :class:`~prealign.loaders.index.sample_index.SampleIndex` records
        no probe): ``sizes[s]`` None, not checked; ``-1``, only that the shard exists."""
        checks = cls(len(sizes), {})
        known = np.asarray([s is not None for s in sizes], bool)
        checks.sizes[known] = np.asarray([s for s in sizes if s is not None], np.int64)
        checks.probed[:] = False
        return checks

    def covers(self, shard: int) -> bool:
        """Shard ``shard`` is checked against an index (a shard gone later is then a
        :class:`MissingShardError`)."""
        return int(self.sizes[shard]) != self.UNCHECKED

    def __call__(self, source, shard: int, opened=None) -> bytes | None:
        """Check ``shard`` of ``source``; ``opened``: the shard's local file, opened already (a
        regular file: one read of its recorded size + 1 for a shard of up to twice :data:`PROBE`
        bytes, which gives its size and its probe, else ``fstat`` and the probe's reads), else it is
        looked up by its URL. A source whose shards are all plain local tars
        (:func:`plain_files`) asks no question of the shard's URL. Returns the shard's bytes when
        the check read all of them in one read (its first read's samples are sliced from them: a
        small shard is read once), else None."""
        recorded = int(self.sizes[shard])
        if recorded == self.UNCHECKED:
            return None
        whole = None
        if opened is None:
            size, plain = shard_size_now(source, shard), False
            if size is None:
                raise MissingShardError(
                    source.urls[shard],
                    f"does not exist (it had {recorded} bytes when indexed)",
                    f"check the path, or {self._rebuild(source)} on the data as it is now",
                )
        else:
            fd, plain = opened.fileno(), plain_files(source)
            if plain and 0 <= recorded <= 2 * PROBE and self.probed[shard]:
                whole = os.pread(fd, recorded + 1, 0)  # (no fstat: the read says the size)
                if len(whole) != recorded:
                    whole = None  # (another size: fstat says which)
            size = recorded if whole is not None else os.fstat(fd).st_size
        if not plain and remote.is_sequential(source.urls[shard]):  # (a .tar.gz: its sidecar
            return None  # holds the tar's bytes, not the file's; a changed sample: its crc32)
        if recorded >= 0 and size >= 0 and size != recorded:
            raise ChangedShardError(
                source.urls[shard],
                f"{size} bytes now, {recorded} when indexed",
                f"the shard changed since it was indexed: {self._rebuild(source)}",
            )
        if not self.probed[shard]:
            return None
        version = int(self.probe_versions[shard])
        if opened is None:
            (probe, first, last), whole = read_probe(source, shard, size, version), None
        else:
            probe, first, last, whole = _probe_of_file(fd, size, whole, version)
        if self.probes[shard] != probe.encode():
            raise ChangedShardError(
                source.urls[shard],
                "its first or last 64 KiB differ from when it was indexed",
                f"the shard changed since it was indexed: {self._rebuild(source)}",
            )
        _check_head(source, shard, int(self.first[shard]), first)
        _check_tail(source, shard, int(self.last[shard]), size, last)
        if self.regions:
            for lo, hi, samples in self.regions.get(shard, ()):
                _check_region(source, shard, lo, size if hi < 0 else hi, samples, size)
        return whole

    def _rebuild(self, source) -> str:
        """What rebuilds the index (built only when an error is raised: the command names every
        shard)."""
        if not self.probed.any():  # sizes alone: a saved SampleIndex
            return (
                "rebuild the saved index: `build_index(source, schema).save(path)` on the data "
                "as it is now"
            )
        return index_hint(source)

    regions: dict = {}
    """``{shard: [(lo, hi, samples), ...]}``: the stretches of bad records of each shard with some
    (:func:`~prealign.loaders.index.tiling.bad_regions`), their samples counted at the shard's first
    read."""


def plain_files(source) -> bool:
    """Every shard of ``source`` is a plain local tar, read at any byte (its ``local_only``, found
    once when it was built, and no ``.tar.gz``): its first reads ask nothing of each shard's URL."""
    return bool(getattr(source, "local_only", False)) and not getattr(source, "stream_only", True)


def _probe_of_file(
    fd: int, size: int, whole: bytes | None = None, version: int = PROBE_VERSION
) -> tuple[str, bytes, bytes, bytes | None]:
    """``read_probe`` of an open local shard of ``size`` bytes (file descriptor ``fd``: the same
    digest of the same spans, by probe definition ``version``), and the shard's bytes when they
    were read whole (else None): one read when the first and last :data:`PROBE` bytes overlap or
    touch, else two; none when ``whole``, its ``size`` bytes, were read already. Version 2 hashes
    a shard read whole once (version 1: its first and last :data:`PROBE` bytes, overlapping)."""
    if size <= 2 * PROBE:
        data = os.pread(fd, size, 0) if whole is None else whole
        first, last = data[:PROBE], data[max(size - PROBE, 0) :]  # (up to PROBE bytes: no copy)
        whole = data if len(data) == size else None  # (changed under the fstat: the probe says so)
    else:
        first, last = os.pread(fd, PROBE, 0), os.pread(fd, PROBE, size - PROBE)
    return probe_digest(first, last, size, version), first, last, whole


def check_all_shards(source, shards=None) -> int:
    """Check ``shards`` (default: all) of ``source`` against their sidecars as their first read does
    (:class:`ShardChecks`; on up to 8 threads when the file system is slow, :func:`per_shard`): the
    whole data set's check at once (``PackedLoader.verify_shards``). Returns the number of shards
    checked; raises the first failure in shard order."""
    check = getattr(source, "shard_check", None)
    if check is None:
        return 0
    shards = list(range(source.num_shards)) if shards is None else list(shards)
    per_shard(source, lambda s: check(source, s), shards, threads=SIDECAR_THREADS)
    return sum(int(check.sizes[s]) != ShardChecks.UNCHECKED for s in shards)


_NO_SAMPLE = frozenset(b"5gxLK")
"""Tar entries that hold no sample: a folder, a pax global or per-entry header, a GNU long name or
link."""


_ZERO_BLOCK = bytes(512)


def _entries_without_samples(data: bytes, at: int, stop: int) -> int | None:
    """Walk the tar headers in ``data`` from ``at``: skip entries that hold no sample
    (:data:`_NO_SAMPLE`, their data included) and stop at ``stop``, at a zero block (the end of the
    archive) or at the end of ``data``. Returns where the walk stopped, or None when it met a member
    that is a file (a sample's)."""
    while at < stop and at + 512 <= len(data):
        head = data[at : at + 512]
        if head == _ZERO_BLOCK:
            return at
        if head[156] not in _NO_SAMPLE:
            return None
        try:
            size = int(head[124:136].split(b"\0")[0].strip() or b"0", 8)
        except ValueError:
            return None
        at += 512 + -(-size // 512) * 512
    return at


def _check_head(source, shard: int, start: int, first: bytes) -> None:
    """When a sidecar's first record is a good sample starting at byte ``start`` (``-1``: it is
    not; ``0``: nothing precedes it), only entries that hold no sample (folders, pax and GNU name
    headers) may precede it: a removed first row leaves a sample's member there. Read from
    ``first`` (the probe's first ``PROBE`` bytes: no read of its own; past them, not checked)."""
    if start <= 0 or start > len(first) or start % 512:
        return
    if _entries_without_samples(first, 0, start) != start:
        raise StaleIndexError(
            source.urls[shard],
            f"sidecar index does not account for the shard: bytes 0..{start} before its first "
            f"sample hold a member, not only folder or header entries (a removed row?)",
            "re-run `prealign index` on it",
        )


def _check_tail(source, shard: int, lo: int, size: int, last: bytes) -> None:
    """When a sidecar's last record is a good sample ending at byte ``lo`` (``-1``: it is not), only
    entries that hold no sample, then the end of the archive (a zero block, or the file's end) may
    follow it: a removed last row leaves a sample's tar header there instead. Read from ``last``
    (the probe's last ``PROBE`` bytes: no read of its own), or for a local shard whose end lies
    before them one small read (a remote one: not checked). Not called for a shard read only front
    to back (:class:`ShardChecks` returns before)."""
    if lo < 0 or size < 0:
        return
    end = len(last)
    if end == min(PROBE, size) and lo >= size - end:
        tail, at = last, lo - (size - end)  # (walked where it lies: no copy)
    elif remote.is_remote(source.urls[shard]):
        return
    else:
        with open(remote.local_path(source.urls[shard]), "rb") as f:
            f.seek(lo)
            tail, at = f.read(PROBE), 0
            end = len(tail)
    stopped = _entries_without_samples(tail, at, end)
    stopped, held = None if stopped is None else stopped - at, end - at
    ended = stopped is not None and (stopped + 512 <= held or lo + stopped >= size)
    if stopped is None or not ended and held == size - lo:
        raise StaleIndexError(
            source.urls[shard],
            f"sidecar index does not account for the shard: the entries after its last "
            f"sample (byte {lo}) hold a member, not only folder entries and the end of the "
            f"archive (a removed row?)",
            "re-run `prealign index` on it",
        )


def _check_region(source, shard: int, lo: int, hi: int, samples: int, size: int) -> None:
    """The bytes ``[lo, hi)`` of a shard, where its index has ``samples`` bad samples (and maybe
    skipped members) between two good ones, hold that many samples
    (:func:`~prealign.loaders.index.tiling.count_samples`): one read. A removed good row next to a
    bad sample leaves one more. Not checked for a shard read only front to
    back, a stretch over :data:`~prealign.loaders.index.tiling.MAX_REGION` bytes, or bytes past
    ``size``."""
    url = source.urls[shard]
    if remote.is_sequential(url) or size < 0 or not 0 <= lo <= hi <= size or hi - lo > MAX_REGION:
        return
    if remote.is_remote(url):
        data = remote.read_range(url, lo, hi, source.remote) if hi > lo else b""
    else:
        with open(remote.local_path(url), "rb") as f:
            f.seek(lo)
            data = f.read(hi - lo)
    found = count_samples(data, lo)
    if found != samples:
        raise StaleIndexError(
            url,
            f"index does not account for the shard: bytes {lo}..{hi}, where it records "
            f"{samples} bad sample(s), hold {'no tar members' if found is None else found} "
            f"(a removed row?)",
            "re-run `prealign index` on it",
        )
