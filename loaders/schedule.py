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
    block = np.arange(n) // max(window, 1)
    return order[np.lexsort((rng.random(n), block))]


class Schedule:
    """Plans epochs (cached one at a time) and lists one rank's requests."""

    def __init__(self, index: SampleIndex, *, layout: ParallelLayout, token_budget: int, dp_size: int,
                 planner: PlannerConfig, seed: int, shuffle: bool, sequential: bool, window: int):
        seed = check_count("seed", seed)
        self.index, self.layout, self.token_budget, self.dp_size = index, layout, token_budget, dp_size
        self.planner, self.seed, self.shuffle, self.sequential, self.window = planner, seed, shuffle, sequential, window
        self._cached: tuple[int, np.ndarray, MicrobatchPlan, int] | None = None

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
            self._cached = (epoch, order, plan, -1 if placed is None else int(order[placed]))
        return self._cached[1:]

    def __call__(self, epoch: int, dp_rank: int, start: int = 0) -> list[Request]:
        order, plan, filler_of = self._plan(epoch)
        return [Request(epoch, i, tuple(int(order[p]) for p in mb), -1 if mb else filler_of)
                for i, mb in enumerate(plan.microbatches[dp_rank][start:], start)]

    def num_microbatches(self, epoch: int) -> int:
        return self.plan(epoch)[1].stats.microbatches_per_rank
