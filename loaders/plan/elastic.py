"""Elastic resume: one epoch served in segments, each under its own DP size (and micro-batches per
step).

A run saved after ``p`` micro-batches per rank at ``dp_size=4`` and resumed at ``dp_size=3`` serves
the rest of that epoch as a new *segment*::

    epoch order ─► segment 0: plan of every sample (dp 4, k 1); its first p0 micro-batches per
                              rank served
                ─► segment 1: plan of the samples segment 0 left, in epoch order (dp 3, k 2);
                              first p1 served
                ─► this run: plan of the samples still left, for this run's dp_size and k

Each segment is planned by the same pure planner (seed, budget, layout, packing and dealing rules)
over the samples the segments before it did not serve, so every rank recomputes what each segment
served (the union of its first ``position`` micro-batches on all of its ranks) from the index alone:
nothing is lost or repeated, and the state holds one :class:`Segment` (four integers) per resize,
never a list of samples. Inside a segment every rank has the same number of micro-batches and each
is within budget, since it is an ordinary plan.

>>> def planned(order, seg):
...     return np.array([0, 2])
>>> rest_of_epoch(np.array([7, 3, 5, 1]), [Segment(dp_size=2, position=1)], planned)
array([3, 1])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from prealign.loaders.errors import ResumeError
from prealign.schemas.checks import int_at_least


def _count(name: str, value, low: int, where: str) -> int:
    return int_at_least(f"loader state: key {where}.{name}", value, low, ResumeError)


@dataclass(frozen=True, kw_only=True)
class Segment:
    """Part of an epoch served under one configuration: ``position`` micro-batches on each of
    ``dp_size`` ranks with ``microbatches_per_step`` per step (``num_workers`` readers per rank for
    a stream; ``None`` where the loader's batches do not depend on it).

    >>> Segment.from_dict(Segment(dp_size=4, position=9).to_dict())
    Segment(dp_size=4, position=9, microbatches_per_step=1, num_workers=None)
    """

    dp_size: int
    position: int
    microbatches_per_step: int = 1
    num_workers: int | None = None

    def to_dict(self) -> dict:
        return {
            "dp_size": self.dp_size,
            "microbatches_per_step": self.microbatches_per_step,
            "num_workers": self.num_workers,
            "position": self.position,
        }

    @classmethod
    def checked(
        cls,
        *,
        dp_size,
        microbatches_per_step,
        num_workers,
        position,
        where: str = "segments",
        min_position: int = 1,
    ) -> "Segment":
        """A segment from unchecked values: :class:`ResumeError` naming ``where.<field>`` for
        anything but ints (``position >= min_position``; ``num_workers`` may be None).

        >>> Segment.checked(dp_size=2, microbatches_per_step=1, num_workers=None, position=0,
        ...                 min_position=0)
        Segment(dp_size=2, position=0, microbatches_per_step=1, num_workers=None)
        """
        return cls(
            dp_size=_count("dp_size", dp_size, 1, where),
            microbatches_per_step=_count("microbatches_per_step", microbatches_per_step, 1, where),
            num_workers=None
            if num_workers is None
            else _count("num_workers", num_workers, 0, where),
            position=_count("position", position, min_position, where),
        )

    @classmethod
    def from_dict(cls, data, where: str = "segments") -> "Segment":
        """Parse strictly: :class:`ResumeError` naming the key for anything but the four fields as
        ints (``position >= 1``: a segment that served nothing is never written; ``num_workers`` may
        be null)."""
        if not isinstance(data, dict) or set(data) != {
            "dp_size",
            "microbatches_per_step",
            "num_workers",
            "position",
        }:
            raise ResumeError(
                f"loader state: key {where}: expected an object with keys dp_size, "
                f"microbatches_per_step, num_workers, position; got {str(data)[:200]}"
            )
        return cls.checked(**data, where=where)

    def same_config(self, other: "Segment", keys: Iterable[str]) -> bool:
        """Whether ``keys`` (field names) are equal in both."""
        return all(getattr(self, k) == getattr(other, k) for k in keys)


MAX_SEGMENTS = 64
"""Most earlier segments (resizes) one epoch's state may hold: each costs a replay of its plan (or,
for a stream, of its readers) at every resume of that epoch; a state with more is refused, not
slowly honoured."""


def check_segments(
    segments: Sequence[Segment], saved: Segment, here: Segment, elastic: Sequence[str]
) -> None:
    """Refuse (:class:`ResumeError` naming the key) earlier ``segments`` no run can have written:
    more than :data:`MAX_SEGMENTS`; a field the loader does not re-plan for (not in ``elastic``)
    other than ``here``'s (a :class:`PackedLoader` segment with workers, a stream's with
    ``microbatches_per_step`` other than 1); an ``elastic`` field null; or two in a row (the last
    one and the ``saved`` run's own configuration included) with the same ``elastic`` fields, which
    a resume continues as one segment.

    >>> check_segments([Segment(dp_size=4, position=2)], Segment(dp_size=4, position=1),
    ...                Segment(dp_size=3, position=0), ("dp_size",))
    Traceback (most recent call last):
    ...
    prealign.loaders.errors.ResumeError: loader state: key segments[0]: dp_size 4 as in the ...
    """
    if len(segments) > MAX_SEGMENTS:
        raise ResumeError(
            f"loader state: key segments: {len(segments)} segments (resizes) in one epoch; at most "
            f"{MAX_SEGMENTS} are resumed (each is replayed at every resume)"
        )
    fixed = [f for f in ("dp_size", "microbatches_per_step", "num_workers") if f not in elastic]
    for i, seg in enumerate(segments):
        where = f"segments[{i}]"
        for f in fixed:
            if getattr(seg, f) != getattr(here, f):
                raise ResumeError(
                    f"loader state: key {where}.{f}: expected {getattr(here, f)!r} (this loader's "
                    f"batches do not depend on it), got {getattr(seg, f)!r}"
                )
        for f in elastic:
            if getattr(seg, f) is None:
                raise ResumeError(f"loader state: key {where}.{f}: expected an int, got null")
        after, name = (
            (segments[i + 1], f"segments[{i + 1}]")
            if i + 1 < len(segments)
            else (saved, "the state's config")
        )
        if seg.same_config(after, elastic):
            same = ", ".join(f"{k} {getattr(seg, k)}" for k in elastic)
            raise ResumeError(
                f"loader state: key {where}: {same} as in {name}: a resume under the same "
                f"configuration goes on in the same segment, so no run writes this"
            )


def unserved(order: np.ndarray, served: np.ndarray) -> np.ndarray:
    """``order`` without the entries at positions ``served``, the rest in their order (vectorised).

    >>> unserved(np.array([4, 0, 2, 9]), np.array([2, 0])).tolist()
    [0, 9]
    """
    keep = np.ones(order.size, bool)
    keep[np.asarray(served, dtype=np.int64)] = False
    return order[keep]


def rest_of_epoch(
    order: np.ndarray,
    segments: Sequence[Segment],
    served: Callable[[np.ndarray, Segment], np.ndarray],
) -> np.ndarray:
    """The sample ids of ``order`` (the epoch's order) that ``segments`` did not serve, in epoch
    order.

    ``served(order, segment)``: positions into ``order`` of the samples ``segment`` served when
    planned over ``order`` (its first ``segment.position`` micro-batches on every rank); each
    segment is planned over what the ones before it left.
    """
    for seg in segments:
        order = unserved(order, served(order, seg))
    return order


def resumed_segments(
    segments: Sequence[Segment], saved: Segment, here: Segment, keys: Sequence[str]
) -> tuple[tuple[Segment, ...], int]:
    """(earlier segments, position in this run's segment) of a resumed epoch. ``saved``: the saved
    run's own part (its configuration, its position); ``here``: this run's configuration. The saved
    run goes on as the same segment when none of ``keys`` differ; otherwise its part becomes one
    more earlier segment (none when it served nothing) and this run starts its own at position 0,
    or, when the saved run served nothing and this run's configuration is the last earlier
    segment's, goes on in that one (so no two segments in a row have the same configuration:
    :func:`check_segments`).

    >>> saved = Segment(dp_size=4, position=5)
    >>> resumed_segments((), saved, Segment(dp_size=3, position=0), ("dp_size",))
    ((Segment(dp_size=4, position=5, microbatches_per_step=1, num_workers=None),), 0)
    >>> resumed_segments((), saved, Segment(dp_size=4, position=0), ("dp_size",))
    ((), 5)
    >>> then, now = Segment(dp_size=3, position=0), Segment(dp_size=4, position=0)
    >>> resumed_segments((saved,), then, now, ("dp_size",))
    ((), 5)
    """
    if saved.same_config(here, keys):
        return tuple(segments), saved.position
    if saved.position:
        return (*segments, saved), 0
    if segments and segments[-1].same_config(here, keys):
        return tuple(segments[:-1]), segments[-1].position
    return tuple(segments), 0


def round_robin(streams: Sequence[Iterable], count: int) -> list:
    """The first ``count`` items a torch DataLoader serves from iterable readers ``streams`` (one
    per worker): one from each in turn, a reader that ran out left out from then on (fewer items
    when all run out).

    >>> round_robin([iter("ab"), iter("wxyz"), iter("")], 5)
    ['a', 'w', 'b', 'x', 'y']
    """
    live: list[Iterator] = [iter(s) for s in streams]
    out: list = []
    while live and len(out) < count:
        for it in list(live):
            if len(out) == count:
                break
            try:
                out.append(next(it))
            except StopIteration:
                live.remove(it)
    return out
