"""Shards split over DataLoader workers: ``fn(shard)`` for each shard, in shard order.

The one module of the index pass that imports torch (its ``DataLoader``): the full transform pass
(:func:`~prealign.loaders.index.build.scan_shards`) imports it when there are shards to scan, so an
index read from sidecars, and ``prealign index --text``, import no torch.
"""

from __future__ import annotations

from typing import Callable

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from prealign.schemas.errors import PrealignError


class _ShardScan(IterableDataset):
    """Shards split over DataLoader workers (worker w takes shards w, w+W, ...)."""

    def __init__(self, fn: Callable[[int], dict], shards: list[int]):
        self.fn, self.shards = fn, shards

    def __iter__(self):
        info = get_worker_info()
        mine = self.shards if info is None else self.shards[info.id :: info.num_workers]
        for shard in mine:
            try:
                yield self.fn(shard)
            except PrealignError as exc:  # typed: re-raised as the same type in the main process
                if info is None:
                    raise
                yield exc
                return


def map_shards(
    fn: Callable[[int], dict],
    shards: list[int],
    *,
    num_workers: int = 0,
    progress: Callable[[], None] | None = None,
) -> list[dict]:
    """``fn(shard)`` (a picklable callable returning a dict with key ``"shard"``) over ``shards``
    with ``num_workers`` DataLoader workers, in shard order; ``progress()`` is called as each shard
    is done."""
    loader = DataLoader(
        _ShardScan(fn, shards),
        batch_size=None,
        num_workers=min(num_workers, len(shards)),
    )
    results = {}
    for r in loader:
        if isinstance(r, PrealignError):
            raise r
        results[r["shard"]] = r
        if progress is not None:
            progress()
    return [results[s] for s in shards]
