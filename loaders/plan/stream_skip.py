"""What a stream's epoch has consumed, per shard, so that readers of another topology skip it
without reading it again (an elastic resume of :class:`~prealign.loaders.StreamingPackedLoader`).

A :class:`Skip` is learned from every old reader's cursor (:func:`fold`), never by replaying:

- ``done``: shards every record of which was read (served, or counted as bad data): never opened;
- ``partial``: shard -> ``(ordinal, location)`` of the last record read in it: the shard is entered
  right after that record (a file seek, an HTTP ``Range`` read);
- ``extra``: sorted int64 stream ids read past their shard's ``partial`` record (only when old
  readers split the shards by sample: each kept every ``G``-th record, and they stopped at other
  records);
- ``returns``: ``[id, aligned size, *location]`` of the samples read but not served (the old
  readers' buffers and unserved micro-batches): read back by location, dealt ``returns[g::G]`` to
  the new readers.

Readers that resume under a :class:`Skip` split ``remaining(order)`` (the epoch's shard order
without ``done``) as any epoch's shards, and count a split by sample over the records not skipped.
So a fold of a fold is a fold: the skip of the next resize is learned in the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import numpy as np

from prealign.loaders.errors import ResumeError
from prealign.schemas.errors import PrealignError


def _ordinal(sid: int) -> int:
    return int(sid) & 0xFFFFFFFF


def _shard(sid: int) -> int:
    return int(sid) >> 32


INT64 = 1 << 63
"""Ints of a state lie in ``[-INT64, INT64)``: they become int64 (numpy, torch, seeks)."""


def int_list(value, low: int = 0, high: int = INT64) -> bool:
    """``value`` is a list of ints (not bools) in ``[low, high)`` (a state's ints: int64).

    >>> int_list([0, 3]), int_list([True]), int_list([-1]), int_list(3)
    (True, False, False, False)
    """
    return isinstance(value, list) and all(
        isinstance(x, int) and not isinstance(x, bool) and low <= x < high for x in value
    )


@dataclass(frozen=True)
class Skip:
    """What earlier segments of an epoch consumed (see the module docstring); JSON-friendly by
    :meth:`to_dict`."""

    done: frozenset = frozenset()
    partial: dict = field(default_factory=dict)
    """shard -> ``(ordinal, location tuple)`` of the last record consumed in it"""
    extra: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    returns: tuple = ()

    def remaining(self, order: list[int]) -> list[int]:
        """``order`` without the shards consumed whole."""
        return [s for s in order if s not in self.done] if self.done else list(order)

    def extra_in(self, shard: int) -> frozenset:
        """Ordinals of ``shard`` consumed past its ``partial`` record."""
        lo, hi = np.searchsorted(self.extra, [shard << 32, (shard + 1) << 32])
        return frozenset((self.extra[lo:hi] & 0xFFFFFFFF).tolist())

    def returns_of(self, g: int, readers: int) -> list:
        """Reader ``g`` of ``readers``'s share of the returned samples (sorted by id)."""
        return list(self.returns[g::readers])

    def to_dict(self) -> dict:
        return {
            "done": sorted(int(s) for s in self.done),
            "partial": [
                [int(s), int(o), [int(x) for x in loc]]
                for s, (o, loc) in sorted(self.partial.items())
            ],
            "extra": [int(i) for i in self.extra],
            "returns": [list(map(int, r)) for r in self.returns],
        }

    def check_locations(self, source) -> None:
        """A :class:`ResumeError` naming the key when a ``partial`` or ``returns`` location cannot
        be one of ``source``'s (:func:`check_own`) or lies in another shard than the one it is
        kept for (:func:`check_in_shards`)."""
        for key, locs, shards in (
            ("partial", [loc for _, loc in self.partial.values()], list(self.partial)),
            ("returns", [r[2:] for r in self.returns], [_shard(r[0]) for r in self.returns]),
        ):
            check_own(source, locs, f"stream.skip.{key}")
            check_in_shards(
                source, locs, shards, f"stream.skip.{key}", " (not another shard's or component's)"
            )

    @classmethod
    def from_dict(cls, d, num_shards: int) -> "Skip":
        """Parse (strictly: a :class:`ResumeError` naming the key) a :meth:`to_dict`."""

        def bad(key: str, why: str):
            raise ResumeError(f"loader state: key 'stream.skip.{key}': {why}")

        if not isinstance(d, dict) or set(d) != {"done", "partial", "extra", "returns"}:
            bad("", f"expected done, partial, extra and returns, got {str(d)[:200]}")

        ids = num_shards << 32  # (a stream id: shard << 32 | ordinal)

        if not int_list(d["done"]) or any(s >= num_shards for s in d["done"]):
            bad("done", f"expected shard numbers below {num_shards}")
        partial = {}
        for p in d["partial"] if isinstance(d["partial"], list) else [None]:
            if not (
                isinstance(p, list)
                and len(p) == 3
                and int_list(p[:1])
                and int_list(p[1:2], 0, 2**32)
                and int_list(p[2], -INT64)  # (a location: its source's, Source.check_locations)
                and p[2]
            ):
                bad("partial", f"expected [shard, ordinal, location], got {str(p)[:100]}")
            if p[0] >= num_shards or p[0] in partial or p[0] in d["done"]:
                bad("partial", f"shard {p[0]} out of range, repeated or done")
            partial[p[0]] = (p[1], tuple(p[2]))
        if not int_list(d["extra"], 0, ids):
            bad("extra", "expected stream ids")
        returns = d["returns"]
        if not (
            isinstance(returns, list)
            and all(
                isinstance(r, list)
                and len(r) > 2
                and int_list(r[:2])
                and int_list(r[2:], -INT64)
                and r[0] < ids
                for r in returns
            )
        ):
            bad("returns", "expected [id, aligned size, *location] lists")
        return cls(
            frozenset(d["done"]),
            partial,
            np.unique(np.asarray(d["extra"], dtype=np.int64)),
            tuple(tuple(r) for r in sorted(returns)),
        )


def check_own(source, locs: list, key: str) -> None:
    """A :class:`ResumeError` naming ``key`` unless the locations ``locs`` (a cursor's) are of
    one width and ``source``'s
    (:meth:`~prealign.loaders.sources.source.Source.check_locations`: shards, rows, byte ranges in
    range)."""
    if not locs:
        return
    try:
        widths = set(map(len, locs))
        if len(widths) != 1:
            raise ValueError(f"locations of widths {sorted(widths)}")
        source.check_locations(np.asarray(locs, np.int64))
    except (PrealignError, ValueError) as exc:
        raise ResumeError(f"loader state: key '{key}': not this source's ({exc})") from None


def check_in_shards(source, locs: list, shards: list[int], key: str, where: str = "") -> None:
    """A :class:`ResumeError` naming ``key`` when a location of ``locs`` (checked:
    :func:`check_own`) lies in another shard than its own of ``shards``, where ``source``'s
    locations name their shard (:meth:`~prealign.loaders.sources.source.Source.shard_of`);
    ``where``: what the expected shard is, for the message."""
    for i, (loc, shard) in enumerate(zip(locs, shards)):
        found = source.shard_of(loc)
        if found is not None and found != shard:
            raise ResumeError(
                f"loader state: key '{key}': a location in shard {found}; expected one in shard "
                f"{shard}{where} (its location {i}: {list(loc)})"
            )


Records = Callable[[int, "tuple | None", "tuple | None"], Iterable]
"""``records(shard, after, base)``: ``(ordinal, location, item)`` of ``shard``, after the record
``after = (ordinal, location)`` when given; ``base``: the shard's ``partial`` record (at or before
``after``), where the shard may be entered without reading what comes before it."""


def kept(
    order: list[int], skip: Skip | None, records: Records, *, start: tuple | None = None
) -> Iterator[tuple[int, int, int, tuple, object]]:
    """``(shard position, shard, ordinal, location, item)`` of the records of ``order`` that
    ``skip`` leaves (``order`` is already ``skip.remaining``), from the record ``start = (shard
    position, ordinal, location)`` on (after it) when given."""
    first = 0 if start is None else start[0]
    for pos in range(first, len(order)):
        shard = order[pos]
        after, upto = None, -1
        if start is not None and pos == first and start[2] is not None:
            after = (start[1], start[2])
        elif start is not None and pos == first:
            upto = start[1]  # (a record without location: the shard again, up to it dropped)
        extra, base = frozenset(), None
        if skip is not None:
            base = skip.partial.get(shard)
            if base is not None and (after is None or after[0] <= base[0]):
                after = base
            extra = skip.extra_in(shard)
        for ordinal, loc, item in records(shard, after, base):
            if ordinal > upto and ordinal not in extra:
                yield pos, shard, ordinal, loc, item


def fold(
    skip: Skip | None,
    order: list[int],
    cursors: list,
    records: Records,
) -> Skip:
    """The :class:`Skip` of an epoch after old readers (``cursors[g]``: reader ``g``'s cursor,
    ``None`` when it served nothing) read under ``skip`` over the epoch's shard ``order``. Reads
    nothing when the old readers split by shard; when they split by sample, walks (no transform)
    the records between the slowest and the fastest reader to list which were read."""
    skip = skip or Skip()
    readers = len(cursors)
    shards = skip.remaining(order)
    done, partial = set(skip.done), dict(skip.partial)
    extra = set(skip.extra.tolist())
    returns = []
    for g, c in enumerate(cursors):
        if c is None:  # it served nothing: its returns were not read back, nothing consumed
            returns += skip.returns_of(g, readers)
            continue
        returns += [*c["buffer"], *(e for b in c["bins"] for e in b)]
    if len(shards) >= readers:  # split by shard: each reader's own shards, read in order
        for g, c in enumerate(cursors):
            mine = shards[g::readers]
            if c is None:
                continue
            pos, ordinal, loc = c["at"]
            if c["done"]:
                done.update(mine)
                continue
            done.update(mine[:pos])
            if ordinal >= 0:
                partial[mine[pos]] = (int(ordinal), tuple(loc))
    else:  # split by sample: record j (1-based) was reader (j - 1) % G's, read iff j <= its k
        ks = [0 if c is None else int(c["k"]) for c in cursors]
        if all(c is not None and c["done"] for c in cursors):
            done.update(shards)
        else:
            low = min(ks)
            slow = ks.index(low)
            start = None
            if low and cursors[slow]["at"][2] is None:  # (a bad record last: walk from the start)
                low = 0
            if low:
                pos, ordinal, loc = cursors[slow]["at"]
                start = (pos, ordinal, tuple(loc))
                done.update(shards[:pos])
                partial[shards[pos]] = (int(ordinal), tuple(loc))
            j = low
            for _, shard, ordinal, _, _ in kept(shards, skip, records, start=start):
                j += 1
                if j > max(ks):
                    break
                if j <= ks[(j - 1) % readers]:
                    extra.add((shard << 32) | ordinal)
    for s in done:
        partial.pop(s, None)
    left = [
        i
        for i in extra
        if _shard(i) not in done
        and not (_shard(i) in partial and _ordinal(i) <= partial[_shard(i)][0])
    ]
    return Skip(
        frozenset(done),
        partial,
        np.unique(np.asarray(left, dtype=np.int64)),
        tuple(tuple(map(int, r)) for r in sorted(returns)),
    )


def fold_parts(
    skip: Skip | None,
    parts: list[list[int]],
    cursors: list,
    records: Records,
) -> Skip:
    """:func:`fold` of a mixture's readers: each component's stream (``parts[i]``, its shards in
    the epoch's order) folded from its own cursors (``cursors[g]["mix"]["streams"][i]``), the
    readers' buffered samples once; the components' shards are disjoint, so the skips' union is the
    epoch's."""
    skip = skip or Skip()
    out = []
    for i, part in enumerate(parts):
        own = [
            None
            if c is None
            else {
                **c["mix"]["streams"][i],
                "buffer": c["buffer"] if i == 0 else [],
                "bins": c["bins"] if i == 0 else [],
            }
            for c in cursors
        ]
        base = skip if i == 0 else Skip(skip.done, skip.partial, skip.extra)
        folded, mine = fold(base, part, own, records), set(part)
        out.append(
            Skip(
                folded.done & mine,
                {k: v for k, v in folded.partial.items() if k in mine},
                folded.extra[np.isin(folded.extra >> 32, part)],
                folded.returns,
            )
        )
    return Skip(
        frozenset().union(*(s.done for s in out)),
        {k: v for s in out for k, v in s.partial.items()},
        np.unique(np.concatenate([s.extra for s in out])),
        out[0].returns,
    )
