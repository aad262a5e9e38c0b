"""Epoch order and the per-rank schedule of micro-batch requests (what the DataLoader is fed).

``epoch_order`` -> :class:`~prealign.loaders.plan.planner.ChunkedPlan` of the index lengths in that
order -> this rank's row, a chunk at a time as requests reach it -> :class:`Request` objects, one
per micro-batch, handed to DataLoader workers. Everything is a pure function of (index, epoch, seed,
config), which is what makes resume exact.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_right
from dataclasses import dataclass
from typing import Callable

import numpy as np

from prealign.loaders.errors import OversizeSampleError, PlanError, ResumeError
from prealign.loaders.index.sample_index import SampleIndex
from prealign.loaders.plan.elastic import Segment, rest_of_epoch
from prealign.loaders.plan.planner import ChunkedPlan, MicrobatchPlan, PlannerConfig, Screening
from prealign.schemas.checks import int_at_least
from prealign.schemas.layout import ParallelLayout


def check_count(name: str, value) -> int:
    """``value`` as an ``int`` when it is an int >= 0 (numpy ints included; not a bool, float or
    str), else :class:`~prealign.loaders.errors.PlanError` naming ``name``.

    >>> check_count("seed", 3)
    3
    """
    return int_at_least(name, value, 0, PlanError)


@dataclass(frozen=True, slots=True)
class Request:
    """One micro-batch to load: sample ids (rows of the index), or none for a filler micro-batch."""

    epoch: int
    position: int
    indices: tuple[int, ...]
    filler_of: int = -1
    """Empty micro-batch: sample id whose field structure the filler copies (all pads, zero loss):
    the epoch's first sample that the plan places (never one it leaves out, e.g. oversize with
    media)."""


def epoch_order(
    index: SampleIndex, *, epoch: int, seed: int, shuffle: bool, sequential: bool, window: int
) -> np.ndarray:
    """Permutation of sample ids for ``epoch``.

    Random-access sources: a full seeded permutation. Sequential sources: shards in a seeded order,
    samples in stream order inside a shard, then shuffled inside consecutive blocks of ``window``
    (reads stay near-sequential).
    """
    n = len(index)
    epoch, seed = check_count("epoch", epoch), check_count("seed", seed)
    if not shuffle:
        return np.arange(n)
    rng = np.random.default_rng([seed, epoch])
    if not sequential:
        return rng.permutation(n)
    shards = np.asarray(index.shards)
    if n and np.any(
        shards[1:] < shards[:-1]
    ):  # not grouped by shard (a hand-built index): group it
        by_shard = np.argsort(shards, kind="stable")
    else:
        by_shard = None
    grouped = shards if by_shard is None else shards[by_shard]
    starts = (
        np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]]) if n else np.zeros(0, np.int64)
    )
    counts = np.diff(np.r_[starts, n])
    perm = rng.permutation(starts.size)
    order = _shards_in_order(starts, counts, perm, n)  # shards in a seeded order
    if by_shard is not None:
        order = by_shard[order]
    return order[_window_shuffle(n, max(window, 1), rng)]


def _shards_in_order(
    starts: np.ndarray, counts: np.ndarray, perm: np.ndarray, n: int
) -> np.ndarray:
    """The ``n`` positions of shards whose samples start at ``starts`` (``counts`` of them each),
    shard ``perm[0]`` first, then ``perm[1]``, ...; shards of one sample count (a webdataset's
    usual layout; one sample each at 100k shards) in a few ops on ``perm``, else a repeat.

    >>> _shards_in_order(np.array([0, 2, 4]), np.array([2, 2, 1]), np.array([2, 0, 1]), 5)
    array([4, 0, 1, 2, 3])
    >>> _shards_in_order(np.array([0, 2, 4]), np.array([2, 2, 2]), np.array([2, 0, 1]), 6)
    array([4, 5, 0, 1, 2, 3])
    """
    if n and counts.min() == counts.max():  # (each shard c samples: shard s at s * c)
        c = int(counts[0])
        return perm if c == 1 else (perm[:, None] * c + np.arange(c)).reshape(-1)
    first, count = starts[perm], counts[perm]
    return np.arange(n) + np.repeat(first - (np.cumsum(count) - count), count)


def _window_shuffle(n: int, window: int, rng: np.random.Generator) -> np.ndarray:
    """A permutation of ``range(n)`` that shuffles inside consecutive blocks of ``window``
    positions, the block boundaries moved by a random offset (O(n), no sort).

    >>> p = _window_shuffle(10, 4, np.random.default_rng(0))
    >>> sorted(p.tolist()) == list(range(10)) and int(abs(p - np.arange(10)).max()) < 4
    True
    """
    window = max(
        min(window, n), 1
    )  # a block of at most n: the same shuffle, memory O(n) whatever the window
    offset = int(rng.integers(window))
    rows = -(-(n + offset) // window)
    grid = rng.permuted(np.arange(rows * window).reshape(rows, window), axis=1).reshape(-1) - offset
    return grid[(grid >= 0) & (grid < n)]


def step_order(
    steps: tuple[int, ...],
    *,
    epoch: int,
    seed: int,
    shuffle: bool,
    window: int | None,
    salt: int = 0,
) -> np.ndarray:
    """Micro-batch positions (of one rank; the same on every rank) in the order they are served:
    the plan's steps (``steps[s]`` micro-batches each) in a seeded order, each kept whole, so the
    DP balance of a step is kept. ``window``: shuffle only inside consecutive groups of that many
    steps (sources read front to back); ``None``: one permutation of all steps. ``salt``: the chunk
    of the plan the steps belong to (each chunk its own order).

    >>> step_order((1, 1, 1, 1), epoch=0, seed=0, shuffle=False, window=None).tolist()
    [0, 1, 2, 3]
    >>> sorted(step_order((2, 2, 1), epoch=0, seed=0, shuffle=True, window=None).tolist())
    [0, 1, 2, 3, 4]
    """
    starts = np.concatenate([[0], np.cumsum(steps, dtype=np.int64)])
    num = len(steps)
    if not shuffle or num < 2:
        return np.arange(int(starts[-1]))
    rng = np.random.default_rng([seed, epoch, 7, salt])
    w = num if window is None else max(int(window), 1)
    perm = np.lexsort((rng.random(num), np.arange(num) // w))
    return np.concatenate([np.arange(starts[s], starts[s + 1]) for s in perm]).astype(np.int64)


class Schedule:
    """Plans epochs lazily (one epoch cached, its chunks planned as requests reach them) and lists
    one rank's requests. Every DP rank plans the same chunks, so all agree without communication."""

    def __init__(
        self,
        index: SampleIndex,
        *,
        layout: ParallelLayout,
        token_budget: int,
        dp_size: int,
        planner: PlannerConfig,
        seed: int,
        shuffle: bool,
        sequential: bool,
        window: int,
        step_window: int | None = None,
        order_of=None,
        groups: np.ndarray | None = None,
    ):
        seed = check_count("seed", seed)
        self.index, self.layout, self.token_budget, self.dp_size = (
            index,
            layout,
            token_budget,
            dp_size,
        )
        self.planner, self.seed, self.shuffle, self.sequential, self.window = (
            planner,
            seed,
            shuffle,
            sequential,
            window,
        )
        self.step_window = step_window
        """Steps are served in a seeded order (:func:`step_order`) inside each chunk of the plan:
        all of the chunk's steps permuted (``None``), or only within groups of ``step_window`` steps
        (sources read front to back)."""
        self.order_of = order_of
        """``order_of(epoch, served)``: the epoch's sample ids in order, instead of
        :func:`epoch_order` (a mixture's interleave; ``served(order, segment)`` as
        :func:`rest_of_epoch` takes it). Replacing it
        re-plans."""
        self.groups = groups
        """int ``[N]`` per sample id, or None: under ``STEP_FIT`` a micro-batch holds one group
        only."""
        self._cached: _Epoch | None = None
        self.resized: tuple[int, tuple[Segment, ...]] = (-1, ())
        """(epoch, its earlier segments): that epoch's samples the segments served under other DP
        sizes or micro-batches per step are left out, and the rest is planned for this schedule
        (:mod:`prealign.loaders.plan.elastic`). Other epochs are planned whole."""

    def _epoch(self, epoch: int) -> "_Epoch":
        segments = self.resized[1] if self.resized[0] == epoch else ()
        key = (epoch, segments, self.order_of)
        if (
            self._cached is None
            or (self._cached.epoch, self._cached.segments, self._cached.order_of) != key
        ):

            def served(o, seg):
                return self._planned(
                    epoch, o, seg.dp_size, seg.microbatches_per_step
                ).samples_before(seg.position)

            if self.order_of is not None:
                order = np.asarray(self.order_of(epoch, served), np.int64)
            else:
                order = epoch_order(
                    self.index,
                    epoch=epoch,
                    seed=self.seed,
                    shuffle=self.shuffle,
                    sequential=self.sequential,
                    window=self.window,
                )
            order = rest_of_epoch(order, segments, served)
            self._cached = self._planned(
                epoch, order, self.dp_size, self.planner.microbatches_per_step, segments
            )
            self._cached.order_of = self.order_of
        return self._cached

    def _planned(
        self, epoch: int, order: np.ndarray, dp_size: int, k: int, segments=()
    ) -> "_Epoch":
        media = (
            None if self.index.media is None else np.asarray(self.index.media, dtype=bool)[order]
        )
        planner = dataclasses.replace(self.planner, microbatches_per_step=k)
        try:
            plan = ChunkedPlan(
                self.index.lengths[order],
                layout=self.layout,
                token_budget=self.token_budget,
                dp_size=dp_size,
                config=planner,
                has_media=media,
                groups=None if self.groups is None else self.groups[order],
            )
        except (
            OversizeSampleError
        ) as exc:  # it names a position in this epoch's order: name the sample
            raise self._named(exc, order) from None
        return _Epoch(epoch, order, plan, self, segments)

    where: Callable[[int], str] | None = None
    """Name of an index row for messages (the source's name of its location), set by the loader."""

    def _named(self, exc: OversizeSampleError, order: np.ndarray) -> OversizeSampleError:
        """``exc`` naming the index row and the sample (``where``) instead of a position in
        ``order``."""
        pos = exc.sample
        if (
            isinstance(pos, bool)
            or not isinstance(pos, (int, np.integer))
            or not 0 <= pos < len(order)
        ):
            return exc
        row = int(order[pos])
        name = (
            f"{self.where(row)} (index row {row})" if self.where is not None else f"index row {row}"
        )
        out = OversizeSampleError(
            sample=name, field=exc.field, expected=exc.expected, actual=exc.actual
        )
        out.__dict__.update({k: v for k, v in exc.__dict__.items() if k != "sample"})
        out.args = (str(exc).replace(f"sample {pos}", f"sample {name}", 1),)
        return out

    def plan(self, epoch: int) -> tuple[np.ndarray, MicrobatchPlan]:
        """(order, whole plan) of ``epoch`` (plans every chunk); plan indices are positions in
        ``order``."""
        ep = self._epoch(epoch)
        return ep.order, ep.plan.full()

    def screening(self) -> tuple[Screening, np.ndarray]:
        """(what the oversize policy does, epoch 0's order): lengths and media flags decide it, so
        it is the same every epoch; no chunk is planned."""
        ep = self._epoch(0)
        return ep.plan.screening, ep.order

    def __call__(self, epoch: int, dp_rank: int, start: int = 0) -> "Requests":
        return Requests(self._epoch(epoch), dp_rank, start)

    def num_microbatches(self, epoch: int) -> int:
        """Micro-batches per rank in ``epoch`` (plans every chunk)."""
        return self._epoch(epoch).count(None)

    def count_to(self, epoch: int, position: int) -> int:
        """Micro-batches per rank in the chunks planned to reach ``position`` (all of them when the
        epoch is shorter): ``position < count_to(...)`` says whether ``position`` exists, planning
        no more."""
        return self._epoch(epoch).count(position)


class _Epoch:
    """One epoch: its order, its :class:`ChunkedPlan`, and the serving order of each planned
    chunk."""

    order_of = None
    """The :attr:`Schedule.order_of` it was planned with."""

    def __init__(
        self, epoch: int, order: np.ndarray, plan: ChunkedPlan, schedule: Schedule, segments=()
    ):
        self.epoch, self.order, self.plan, self.schedule, self.segments = (
            epoch,
            order,
            plan,
            schedule,
            segments,
        )
        self.starts = [0]
        """``starts[c]``: position of chunk ``c``'s first micro-batch (known for planned chunks, +
        the next)."""
        self.served: list[np.ndarray] = []
        kept = plan.order
        self.filler_of = int(order[kept.min()]) if kept.size else -1

    def _plan_next(self) -> None:
        c = len(self.served)
        chunk = self.plan.chunk(c)
        sch = self.schedule
        served = step_order(
            chunk.steps,
            epoch=self.epoch,
            seed=sch.seed,
            shuffle=sch.shuffle,
            window=sch.step_window,
            salt=c,
        )
        self.served.append(served)
        self.starts.append(self.starts[-1] + len(served))

    def count(self, position: int | None) -> int:
        """Micro-batches per rank planned once ``position`` is covered (``None``: the whole
        epoch)."""
        while len(self.served) < self.plan.num_chunks and (
            position is None or self.starts[-1] <= position
        ):
            self._plan_next()
        return self.starts[-1]

    def locate(self, position: int) -> tuple[int, int]:
        """(chunk, micro-batch of this rank's row in it) served at ``position``."""
        self.count(position)
        c = bisect_right(self.starts, position) - 1
        return c, int(self.served[c][position - self.starts[c]])

    def samples_before(self, position: int) -> np.ndarray:
        """int64 positions into :attr:`order` of the samples in the first ``position`` micro-batches
        of every rank (what a run stopped there had served); :class:`ResumeError` past the epoch's
        end."""
        if position > self.count(position):
            raise ResumeError(
                f"loader state: a segment's position {position} is past the end of epoch "
                f"{self.epoch} planned for dp_size {self.plan.dp} ({self.count(None)} "
                f"micro-batches per rank)"
            )
        parts = [np.zeros(0, np.int64)]
        for c, served in enumerate(self.served):
            if position <= self.starts[c]:
                break
            rows = self.plan.chunk(c).microbatches
            mine = served[: position - self.starts[c]].tolist()
            parts.append(np.fromiter((i for row in rows for j in mine for i in row[j]), np.int64))
        return np.concatenate(parts)


class Requests:
    """One rank's requests from micro-batch ``start`` on, built as they are iterated (chunks are
    planned when the first of their micro-batches is requested: an epoch of a million samples is not
    planned before its first batch). ``len()`` plans the whole epoch."""

    def __init__(self, epoch: _Epoch, dp_rank: int, start: int):
        self.ep, self.dp_rank, self.start = epoch, dp_rank, start

    def __len__(self) -> int:
        return max(self.ep.count(None) - self.start, 0)

    def __getitem__(self, k: int) -> Request:
        i = self.start + k
        if k < 0 or i >= self.ep.count(i):
            raise IndexError(k)
        c, j = self.ep.locate(i)
        mb = self.ep.plan.chunk(c).microbatches[self.dp_rank][j]
        return Request(
            self.ep.epoch,
            i,
            tuple(self.ep.order[list(mb)].tolist()) if mb else (),
            -1 if mb else self.ep.filler_of,
        )

    def __iter__(self):
        k = 0
        while self.start + k < self.ep.count(self.start + k):
            yield self[k]
            k += 1
