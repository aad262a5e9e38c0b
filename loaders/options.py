"""The rarer knobs of both loaders (:class:`~prealign.loaders.PackedLoader`,
:class:`~prealign.loaders.StreamingPackedLoader`), as small frozen keyword-only option objects
validated at construction (a mistake is a :class:`~prealign.loaders.errors.PlanError`, a
``ConfigError``).

    PackedLoader(source, schema=, layout=, token_budget=, seed=,
                 workers=WorkerConfig(...),      where it runs: ranks, DataLoader workers,
                                                 process group (or the flat dp_rank=, dp_size=,
                                                 cp_rank=, num_workers=, group= keywords: sugar)
                 planner=PlannerConfig(...),     how micro-batches are filled (loaders.planner;
                                                 the stream's buffer_size and oversize too)
                 bad_data=BadDataPolicy(...),    what a bad sample does             (loaders.policy)
                 shuffle=ShuffleOptions(...),    sample order
                 indexing=IndexOptions(...),     the index pass, or a prebuilt index
                 loading=LoadingOptions(...),    torch DataLoader settings
                 collator=...)                   another collate callable

>>> LoadingOptions(prefetch_factor=4, pin_memory=True).prefetch_factor
4
>>> ShuffleOptions(enabled=False).window
1024
"""

from __future__ import annotations

from dataclasses import dataclass

from prealign.loaders.errors import PlanError
from prealign.loaders.handoff.slots import shm_cap
from prealign.loaders.index.sample_index import SampleIndex
from prealign.loaders.plan.planner import check_dp_size
from prealign.schemas.checks import int_at_least


def _int(obj, field: str, low: int, *, name: str = "", optional: bool = False) -> None:
    """``obj.<field>`` stored as an ``int`` when it is an int >= ``low`` (numpy ints too; None too
    where ``optional``), else :class:`~prealign.loaders.errors.PlanError` naming ``name`` (default
    ``<class>.<field>``)."""
    value = getattr(obj, field)
    if optional and value is None:
        return
    name = name or f"{type(obj).__name__}.{field}"
    want = f"an int >= {low}{' or None' if optional else ''}"
    object.__setattr__(obj, field, int_at_least(name, value, low, PlanError, expected=want))


def check_dp(dp_rank, dp_size) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` as ints when ``dp_size`` is an int in ``[1, MAX_DP_SIZE]`` and
    ``dp_rank`` an int in ``[0, dp_size)`` (numpy ints too, never a bool), else
    :class:`~prealign.loaders.errors.PlanError` naming the argument."""
    size = check_dp_size(dp_size)
    want = f"an int in [0, {size})"
    rank = int_at_least("dp_rank", dp_rank, 0, PlanError, expected=want)
    if rank >= size:
        raise PlanError(f"dp_rank: expected {want}, got {dp_rank!r}")
    return rank, size


def check_option(name: str, value, cls: type):
    """``value`` when it is a ``cls`` or None, else :class:`~prealign.loaders.errors.PlanError`
    naming ``name``."""
    if value is not None and not isinstance(value, cls):
        raise PlanError(f"{name}: expected a {cls.__name__} or None, got {type(value).__name__}")
    return value


def _bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise PlanError(f"{name}: expected True or False, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ShuffleOptions:
    """Sample order of each epoch (seeded by the loader's ``seed``; part of the resume state)."""

    enabled: bool = True
    """Shuffle the samples every epoch (False: index order)."""
    window: int = 1024
    """Block size of the in-shard shuffle of sequential sources (webdataset)."""

    def __post_init__(self):
        _bool("ShuffleOptions.enabled", self.enabled)
        _int(self, "window", 1)


@dataclass(frozen=True, kw_only=True)
class IndexOptions:
    """The index pass (decode, transform and validate every sample once; it runs on first use of the
    loader, or at :meth:`PackedLoader.prepare`)."""

    prebuilt: SampleIndex | str | None = None
    """A :class:`SampleIndex`, or the path of one saved with :meth:`SampleIndex.save`: no index
    pass."""
    workers: int | None = None
    """DataLoader workers of the index pass (None: the loader's ``num_workers``)."""
    distributed: bool = True
    """With an initialised process group, split the pass over all ranks and exchange the records
    (a collective: every rank must prepare its loader)."""

    def __post_init__(self):
        if self.prebuilt is not None and not isinstance(self.prebuilt, (SampleIndex, str)):
            raise PlanError(
                f"IndexOptions.prebuilt: expected a SampleIndex, a path or None, got "
                f"{type(self.prebuilt).__name__}"
            )
        _int(self, "workers", 0, optional=True)
        _bool("IndexOptions.distributed", self.distributed)


MAX_TIMEOUT = (2**31 - 1) / 1000
"""Largest ``LoadingOptions.timeout`` (about 24.8 days): torch waits for a batch with
``select``/``poll``, whose timeout is an int32 of milliseconds (more: an ``OverflowError`` at the
first batch)."""
MAX_PREFETCH = 1 << 12
"""Largest ``LoadingOptions.prefetch_factor``: torch's DataLoader steps ``prefetch_factor *
num_workers`` times at every epoch's start whatever the data (1e8: 80 CPU seconds for 6 batches),
and holds that many batches."""


@dataclass(frozen=True, kw_only=True)
class LoadingOptions:
    """torch ``DataLoader`` settings of the batch workers (``num_workers`` is the loader's own
    argument)."""

    prefetch_factor: int | None = None
    """Batches each worker loads ahead (None: torch's default; only with workers)."""
    pin_memory: bool = False
    persistent_workers: bool = False
    """Keep the workers between epochs (only with workers)."""
    multiprocessing_context: str | None = None
    """``"fork"``, ``"spawn"`` or ``"forkserver"`` (None: torch's default; only with workers)."""
    timeout: float = 0
    """Seconds to wait for a batch from the workers (0: forever)."""
    shm_cap: int | None = None
    """Bytes of shared memory (``/dev/shm``, memfd) each worker may hold in hand-off slots; past it
    batches are handed over by copy (0: always). None: ``PREALIGN_SHM_CAP``, else the smaller of 1
    GiB and 1/8 of ``/dev/shm`` (Kubernetes counts tmpfs toward the pod's memory; Docker's default
    is 64 MB)."""

    def __post_init__(self):
        _int(self, "prefetch_factor", 1, optional=True)
        if self.prefetch_factor is not None and self.prefetch_factor > MAX_PREFETCH:
            raise PlanError(
                f"LoadingOptions.prefetch_factor: expected an int <= {MAX_PREFETCH} (batches each "
                f"worker loads ahead), got {self.prefetch_factor:,}"
            )
        _bool("LoadingOptions.pin_memory", self.pin_memory)
        _bool("LoadingOptions.persistent_workers", self.persistent_workers)
        _int(self, "shm_cap", 0, optional=True)
        if self.shm_cap is None:
            shm_cap()  # a malformed PREALIGN_SHM_CAP is a ConfigError here, not at the first batch
        if self.multiprocessing_context not in (None, "fork", "spawn", "forkserver"):
            raise PlanError(
                f"LoadingOptions.multiprocessing_context: expected 'fork', 'spawn', 'forkserver' "
                f"or None, got {self.multiprocessing_context!r}"
            )
        if (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, (int, float))
            or not 0 <= self.timeout <= MAX_TIMEOUT
        ):
            raise PlanError(
                f"LoadingOptions.timeout: expected seconds >= 0 and <= {MAX_TIMEOUT} (0: forever), "
                f"got {self.timeout!r}"
            )


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """Where a loader runs: DP rank ``dp_rank`` of ``dp_size``, CP rank ``cp_rank`` (None: no CP
    shard), ``num_workers`` DataLoader workers and ``group``, the process group of its collectives
    (None: the world). Both loaders take one as ``workers=`` or build it from the same flat keywords
    (``loader.workers``).

    >>> WorkerConfig(dp_rank=1, dp_size=4, num_workers=2).num_workers
    2
    """

    dp_rank: int = 0
    dp_size: int = 1
    cp_rank: int | None = None
    num_workers: int = 0
    group: object = None

    def __post_init__(self):
        rank, size = check_dp(self.dp_rank, self.dp_size)
        object.__setattr__(self, "dp_rank", rank)
        object.__setattr__(self, "dp_size", size)
        _int(self, "cp_rank", 0, name="cp_rank", optional=True)
        _int(self, "num_workers", 0, name="num_workers")


def worker_config(workers: WorkerConfig | None, **flat) -> WorkerConfig:
    """A loader's :class:`WorkerConfig`: ``workers``, or one built from the flat keywords
    (``dp_rank``, ``dp_size``, ``cp_rank``, ``num_workers``, ``group``; ``None``: not given). A flat
    keyword given beside ``workers`` is a :class:`~prealign.loaders.errors.PlanError` (given twice).

    >>> config = worker_config(None, dp_rank=1, dp_size=2, cp_rank=None, num_workers=None,
    ...                        group=None)
    >>> config.dp_size
    2
    """
    check_option("workers", workers, WorkerConfig)
    given = {name: value for name, value in flat.items() if value is not None}
    if workers is None:
        return WorkerConfig(**given)
    if given:
        raise PlanError(
            f"{', '.join(given)}: given twice, as a keyword and in workers= (give it in the "
            f"WorkerConfig)"
        )
    return workers
