"""The worker's hand-off from loading to collating: what a planned dataset's
``__getitems__(request)`` returns and the loader's collate_fn takes, in the same DataLoader worker
(or the main process)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Fetched:
    """One micro-batch as loaded for its collate_fn.

    >>> Fetched(request=None, samples=[{"input_ids": [5, 6]}], where=str).skipped is None
    True
    """

    request: Any
    """The :class:`~prealign.loaders.plan.schedule.Request` (its ``indices`` name the index
    rows)."""
    samples: Any
    """The loaded samples (a list of dicts, in ``request.indices`` order), or the typed
    :class:`~prealign.schemas.errors.PrealignError` that stopped loading them (the collate_fn hands
    it on)."""
    where: Callable[[int], str]
    """Name of index row ``i`` for error messages."""
    skipped: list | None = None
    """Under the skip policy: the records (:class:`~prealign.loaders.policy.BadRecord`) of the
    samples left out while loading (None: another policy, nothing may be left out)."""
    share: Any = None
    """:class:`~prealign.loaders.handoff.batch_share.BatchShare`'s claim on the micro-batch (None:
    not shared)."""
