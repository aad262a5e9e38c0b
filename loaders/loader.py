"""``PackedLoader``: planned, DP-balanced, exactly resumable packed batches on a torch DataLoader.

    source ──index pass (once)──► lengths ──planner (main process, every rank the same plan)──►
    this rank's micro-batches ──Request──► DataLoader workers: read + transform + collate ──► batch

Workers only load and collate the sample lists the planner chose, so the order of batches does not
depend on the number of workers, and the state is just ``(epoch, position)``: resuming replays the
plan and skips the first ``position`` micro-batches (nothing prefetched is lost or repeated). A
state of another ``dp_size`` or ``microbatches_per_step`` re-plans the rest of its epoch from the
samples not yet served (:mod:`prealign.loaders.plan.elastic`, ``docs/resume.md``).

Ranks: TP ranks of a DP group build identical batches (nothing here depends on the TP rank); CP
ranks of a DP group get complementary shards of the same micro-batch (the collator's ``cp_rank``;
under ``PlannerConfig(hybrid_cp=True)`` the shards of their CP sub-group's sequences,
:class:`~prealign.loaders.plan.hybrid_cp.HybridCPCollator`);
DP ranks get disjoint micro-batches that together hold every sample once per epoch, the same number
on every rank in every step.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from itertools import islice
from typing import Callable

import numpy as np
import torch

from prealign.loaders.core import LoaderCore, unpacked
from prealign.loaders.errors import BadSampleError, ResumeError, SourceChangedError
from prealign.loaders.handoff.batch_share import BatchShare
from prealign.loaders.handoff.fetched import Fetched
from prealign.loaders.handoff.transport import pack_batch
from prealign.loaders.index.build import build_index
from prealign.loaders.index.sample_checks import has_media, media_keys
from prealign.loaders.index.sample_index import SampleIndex
from prealign.loaders.index.shard_checks import check_all_shards
from prealign.loaders.index.source_index import check_index
from prealign.loaders.mixture import Mixture
from prealign.loaders.options import (
    IndexOptions,
    LoadingOptions,
    ShuffleOptions,
    WorkerConfig,
    check_option,
    worker_config,
)
from prealign.loaders.plan.planner import MicrobatchPlan, PlannerConfig
from prealign.loaders.plan.schedule import Request, Schedule, check_count
from prealign.loaders.policy import (
    BadDataPolicy,
    BadDataReport,
    BadRecord,
    BadSampleWarning,
    OnBadSample,
    Oversize,
    PackStrategy,
)
from prealign.loaders.serve.workers import hand_over
from prealign.loaders.shaping import filler_length, filler_sample, truncate_sample
from prealign.loaders.sources.source import Source
from prealign.loaders.state import LoaderState
from prealign.schemas.errors import ConfigError, PrealignError, SampleError
from prealign.schemas.layout import ParallelLayout
from prealign.schemas.schema import BatchSchema


def _with_media_flags(
    index: SampleIndex, source: Source, schema: BatchSchema, max_len: int
) -> SampleIndex:
    """``index`` with ``media`` filled in, for an index that lacks it (built by other code): only
    the samples the planner would cut (longer than ``max_len``) are loaded, to see whether they
    carry media."""
    keys = media_keys(schema)
    media = np.zeros(len(index), dtype=bool)
    for i in np.nonzero(index.lengths > max_len)[0]:
        media[i] = has_media(source.load(tuple(index.locations[i].tolist())), keys)
    return dataclasses.replace(index, media=media)


class _PlannedSamples:
    """What DataLoader workers hold: the source, the index locations and the truncation length."""

    def __init__(
        self, source: Source, index: SampleIndex, schema: BatchSchema, max_len: int, filler_len: int
    ):
        self.source, self.schema, self.max_len, self.filler_len = (
            source,
            schema,
            max_len,
            filler_len,
        )
        self.locations, self.lengths = index.locations, index.lengths

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def _load(self, i: int) -> dict:
        sample = self.source.load(tuple(self.locations[i].tolist()))
        n = int(self.lengths[i])
        ids = sample.get("input_ids")
        got = len(ids) if ids is not None and hasattr(ids, "__len__") else None
        if got != n:
            raise SourceChangedError(
                f"sample {i} ({self.source.where(tuple(self.locations[i].tolist()))}): "
                f"indexed with {n} tokens, loaded with {got}; the data or the transform "
                f"is not deterministic{_rebuild_hint(self.source)}"
            )
        return truncate_sample(sample, self.schema, self.max_len) if n > self.max_len else sample

    def where(self, i: int) -> str:
        """Name of index row ``i`` for error messages: the source's name of its location."""
        return self.source.where(tuple(self.locations[i].tolist()))

    def _filler(self, i: int) -> dict:
        """A filler shaped like index row ``i``: loaded whole (not truncated: :func:`filler_sample`
        empties its media first, then cuts it to the filler length)."""
        sample = self.source.load(tuple(self.locations[i].tolist()))
        return filler_sample(sample, self.schema, self.filler_len)

    skip_at_load: bool = False
    """Under the skip policy: a sample that fails to load (found bad only now: an index built from
    headers checks less than the full pass) is left out of its micro-batch and reported, not
    fatal."""

    def __getitems__(self, request: Request):
        """The micro-batch's samples as a :class:`~prealign.loaders.handoff.fetched.Fetched`, with
        :meth:`where` for the collate_fn's error messages (and, under the skip policy, the samples
        left out at load time, their ``BadRecord``). In a worker, a typed error is handed to the
        collate_fn in place of the samples and returned from the worker as the batch
        (:func:`~prealign.loaders.serve.workers.worker_batches`
        raises it)."""
        try:
            if not request.indices:
                return Fetched(request, [self._filler(request.filler_of)], self.where)
            read_ahead = getattr(self.source, "read_ahead", None)
            if read_ahead is not None:  # (one read deadline for the micro-batch's shards)
                read_ahead(self.locations[list(request.indices)])
            if not self.skip_at_load:
                return Fetched(request, [self._load(i) for i in request.indices], self.where)
            samples, kept, skipped = [], [], []
            for i in request.indices:
                try:
                    samples.append(self._load(i))
                    kept.append(i)
                except SampleError as exc:
                    skipped.append(BadRecord.of_error(exc, f"{self.where(i)} (index row {i})"))
            if not samples:
                raise BadSampleError(
                    sample=self.where(request.indices[0]),
                    field=None,
                    expected="a loadable sample in the micro-batch",
                    actual=f"all {len(skipped)} failed: {skipped[0].message}",
                )
            return Fetched(
                dataclasses.replace(request, indices=tuple(kept)), samples, self.where, skipped
            )
        except PrealignError as exc:
            return Fetched(request, hand_over(exc), self.where)


@dataclass(frozen=True)
class _CollatePlanned:
    """collate_fn: the collator's batch plus ``sample_index`` int64 ``[N]`` (index rows; empty for a
    filler), ``is_filler`` bool, ``epoch`` and ``microbatch`` ints."""

    collator: Callable
    pack: bool = False
    """In worker processes: hand the batch over as one buffer
    (:mod:`prealign.loaders.handoff.transport`)."""

    def __call__(self, fetched: Fetched):
        request, samples, where = fetched.request, fetched.samples, fetched.where
        if isinstance(samples, PrealignError):
            return samples
        skipped = (
            None if fetched.skipped is None else list(fetched.skipped)
        )  # None: not the skip policy
        while True:
            try:
                batch = self.collator(samples)
                break
            except (
                SampleError
            ) as exc:  # it names a position in the micro-batch: name the dataset sample
                err = _renamed(exc, request, where)
                pos = exc.sample
                if (
                    skipped is None
                    or len(samples) < 2
                    or isinstance(pos, bool)
                    or not isinstance(pos, int)
                    or not 0 <= pos < len(samples)
                ):
                    if self.pack:
                        return err
                    raise err from exc
                skipped.append(BadRecord.of_error(err))  # found bad at load: left out
                samples = samples[:pos] + samples[pos + 1 :]
                request = dataclasses.replace(
                    request, indices=request.indices[:pos] + request.indices[pos + 1 :]
                )
            except PrealignError as exc:
                if self.pack:
                    return exc
                raise
        if skipped:
            batch["skipped_at_load"] = skipped
        members = batch.get(
            "hybrid_cp_members"
        )  # hybrid CP: this rank holds only its block's samples
        ids = (
            request.indices
            if members is None or not request.indices
            else [request.indices[i] for i in members]
        )
        batch["sample_index"] = torch.tensor(ids, dtype=torch.int64)
        batch["is_filler"] = not request.indices
        batch["epoch"] = request.epoch
        batch["microbatch"] = request.position
        return pack_batch(batch) if self.pack else batch


def _renamed(exc: SampleError, request: Request, where: Callable[[int], str]) -> SampleError:
    """``exc`` (same type, field, expected, actual, reason, hint) naming the dataset sample instead
    of its position ``exc.sample`` in ``request``'s micro-batch: ``"<source name> (index row
    i)"``."""
    pos = exc.sample
    if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos < len(request.indices):
        return exc  # a batch-level problem, or a filler: nothing to rename
    row = request.indices[pos]
    name = f"{where(row)} (index row {row})"
    out = type(exc).__new__(
        type(exc)
    )  # not the constructor: subclasses take other arguments (MediaError)
    out.__dict__.update(exc.__dict__)
    out.sample = name
    out.args = (str(exc).replace(f"sample {pos}", f"sample {name}", 1),)  # the header comes first
    return out


class _Requests:
    """batch_sampler whose content is set before each epoch (so persistent workers can be
    reused)."""

    def __init__(self):
        self.requests: list[Request] = []

    def __iter__(self):
        return iter(self.requests)

    def __len__(self) -> int:
        return len(self.requests)


class PackedLoader(LoaderCore):
    """Iterable of collated, token-budgeted micro-batches for one (DP rank, CP rank).

    Iterating yields the rest of the current epoch and then moves to the next; :meth:`set_epoch`
    jumps to an epoch (a no-op for the epoch in progress, so a resumed position is kept).
    Each batch is the collator's output (``THDCollator(schema, layout, cp_rank)`` by default: token
    fields ``[1, T/cp, *dense]`` with ``T <= token_budget``, ``cu_seqlens*`` ...) plus
    ``sample_index`` int64 ``[N]`` (rows of :attr:`index`), ``is_filler`` bool, ``epoch`` and
    ``microbatch`` ints. Under ``PlannerConfig(hybrid_cp=True)`` a rank's batch holds only its CP
    sub-group's sequences (``sample_index`` lists them) plus ``local_cp_size`` and
    ``hybrid_cp_members`` (``docs/balance.md``).

    ``token_budget``: global padded THD length of one micro-batch (one CP group; each CP rank holds
    ``budget / cp``). ``workers``: where it runs (:class:`~prealign.loaders.options.WorkerConfig`:
    DP and CP ranks, DataLoader workers, process group), or the same as the flat keywords
    ``dp_rank``, ``dp_size``, ``cp_rank``, ``num_workers``, ``group`` (defaults: rank 0 of 1, no CP
    shard, no workers, the world). The rarer knobs are option objects
    (:mod:`prealign.loaders.options`): ``planner`` (:class:`PlannerConfig`: strategy, buffer,
    oversize policy, ``k`` micro-batches per step), ``bad_data`` (:class:`BadDataPolicy` for samples
    that fail to decode / transform / validate in the index pass), ``shuffle``
    (:class:`ShuffleOptions`), ``indexing`` (:class:`IndexOptions`: a prebuilt index, index workers,
    distributed pass), ``loading`` (:class:`LoadingOptions`: DataLoader settings). ``collator``:
    another collate callable (e.g. ``THDCollator(..., defer_cp_shard=True)``) that pads exactly as
    ``layout`` says. ``share``: a :class:`~prealign.loaders.handoff.batch_share.BatchShare`
    (opt-in): the CP ranks of a node load and collate each micro-batch once between them. ``group``:
    the process group of the distributed index pass.

    The constructor only checks its arguments: no I/O, no collective. The index pass (a collective
    with ``IndexOptions(distributed=True)`` and a process group) runs on first use (``len``,
    iteration, ``plan``, ``state_dict``, ``report``, ``index``...) or at an explicit
    :meth:`prepare`.

    A state saved under another ``dp_size`` or ``microbatches_per_step`` resumes too: the rest of
    its epoch is re-planned for this run from the samples the saved run had not served
    (:mod:`prealign.loaders.plan.elastic`).
    """

    elastic = ("dp_size", "microbatches_per_step")

    def __init__(
        self,
        source: Source,
        *,
        schema: BatchSchema,
        layout: ParallelLayout,
        token_budget: int,
        seed: int = 0,
        workers: WorkerConfig | None = None,
        planner: PlannerConfig | None = None,
        bad_data: BadDataPolicy | None = None,
        shuffle: ShuffleOptions | None = None,
        indexing: IndexOptions | None = None,
        loading: LoadingOptions | None = None,
        collator: Callable | None = None,
        share: "BatchShare | None" = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        cp_rank: int | None = None,
        num_workers: int | None = None,
        group=None,
    ):
        check_option("shuffle", shuffle, ShuffleOptions)
        check_option("indexing", indexing, IndexOptions)
        check_option("share", share, BatchShare)
        if share is not None and getattr(planner, "hybrid_cp", False):
            raise ConfigError(
                "share: BatchShare publishes one collated micro-batch for the whole CP group, "
                "while "
                "under PlannerConfig(hybrid_cp=True) each CP sub-group collates its own samples; "
                "use one of them"
            )
        workers = worker_config(
            workers,
            dp_rank=dp_rank,
            dp_size=dp_size,
            cp_rank=cp_rank,
            num_workers=num_workers,
            group=group,
        )
        super().__init__(
            source,
            schema=schema,
            layout=layout,
            token_budget=token_budget,
            workers=workers,
            seed=seed,
            planner=planner,
            bad_data=bad_data,
            loading=loading,
            collator=collator,
        )
        self.shuffle_options = shuffle or ShuffleOptions()
        self.shuffle, self.shuffle_window = (
            self.shuffle_options.enabled,
            self.shuffle_options.window,
        )
        self.indexing = indexing or IndexOptions()
        self.share = share
        self._index: SampleIndex | None = None
        self._mixture_setup()
        self._failed_report: BadDataReport | None = None  # of an index pass that raised

    def prepare(self) -> "PackedLoader":
        """Run the index pass (or load the prebuilt index) and set up the plan and the DataLoader; a
        no-op once done. Every rank must call it (or use the loader) when the pass is
        distributed."""
        if self._index is not None:
            return self
        source, schema, layout, opts = self.source, self.schema, self.layout, self.indexing
        cap, num_workers = self._capacity, self.num_workers
        index = SampleIndex.load(opts.prebuilt) if isinstance(opts.prebuilt, str) else opts.prebuilt
        if index is not None:  # a reused index must describe this data (issue #7): before any batch
            check_index(index, source)
        elif isinstance(source, Mixture):  # each component's pass, merged (loaders/mixture.py)
            index = source.build_index(
                schema,
                policy=self.bad_data,
                num_workers=num_workers if opts.workers is None else opts.workers,
                distributed=opts.distributed,
                group=self.group,
            )
        else:
            try:
                index = build_index(
                    source,
                    schema,
                    policy=self.bad_data,
                    num_workers=num_workers if opts.workers is None else opts.workers,
                    distributed=opts.distributed,
                    group=self.group,
                )
            except PrealignError as exc:  # what the pass counted before it stopped: loader.report
                self._failed_report = getattr(exc, "report", None) or BadDataReport()
                raise
        if isinstance(source, Mixture):  # (an index built elsewhere: its rows by component)
            index = source.adopt(index)
        if (
            index.media is None
            and media_keys(schema)
            and self.planner.oversize is Oversize.TRUNCATE
        ):
            index = _with_media_flags(index, source, schema, cap)
        self._schedule = Schedule(
            index,
            layout=layout,
            token_budget=self.token_budget,
            dp_size=self.dp_size,
            planner=self.planner,
            seed=self.seed,
            shuffle=self.shuffle,
            sequential=source.sequential,
            window=self.shuffle_window,
            step_window=64
            if getattr(source, "stream_only", getattr(source, "streaming", False))
            else None,
        )
        if isinstance(source, Mixture):
            self._mixture_schedule()
        self._schedule.resized = self._resized
        self._requests = _Requests()
        planned = _PlannedSamples(source, index, schema, cap, filler_length(layout))
        self._schedule.where = planned.where  # (an oversize sample named by index row and location)
        planned.skip_at_load = self.bad_data.on_error is OnBadSample.SKIP
        collate_fn = _CollatePlanned(self.collator, pack=num_workers > 0)
        description = (  # (stats local shards: once, here, never in state_dict)
            source.describe() if self.share is not None else {"kind": _source_kind(source)}
        )
        if (
            self.share is not None
        ):  # CP peers read each other's micro-batches (loaders/handoff/batch_share.py)
            planned, collate_fn = self.share.attach(
                planned,
                collate_fn,
                collator=self.collator,
                cp_rank=self.cp_rank,
                scope={
                    "dp_rank": self.dp_rank,
                    "config": self._config(),
                    "data": [len(index), index.digest],
                    "source": description,
                },
                transform=getattr(self.source, "transform", None),
            )
        self._loader = self._data_loader(
            planned, persistent=True, batch_sampler=self._requests, collate_fn=collate_fn
        )
        # truncations/skips depend on lengths and media flags only: the same every epoch
        screened, order0 = self._schedule.screening()
        self._oversize = screened
        self._skipped_media = tuple(sorted(int(order0[p]) for p in screened.skipped_media))
        self._fingerprint = {
            "source": description.get("kind"),
            "num_samples": len(index),
            "digest": index.digest,
        }
        self._index = index
        self._announce_oversize()
        return self

    def verify_shards(self) -> int:
        """Check every shard against its sidecar now (size, first and last 64 KiB: what each shard's
        first read checks, :class:`~prealign.loaders.index.sidecar.ShardChecks`), on a few threads;
        raises the first :class:`~prealign.loaders.errors.MissingShardError` / ``ChangedShardError``
        in shard order. Returns the number of shards checked (0 when none came from sidecars). The
        loader itself never waits for it."""
        return check_all_shards(self.prepare().source)

    @property
    def index(self) -> SampleIndex:
        """The :class:`SampleIndex` (runs :meth:`prepare` first)."""
        return self.prepare()._index

    # ---- iteration ------------------------------------------------------------------------------
    def _normalised(self) -> tuple[int, int]:
        """(epoch, position) with a finished epoch read as the start of the next one."""
        self.prepare()
        if self._position >= self._schedule.count_to(self._epoch, self._position):
            return self._epoch + 1, 0
        return self._epoch, self._position

    def _batches(self, token: object):
        epoch, start = self._normalised()
        self._epoch, self._position = epoch, start
        self._requests.requests = self._schedule(epoch, self.dp_rank, start)
        try:
            for batch in self._served(self._loader, token):
                batch = unpacked(batch)
                self._count_skipped(batch.pop("skipped_at_load", ()), warn=self.bad_data.warn)
                if (
                    self._component_of is not None
                ):  # which mixture component each sequence came from
                    batch["sample_component"] = torch.from_numpy(
                        self._component_of[batch["sample_index"].numpy()]
                    )
                self._position = batch["microbatch"] + 1
                yield batch
        finally:  # the shard files this process read (num_workers=0): closed at the epoch's end
            if self.num_workers == 0 and callable(getattr(self.source, "close_files", None)):
                self.source.close_files()
        if self._active is token:
            self._epoch, self._position = epoch + 1, 0

    def __len__(self) -> int:
        """Micro-batches in the current epoch (the same on every DP rank; after a resize, in its
        segment)."""
        epoch = self._normalised()[0]  # (prepares)
        return self._schedule.num_microbatches(epoch)

    def plan(self, epoch: int | None = None) -> MicrobatchPlan:
        """The (all-rank) plan of ``epoch`` (default: the current one), with its statistics; of an
        epoch resumed after a resize, the plan of the samples its earlier segments left."""
        epoch = self.epoch if epoch is None else check_count("epoch", epoch)
        return self.prepare()._schedule.plan(epoch)[1]

    def epoch_samples(self, epoch: int | None = None) -> list[tuple[int, ...]]:
        """This rank's micro-batches of ``epoch`` as tuples of sample ids (what batches'
        ``sample_index`` hold)."""
        e = self.epoch if epoch is None else check_count("epoch", epoch)
        return [r.indices for r in self.prepare()._schedule(e, self.dp_rank)]

    # ---- bad data -------------------------------------------------------------------------------
    @property
    def report(self) -> BadDataReport:
        """Everything left out or cut: index-pass skips (by reason) plus oversize truncations/skips
        (``oversize_truncated``, ``oversize_skipped``, and ``oversize_media`` for samples carrying
        media that ``Oversize.TRUNCATE`` leaves out rather than cut, each one named). After a
        :meth:`prepare` that raised (a bad sample under ``raise``, too many under ``skip``): what
        its index pass counted before it stopped, without running it again."""
        if self._index is None and self._failed_report is not None:
            return BadDataReport(
                counts=dict(self._failed_report.counts), examples=list(self._failed_report.examples)
            )
        self.prepare()
        rep = BadDataReport(
            counts=dict(self.index.report.counts), examples=list(self.index.report.examples)
        )
        rep.examples.extend(self._load_report.examples)  # found bad only when loaded (counted once)
        for reason, n in self._load_report.counts.items():
            rep.counts[reason] = rep.counts.get(reason, 0) + n
        over = self._oversize
        if over.truncated:
            rep.counts["oversize_truncated"] = len(over.truncated)
        if over.skipped:
            rep.counts["oversize_skipped"] = len(over.skipped)
        for i in self._skipped_media:
            where = self.source.where(tuple(self.index.locations[i].tolist()))
            rep.add(
                BadRecord(
                    "oversize_media",
                    where,
                    f"{int(self.index.lengths[i])} tokens > "
                    f"{over.capacity} (token_budget {self.token_budget}) and carries "
                    f"media: left out, not truncated",
                )
            )
        return rep

    def _announce_oversize(self) -> None:
        over = self._oversize
        if over.truncated or over.skipped:
            warnings.warn(
                BadSampleWarning(
                    f"{len(over.truncated)} sample(s) truncated ({over.cut_tokens} tokens cut) and "
                    f"{len(over.skipped)} skipped by the oversize policy "
                    f"{self.planner.oversize.value!r} "
                    f"(token_budget {self.token_budget}, max sample length {over.capacity})"
                ),
                stacklevel=3,
            )
        if over.skipped_media:
            warnings.warn(
                BadSampleWarning(
                    f"{len(over.skipped_media)} sample(s) carrying media skipped, not truncated "
                    f"(oversize_media): "
                    f"longer than {over.capacity} tokens (token_budget {self.token_budget}), and "
                    f"a cut could split an "
                    f"image's tokens from its pixel_values / image_grid_thw; raise token_budget "
                    f"to keep them"
                ),
                stacklevel=3,
            )

    # ---- state ----------------------------------------------------------------------------------
    def _config(self) -> dict:
        return {**super()._config(), "shuffle": self.shuffle, "shuffle_window": self.shuffle_window}

    def _set_resized(self, epoch: int, segments: tuple) -> None:
        super()._set_resized(epoch, segments)
        if self._index is not None:
            self._schedule.resized = self._resized

    def _check_segment_sizes(self, segments: tuple) -> None:
        """Refuse a segment with more DP ranks than the data has samples."""
        n = len(self.index)
        for i, seg in enumerate(segments):
            if seg.dp_size > n:
                raise ResumeError(
                    f"loader state: key segments[{i}].dp_size: expected at most the {n} samples of "
                    f"the data, got {seg.dp_size}"
                )

    def _check_position(self, epoch: int, position: int) -> None:
        """Refuse a ``position`` past the end of its epoch (equal to its length: the epoch is
        finished)."""
        have = self.prepare()._schedule.count_to(epoch, position)
        if position > have:
            raise ResumeError(
                f"loader state: key 'position': {position} is past the end of epoch {epoch} "
                f"({have} micro-batches per rank)"
            )

    # ---- mixtures (loaders/mixture.py, docs/mixtures.md)
    # ----------------------------------------------
    _component_of = None
    """int64 ``[N]``: the mixture component of each sample id (None: not a mixture)."""

    def _mixture_setup(self) -> None:
        """A :class:`Mixture` plans with ``STEP_FIT`` (each step the next stretch of its interleave)
        unless the planner names a strategy other than the default BFD; its steps are served in plan
        order."""
        self._phases: tuple = (-1, ())
        if isinstance(self.source, Mixture) and self.planner.strategy is PackStrategy.BFD:
            self.planner = dataclasses.replace(self.planner, strategy=PackStrategy.STEP_FIT)

    def _mixture_schedule(self) -> None:
        mixture = self.source
        self._component_of = mixture.component_of()
        self._schedule.step_window = 1
        self._schedule.groups = self._component_of if mixture.pack_within_component else None
        self._set_phases(*self._phases)

    def _set_phases(self, epoch: int, phases: tuple) -> None:
        """Earlier phases (other weights) of ``epoch``; a new order function re-plans the
        schedule."""
        self._phases = (epoch, tuple(phases))
        if self._index is None and not hasattr(self, "_schedule"):
            return
        mixture, seed, shuffle, window = self.source, self.seed, self.shuffle, self.shuffle_window

        def order_of(e, served):
            return mixture.epoch_order(
                e,
                seed=seed,
                shuffle=shuffle,
                window=window,
                served=served,
                phases=phases if e == epoch else (),
            )

        self._schedule.order_of = order_of

    def mixture_report(self, epoch: int | None = None) -> dict:
        """Over a :class:`Mixture`: per component, samples and tokens planned for ``epoch``
        (default: the current one; after a resize or a weight change, its segment's) and served so
        far on every rank, the realized share
        against the weight, and its bad samples with their reasons (:meth:`Mixture.accounting`)."""
        if not isinstance(self.source, Mixture):
            raise ConfigError(
                f"mixture_report: the loader's source is a {type(self.source).__name__}, not a "
                f"Mixture"
            )
        now, position = self._normalised()
        epoch = now if epoch is None else check_count("epoch", epoch)
        order, plan = self._schedule.plan(epoch)
        planned = order[[i for rank in plan.microbatches for mb in rank for i in mb]]
        upto = position if epoch == now else (0 if epoch > now else len(plan.microbatches[0]))
        served = [
            i
            for r in range(self.dp_size)
            for q in islice(self._schedule(epoch, r), upto)
            for i in q.indices
        ]
        return self.source.accounting(planned, np.asarray(served, np.int64))

    def state_dict(self) -> dict:
        out = super().state_dict()
        if isinstance(self.source, Mixture):
            epoch, phases = self._phases
            out["mixture"] = self.source.state_of(phases if epoch == out["epoch"] else ())
        return out

    def load_state_dict(self, state) -> None:
        """As :meth:`LoaderCore.load_state_dict`; over a :class:`Mixture`, a state saved with other
        weights resumes with what it served left out and the rest of its epoch under this mixture's
        weights."""
        if not isinstance(self.source, Mixture):
            return super().load_state_dict(state)
        if isinstance(state, (str, bytes, bytearray)):
            state = LoaderState.from_dict(state, kind=self.state_kind).to_dict() | _mixture_entry(
                state
            )
        st = LoaderState.from_dict(state, kind=self.state_kind)
        saved = state.get("mixture")
        mode, phases = self.source.resume_phases(
            saved, segments=st.segments, own=self._segment(st.config, st.position)
        )
        if mode == "next_epoch":
            state = {k: v for k, v in st.to_dict().items() if k != "segments"}
            state.update(version=2, epoch=st.epoch + 1, position=0, data=self._data())
            phases = ()
        elif mode == "changed":
            state = {k: v for k, v in st.to_dict().items() if k != "segments"}
            state.update(version=2, position=0)
        before = self._phases
        self.prepare()._set_phases(state["epoch"], phases)
        try:
            super().load_state_dict(state)
        except BaseException:
            self._set_phases(*before)
            raise


def _source_kind(source) -> str | None:
    """``source.describe()["kind"]`` without the description where the class fixes it
    (``KIND``: a webdataset source's description lists a size per shard)."""
    kind = getattr(type(source), "KIND", None)
    return kind if kind is not None else source.describe().get("kind")


def _mixture_entry(text) -> dict:
    """The ``"mixture"`` entry of a state given as JSON text (already parsed once by
    LoaderState)."""
    import json

    data = json.loads(text)
    return {"mixture": data["mixture"]} if isinstance(data, dict) and "mixture" in data else {}


def _rebuild_hint(source) -> str:
    """For a source read through sidecars: the transform it loads with and the command that rebuilds
    them."""
    if not getattr(source, "sidecars", False) or not getattr(source, "urls", None):
        return ""
    from prealign.loaders.index.hints import index_hint
    from prealign.loaders.index.sidecar import transform_name

    return (
        f", or its sidecars were built with a transform other than this loader's "
        f"{transform_name(source.transform)}: {index_hint(source)}"
    )
