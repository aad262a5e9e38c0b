"""Epoch order and the per-rank schedule of micro-batch requests (what the DataLoader is fed).

``epoch_order`` -> :func:`~prealign.loaders.planner.plan_microbatches` on the index lengths in that order
-> this rank's row -> :class:`Request` objects, one per micro-batch, handed to DataLoader workers.
Everything is a pure function of (index, epoch, seed, config), which is what makes resume exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prealign.schemas.layout import ParallelLayout
from .errors import PlanError
from .index import SampleIndex
from .planner import MicrobatchPlan, PlannerConfig, plan_microbatches


def check_count(name: str, value) -> int:
    """``value`` when it is an int >= 0 (numpy ints included; not a bool, float or str), else
    :class:`~prealign.loaders.errors.PlanError` naming ``name``.

    >>> check_count("seed", 3)
    3
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
        raise PlanError(f"{name}: expected an int >= 0, got {value!r} ({type(value).__name__})")
    return int(value)


@dataclass(frozen=True, slots=True)
class Request:
    """One micro-batch to load: sample ids (rows of the index), or none for a filler micro-batch."""

    epoch: int
    position: int
    indices: tuple[int, ...]
    filler_of: int = -1
    """Empty micro-batch: sample id whose field structure the filler copies (all pads, zero loss):
    the epoch's first sample that the plan places (never one it leaves out, e.g. oversize with media)."""


def epoch_order(index: SampleIndex, *, epoch: int, seed: int, shuffle: bool, sequential: bool,
                window: int) -> np.ndarray:
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
    shard_ids, inverse = np.unique(index.shards, return_inverse=True)
    shard_rank = rng.permutation(len(shard_ids))[inverse]
    order = np.lexsort((np.arange(n), shard_rank))
    window = max(window, 1)
    block = (np.arange(n) + rng.integers(window)) // window  # window boundaries move every epoch
    return order[np.lexsort((rng.random(n), block))]


def step_order(steps: tuple[int, ...], *, epoch: int, seed: int, shuffle: bool, window: int | None) -> np.ndarray:
    """Micro-batch positions (of one rank; the same on every rank) in the order they are served:
    the plan's steps (``steps[s]`` micro-batches each) in a seeded order, each kept whole, so the
    DP balance of a step is kept. ``window``: shuffle only inside consecutive groups of that many
    steps (sources read front to back); ``None``: one permutation of all steps.

    >>> step_order((1, 1, 1, 1), epoch=0, seed=0, shuffle=False, window=None).tolist()
    [0, 1, 2, 3]
    >>> sorted(step_order((2, 2, 1), epoch=0, seed=0, shuffle=True, window=None).tolist())
    [0, 1, 2, 3, 4]
    """
    starts = np.concatenate([[0], np.cumsum(steps, dtype=np.int64)])
    num = len(steps)
    if not shuffle or num < 2:
        return np.arange(int(starts[-1]))
    rng = np.random.default_rng([seed, epoch, 7])
    w = num if window is None else max(int(window), 1)
    perm = np.lexsort((rng.random(num), np.arange(num) // w))
    return np.concatenate([np.arange(starts[s], starts[s + 1]) for s in perm]).astype(np.int64)


class Schedule:
    """Plans epochs (cached one at a time) and lists one rank's requests."""

    def __init__(self, index: SampleIndex, *, layout: ParallelLayout, token_budget: int, dp_size: int,
                 planner: PlannerConfig, seed: int, shuffle: bool, sequential: bool, window: int,
                 step_window: int | None = None):
        seed = check_count("seed", seed)
        self.index, self.layout, self.token_budget, self.dp_size = index, layout, token_budget, dp_size
        self.planner, self.seed, self.shuffle, self.sequential, self.window = planner, seed, shuffle, sequential, window
        self.step_window = step_window
        """Steps are served in a seeded order (:func:`step_order`): all of them permuted (``None``), or
        only within groups of ``step_window`` steps (sources read front to back)."""
        self._cached: tuple[int, np.ndarray, MicrobatchPlan, int, np.ndarray] | None = None

    def plan(self, epoch: int) -> tuple[np.ndarray, MicrobatchPlan]:
        """(order, plan) of ``epoch``; plan indices are positions in ``order``."""
        return self._plan(epoch)[:2]

    def _plan(self, epoch: int) -> tuple[np.ndarray, MicrobatchPlan, int]:
        """(order, plan, filler sample id) of ``epoch``."""
        if self._cached is None or self._cached[0] != epoch:
            order = epoch_order(self.index, epoch=epoch, seed=self.seed, shuffle=self.shuffle,
                                sequential=self.sequential, window=self.window)
            media = None if self.index.media is None else np.asarray(self.index.media, dtype=bool)[order]
            plan = plan_microbatches(self.index.lengths[order], layout=self.layout, token_budget=self.token_budget,
                                     dp_size=self.dp_size, config=self.planner, has_media=media)
            placed = min((p for row in plan.microbatches for mb in row for p in mb), default=None)
            served = step_order(plan.steps, epoch=epoch, seed=self.seed, shuffle=self.shuffle, window=self.step_window)
            self._cached = (epoch, order, plan, -1 if placed is None else int(order[placed]), served)
        return self._cached[1:4]

    def __call__(self, epoch: int, dp_rank: int, start: int = 0) -> "Requests":
        order, plan, filler_of = self._plan(epoch)
        return Requests(epoch, start, self._cached[4], plan.microbatches[dp_rank], order, filler_of)

    def num_microbatches(self, epoch: int) -> int:
        return self.plan(epoch)[1].stats.microbatches_per_rank


class Requests:
    """One rank's requests from micro-batch ``start`` on, built as they are iterated (an epoch of a
    million samples is not turned into objects before its first batch)."""

    def __init__(self, epoch: int, start: int, served: np.ndarray, row, order: np.ndarray, filler_of: int):
        self.epoch, self.start, self.served, self.row, self.order, self.filler_of = \
            epoch, start, served, row, order, filler_of

    def __len__(self) -> int:
        return max(len(self.served) - self.start, 0)

    def __getitem__(self, k: int) -> Request:
        i = self.start + k
        if not 0 <= k < len(self):
            raise IndexError(k)
        mb = self.row[int(self.served[i])]
        return Request(self.epoch, i, tuple(self.order[list(mb)].tolist()) if mb else (), -1 if mb else self.filler_of)

    def __iter__(self):
        return (self[k] for k in range(len(self)))
