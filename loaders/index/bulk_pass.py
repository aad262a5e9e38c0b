"""The header pass of pre-tokenized text shards at machine speed: blocks of a shard walked in
bulk (:func:`~prealign.loaders.sources.tar_index.walk`), the common sample judged in arrays.

    8 MiB block ─walk─► members ─group by key─► samples
      one input_ids.npy, a known signature, ids >= 0 ──► npy header (cached), ids' max and
      │                                                  min (one reduction a block), crc32
      anything else (more members, a new signature, a bad header, a duplicate key, ...)
      └──► ``ShardPass.sample``, the reference, on that sample's members

Each sample gets exactly what ``ShardPass.sample`` would give it (its location, length,
signature, bounds, events), in stream order; a shard the bulk walker does not parse exactly
(links, directories, corruption, truncation:
:class:`~prealign.loaders.sources.tar_index.Unhandled`) is read again by the reference tar
reader (``header_index_shard`` does it).
"""

from __future__ import annotations

import zlib

import numpy as np

from prealign.loaders.index.sample_checks import BOUNDED, NO_VALUES
from prealign.loaders.policy import BadRecord
from prealign.loaders.sources.npy import NpyFormatError, parse_npy_header
from prealign.loaders.sources.tar_decode import split_member_name
from prealign.loaders.sources.tar_index import walk

BLOCK_BYTES = 8 << 20
"""Bytes read at a time (a larger member is read whole: one sample's members are in memory)."""
IDS = "input_ids.npy"
_IDS_CRC = zlib.crc32(IDS.encode() + b"\0")
_MAGIC = b"\x93NUMPY\x01\x00"
_BIG = int(np.iinfo(np.int64).max)


def bulk_text_pass(records, f) -> None:
    """Walk the shard ``f`` (a :class:`~prealign.loaders.index.sidecar.Fingerprint` at its
    start) into ``records`` (a ``ShardPass`` of the text rule). Raises
    :class:`~prealign.loaders.sources.tar_index.Unhandled` for a shard the reference must read
    instead."""
    state = _State(records)
    buf, base, want = bytearray(), 0, BLOCK_BYTES  # (grown and cut in place: no copy)
    while True:
        chunk = f.read(want)
        eof = len(chunk) < want
        buf += chunk
        del chunk
        walked = walk(buf, base, eof=eof)
        stop = state.take(buf, base, walked)
        if walked.ended:
            return
        del buf[: stop - base]
        base = stop
        want = max(BLOCK_BYTES, walked.need - base - len(buf))


class _State:
    """What lasts from one block to the next: the keys seen."""

    def __init__(self, records):
        self.records = records
        self.seen: set[str] = set()
        self.simple = all(r == IDS for r in records.source.required)

    def take(self, buf: bytearray, base: int, w) -> int:
        """Judge the samples of block ``w`` that end in it (all of them once the archive ended);
        returns the archive offset from which the rest (the last sample, which may go on) is to
        be walked again."""
        splits = [split_name(n) for n in w.names]
        m = stop = len(splits)
        if not w.ended:  # the last sample may go on in the next block: walked again with it
            named = [j for j in range(m) if splits[j] is not None]
            if named:
                k = len(named) - 1
                while k > 0 and splits[named[k - 1]][0] == splits[named[-1]][0]:
                    k -= 1
                stop = named[k]
        with memoryview(buf) as mv:
            fast = self._fast(mv, base, w, splits, stop) if self.simple and stop else None
            lo = 0
            if fast is not None:  # a new signature's first sample (the reference's), then arrays
                by_sig, sig = self.records.by_sig, fast["sig"]
                new = next(
                    (k for k in range(stop) if sig[k] is not None and sig[k] not in by_sig), None
                )
                if (
                    new is not None
                    and new + 1 < stop
                    and splits[new + 1] is not None
                    and splits[new + 1][0] != splits[new][0]
                ):
                    self._emit(mv, base, w, splits, 0, new + 1, fast)
                    lo = new + 1
            if lo < stop and not (
                fast is not None and self._all_fast(mv, base, w, splits, lo, stop, fast)
            ):
                self._emit(mv, base, w, splits, lo, stop, fast)
        return int(w.offset[stop]) if stop < m else w.done

    def _fast(self, mv: memoryview, base: int, w, splits: list, stop: int) -> dict:
        """Of the members ``[0, stop)``: ``ok`` bool, ``tokens``, ``max_id`` and ``min_id`` int64,
        ``sig`` (a list), ``ok`` where the member is an ``input_ids.npy`` whose sample may be
        judged here alone (a version-1 npy header of a 1-D integer array, its data whole, at
        least one id, none negative)."""
        ext = np.asarray([s is not None and s[1] == IDS for s in splits[:stop]], bool)
        at, size = w.data_at[:stop] - base, w.size[:stop]
        ok = ext & (size >= 10)
        raw = np.frombuffer(mv, np.uint8)
        head = np.zeros((stop, 10), np.uint8)
        head[ok] = raw[at[ok][:, None] + np.arange(10)]
        ok &= (head[:, :8] == np.frombuffer(_MAGIC, np.uint8)).all(1)
        hlen = 10 + head[:, 8].astype(np.int64) + 256 * head[:, 9].astype(np.int64)
        ok &= hlen <= size
        parsed = [
            _header(mv[a : a + n].tobytes()) if good else None
            for a, n, good in zip(at.tolist(), hlen.tolist(), ok.tolist())
        ]
        ok &= np.asarray([p is not None for p in parsed], bool)
        tokens = np.asarray([p[0] if p else 0 for p in parsed], np.int64)
        first = at + np.asarray([p[2] if p else 0 for p in parsed], np.int64)  # the first id
        item = np.asarray([p[3].itemsize if p else 1 for p in parsed], np.int64)
        ok &= (tokens > 0) & (first - at + tokens * item <= size) & (first % item == 0)
        max_id, min_id = np.zeros(stop, np.int64), np.zeros(stop, np.int64)
        for dtype in {p[3] for p in parsed if p}:
            same = np.asarray([p is not None and p[3] == dtype for p in parsed], bool)
            sel = np.flatnonzero(ok & same)
            if not len(sel):
                continue
            lo_at = first[sel] // dtype.itemsize
            hi_at = lo_at + tokens[sel]
            edges = np.stack([lo_at, hi_at], 1).ravel()[:-1]
            ids = np.frombuffer(mv, dtype, count=int(hi_at[-1]))
            max_id[sel] = np.maximum.reduceat(ids, edges)[::2]
            min_id[sel] = np.minimum.reduceat(ids, edges)[::2]
            del ids
        ok &= min_id >= 0
        return {
            "ok": ok,
            "tokens": tokens,
            "sig": [p[1] if p else None for p in parsed],
            "max_id": max_id,
            "min_id": min_id,
        }

    def _all_fast(
        self, mv: memoryview, base: int, w, splits: list, lo: int, hi: int, fast: dict
    ) -> bool:
        """Judge the members ``[lo, hi)`` in arrays when each is a sample of its own judged here,
        of a signature seen before and a key not; else False (nothing done)."""
        rec, seen = self.records, self.seen
        if not fast["ok"][lo:hi].all():
            return False
        keys = [s[0] for s in splits[lo:hi]]
        known = set(keys)
        sigs = fast["sig"][lo:hi]
        if (
            len(known) != hi - lo
            or not known.isdisjoint(seen)
            or not set(sigs) <= rec.by_sig.keys()
        ):
            return False
        ends = np.empty(hi - lo, np.int64)
        ends[:-1] = w.offset[lo + 1 : hi]
        ends[-1] = w.offset[hi] if hi < len(splits) else w.end[hi - 1]
        at = (w.data_at[lo:hi] - base).tolist()
        crcs = [zlib.crc32(mv[a : a + n], _IDS_CRC) for a, n in zip(at, w.size[lo:hi].tolist())]
        locations = np.stack(
            [
                np.full(hi - lo, rec.shard, np.int64),
                w.offset[lo:hi],
                ends,
                np.asarray(crcs, np.int64),
            ],
            1,
        )
        by_sig = rec.by_sig
        rec.add_rows(
            locations.tolist(),
            fast["tokens"][lo:hi].tolist(),
            [by_sig[s] for s in sigs],
            _bounds(fast["max_id"][lo:hi], fast["min_id"][lo:hi]),
        )
        seen.update(keys)
        return True

    def _emit(
        self, mv: memoryview, base: int, w, splits: list, lo: int, stop: int, fast: dict | None
    ) -> None:
        """The members ``[lo, stop)`` grouped into samples as the reference groups them; each
        sample judged here when ``fast`` says it may be, else by ``ShardPass.sample``."""
        rec, seen = self.records, self.seen
        out = _Samples(rec, seen, mv, base, w, splits, stop, fast)
        offset = out.offset
        stop_at = offset[stop] if stop < len(splits) else None
        key, first, last, count = None, 0, 0, 0
        for j in range(lo, stop):
            split = splits[j]
            if split is None:
                out.flush()
                rec.events.append(
                    BadRecord(
                        "ignored_member",
                        f"{rec.url}:{w.names[j]}",
                        "tar file member without an extension",
                    )
                )
                continue
            if split[0] != key:
                if count:
                    out.close(key, first, last, offset[j], count)
                    seen.add(key)
                key, first, count = split[0], j, 0
            last = j
            count += 1
        if count:
            out.close(key, first, last, int(w.end[last]) if stop_at is None else stop_at, count)
            seen.add(key)
        out.flush()


class _Samples:
    """The samples of one stretch of a block as :meth:`_State._emit` closes them: one judged in
    arrays (a single ``input_ids.npy`` ``fast`` passed, of a known signature and a new key) waits
    in ``rows`` / ``locations`` to be appended with its neighbours (:meth:`flush`); any other is
    judged by ``ShardPass.sample`` (the rows waiting appended first: records keep stream order)."""

    def __init__(
        self,
        rec,
        seen: set,
        mv: memoryview,
        base: int,
        w,
        splits: list,
        stop: int,
        fast: dict | None,
    ):
        self.rec, self.seen, self.mv, self.base = rec, seen, mv, base
        self.splits, self.fast = splits, fast
        self.data_at, self.size = w.data_at.tolist(), w.size.tolist()
        self.offset = w.offset.tolist()
        self.ok = fast["ok"].tolist() if fast is not None else [False] * stop
        self.rows: list[int] = []
        self.locations: list = []

    def flush(self) -> None:
        rows, fast = self.rows, self.fast
        if rows:
            r = np.asarray(rows, np.int64)
            self.rec.add_rows(
                self.locations[:],
                fast["tokens"][r].tolist(),
                [self.rec.by_sig[fast["sig"][j]] for j in rows],
                _bounds(fast["max_id"][r], fast["min_id"][r]),
            )
            rows.clear(), self.locations.clear()

    def close(self, key: str, first: int, last: int, end: int, count: int) -> None:
        """The sample of members ``[first, last]`` (``count`` named), ending at byte ``end``."""
        duplicate = key in self.seen
        data_at, size, base = self.data_at, self.size, self.base
        if (
            count == 1
            and self.ok[first]
            and not duplicate
            and self.fast["sig"][first] in self.rec.by_sig
        ):
            a = data_at[first] - base
            crc = zlib.crc32(self.mv[a : a + size[first]], _IDS_CRC)
            self.locations.append([self.rec.shard, self.offset[first], end, crc])
            self.rows.append(first)
            return
        self.flush()
        splits, mv = self.splits, self.mv
        members = [
            (splits[j][1], mv[data_at[j] - base : data_at[j] - base + size[j]].tobytes(), "file")
            for j in range(first, last + 1)
            if splits[j] is not None
        ]
        self.rec.sample(key, self.offset[first], end, members, duplicate)


_NONE = np.tile(NO_VALUES, (len(BOUNDED), 1))


def _bounds(max_id: np.ndarray, min_id: np.ndarray) -> np.ndarray:
    """``int64 [k, 3, 4]``: ``value_bounds`` of samples of ``input_ids`` alone, none negative."""
    out = np.tile(_NONE, (len(max_id), 1, 1))
    out[:, 0, 0], out[:, 0, 1] = max_id, min_id
    return out


_HEADERS: dict[bytes, tuple | None] = {}


def _header(raw: bytes) -> tuple | None:
    """``(tokens, signature, data offset, dtype)`` of an ``input_ids.npy`` header the text rule
    reads as ``[L]`` of integers (int8..int64, uint8..uint32), else None (left to the
    reference). Cached."""
    hit = _HEADERS.get(raw, False)
    if hit is not False:
        return hit
    try:
        head = parse_npy_header(raw, member=IDS)
    except NpyFormatError:
        out = None
    else:
        dtype = head.dtype
        one_d = (
            len(head.shape) == 1
            and dtype.kind in "iu"
            and not (dtype.kind == "u" and dtype.itemsize == 8)
        )
        sig = ((("input_ids", dtype.str, "L"),), ())
        out = (head.shape[0], sig, head.offset, dtype) if one_d else None
    if len(_HEADERS) >= 4096:
        _HEADERS.clear()
    _HEADERS[raw] = out
    return out


def split_name(name: str) -> tuple[str, str] | None:
    """:func:`~prealign.loaders.sources.tar_decode.split_member_name` without a regular
    expression (the same answer; a name with a newline is left to it).

    >>> split_name("a/0001.input_ids.npy"), split_name("README"), split_name("a/.x.npy")
    (('a/0001', 'input_ids.npy'), None, None)
    """
    if "\n" in name:
        return split_member_name(name)
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash or dot == len(name) - 1:
        return None
    return name[:dot], name[dot + 1 :].lower()
