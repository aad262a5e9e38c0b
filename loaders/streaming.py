"""``StreamingPackedLoader``: packed micro-batches from a stream that cannot be indexed first.

    shards (seeded order per epoch) ──split: reader g = dp_rank * W + worker──► scan ─► transform
        ─► validate (the collator, per arrival chunk) ─► bounded buffer (``buffer_size`` samples)
        ─► best-fit decreasing when full: the fullest micro-batches out, the rest wait ─► collate
    main process: one flag per micro-batch, all-reduced (MAX) over ``group``: while any rank still
    has data every rank yields (a rank out of data yields a filler: all pad, zero loss), then the
    epoch ends on every rank at the same micro-batch

Same hard budget and collator as :class:`~prealign.loaders.PackedLoader` and the same batch contract
(the collator's fields plus ``sample_index`` int64 ``[N]``, ``is_filler``, ``epoch``,
``microbatch``); ``sample_index`` holds stream ids ``shard << 32 | ordinal`` (the ordinal of the
sample in its shard).

Readers take disjoint shards (``shards[g::G]`` of the epoch's shard order, ``G = dp_size * W``);
with fewer shards than readers every reader scans them all and keeps every ``G``-th sample. Every
sample is read by exactly one reader per epoch and either packed or counted by the bad-data policy:
none is dropped or repeated. The first batch comes after at most ``buffer_size`` samples per worker.

The end-of-epoch agreement costs one ``all_reduce`` of one int64 per micro-batch on ``group``
(default: the world; every rank of it must iterate, TP/CP ranks of a DP rank read the same stream).
Without an initialised process group (or ``dp_size == 1``) there is none. It waits at most
``collective_timeout`` seconds (default 300): a peer that stopped iterating is a
:class:`~prealign.loaders.errors.CollectiveTimeoutError` naming the ranks and the position, not a
hang of the process group's own timeout (30 min by default).

Resume: the state is ``(epoch, position)``, the same on every rank, in the format of
:class:`~prealign.loaders.PackedLoader`'s (:mod:`prealign.loaders.state`; the data fingerprint is a
digest of the source's description, taken once at :meth:`~StreamingPackedLoader.prepare`).
``state_dict(cursors=True)`` adds this rank's reader *cursors* (version 4): per reader, the last
record it read (shard position, ordinal, location), its packing state (gate, fixed dims) and the
samples its buffer holds and the micro-batches of its round not served yet (ids and locations, at
most ``buffer_size`` samples), and which reader the DataLoader asks next. Loading a rank's own such
state seeks: each reader reads back its buffered samples by location, goes on in its shard after the
last record (:meth:`~prealign.loaders.sources.source.Source.scan_after`: a webdataset shard's
members before it are read, not decoded) and its DataLoader worker ``w`` plays the saved reader
``(w + next) % W``, so the batches are the uninterrupted run's at a cost that does not grow with the
position. A :class:`Mixture` stream's cursor holds each component stream's cursor and the
interleave's state (:class:`~prealign.loaders.plan.mixing.StreamMix`): it seeks every component.
Without cursors (a state of another rank, of an older prealign) loading re-reads this rank's
stream from the start of the epoch and replays the deterministic packing, skipping the first
``position`` micro-batches (cost: reading and collating that much of the stream again). A
position past the end of its epoch (every rank's stream ends before it) cannot be known before
the stream is read: it is a
:class:`~prealign.loaders.errors.ResumeError` at the first ``next``, on every rank alike. A state of
another ``num_workers`` or ``dp_size`` resumes too: at the first ``next`` every reader of the saved
run (every rank's) is replayed in this process, ids only, and the samples its DataLoader had served
(round-robin over its workers) are left out of this run's readers, which split the rest of the epoch
anew (cost: packing every old rank's served part of the stream again, and with fewer shards than old
readers reading that prefix once per old reader; the served ids are one shared sorted int64 tensor;
``docs/resume.md``).
``state_dict(cursors="all")`` (a collective) gathers every DP rank's cursors into one state
(version 6, its cursors packed; ``dst=r``: gathered to rank ``r`` only;
:func:`merge_rank_states` merges per-rank ones): under the same topology each rank
seeks as above; under another, ``load_state_dict`` folds the old readers' cursors into the shards
the epoch consumed whole (never opened again), the shards it consumed in part (entered after their
last consumed sample: a seek, an HTTP ``Range`` read) and the samples read but not served (read
back by location) (:mod:`~prealign.loaders.plan.stream_skip`), and this run's readers split the
rest: no replay, at a cost that does not grow with the position.

Options, validation, ``set_epoch``, ``from_parallel_state``, the one-live-iterator guard, the state
and the worker path (a sample's typed error raised as its own type, a dead worker a
:class:`~prealign.loaders.errors.WorkerError`) are :class:`~prealign.loaders.core.LoaderCore`'s,
shared with :class:`~prealign.loaders.PackedLoader`.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from prealign.loaders.core import LoaderCore, describe_digest, unpacked
from prealign.loaders.errors import (
    BadSampleError,
    CollectiveTimeoutError,
    OversizeSampleError,
    PlanError,
    ResumeError,
    SourceChangedError,
)
from prealign.loaders.handoff.transport import pack_batch
from prealign.loaders.index.apply_policy import FixedDims
from prealign.loaders.index.sample_checks import has_media, media_keys, validated
from prealign.loaders.mixture import Mixture
from prealign.loaders.options import LoadingOptions, WorkerConfig, check_option, worker_config
from prealign.loaders.plan.elastic import round_robin
from prealign.loaders.plan.mixing import StreamMix
from prealign.loaders.plan.packing import best_fit_decreasing
from prealign.loaders.plan.planner import PlannerConfig
from prealign.loaders.plan.stream_skip import (
    Skip,
    check_in_shards,
    check_own,
    fold,
    fold_parts,
    kept,
)
from prealign.loaders.policy import BadDataGate, BadDataPolicy, BadDataReport, BadRecord, Oversize
from prealign.loaders.serve.workers import hand_over
from prealign.loaders.shaping import filler_length, filler_sample, truncate_sample
from prealign.loaders.sources.source import Source
from prealign.loaders.sources.webdataset import WebDatasetSource
from prealign.loaders.state import (
    STREAM_STATE_KIND,
    LoaderState,
    check_cursor,
    pack_cursor,
    unpack_cursor,
)
from prealign.schemas.checks import int_at_least
from prealign.schemas.errors import ConfigError, PrealignError, SampleError
from prealign.schemas.layout import ParallelLayout
from prealign.schemas.schema import BatchSchema

_MAX_WAIT = datetime.timedelta.max.total_seconds()
"""Largest ``collective_timeout`` (about 8.6e13 s): it is waited as a ``datetime.timedelta``."""
_CHUNK = 32
STREAM_PLANNER = PlannerConfig(buffer_size=1024)
"""The streaming loader's default planner: readers hold 1,024 samples; oversize samples raise."""
_STREAM_FIELDS = ("buffer_size", "oversize")


def stream_planner(
    planner: PlannerConfig | None,
    buffer_size: int | None = None,
    oversize: Oversize | str | None = None,
) -> PlannerConfig:
    """The :class:`PlannerConfig` of a stream: ``planner`` (default :data:`STREAM_PLANNER`) with the
    ``buffer_size`` / ``oversize`` keywords (kept from the loader's first signature) applied. A
    keyword given in ``planner`` too, or a planner field a stream cannot honour (it packs best-fit
    decreasing from its buffer, one micro-batch per step) set to another value than its default, is
    a :class:`PlanError`.

    >>> skip = PlannerConfig(oversize="skip")
    >>> stream_planner(None, buffer_size=64).buffer_size, stream_planner(skip).oversize
    (64, <Oversize.SKIP: 'skip'>)
    """
    check_option("planner", planner, PlannerConfig)
    out = planner or STREAM_PLANNER
    for name, value in zip(_STREAM_FIELDS, (buffer_size, oversize)):
        if value is None:
            continue
        if planner is not None:
            raise PlanError(
                f"{name}: given twice, as a keyword and in planner= (give it in the PlannerConfig)"
            )
        out = dataclasses.replace(out, **{name: value})  # validated by PlannerConfig
    default = PlannerConfig()
    for field in dataclasses.fields(PlannerConfig):
        value = getattr(out, field.name)
        if field.name not in _STREAM_FIELDS and value != getattr(default, field.name):
            raise PlanError(
                f"planner.{field.name}: {value!r} does not apply to StreamingPackedLoader (it "
                f"packs "
                f"best-fit decreasing from its buffer, one micro-batch per step); leave it at its "
                f"default {getattr(default, field.name)!r}"
            )
    return out


def stream_id(shard: int, ordinal: int) -> int:
    """``shard << 32 | ordinal``: a sample's id in ``sample_index``.

    >>> stream_id(2, 5) >> 32, stream_id(2, 5) & 0xFFFFFFFF
    (2, 5)
    """
    return (int(shard) << 32) | int(ordinal)


def served_in(served: torch.Tensor | None, shard: int) -> np.ndarray:
    """Bool ``[max ordinal + 1]``: which ordinals of ``shard`` the sorted stream ids ``served`` hold
    (one shard's mask at a time: a reader's memory stays that of the ids).

    >>> served_in(torch.tensor([stream_id(0, 1), stream_id(2, 0), stream_id(2, 3)]), 2).tolist()
    [True, False, False, True]
    """
    if served is None or not served.numel():
        return np.zeros(0, bool)
    ids = served.numpy()
    lo, hi = np.searchsorted(ids, [stream_id(shard, 0), stream_id(shard + 1, 0)])
    ordinals = ids[lo:hi] & 0xFFFFFFFF
    mask = np.zeros(int(ordinals[-1]) + 1 if ordinals.size else 0, bool)
    mask[ordinals] = True
    return mask


def records_of(source: Source):
    """``records(shard, after, base)`` of :func:`~prealign.loaders.plan.stream_skip.kept` over
    ``source``: a shard's ``(ordinal, location, item)`` from its start, or after the record
    ``after`` (:meth:`Source.scan_after`: not decoded again); a webdataset shard with a ``base`` is
    entered at ``base``'s end (a seek, a range read), what comes before it not read at all."""
    seeks = isinstance(source, (WebDatasetSource, Mixture))

    def records(shard: int, after, base):
        if after is None:
            return ((o, loc, item) for o, (loc, item) in enumerate(source.scan(shard)))
        kw = {"seek": base[1]} if seeks and base is not None else {}
        rest = source.scan_after(shard, after[0], tuple(after[1]), **kw)
        return ((o, loc, item) for o, (loc, item) in enumerate(rest, after[0] + 1))

    return records


Entry = tuple
"""One buffered sample: ``(aligned size, stream id, sample dict, record)``, ``record`` the sample as
a cursor holds it, ``[stream id, aligned size, *location]`` (ints; made once, when the sample is
buffered)."""


def entry(size: int, sid: int, sample: dict, loc) -> Entry:
    return size, sid, sample, [sid, size, *map(int, loc)]


@dataclass(frozen=True)
class _Reader(IterableDataset):
    """One epoch of one DP rank's stream, packed; in DataLoader workers, worker ``w`` is reader
    ``dp_rank * W + (w + rotate) % W`` (its *role*). Yields ``(batch, events, mark)``: the collated
    micro-batch, the bad-data events (``[reason, where, frozen error]``) met since the previous one,
    and ``(role, cursor or None)``: the reader's cursor (:meth:`_Packer.cursor`) with the first
    micro-batch of each packing round, from which the reader goes on without re-reading what came
    before."""

    source: Source
    schema: BatchSchema
    collator: Callable
    layout: ParallelLayout
    cap: int
    buffer_size: int
    oversize: Oversize
    policy: BadDataPolicy
    dp_rank: int
    dp_size: int
    seed: int
    epoch: int
    pack: bool = False
    served: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    """Sorted int64 ``[S]`` stream ids served by earlier segments of the epoch (a resize), left out
    before the split; 8 bytes a sample, in shared memory when workers read (handed to them, not
    copied)."""
    worker: tuple[int, int] | None = None
    """(workers, worker id) of a reader replayed outside a DataLoader; ``None``: the
    DataLoader's."""
    ids_only: bool = False
    """Yield each micro-batch's stream ids instead of collating it (a replay)."""
    cursors: tuple | None = dataclasses.field(default=None, compare=False)
    """Per role, the cursor to go on from (``None``: from the start of the epoch); ``None``: all
    from the start."""
    rotate: int = 0
    """Worker ``w`` plays role ``(w + rotate) % W``: the DataLoader asks worker 0 first, the saved
    run's next reader was role ``rotate``."""
    skip: Skip | None = dataclasses.field(default=None, compare=False)
    """What earlier segments of the epoch consumed (an elastic resume,
    :mod:`~prealign.loaders.plan.stream_skip`): the readers split the shards it leaves and read its
    returned samples back."""

    def _place(self) -> tuple[int, int, int]:
        """``(role, g, G)``: this reader's role among its rank's, its number among all readers, and
        how many readers there are."""
        info = get_worker_info()
        workers, w = self.worker or ((1, 0) if info is None else (info.num_workers, info.id))
        role = (w + self.rotate) % workers
        return role, self.dp_rank * workers + role, self.dp_size * workers

    def _mine(self, at: list):
        """``(role, records, mix)``: this reader's role and its ``(shard, ordinal, location, raw)``
        in stream order; bad records as ``(shard, ordinal, location, exception or BadRecord)``.
        ``at`` is kept at the last record's ``[shard position, ordinal, location, k]``. ``mix``: a
        :class:`Mixture`'s interleave (each component's stream its own, read from its own cursor;
        the caller sets ``mix.units[0]`` to each sample's tokens once transformed), else None."""
        role, g, readers = self._place()
        n = self.source.num_shards
        order = np.random.default_rng([self.seed, self.epoch]).permutation(n).tolist()
        cursor = self.cursors[role] if self.cursors is not None else None
        if not isinstance(self.source, Mixture):
            return role, self._scanned(order, g, readers, at, cursor), None
        parts = self.source.shards_by_component(order)
        saved = None if cursor is None else cursor["mix"]
        mix = _MixCursor(self.source.stream_mix(None if saved is None else saved["state"]))
        subs = [None] * len(parts) if saved is None else saved["streams"]
        for sub in subs:
            mix.ats.append([0, -1, None, 0] if sub is None else [*sub["at"], sub["k"]])
        streams = [
            self._scanned(part, g, readers, a, sub) for part, a, sub in zip(parts, mix.ats, subs)
        ]
        return role, mix.mix(*streams), mix

    def _scanned(
        self, order: list[int], g: int, readers: int, at: list, cursor: dict | None = None
    ):
        """Reader ``g`` of ``readers``'s samples of the shards ``order`` (see :meth:`_mine`), from
        ``cursor``'s record on (the records up to it are not decoded again:
        :meth:`Source.scan_after`)."""
        order = order if self.skip is None else self.skip.remaining(order)
        split_shards = len(order) >= readers
        shards = order[g::readers] if split_shards else order
        start, k = None, 0
        if cursor is not None:
            if cursor["done"]:
                return
            (pos, last, last_loc), k = cursor["at"], cursor["k"]
            start = (pos, last, None if last_loc is None else tuple(last_loc))
        current, left_out = None, np.zeros(0, bool)
        for pos, shard, ordinal, loc, item in kept(
            shards, self.skip, records_of(self.source), start=start
        ):
            if shard != current:
                current, left_out = shard, served_in(self.served, shard)
            if ordinal < left_out.size and left_out[ordinal]:
                continue
            if not split_shards:
                k += 1
                if (k - 1) % readers != g:
                    continue
            at[:] = pos, ordinal, loc, k
            yield shard, ordinal, loc, item

    def __iter__(self):
        """The packed stream; a :class:`~prealign.schemas.errors.PrealignError` ends it, raised here
        in the main process, handed over as the last item in a worker (raised as its own type by the
        loader)."""
        try:
            yield from self._packed()
        except PrealignError as exc:
            yield hand_over(exc)

    def _packed(self):
        packer, at = _Packer(self), [0, -1, None, 0]
        role, records, mix = self._mine(at)
        seekable = not self.ids_only
        cursor = self.cursors[role] if self.cursors is not None else None
        for entries in packer.restore(cursor) if cursor is not None else ():
            yield *packer.collated(entries), (role, None)

        def rounds(final: bool):
            bins = packer.emit(final)
            mark = packer.cursor(at, bins, final, mix) if seekable else None
            for i, entries in enumerate(bins):
                yield *packer.collated(entries), (role, mark if i == 0 else None)

        if cursor is None and self.skip is not None and self.skip.returns:
            _, g, readers = self._place()  # samples an earlier segment read but did not serve
            packer.buffer += packer.read_back(self.skip.returns_of(g, readers))
            while len(packer.buffer) >= self.buffer_size:
                yield from rounds(final=False)

        for shard, ordinal, loc, item in records:
            where = self.source.where(loc) if loc is not None else f"shard {shard}"
            if isinstance(item, BadRecord):  # (a member that is not a sample: counted)
                packer.events.append(item)
                continue
            if isinstance(item, Exception):
                packer.bad(
                    where, item, as_is=False
                )  # (raised as the index raises it: from its record)
                continue
            try:
                sample = self.source.apply_transform(item, loc)
            except SampleError as exc:
                packer.bad(where, exc)
                continue
            if mix is not None:  # a mixture's interleave by tokens
                mix.mix.units[0] = len(sample.get("input_ids", ()))
            packer.pending.append((stream_id(shard, ordinal), where, sample, loc))
            waiting = len(packer.buffer) + len(packer.pending)
            if len(packer.pending) >= _CHUNK or waiting >= self.buffer_size:
                packer.validate()
            if len(packer.buffer) >= self.buffer_size:
                yield from rounds(final=False)
        packer.validate()
        while packer.buffer:
            yield from rounds(final=True)
        if packer.events:  # bad data after the last micro-batch: an empty hand-over carries it
            last = packer.cursor(at, [], True, mix) if seekable else None
            yield None, list(packer.events), (role, last)


@dataclass
class _MixCursor:
    """A :class:`Mixture` reader's position: the interleave of its component streams (``mix``)
    and each stream's ``[shard position, ordinal, location, k]`` of its last record (``ats``)."""

    mix: StreamMix
    ats: list = dataclasses.field(default_factory=list)

    def saved(self) -> dict:
        """JSON-friendly: ``{"state": the interleave's, "streams": [{at, k, done}, ...]}``, O(
        components)."""
        state = self.mix.state()
        streams = [
            {
                "at": [pos, ordinal, None if loc is None else [int(x) for x in loc]],
                "k": k,
                "done": ended,
            }
            for (pos, ordinal, loc, k), ended in zip(self.ats, state["ended"])
        ]
        return {"state": state, "streams": streams}


class _Packer:
    """One reader's packing state (was a closure): the bad-data gate, the rule that fixes named
    dims, the samples waiting to be validated, the bounded buffer, the bad-data events not handed
    over yet. :meth:`cursor` writes it down with the stream position; :meth:`restore` reads it
    back."""

    def __init__(self, reader: _Reader):
        self.reader = reader
        self.gate = BadDataGate(reader.policy)
        self.events: list = []
        self.buffer: list[Entry] = []
        self.pending: list[tuple[int, str, dict, tuple]] = []  # (id, where, sample, location)
        self.rule = FixedDims(reader.schema)  # (the index's: the first sample with a dim fixes it)
        self.mkeys = media_keys(reader.schema)

    def bad(self, where: str, err: Exception, *, as_is: bool = True) -> None:
        record = BadRecord.of_error(err, where)
        self.gate.bad(record, err if as_is else None)  # raises under RAISE / past max_consecutive
        self.events.append(record)

    def validate(self) -> None:
        r = self.reader
        results = validated([p[2] for p in self.pending], r.schema)
        for (sid, where, sample, loc), res in zip(self.pending, results):
            if isinstance(res, SampleError):
                self.bad(
                    where,
                    BadSampleError(
                        sample=where, field=res.field, expected=res.expected, actual=res.actual
                    ),
                )
                continue
            n, dims = res
            refuse = self.rule.admit(dims, where)
            if refuse is not None:
                self.bad(where, refuse(where))
                continue
            if n > r.cap:
                if r.oversize is Oversize.ERROR:
                    raise OversizeSampleError(
                        sample=where,
                        field="input_ids",
                        expected=f"<= {r.cap} tokens",
                        actual=f"{n} tokens",
                    )
                if r.oversize is Oversize.SKIP or (self.mkeys and has_media(sample, self.mkeys)):
                    reason = "oversize_skipped" if r.oversize is Oversize.SKIP else "oversize_media"
                    what = (
                        "left out"
                        if r.oversize is Oversize.SKIP
                        else "carries media: left out, not truncated"
                    )
                    self.events.append(
                        BadRecord(
                            reason,
                            where,
                            f"{n} tokens > {r.cap} (the most "
                            f"a micro-batch of the budget holds); {what}",
                        )
                    )
                    continue
                sample, n = truncate_sample(sample, r.schema, r.cap), r.cap
            self.gate.good()
            self.buffer.append(entry(r.layout.aligned_length(n), sid, sample, loc))
        self.pending.clear()

    def emit(self, final: bool) -> list[list[Entry]]:
        """The next micro-batches' samples, best-fit decreasing over the buffer: all of them when
        ``final``, else the fuller half (the rest may still grow); what they take leaves the
        buffer."""
        buffer = self.buffer
        sizes = np.array([b[0] for b in buffer], dtype=np.int64)
        bins = best_fit_decreasing(sizes, self.reader.cap, self.reader.layout.max_seqs)
        bins.sort(key=lambda b: (-int(sizes[b].sum()), min(buffer[i][1] for i in b)))
        keep = len(bins) if final else max(1, len(bins) // 2)
        used = {i for b in bins[:keep] for i in b}
        self.buffer = [buffer[i] for i in range(len(buffer)) if i not in used]
        return [[buffer[i] for i in b] for b in bins[:keep]]

    def collated(self, entries: list[Entry]):
        r = self.reader
        if r.ids_only:
            return [e[1] for e in entries], []
        batch = r.collator([e[2] for e in entries])
        batch["sample_index"] = torch.tensor([e[1] for e in entries], dtype=torch.int64)
        batch["is_filler"] = False
        batch["epoch"] = r.epoch
        batch["microbatch"] = -1
        ev = list(self.events)
        self.events.clear()
        return (pack_batch(batch) if r.pack else batch), ev

    def cursor(
        self, at: list, bins: list[list[Entry]], done: bool, mix: "_MixCursor | None" = None
    ) -> dict:
        """JSON-friendly: where the stream goes on (``at``: ``[shard position, ordinal, location]``
        of the last record read, ``k`` the records counted for a split by sample, ``done`` at its
        end), the gate's count of bad samples in a row, the fixed dims, the buffer and the
        micro-batches of this round (``bins``) as ``[id, aligned size, *location]`` (re-read at a
        resume: at most ``buffer_size`` samples); a :class:`Mixture`'s reader adds ``mix``
        (:meth:`_MixCursor.saved`: each component stream's own ``at`` / ``k`` / ``done`` and the
        interleave's state)."""
        pos, ordinal, loc, k = at
        rule = self.rule
        where = None if loc is None else [int(x) for x in loc]
        return {
            "at": [pos, ordinal, where],
            "k": k,
            "done": done,
            "gate": self.gate.consecutive,
            "rule": [rule.fixed, rule.fixed_by, rule.fields],
            "buffer": [e[3] for e in self.buffer],
            "bins": [[e[3] for e in b] for b in bins],
            **({} if mix is None else {"mix": mix.saved()}),
        }

    def restore(self, cursor: dict) -> list[list[Entry]]:
        """Set the state ``cursor`` wrote down (its samples read back by location); returns the
        round's micro-batches not served yet."""
        self.gate.consecutive = int(cursor["gate"])
        fixed, fixed_by, fields = cursor["rule"]
        self.rule.fixed, self.rule.fixed_by = dict(fixed), dict(fixed_by)
        self.rule.fields = None if fields is None else tuple(fields)
        records = [*cursor["buffer"], *(e for b in cursor["bins"] for e in b)]
        entries = self.read_back(records)
        self.buffer = entries[: len(cursor["buffer"])]
        rest = iter(entries[len(cursor["buffer"]) :])
        return [[next(rest) for _ in b] for b in cursor["bins"]]

    def read_back(self, records: list[list]) -> list[Entry]:
        """The buffered samples ``[id, aligned size, *location]`` read, transformed and cut as when
        they were buffered (validated in one call); another size is a :class:`ResumeError` (the data
        changed since the state was saved)."""
        r, samples = self.reader, [None] * len(records)
        for i in sorted(range(len(records)), key=lambda i: records[i][2:]):  # in stream order
            sid, _, *loc = records[i]
            try:
                samples[i] = r.source.apply_transform(r.source.read(tuple(loc)), tuple(loc))
            except (SampleError, SourceChangedError) as exc:
                raise ResumeError(
                    f"loader state: cursor sample {r.source.where(tuple(loc))} (id "
                    f"{sid}) is bad data now ({exc}); the data changed since the state was saved"
                ) from exc
        out = []
        for (sid, size, *loc), sample, res in zip(records, samples, validated(samples, r.schema)):
            n = res[0] if not isinstance(res, SampleError) else None
            if n is not None and n > r.cap:
                sample, n = truncate_sample(sample, r.schema, r.cap), r.cap
            if n is None or r.layout.aligned_length(n) != size:
                raise ResumeError(
                    f"loader state: cursor sample {r.source.where(tuple(loc))} (id "
                    f"{sid}): expected {size} aligned tokens, read {res!r}; the data "
                    f"changed since the state was saved"
                )
            out.append(entry(size, sid, sample, loc))
        return out


def check_streamed_mixture(source: Source) -> None:
    """A :class:`Mixture` stream reads every sample of every component once (its sizes are not
    known before it is read): a ``length`` other than ``"total"`` or a component's ``repeat`` other
    than 1 (settings of a planned epoch) is a :class:`ConfigError` naming it, never ignored."""
    if not isinstance(source, Mixture):
        return
    if source.spec.length != "total":
        raise ConfigError(
            f"StreamingPackedLoader: Mixture length: expected 'total' (a stream's epoch is every "
            f"sample once), got {source.spec.length!r}; PackedLoader plans an epoch of that length"
        )
    for name, component in source.components.items():
        if component.repeat is not None and component.repeat != 1:
            raise ConfigError(
                f"StreamingPackedLoader: mixture component {name!r}: repeat: expected None or 1 (a "
                f"stream reads every sample once), got {component.repeat!r}; give it a weight (its "
                f"share of the interleave) or use PackedLoader, which plans repeats"
            )


class StreamingPackedLoader(LoaderCore):
    """Iterable of packed micro-batches from a stream (see the module docstring). ``source``: any
    :class:`~prealign.loaders.sources.source.Source` (``HFSource`` over an ``IterableDataset``, a
    webdataset of any size); nothing is indexed. ``planner``: its ``buffer_size`` is the samples
    each reader holds before packing (default 1,024: :data:`STREAM_PLANNER`), its ``oversize`` the
    policy for a sample longer than the budget allows (the ``buffer_size`` and ``oversize``
    keywords, deprecated, set the same). ``workers`` (or the flat rank keywords) as
    :class:`~prealign.loaders.PackedLoader`'s; its ``group`` is the process group of the
    end-of-epoch agreement (default: the world). ``loading``: DataLoader settings of the readers
    (``persistent_workers`` does not apply: each epoch starts its readers afresh). The other
    arguments are :class:`~prealign.loaders.PackedLoader`'s, validated the same way.
    ``collective_timeout``: seconds the per-micro-batch agreement may wait for the other ranks
    before it is a :class:`~prealign.loaders.errors.CollectiveTimeoutError` (``None``: the process
    group's own timeout)."""

    state_kind = STREAM_STATE_KIND
    elastic = ("dp_size", "num_workers")

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
        loading: LoadingOptions | None = None,
        collator: Callable | None = None,
        collective_timeout: float | None = 300.0,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        cp_rank: int | None = None,
        num_workers: int | None = None,
        group=None,
        buffer_size: int | None = None,
        oversize: Oversize | str | None = None,
    ):
        if buffer_size is not None or oversize is not None:
            given = " and ".join(
                n
                for n, v in (("buffer_size", buffer_size), ("oversize", oversize))
                if v is not None
            )
            warnings.warn(
                f"StreamingPackedLoader({given}=...) is deprecated: give "
                f"planner=PlannerConfig({given}=...) (defaults: STREAM_PLANNER)",
                DeprecationWarning,
                stacklevel=2,
            )
        planner = stream_planner(planner, buffer_size, oversize)
        if collective_timeout is not None and (
            isinstance(collective_timeout, bool)
            or not isinstance(collective_timeout, (int, float))
            or not 0 < collective_timeout <= _MAX_WAIT  # (waited as a timedelta)
        ):
            raise PlanError(
                f"collective_timeout: expected seconds > 0 and <= {_MAX_WAIT:g}, or None (the "
                f"process group's own), got {collective_timeout!r}"
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
        check_streamed_mixture(source)
        self.collective_timeout = None if collective_timeout is None else float(collective_timeout)
        self._filler: dict | None = None
        self._served_cache: tuple = (None, None)
        self._track: _Track | None = None
        self._skip: tuple[int, Skip | None, int] = (-1, None, 0)
        """(epoch, what its earlier segments consumed, their micro-batches per rank): a version-5
        state's (an elastic resume that skips instead of replaying)."""

    buffer_size = property(lambda self: self.planner.buffer_size)
    oversize = property(lambda self: self.planner.oversize)
    cap = property(lambda self: self._capacity)

    @property
    def report(self) -> BadDataReport:
        """Everything skipped so far (by reason), as the readers met it."""
        return self._load_report

    def prepare(self) -> "StreamingPackedLoader":
        """Fingerprint the data (the source's description: shard names and sizes) once, for the
        state; a no-op once done. Nothing is read or indexed."""
        if self._fingerprint is None:
            description = self.source.describe()
            self._fingerprint = {
                "source": description.get("kind"),
                "num_shards": self.source.num_shards,
                "digest": describe_digest(description),
            }
        return self

    # ---- the collective
    # ------------------------------------------------------------------------------
    def _any_rank(self, has_batch: bool, *, epoch: int = 0, position: int = 0) -> bool:
        return (
            self._max_over_ranks(
                int(has_batch), epoch=epoch, position=position, what="the end-of-epoch agreement"
            )
            > 0
        )

    def _max_over_ranks(
        self, value: int, *, epoch: int, position: int, what: str, timed: bool = True
    ) -> int:
        """MAX of ``value`` over ``group`` (``value`` itself without a process group), waiting at
        most ``collective_timeout`` s when ``timed``: ``all_reduce(async_op=True)`` then
        ``wait(timeout)`` (gloo and NCCL alike block the CPU until done or raise), a timeout a
        :class:`CollectiveTimeoutError` (final under
        NCCL: the collective stays queued on the communicator). Untimed: the process group's own
        timeout."""
        import torch.distributed as dist

        if self.dp_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return value
        flag = torch.tensor([int(value)], dtype=torch.int64)
        if dist.get_backend(self.group) == "nccl":
            flag = flag.cuda()
        if self.collective_timeout is None or not timed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            return int(flag.item())
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        try:
            done = work.wait(timeout=datetime.timedelta(seconds=self.collective_timeout))
        except RuntimeError as exc:  # gloo / NCCL: "timed out" (or a peer's connection closed)
            raise self._collective_error(what, epoch, position, str(exc)) from exc
        if done is False:
            raise self._collective_error(what, epoch, position, "wait returned without completing")
        return int(flag.item())

    def _collective_error(
        self, what: str, epoch: int, position: int, cause: str
    ) -> CollectiveTimeoutError:
        import torch.distributed as dist

        ranks = (
            dist.get_process_group_ranks(self.group)
            if self.group is not None
            else list(range(dist.get_world_size()))
        )
        return CollectiveTimeoutError(
            f"StreamingPackedLoader (rank {dist.get_rank()}, dp_rank {self.dp_rank}): {what} "
            f"all_reduce over ranks "
            f"{ranks} did not complete within collective_timeout={self.collective_timeout:g} s at "
            f"epoch {epoch}, "
            f"micro-batch {position}: a peer rank stopped iterating this loader, died or is stuck "
            f"(every rank of the group must iterate every micro-batch) ({cause})"
        )

    def _filler_batch(self, epoch: int, position: int) -> dict:
        """An all-pad, zero-loss micro-batch shaped like the stream's first good sample."""
        if self._filler is None:
            template = None
            for shard in range(self.source.num_shards):
                for loc, item in self.source.scan(shard):
                    if isinstance(item, dict):
                        try:
                            template = self.source.apply_transform(item, loc)
                            validated([template], self.schema)[0][0]
                            break
                        except (SampleError, TypeError):
                            template = None
                if template is not None:
                    break
            if template is None:
                raise BadSampleError(
                    sample=None,
                    field=None,
                    expected="at least one good sample in the stream",
                    actual="none",
                )
            self._filler = self.collator(
                [filler_sample(template, self.schema, filler_length(self.layout))]
            )
        batch = dict(self._filler)
        batch.update(
            sample_index=torch.zeros(0, dtype=torch.int64),
            is_filler=True,
            epoch=epoch,
            microbatch=position,
        )
        return batch

    # ---- iteration
    # -----------------------------------------------------------------------------------
    def _reader_of(
        self, epoch: int, dp_rank: int, dp_size: int, served: torch.Tensor | None, **kwargs
    ) -> _Reader:
        """Reader of ``dp_rank`` of ``dp_size`` over ``epoch``, leaving out ``served``; ``kwargs``:
        the rest of :class:`_Reader`'s fields (``pack``, ``worker``, ``ids_only``)."""
        return _Reader(
            self.source,
            self.schema,
            self.collator,
            self.layout,
            self._capacity,
            self.buffer_size,
            self.oversize,
            self.bad_data,
            dp_rank,
            dp_size,
            self.seed,
            epoch,
            served=served,
            skip=self._skip[1] if self._skip[0] == epoch else None,
            **kwargs,
        )

    def _reader(
        self, epoch: int, served: torch.Tensor | None = None, track: "_Track | None" = None
    ):
        seek = {} if track is None else {"cursors": tuple(track.saved()), "rotate": track.next}
        reader = self._reader_of(
            epoch, self.dp_rank, self.dp_size, served, pack=self.num_workers > 0, **seek
        )
        return self._data_loader(reader, persistent=False, batch_size=None)

    def _served_before(self, epoch: int) -> torch.Tensor | None:
        """Sorted int64 stream ids the earlier segments of ``epoch`` served (a resize; None without
        one), built once per epoch and shared with the workers: each segment's readers replayed in
        this process, ids only, every rank of it (another DP size or worker count reads other
        shards), over what the segments before it left; a rank's first ``position`` micro-batches in
        the order its DataLoader served them
        (:func:`~prealign.loaders.plan.elastic.round_robin`)."""
        segments = self._resized[1] if self._resized[0] == epoch else ()
        if not segments or self._skip[0] == epoch:
            return None
        if self._served_cache[0] == (epoch, segments):
            return self._served_cache[1]
        served = torch.zeros(0, dtype=torch.int64)
        for n, seg in enumerate(segments):
            parts, workers, longest = [served.numpy()], max(seg.num_workers or 0, 1), 0
            for rank in range(seg.dp_size):
                readers = [
                    self._reader_of(
                        epoch, rank, seg.dp_size, served, worker=(workers, w), ids_only=True
                    )._packed()
                    for w in range(workers)
                ]
                streams = [(ids for ids, _, _ in r if ids is not None) for r in readers]
                first = round_robin(streams, seg.position)
                longest = max(longest, len(first))
                parts.append(np.fromiter((i for ids in first for i in ids), np.int64))
            if longest < seg.position:
                raise ResumeError(
                    f"StreamingPackedLoader: the state's segment {n} (dp_size {seg.dp_size}, "
                    f"num_workers "
                    f"{seg.num_workers}) has position {seg.position}, past the end of epoch "
                    f"{epoch}, "
                    f"which has {longest} micro-batches on those ranks (a state of other data, or "
                    f"edited)"
                )
            served = torch.from_numpy(np.sort(np.concatenate(parts)))
        if self.num_workers > 0:
            served.share_memory_()
        self._served_cache = ((epoch, segments), served)
        return served

    def _check_segment_sizes(self, segments) -> None:
        """Refuse a segment with more readers (``dp_size * max(num_workers, 1)``) than the stream
        has samples (counted up to the widest segment's readers, and only when it has more readers
        than shards)."""
        widest = max((seg.dp_size * max(seg.num_workers, 1) for seg in segments), default=0)
        if widest <= self.source.num_shards:
            return
        scans = (
            item for shard in range(self.source.num_shards) for item in self.source.scan(shard)
        )
        count = sum(1 for _ in itertools.islice(scans, widest))
        for i, seg in enumerate(segments):
            if seg.dp_size * max(seg.num_workers, 1) > count:
                raise ResumeError(
                    f"loader state: key segments[{i}]: dp_size {seg.dp_size} * num_workers "
                    f"{seg.num_workers} readers; expected at most the {count} samples of the stream"
                )

    def _take(self, it):
        """The next real micro-batch of this rank's stream, or None at its end (bad-data events
        counted, the readers' cursors tracked)."""
        for batch, events, (role, cursor) in it:
            self._count_skipped(events, warn=False)  # (the reader's gate warned)
            self._track.took(role, cursor, batch is not None)
            if batch is not None:
                return unpacked(batch)
        return None

    def _batches(self, token: object):
        self.prepare()
        epoch, start = self._epoch, self._position
        track = self._track if start and self._track and self._track.at == (epoch, start) else None
        workers = max(self.num_workers, 1)
        self._track = _Track.fresh(epoch, workers) if track is None else track.copy()
        it = self._served(self._reader(epoch, self._served_before(epoch), track), token)
        exhausted = False
        skipped = start if track is not None else 0  # with cursors: the readers go on there
        for _ in range(start - skipped):  # without: re-read and re-pack the stream up to there
            if self._take(it) is None:
                exhausted = True
                break
            skipped += 1
        if (
            start
        ):  # the epoch has max(real micro-batches over ranks): a position past it cannot be resumed
            longest = self._max_over_ranks(
                skipped, epoch=epoch, position=start, what="the resume check", timed=False
            )  # ranks replay at their own speed: an hour apart is no fault
            if longest < start:
                raise ResumeError(
                    f"StreamingPackedLoader: the state's position {start} is past the end of epoch "
                    f"{epoch}, which has {longest} micro-batches on these ranks (a state of other "
                    f"data, or edited)"
                )
        position = start
        while True:
            batch = None if exhausted else self._take(it)
            exhausted = batch is None
            if not self._any_rank(batch is not None, epoch=epoch, position=position):
                break
            if batch is None:
                batch = self._filler_batch(epoch, position)
            self._check_live(token)
            batch["epoch"], batch["microbatch"] = epoch, position
            position += 1
            self._position = position
            self._track.at = (epoch, position)
            yield batch
        if self._active is token:
            self._epoch, self._position = epoch + 1, 0

    # ---- state
    # ---------------------------------------------------------------------------------------
    def _config(self) -> dict:
        return {**super()._config(), "num_workers": self.num_workers}

    def epoch_offset(self, epoch: int | None = None) -> int:
        epoch = self.epoch if epoch is None else epoch
        folded = self._skip[2] if self._skip[0] == epoch else 0
        return super().epoch_offset(epoch) + folded

    def set_epoch(self, epoch: int) -> None:
        if epoch != self._normalised()[0]:
            self._skip = (-1, None, 0)
        super().set_epoch(epoch)

    def _entry(self) -> dict | None:
        """This rank's cursors as a version-5 state holds them (``None``: not known at this
        position, e.g. before a replay ran)."""
        epoch, position = self._normalised()
        track = self._track
        if not position:
            return {"next": 0, "readers": [None] * max(self.num_workers, 1)}
        if track is None or track.at != (epoch, position):
            return None
        return {"next": track.next, "readers": track.saved()}

    def _gathered(self, entry: dict | None, dst: int | None = None) -> list | None:
        """Every DP rank's :meth:`_entry` (``None`` for a rank not heard from): an
        ``all_gather_object`` over ``group`` (a collective: every rank of it calls it) when a
        process group is up, else this rank's alone. ``dst``: a ``gather_object`` to that global
        rank instead (the others get ``None``: they receive nothing; a rank whose group does not
        hold ``dst`` takes part in no collective)."""
        import torch.distributed as dist

        ranks: list = [None] * self.dp_size
        if not (dist.is_available() and dist.is_initialized()):
            ranks[self.dp_rank] = entry
            return ranks
        if dst is not None:
            world = dist.get_world_size()
            if dst >= world:
                raise PlanError(f"state_dict(dst={dst}): not a rank of the world (0..{world - 1})")
            if self.group is not None and dst not in dist.get_process_group_ranks(self.group):
                return None  # (dst's own DP group gathers: each DP group holds every DP rank)
        if self.dp_size == 1:
            ranks[self.dp_rank] = entry
            return ranks if dst is None or dist.get_rank() == dst else None
        got: list | None = [None] * dist.get_world_size(self.group)
        if dst is None:
            dist.all_gather_object(got, (self.dp_rank, entry), group=self.group)
        else:
            got = got if dist.get_rank() == dst else None
            dist.gather_object((self.dp_rank, entry), got, dst=dst, group=self.group)
            if got is None:
                return None
        for rank, e in got:  # (TP / CP ranks of a DP rank read the same stream: the first one)
            if ranks[rank] is None:
                ranks[rank] = e
        return ranks

    def state_dict(self, cursors: bool | str = False, dst: int | None = None) -> dict | None:
        """The state (:meth:`LoaderCore.state_dict`: the same on every rank). ``cursors=True`` adds
        this rank's reader cursors (version 4, :mod:`prealign.loaders.state`): where each of its
        readers goes on and the samples its buffer holds (at most ``buffer_size`` a reader), so that
        this rank resumes by seeking instead of replaying its stream. Such a state is this rank's:
        load each rank's own (another rank replays). ``cursors="all"`` gathers every DP rank's
        cursors over ``group`` (a collective: call it on every rank) into one state, the same on
        every rank (version 6: version 5 with each reader's samples packed,
        :func:`~prealign.loaders.state.pack_cursor`): it resumes under the same ``dp_size`` /
        ``num_workers`` exactly (each rank seeks), and under others without replaying (the
        shards the old readers consumed are skipped, the partly consumed ones entered by seek,
        their buffered samples read back; ``docs/resume.md``). :func:`merge_rank_states`
        merges per-rank ``cursors=True`` states into the same. An epoch resumed from a version-5
        or 6 state under another topology writes version 5 or 6 (``stream.skip``: what its
        earlier segments consumed) whatever ``cursors`` is. A :class:`Mixture` stream's reader
        cursors hold each component stream's cursor and the interleave's state
        (``docs/resume.md``).

        ``dst`` (with ``cursors="all"``): the global rank that gathers the state (a
        ``gather_object``, as Energon's ``save_state_global(global_dst_rank)``): it returns the
        state, every other rank ``None`` (it receives nothing; at hundreds of ranks every rank
        receiving every rank's cursors is the cost ``dst`` avoids). Call it on every rank: under
        Megatron's TP / CP / PP the loader's ``group`` is one DP group of several, and each holds
        every DP rank, so the group holding ``dst`` gathers and the ranks of the other groups
        return ``None`` at once (a ``dst`` outside the world is a :class:`PlanError` on every
        rank). Save it from ``dst``; every rank of the next run loads the same file. Without a
        process group the state is returned."""
        if cursors not in (False, True, "all"):
            raise PlanError(f"state_dict: cursors expected False, True or 'all', got {cursors!r}")
        if dst is not None and (
            cursors != "all" or isinstance(dst, bool) or not isinstance(dst, int) or dst < 0
        ):
            raise PlanError(
                f"state_dict: dst expected a global rank >= 0 with cursors='all', got dst={dst!r} "
                f"with cursors={cursors!r}"
            )
        out = super().state_dict()
        epoch, position = self._normalised()
        skip, folded = (self._skip[1], self._skip[2]) if self._skip[0] == epoch else (None, 0)
        elastic = self._skip[0] == epoch
        if cursors == "all" and "segments" in out:  # an epoch resumed by replay of old segments
            warnings.warn(
                "StreamingPackedLoader.state_dict(cursors='all'): this epoch was resumed from a "
                "version-3 state (earlier segments replayed), whose readers cannot be written as "
                "cursors: the state is version 3 (a resume replays); the next epoch has cursors",
                stacklevel=2,
            )
            import torch.distributed as dist

            here = dist.get_rank() if dist.is_available() and dist.is_initialized() else dst
            return out if dst in (None, here) else None
        if cursors == "all" or elastic:
            entry = self._entry() if cursors else None
            entry = _packed(entry) if cursors == "all" else entry
            ranks = self._gathered(entry, dst) if cursors == "all" else [None] * self.dp_size
            if ranks is None:  # (gathered to another rank)
                return None
            if cursors is True:
                ranks[self.dp_rank] = entry
            state = LoaderState.from_dict(out, kind=self.state_kind)
            stream = {
                "dp_size": self.dp_size,
                "num_workers": self.num_workers,
                "offset": folded,
                "skip": None if skip is None else skip.to_dict(),
                "ranks": ranks,
            }
            return dataclasses.replace(state, stream=stream).to_dict()
        track = self._track
        current = track is not None and track.at == (epoch, position)
        if not (cursors and position and current):
            return out
        state = LoaderState.from_dict(out, kind=self.state_kind)
        return dataclasses.replace(
            state,
            cursors={
                "dp_rank": self.dp_rank,
                "dp_size": self.dp_size,
                "num_workers": self.num_workers,
                "next": track.next,
                "readers": track.saved(),
            },
        ).to_dict()

    def load_state_dict(self, state) -> None:
        st = LoaderState.from_dict(state, kind=self.state_kind)
        int_at_least(
            "loader state: key 'config.num_workers'",
            st.config.get("num_workers"),
            0,
            ResumeError,
            expected="an int >= 0 (a stream's readers depend on it)",
        )
        if st.stream is not None:
            return self._load_stream(st)
        super().load_state_dict(state)
        self._track, self._skip = None, (-1, None, 0)
        cursors = st.cursors
        if cursors is None or not self._position:
            return
        here = {"dp_rank": self.dp_rank, "dp_size": self.dp_size, "num_workers": self.num_workers}
        if any(cursors.get(k) != v for k, v in here.items()):
            saved = {k: cursors.get(k) for k in here}
            warnings.warn(
                f"StreamingPackedLoader.load_state_dict: the state's reader cursors are "
                f"those of {saved}, this is {here}: this rank replays its stream up "
                f"to micro-batch {self._position} (load each rank's own state_dict(cursors=True) "
                f"to seek)",
                stacklevel=2,
            )
            return
        at, workers = (self._epoch, self._position), max(self.num_workers, 1)
        self._track = _Track.loaded(cursors, at, workers)
        first, total = self.dp_rank * workers, self.dp_size * workers
        self._check_cursors(
            self._track.cursors,
            "cursors.readers",
            parts=self._epoch_parts(st.epoch, None),
            limit=self._cursor_limit(None),
            first=first,
            total=total,
        )

    def _epoch_parts(self, epoch: int, skip: Skip | None) -> list[list[int]]:
        """The shards epoch ``epoch`` reads, in its seeded order, those ``skip`` finished left out:
        one list, or one per component of a :class:`Mixture` (what the readers split,
        :meth:`_mine`)."""
        order = np.random.default_rng([self.seed, epoch]).permutation(self.source.num_shards)
        order = order.tolist()
        mixture = isinstance(self.source, Mixture)
        parts = self.source.shards_by_component(order) if mixture else [order]
        return parts if skip is None else [skip.remaining(part) for part in parts]

    def _check_cursors(
        self, readers: list, key: str, *, parts: list, limit: int, first: int, total: int
    ) -> None:
        """A :class:`ResumeError` naming the key under ``key`` unless every reader cursor (of
        readers ``first, first + 1, ...`` of ``total``, who read the shards ``parts``:
        :meth:`_epoch_parts`) is of the types it is written with
        (:func:`~prealign.loaders.state.check_cursor`), holds at most ``limit`` samples
        (:meth:`_cursor_limit`), and goes on in its own shards (a :class:`Mixture`'s: each
        component's stream in that component's) from a location of this source."""
        mixture = isinstance(self.source, Mixture)
        for w, c in enumerate(readers):
            if c is None:
                continue
            where = f"{key}[{w}]"
            check_cursor(c, where, len(parts) if mixture else None)
            records = [*c["buffer"], *(r for b in c["bins"] for r in b)]
            if len(records) > limit:
                raise ResumeError(
                    f"loader state: key '{where}.buffer': {len(records)} samples; expected at "
                    f"most {limit} (buffer_size {self.buffer_size} and the samples the state "
                    f"returns)"
                )
            self._check_records(records, where)
            subs = c["mix"]["streams"] if mixture else [c]
            for i, (part, sub) in enumerate(zip(parts, subs)):
                mine = part[first + w :: total] if len(part) >= total else part
                name = f"{where}.mix.streams[{i}]" if mixture else where
                self._check_at(sub["at"], None if sub["done"] else mine, i, f"{name}.at")

    def _cursor_limit(self, skip: Skip | None) -> int:
        """The most samples a reader cursor holds: its buffer, or what it read back first (its
        share of ``skip.returns``, read before anything else)."""
        return self.buffer_size + (0 if skip is None else len(skip.returns))

    def _check_at(self, at: list, shards: list | None, component: int, key: str) -> None:
        """``at = [shard position, ordinal, location]`` of a stream that reads ``shards`` (None: it
        ended) lies in them: the position among them, the location this source's, in that shard
        (and of component ``component`` in a :class:`Mixture`)."""
        pos, ordinal, loc = at
        if shards is None or ordinal == -1:
            return
        mixture = isinstance(self.source, Mixture)
        own = f" of component {self.source.names[component]!r}" if mixture else ""
        if pos >= len(shards):
            raise ResumeError(
                f"loader state: key '{key}': shard position {pos}; expected one of the "
                f"{len(shards)} shards{own} this reader reads"
            )
        if loc is None:
            return
        check_own(self.source, [loc], key)
        if mixture and loc[0] != component:
            raise ResumeError(
                f"loader state: key '{key}': a location of component "
                f"{self.source.names[loc[0]]!r}; expected one{own} (shard {shards[pos]})"
            )
        where = f", at position {pos} of the shards{own} this reader reads"
        check_in_shards(self.source, [loc], [shards[pos]], key, where)

    def _check_records(self, records: list, key: str) -> None:
        """Cursor records ``[stream id, aligned size, *location]``: locations of this source, of
        one width, each in its id's shard (one of the source's) where the location names it."""
        check_own(self.source, [r[2:] for r in records], key)
        shards = [sid >> 32 for sid, *_ in records]
        if shards and max(shards) >= self.source.num_shards:
            raise ResumeError(
                f"loader state: key '{key}': a sample id of shard {max(shards)}; expected one of "
                f"the {self.source.num_shards} shards"
            )
        check_in_shards(self.source, [r[2:] for r in records], shards, key, ", its sample id's")

    def _load_stream(self, st: LoaderState) -> None:
        """A version-5 state: same ``dp_size`` / ``num_workers``: this rank's cursors (exact);
        another: the old readers' cursors folded into what the epoch consumed
        (:func:`~prealign.loaders.plan.stream_skip.fold`), this run a new segment at position 0."""
        stream = st.stream
        shape = (stream.get("dp_size"), stream.get("num_workers"))
        ranks, offset = stream.get("ranks"), stream.get("offset")
        if (
            not all(isinstance(x, int) and not isinstance(x, bool) for x in (*shape, offset))
            or shape[0] < 1
            or shape[1] < 0
            or offset < 0
            or not isinstance(ranks, list)
            or len(ranks) != shape[0]
            or not all(r is None or isinstance(r, dict) for r in ranks)
            or set(stream) != {"dp_size", "num_workers", "offset", "skip", "ranks"}
        ):
            raise ResumeError(
                f"loader state: key 'stream': expected dp_size, num_workers, offset, skip and "
                f"one entry per DP rank, got {str(stream)[:200]}"
            )
        saved = {**st.config, "dp_size": shape[0], "num_workers": shape[1]}
        plain = dataclasses.replace(st, stream=None, config=saved).to_dict()
        super().load_state_dict(plain)  # (the configuration and data checked)
        self._set_resized(-1, ())
        self._track = None
        raw = stream["skip"]
        skip = None if raw is None else Skip.from_dict(raw, self.source.num_shards)
        if skip is not None:
            skip.check_locations(self.source)
        old_workers = max(shape[1], 1)
        if shape == (self.dp_size, self.num_workers):
            self._skip = (st.epoch, skip, offset)
            limit = self._cursor_limit(skip)
            entry = _unpacked(ranks[self.dp_rank], f"stream.ranks[{self.dp_rank}]", limit)
            if not st.position:
                return
            if entry is None:
                warnings.warn(
                    f"StreamingPackedLoader.load_state_dict: the state has no cursors of dp_rank "
                    f"{self.dp_rank}: this rank replays its stream up to micro-batch "
                    f"{st.position} (save with state_dict(cursors='all') to seek)",
                    stacklevel=3,
                )
                return
            self._track = _Track.loaded(entry, (st.epoch, st.position), old_workers)
            self._check_cursors(
                self._track.cursors,
                f"stream.ranks[{self.dp_rank}].readers",
                parts=self._epoch_parts(st.epoch, skip),
                limit=limit,
                first=self.dp_rank * old_workers,
                total=shape[0] * old_workers,
            )
            return
        missing = [r for r, e in enumerate(ranks) if e is None]
        if missing and st.position:
            raise ResumeError(
                f"loader state: key 'stream.ranks': no cursors of dp_rank(s) {missing[:8]} of the "
                f"saved run (dp_size {shape[0]}), so what they consumed is not known: resume "
                f"under dp_size {shape[0]} and num_workers {shape[1]}, or save with "
                f"state_dict(cursors='all') on every rank (or merge_rank_states of every rank's "
                f"state_dict(cursors=True))"
            )
        cursors = []
        parts, limit = self._epoch_parts(st.epoch, skip), self._cursor_limit(skip)
        for r, e in enumerate(ranks):
            e = _unpacked(e, f"stream.ranks[{r}]", limit)
            readers = [None] * old_workers if e is None else e.get("readers")
            if not (
                isinstance(readers, list)
                and len(readers) == old_workers
                and all(c is None or isinstance(c, dict) for c in readers)
            ):
                raise ResumeError(
                    f"loader state: key 'stream.ranks[{r}]': expected {old_workers} reader "
                    f"cursors, got {str(e)[:200]}"
                )
            self._check_cursors(
                readers,
                f"stream.ranks[{r}].readers",
                parts=parts,
                limit=limit,
                first=r * old_workers,
                total=shape[0] * old_workers,
            )
            cursors += readers
        whole = self._epoch_parts(st.epoch, None)  # (the skip is folded in, not applied)
        try:
            records = records_of(self.source)
            if isinstance(self.source, Mixture):  # each component's stream folded on its own
                folded = fold_parts(skip, whole, cursors, records)
            else:
                folded = fold(skip, whole[0], cursors, records)
            folded = Skip.from_dict(folded.to_dict(), self.source.num_shards)  # (its bounds)
            folded.check_locations(self.source)
        except (KeyError, TypeError, ValueError, IndexError, OverflowError) as exc:
            raise ResumeError(
                f"loader state: key 'stream.ranks': a reader cursor is not one this prealign "
                f"writes ({type(exc).__name__}: {exc})"
            ) from None
        self._skip = (st.epoch, folded, offset + st.position)
        self._epoch, self._position = st.epoch, 0


def merge_rank_states(states: list) -> dict:
    """One version-6 state (version 5, cursors packed) from per-rank states of one run (each rank's
    ``state_dict(cursors=True)``, version 4 or 5, or a gathered one): the same epoch, position,
    configuration and data, each rank's cursors in its place, so that a run under another
    ``dp_size`` / ``num_workers`` resumes it without replaying (Energon's ``save_state_rank``
    files merged, like its ``redist`` tool). A :class:`ResumeError` names what differs."""
    parsed = [LoaderState.from_dict(s, kind=STREAM_STATE_KIND) for s in states]
    if not parsed:
        raise ResumeError("merge_rank_states: no state given")
    merged, ranks = None, None
    for i, st in enumerate(parsed):
        if st.cursors is not None:
            if st.segments:
                raise ResumeError(
                    f"merge_rank_states: state {i} is of an epoch resumed by replay of earlier "
                    f"segments (version 4 with segments): it cannot be merged; resume it under its "
                    f"own dp_size and num_workers"
                )
            c = st.cursors
            entry = _packed({"next": c.get("next"), "readers": c.get("readers")})
            shape = {
                "dp_size": c.get("dp_size"),
                "num_workers": c.get("num_workers"),
                "offset": 0,
                "skip": None,
            }
            mine = {c.get("dp_rank"): entry}
        elif st.stream is not None:
            shape = {k: v for k, v in st.stream.items() if k != "ranks"}
            ranks_of = enumerate(st.stream.get("ranks") or [])
            mine = {r: _packed(e) for r, e in ranks_of if e is not None}
        elif not st.position and not st.segments:  # nothing served yet: every rank's is known
            dp, workers = st.config.get("dp_size"), st.config.get("num_workers")
            if not (isinstance(dp, int) and isinstance(workers, int) and dp >= 1):
                raise ResumeError(f"merge_rank_states: state {i}: config without dp_size")
            shape = {"dp_size": dp, "num_workers": workers, "offset": 0, "skip": None}
            mine = {r: {"next": 0, "readers": [None] * max(workers, 1)} for r in range(dp)}
        else:
            raise ResumeError(
                f"merge_rank_states: state {i} (version 2 or 3, at micro-batch {st.position}) "
                f"has no cursors: save with state_dict(cursors=True)"
            )
        base = dataclasses.replace(st, cursors=None, stream=shape)
        if merged is None:
            merged, ranks = base, [None] * int(shape["dp_size"])
        elif base != merged:
            raise ResumeError(
                f"merge_rank_states: state {i} is not of the same run, epoch and position as "
                f"state 0 (epoch {st.epoch} position {st.position} vs {merged.epoch} "
                f"{merged.position})"
            )
        for r, e in mine.items():
            if not (isinstance(r, int) and 0 <= r < len(ranks)):
                raise ResumeError(f"merge_rank_states: state {i}: dp_rank {r!r} out of range")
            if ranks[r] is not None and ranks[r] != e:
                raise ResumeError(f"merge_rank_states: two different states of dp_rank {r}")
            ranks[r] = e
    return dataclasses.replace(merged, stream={**merged.stream, "ranks": ranks}).to_dict()


def _packed(entry: dict | None) -> dict | None:
    """A rank's entry of a version-5 state with its reader cursors packed
    (:func:`~prealign.loaders.state.pack_cursor`: one int array per reader)."""
    readers = entry.get("readers") if isinstance(entry, dict) else None
    if not isinstance(readers, list):
        return entry
    return {**entry, "readers": [pack_cursor(c) if isinstance(c, dict) else c for c in readers]}


def _unpacked(entry: dict | None, where: str, limit: int) -> dict | None:
    """:func:`_packed` undone (an entry of a version-5 state is returned as it is); a reader
    cursor of more than ``limit`` samples is refused before it is inflated."""
    readers = entry.get("readers") if isinstance(entry, dict) else None
    if not isinstance(readers, list):
        return entry
    return {
        **entry,
        "readers": [
            unpack_cursor(c, f"{where}.readers[{g}]", limit) for g, c in enumerate(readers)
        ],
    }


@dataclass
class _Track:
    """This rank's readers as its DataLoader served them: per role, the last cursor it sent and how
    many of that round's micro-batches were served since; the role the DataLoader asks next; the
    ``(epoch, position)`` it describes."""

    at: tuple[int, int]
    cursors: list
    served: list
    next: int = 0

    @classmethod
    def fresh(cls, epoch: int, workers: int) -> "_Track":
        return cls((epoch, 0), [None] * workers, [0] * workers)

    @classmethod
    def loaded(cls, saved: dict, at: tuple[int, int], workers: int) -> "_Track":
        """From a state's ``cursors`` (checked: one per role, the next role in range)."""
        readers, nxt = saved.get("readers"), saved.get("next")
        if (
            not isinstance(readers, list)
            or len(readers) != workers
            or not all(r is None or isinstance(r, dict) for r in readers)
            or not (isinstance(nxt, int) and 0 <= nxt < workers)
        ):
            raise ResumeError(
                f"loader state: key 'cursors': expected {workers} reader cursors and "
                f"a next reader in [0, {workers}), got {str(saved)[:200]}"
            )
        return cls(at, list(readers), [0] * workers, nxt)

    def copy(self) -> "_Track":
        return dataclasses.replace(self, cursors=list(self.cursors), served=list(self.served))

    def took(self, role: int, cursor: dict | None, batch: bool) -> None:
        """The DataLoader served an item of reader ``role`` (a micro-batch when ``batch``) carrying
        ``cursor``."""
        if cursor is not None:
            self.cursors[role], self.served[role] = cursor, 0
        self.served[role] += int(batch)
        self.next = (role + 1) % len(self.cursors)

    def saved(self) -> list:
        """Per role, its cursor without the micro-batches of its round already served."""
        return [
            None if c is None else {**c, "bins": c["bins"][n:]}
            for c, n in zip(self.cursors, self.served)
        ]
