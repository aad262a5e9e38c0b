"""The one tiling check of an index (a sidecar is a one-shard case of a merged index): every record
of a shard accounted for, so a row removed, repeated or reordered (its counts adjusted) is refused,
never served short.

An index keeps the byte range ``[start, end)`` of each good sample and, for each bad or skipped
record, only its stream position. So the check has two halves:

* :func:`check_tiling` when an index is read (vectorised, a cost per file): the good samples of a
  shard are in order and never overlap, two with no record between them are adjacent, and each
  shard's ``first`` / ``last`` byte is that of its first / last good sample when that is its first /
  last record.
* :func:`bad_regions` and :func:`count_samples` at a shard's first read
  (:class:`~prealign.loaders.index.shard_checks.ShardChecks`): the bytes between two good samples
  with bad records between them (or before the first, or after the last) hold exactly as many
  samples as the index has bad sample records there (one read of those bytes, per shard with bad
  records). A removed good row next to a bad sample leaves one sample more in its gap than the index
  accounts for.
"""

from __future__ import annotations

import io
from typing import Callable

import numpy as np

from prealign.loaders.sources.tar_decode import split_member_name
from prealign.loaders.sources.tar_reader import TarFormatError, iter_members

MAX_REGION = 64 << 20
"""Largest stretch of bad samples read to count them at a shard's first read (bytes); a longer one
(a shard of huge undecodable members) is not counted."""


def check_tiling(
    spans: np.ndarray,
    owner: np.ndarray,
    num_events: np.ndarray,
    events: list[tuple[int, int]],
    bad: Callable[[str], Exception],
    *,
    rows: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Raise ``bad(what)`` unless the good samples tile their shards as the index pass found them.

    ``spans`` int64 ``[N, 3]`` (start, end, checksum) shard after shard; ``owner`` int64 ``[N]`` the
    shard of each; ``num_events`` int64 ``[S]`` records (good and bad) per shard; ``events``
    ``(shard, position)`` of each bad or skipped record, in order (positions checked in range by the
    caller); ``rows`` int64 ``[S]``: the samples of each shard, when known (the count of
    ``owner``'s values: not counted again). Returns ``(first, last)`` int64 ``[S]``: per shard, the
    byte its first good sample starts at when that is its first record, where its last good sample
    ends when that is its last record (else ``-1``), as
    :func:`~prealign.loaders.index.sidecar.expected_of` records them."""
    if not events:  # every record a good sample (a healthy data set): no position looked up
        good = int(num_events.sum())
        is_event = good_at = None
    else:
        first_record = np.concatenate([[0], np.cumsum(num_events)]).astype(np.int64)
        is_event = np.zeros(int(first_record[-1]), bool)
        at = np.asarray(events, np.int64).reshape(-1, 2)
        is_event[first_record[at[:, 0]] + at[:, 1]] = True
        good_at = np.flatnonzero(~is_event)  # each good sample's stream position, in shard order
        good = good_at.size
    if good != spans.shape[0]:
        raise bad(f"{spans.shape[0]} samples, {good} good records")
    same = owner[1:] == owner[:-1]
    if np.any(same & (spans[1:, 0] < spans[:-1, 1])):
        i = int(np.argmax(same & (spans[1:, 0] < spans[:-1, 1])))
        raise bad(
            f"shard {int(owner[i])}: samples overlap or are out of order (bytes "
            f"{int(spans[i + 1, 0])}.."
            f"{int(spans[i + 1, 1])} after {int(spans[i, 0])}..{int(spans[i, 1])}: a repeated or "
            f"reordered row)"
        )
    gap = same & (spans[1:, 0] != spans[:-1, 1])
    if good_at is not None:  # (two good samples with bad records between them may have a gap)
        gap &= good_at[1:] == good_at[:-1] + 1
    if np.any(gap):
        i = int(np.argmax(gap))
        raise bad(
            f"shard {int(owner[i])}: a gap of {int(spans[i + 1, 0] - spans[i, 1])} bytes between "
            f"two samples with no bad or skipped record between them (a removed row)"
        )
    if rows is None:
        rows = (
            np.bincount(owner, minlength=len(num_events))
            if owner.size
            else np.zeros(len(num_events), np.int64)
        )
    lo = np.concatenate([[0], np.cumsum(rows)])[:-1]
    has = rows > 0
    if is_event is None:  # (no bad record: a shard's first and last records are good samples)
        if bool(has.all()):
            ends = spans[lo + rows - 1, 1]
            return spans[lo, 0].astype(np.int64, copy=False), ends.astype(np.int64, copy=False)
        first = np.full(len(num_events), -1, np.int64)
        last = np.full(len(num_events), -1, np.int64)
        first[has], last[has] = spans[lo[has], 0], spans[lo[has] + rows[has] - 1, 1]
        return first, last
    first = np.full(len(num_events), -1, np.int64)
    last = np.full(len(num_events), -1, np.int64)
    head_good, tail_good = (
        has.copy(),
        has.copy(),
    )  # (a shard with samples has records: indices in range)
    head_good[has] = ~is_event[first_record[:-1][has]]
    tail_good[has] = ~is_event[first_record[1:][has] - 1]
    first[head_good] = spans[lo[head_good], 0]
    last[tail_good] = spans[lo[tail_good] + rows[tail_good] - 1, 1]
    return first, last


def bad_regions(spans: np.ndarray, events: list, num_events: int) -> list[tuple[int, int, int]]:
    """``(lo, hi, samples)`` of each stretch of one shard's bad records: the bytes from the end of
    the good sample before them (``0``: none) to the start of the one after (``-1``: none, the end
    of the archive), and the bad samples the index has there. ``events``: ``[position, record]`` of
    the shard's bad and skipped records (:class:`~prealign.loaders.policy.BadRecord`), in order; a
    stretch holding a corrupt-shard record (the archive unreadable past it) is left out. A stretch
    of skipped records alone holds no sample. A cost per bad record."""
    out: list[tuple[int, int, int]] = []
    i = 0
    while i < len(events):
        j, samples, corrupt = i, 0, False
        while True:  # a run of consecutive records that are not good samples
            rec = events[j][1]
            corrupt |= rec.is_shard
            samples += rec.is_error
            if j + 1 < len(events) and events[j + 1][0] == events[j][0] + 1:
                j += 1
            else:
                break
        start, stop = events[i][0], events[j][0]  # positions of the run's first and last record
        before = start - i  # good samples before the run
        if not corrupt:
            lo = int(spans[before - 1, 1]) if before > 0 else 0
            hi = int(spans[before, 0]) if stop + 1 < num_events else -1
            out.append((lo, hi, samples))
        i = j + 1
    return out


def count_samples(data: bytes, base: int) -> int | None:
    """The samples (runs of members sharing a key) in tar bytes ``data`` starting at archive offset
    ``base``, up to their end or an end-of-archive marker; None when they are not a tar stream."""
    keys, last = 0, None
    try:
        for m in iter_members(io.BytesIO(data), base=base, need_end_marker=False):
            split = split_member_name(m.name)
            if split is not None and split[0] != last:
                keys, last = keys + 1, split[0]
    except TarFormatError:
        return None
    return keys
