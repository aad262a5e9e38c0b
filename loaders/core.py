"""The core both loaders share (:class:`~prealign.loaders.PackedLoader`,
:class:`~prealign.loaders.StreamingPackedLoader`): one validation of the arguments, the rank
keywords as one :class:`~prealign.loaders.options.WorkerConfig`, epoch and position (``set_epoch``),
one live iterator at a time, one versioned state (:mod:`prealign.loaders.state`) whose data
fingerprints are computed once at ``prepare``, and one DataLoader path out of the workers (a
worker's typed error raised as its own type, a dead worker a
:class:`~prealign.loaders.errors.WorkerError`: :mod:`prealign.loaders.serve.workers`).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import json
import warnings
import weakref
from typing import Callable

from torch.utils.data import DataLoader

from prealign.collate.thd import THDCollator
from prealign.loaders.errors import LoaderUsageError, PlanError, ResumeError
from prealign.loaders.handoff.slots import init_worker
from prealign.loaders.handoff.transport import PackedBatch, unpack_batch
from prealign.loaders.options import LoadingOptions, WorkerConfig, check_option
from prealign.loaders.plan.elastic import Segment, check_segments, resumed_segments
from prealign.loaders.plan.hybrid_cp import HybridCPCollator
from prealign.loaders.plan.planner import PlannerConfig, microbatch_capacity
from prealign.loaders.plan.schedule import check_count
from prealign.loaders.policy import BadDataPolicy, BadDataReport, BadSampleWarning
from prealign.loaders.serve.workers import discard_iterator, worker_batches
from prealign.loaders.sources.source import Source
from prealign.loaders.state import STATE_KIND, LoaderState
from prealign.schemas.layout import ParallelLayout
from prealign.schemas.schema import BatchSchema

_CONFIG_KEY = {
    "dp_size": "dp_size",
    "microbatches_per_step": "planner.microbatches_per_step",
    "num_workers": "num_workers",
}
"""Where each :class:`~prealign.loaders.plan.elastic.Segment` field stands in a state's
``config``."""

_WORKER_LOADERS: weakref.WeakSet = weakref.WeakSet()
"""torch DataLoaders with workers that the loaders made and that are still alive."""


@atexit.register
def _shut_down_workers() -> None:
    """At the main process's exit, before multiprocessing terminates its daemonic children (its exit
    hook was registered earlier, so it runs later): each live loader's persistent workers are told
    to stop and joined as torch does it, so they exit normally and run their own exit hooks (a share
    folder's clean-up)."""
    for loader in list(_WORKER_LOADERS):
        it = getattr(
            loader, "_iterator", None
        )  # a persistent iterator (another lives in its own generator)
        if it is not None:
            discard_iterator(loader, it)


def describe_digest(description: dict) -> str:
    """16 hex digits of a source's JSON description (shard names, sizes).

    >>> describe_digest({"kind": "hf"}) == describe_digest({"kind": "hf"})
    True
    """
    text = json.dumps(description, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def unpacked(batch):
    """A batch handed over packed by a worker (:mod:`prealign.loaders.handoff.transport`) as a plain
    dict."""
    return unpack_batch(batch) if isinstance(batch, PackedBatch) else batch


class LoaderCore:
    """Base of both loaders. Subclasses set :attr:`state_kind`, implement :meth:`prepare` (which
    sets ``self._fingerprint``) and :meth:`_batches`, and may add to :meth:`_config`."""

    state_kind: str = STATE_KIND
    elastic: tuple[str, ...] = ()
    """What a state may change (names of :class:`~prealign.loaders.plan.elastic.Segment` fields):
    the saved run's part of its epoch becomes a segment and the rest of the epoch is served under
    this run's."""

    def __init__(
        self,
        source: Source,
        *,
        schema: BatchSchema,
        layout: ParallelLayout,
        token_budget: int,
        workers: WorkerConfig,
        seed: int,
        planner: PlannerConfig | None,
        bad_data: BadDataPolicy | None,
        loading: LoadingOptions | None,
        collator: Callable | None,
    ):
        for name, value, cls in (
            ("planner", planner, PlannerConfig),
            ("bad_data", bad_data, BadDataPolicy),
            ("loading", loading, LoadingOptions),
        ):
            check_option(name, value, cls)
        for name, value, cls in (
            ("source", source, Source),
            ("schema", schema, BatchSchema),
            ("layout", layout, ParallelLayout),
        ):  # (None too: each is required)
            if not isinstance(value, cls):
                raise PlanError(f"{name}: expected a {cls.__name__}, got {type(value).__name__}")
        if collator is not None and not callable(collator):
            raise PlanError(
                f"collator: expected a callable (list of samples -> batch) or None, got "
                f"{type(collator).__name__}"
            )
        self.source, self.schema, self.layout, self.token_budget = (
            source,
            schema,
            layout,
            token_budget,
        )
        self.workers = workers
        self.seed = check_count("seed", seed)
        self.planner = planner or PlannerConfig()
        self.bad_data = bad_data or BadDataPolicy()
        self.loading = loading or LoadingOptions()
        self.collator = collator or THDCollator(
            schema=schema, layout=layout, cp_rank=workers.cp_rank
        )
        if (
            self.planner.hybrid_cp
        ):  # each CP rank's batch: its sub-group's shards (plan/hybrid_cp.py)
            self.collator = HybridCPCollator(
                collator=self.collator,
                token_budget=token_budget,
                cost=self.planner.cost,
                comm_ratio=self.planner.cp_comm_ratio,
            )
        self._capacity = microbatch_capacity(
            layout, token_budget
        )  # arithmetic only: a bad budget fails here
        self._schema_fingerprint = schema.fingerprint()
        self._fingerprint: dict | None = None  # the data's, set by prepare()
        self._load_report = BadDataReport()
        self._epoch, self._position = 0, 0
        self._resized: tuple[int, tuple[Segment, ...]] = (-1, ())  # (epoch, its earlier segments)
        self._active: object | None = None

    # ---- the rank keywords
    # ---------------------------------------------------------------------------
    dp_rank = property(lambda self: self.workers.dp_rank)
    dp_size = property(lambda self: self.workers.dp_size)
    cp_rank = property(lambda self: self.workers.cp_rank)
    num_workers = property(lambda self: self.workers.num_workers)
    group = property(lambda self: self.workers.group)

    @classmethod
    def from_parallel_state(
        cls,
        source: Source,
        *,
        schema: BatchSchema,
        token_budget: int,
        layout: ParallelLayout | None = None,
        **kwargs,
    ):
        """Ranks (and, without ``layout``, tp/cp sizes) read from megatron-core's ``parallel_state``
        when initialised, else from ``torch.distributed`` (every rank a DP rank, no CP); a
        ``workers=`` :class:`~prealign.loaders.options.WorkerConfig` keeps its ``num_workers`` and
        ``group``."""
        from prealign.schemas.parallel_state import data_parallel_info

        info = data_parallel_info()
        if layout is None:
            layout = ParallelLayout(tp=info["tp"], cp=info["cp"])
        elif (layout.tp, layout.cp) != (info["tp"], info["cp"]):
            raise PlanError(
                f"layout tp={layout.tp}, cp={layout.cp} but the process groups have "
                f"tp={info['tp']}, cp={info['cp']}"
            )
        ranks = {
            "dp_rank": info["dp_rank"],
            "dp_size": info["dp"],
            "cp_rank": info["cp_rank"] if info["cp"] > 1 else None,
        }
        if (
            kwargs.get("workers") is not None
        ):  # its ranks are the process groups'; its workers and group stay
            check_option("workers", kwargs["workers"], WorkerConfig)
            return cls(
                source,
                schema=schema,
                layout=layout,
                token_budget=token_budget,
                **{**kwargs, "workers": dataclasses.replace(kwargs["workers"], **ranks)},
            )
        return cls(
            source, schema=schema, layout=layout, token_budget=token_budget, **ranks, **kwargs
        )

    def prepare(self):
        """Set up what the loader needs before its first batch (the data's fingerprint at least); a
        no-op once done."""
        raise NotImplementedError

    # ---- epochs and the one live iterator
    # --------------------------------------------------------------
    def _normalised(self) -> tuple[int, int]:
        """(epoch, position) of the next batch."""
        return self._epoch, self._position

    @property
    def epoch(self) -> int:
        return self._normalised()[0]

    def epoch_offset(self, epoch: int | None = None) -> int:
        """Micro-batches per rank that ``epoch`` (default: the current one) served before the
        segment this loader serves it in (0 unless it was resumed under another configuration):
        ``batch["microbatch"] + loader.epoch_offset(batch["epoch"])`` counts each rank's
        micro-batches from the start of the epoch across resizes (``microbatch``, ``len()`` and
        ``plan()`` are the segment's)."""
        epoch = self.epoch if epoch is None else check_count("epoch", epoch)
        return sum(s.position for s in self._resized[1]) if self._resized[0] == epoch else 0

    def set_epoch(self, epoch: int) -> None:
        """Go to the start of ``epoch``; the epoch in progress keeps its position (a live iterator
        over another epoch stops with :class:`~prealign.loaders.errors.LoaderUsageError`)."""
        epoch = check_count("epoch", epoch)
        if epoch != self._normalised()[0]:
            self._epoch, self._position = epoch, 0
            self._set_resized(-1, ())
            self._active = None

    def __iter__(self):
        """The rest of the current epoch; starting another iterator stops this one (at its next
        batch)."""
        token = self._active = object()
        try:
            yield from self._batches(token)
        finally:
            if self._active is token:
                self._active = None

    def _batches(self, token: object):
        raise NotImplementedError

    def _check_live(self, token: object) -> None:
        if self._active is not token:
            raise LoaderUsageError(
                f"{type(self).__name__}: a newer iterator over this loader was started (or "
                f"set_epoch moved it); iterate one at a time"
            )

    def _data_loader(self, dataset, *, persistent: bool, **kwargs) -> DataLoader:
        """A torch DataLoader over ``dataset`` with the loader's workers and
        :class:`LoadingOptions`; its persistent workers are shut down gracefully when the process
        exits (:func:`_shut_down_workers`)."""
        lo, workers = self.loading, self.num_workers > 0
        if workers and lo.prefetch_factor is not None:
            kwargs["prefetch_factor"] = lo.prefetch_factor
        loader = DataLoader(
            dataset,
            num_workers=self.num_workers,
            pin_memory=lo.pin_memory,
            persistent_workers=persistent and lo.persistent_workers and workers,
            multiprocessing_context=lo.multiprocessing_context if workers else None,
            worker_init_fn=functools.partial(init_worker, shm_cap=lo.shm_cap) if workers else None,
            timeout=lo.timeout,
            **kwargs,
        )
        if workers:
            _WORKER_LOADERS.add(loader)
        return loader

    def _served(self, loader: DataLoader, token: object):
        """``loader``'s items through the one worker path (typed errors as their own type, a dead
        worker a WorkerError), stopping when a newer iterator took over."""
        yield from worker_batches(loader, before_each=lambda: self._check_live(token))

    def _count_skipped(self, skipped, *, warn: bool) -> None:
        """Count the records (:class:`~prealign.loaders.policy.BadRecord`) of samples left out while
        loading (and warn, if ``warn``)."""
        for rec in skipped:
            self._load_report.add(rec)
            if warn:
                warnings.warn(
                    BadSampleWarning(
                        f"skipped {rec.where} at load time ({rec.reason}): {rec.message}"
                    )
                )

    # ---- state
    # ---------------------------------------------------------------------------------------
    def _config(self) -> dict:
        """What shapes the batches (a state resumes only under the same)."""
        return {
            "seed": self.seed,
            "dp_size": self.dp_size,
            "token_budget": self.token_budget,
            "layout": self.layout.to_dict(),
            "schema": self._schema_fingerprint,
            "planner": self.planner.to_dict(),
        }

    def _data(self) -> dict:
        """Fingerprints of the data, computed once by :meth:`prepare`."""
        return self.prepare()._fingerprint

    def _segment(self, config: dict, position: int) -> Segment:
        """The :class:`Segment` of a run of ``config`` (a :meth:`_config`, or a state's: checked)
        that served ``position`` micro-batches."""
        planner = config.get("planner")
        return Segment.checked(
            dp_size=config.get("dp_size"),
            num_workers=config.get("num_workers"),
            microbatches_per_step=planner.get("microbatches_per_step")
            if isinstance(planner, dict)
            else None,
            position=position,
            where="config",
            min_position=0,
        )

    def _set_resized(self, epoch: int, segments: tuple[Segment, ...]) -> None:
        """Serve ``epoch`` after its earlier ``segments`` (``(-1, ())``: none)."""
        self._resized = (epoch, segments)

    def _check_position(self, epoch: int, position: int) -> None:
        """Refuse a position this loader cannot reach, its earlier segments set (default: nothing to
        check)."""

    def _check_segment_sizes(self, segments: tuple[Segment, ...]) -> None:
        """Refuse earlier segments with more ranks (readers) than the epoch has samples (default:
        none to refuse): replaying one costs time and memory in its size, and no real run is that
        wide."""

    def state_dict(self) -> dict:
        """JSON-serialisable state, identical on every rank of the run
        (:mod:`prealign.loaders.state`); touches no file."""
        data = self._data()
        epoch, position = self._normalised()
        segments = self._resized[1] if self._resized[0] == epoch else ()
        return LoaderState(
            epoch=epoch,
            position=position,
            config=self._config(),
            data=data,
            kind=self.state_kind,
            segments=segments,
        ).to_dict()

    def load_state_dict(self, state) -> None:
        """Resume: the next batches are exactly those the saved run would have yielded next, or,
        when the state was saved under another of :attr:`elastic` (``dp_size``...), the rest of its
        epoch re-planned for this run (:mod:`prealign.loaders.plan.elastic`). Refuses
        (:class:`~prealign.loaders.errors.ResumeError`) a state of another kind, version,
        configuration or data, and (:class:`~prealign.loaders.errors.LoaderUsageError`) any while an
        iterator is live."""
        if self._active is not None:
            raise LoaderUsageError(
                f"{type(self).__name__}.load_state_dict: a live iterator over this loader "
                f"(epoch {self._epoch}, position {self._position}); exhaust it or close it "
                f"(it.close()) first"
            )
        st = LoaderState.from_dict(state, kind=self.state_kind)
        config = self._config()
        st.check_compatible(
            config, self._data(), elastic=tuple(_CONFIG_KEY[k] for k in self.elastic)
        )
        if st.segments and not self.elastic:
            raise ResumeError(
                f"{type(self).__name__}: the state has segments served under other configurations "
                f"({len(st.segments)}), which this loader cannot re-plan"
            )
        saved, here = self._segment(st.config, st.position), self._segment(config, 0)
        check_segments(st.segments, saved, here, self.elastic)
        self._check_segment_sizes(st.segments)
        segments, position = resumed_segments(st.segments, saved, here, self.elastic)
        before = self._resized
        self._set_resized(st.epoch, segments)
        try:
            self._check_position(st.epoch, position)
        except BaseException:
            self._set_resized(*before)
            raise
        self._epoch, self._position = st.epoch, position
