"""``StreamingPackedLoader``: packed micro-batches from a stream that cannot be indexed first.

    shards (seeded order per epoch) ──split: reader g = dp_rank * W + worker──► scan ─► transform
        ─► validate (the collator, per arrival chunk) ─► bounded buffer (``buffer_size`` samples)
        ─► best-fit decreasing when full: the fullest micro-batches out, the rest wait ─► collate
    main process: one flag per micro-batch, all-reduced (MAX) over ``group``: while any rank still has
    data every rank yields (a rank out of data yields a filler: all pad, zero loss), then the epoch
    ends on every rank at the same micro-batch

Same hard budget and collator as :class:`~prealign.loaders.PackedLoader` and the same batch contract
(the collator's fields plus ``sample_index`` int64 ``[N]``, ``is_filler``, ``epoch``, ``microbatch``);
``sample_index`` holds stream ids ``shard << 32 | ordinal`` (the ordinal of the sample in its shard).

Readers take disjoint shards (``shards[g::G]`` of the epoch's shard order, ``G = dp_size * W``); with
fewer shards than readers every reader scans them all and keeps every ``G``-th sample. Every sample is
read by exactly one reader per epoch and either packed or counted by the bad-data policy: none is
dropped or repeated. The first batch comes after at most ``buffer_size`` samples per worker.

The end-of-epoch agreement costs one ``all_reduce`` of one int64 per micro-batch on ``group`` (default:
the world; every rank of it must iterate, TP/CP ranks of a DP rank read the same stream). Without an
initialised process group (or ``dp_size == 1``) there is none.

Resume: the state is ``(epoch, position)``, the same on every rank. Loading it re-reads this rank's
stream from the start of the epoch and replays the deterministic packing, skipping the first
``position`` micro-batches without collating them (cost: reading that much of the stream again).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from prealign.collate.thd import THDCollator
from prealign.loaders.errors import BadSampleError, OversizeSampleError, PlanError, ResumeError
from prealign.loaders.handoff.slots import worker_heap
from prealign.loaders.handoff.transport import PackedBatch, pack_batch, unpack_batch
from prealign.loaders.index.events import error_from_record, error_record, record_reason
from prealign.loaders.index.sample_checks import has_media, media_keys, validated
from prealign.loaders.loader import filler_sample, truncate_sample
from prealign.loaders.options import LoadingOptions, check_dp
from prealign.loaders.plan.packing import best_fit_decreasing
from prealign.loaders.plan.planner import microbatch_capacity
from prealign.loaders.plan.schedule import check_count
from prealign.loaders.policy import BadDataGate, BadDataPolicy, BadDataReport, Oversize, coerce_enum
from prealign.loaders.sources.source import Skip, Source
from prealign.schemas.errors import SampleError
from prealign.schemas.layout import ParallelLayout
from prealign.schemas.schema import BatchSchema

STATE_KIND = "prealign.StreamingPackedLoader"
STATE_VERSION = 1
_CHUNK = 32


def stream_id(shard: int, ordinal: int) -> int:
    """``shard << 32 | ordinal``: a sample's id in ``sample_index``.

    >>> stream_id(2, 5) >> 32, stream_id(2, 5) & 0xFFFFFFFF
    (2, 5)
    """
    return (int(shard) << 32) | int(ordinal)


@dataclass(frozen=True)
class _Reader(IterableDataset):
    """One epoch of one DP rank's stream, packed; in DataLoader workers, worker ``w`` is reader
    ``dp_rank * W + w``. Yields ``(batch, events)``: the collated micro-batch and the bad-data events
    (``[reason, where, frozen error]``) met since the previous one."""

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

    def _mine(self):
        """``(shard, ordinal, location, raw)`` of this reader's samples, in stream order; bad records as
        ``(shard, ordinal, location, exception or Skip)``."""
        info = get_worker_info()
        workers, w = (1, 0) if info is None else (info.num_workers, info.id)
        g, readers = self.dp_rank * workers + w, self.dp_size * workers
        n = self.source.num_shards
        order = np.random.default_rng([self.seed, self.epoch]).permutation(n).tolist()
        split_shards = n >= readers
        shards = order[g::readers] if split_shards else order
        k = 0
        for shard in shards:
            for ordinal, (loc, item) in enumerate(self.source.scan(shard)):
                if not split_shards:
                    k += 1
                    if (k - 1) % readers != g:
                        continue
                yield shard, ordinal, loc, item

    def __iter__(self):
        gate = BadDataGate(self.policy)
        events: list = []
        buffer: list[tuple[int, int, dict]] = []  # (aligned size, id, sample)
        pending: list[tuple[int, str, dict]] = []
        fixed: dict = {}
        mkeys = media_keys(self.schema)

        def bad(reason: str, where: str, err: Exception) -> None:
            gate.bad(reason, where, err)  # raises under RAISE / past max_consecutive
            events.append([reason, where, error_record(err) if isinstance(err, Exception) else err])

        def validate() -> None:
            for (sid, where, sample), res in zip(pending, validated([p[2] for p in pending], self.schema)):
                if isinstance(res, SampleError):
                    bad("bad_sample", where, BadSampleError(sample=where, field=res.field, expected=res.expected,
                                                            actual=res.actual))
                    continue
                n, dims = res
                clash = next((d for d, v in dims.items() if fixed.get(d, v) != v), None)
                if clash is not None:
                    bad("dim_mismatch", where, BadSampleError(sample=where, field=None, reason="dim_mismatch",
                                                              expected=f"{clash} = {fixed[clash]}",
                                                              actual=f"{clash} = {dims[clash]}"))
                    continue
                fixed.update(dims)
                if n > self.cap:
                    if self.oversize is Oversize.ERROR:
                        raise OversizeSampleError(sample=where, field="input_ids", expected=f"<= {self.cap} tokens",
                                                  actual=f"{n} tokens")
                    if self.oversize is Oversize.SKIP or (mkeys and has_media(sample, mkeys)):
                        reason = "oversize_skipped" if self.oversize is Oversize.SKIP else "oversize_media"
                        events.append([reason, where, None])
                        continue
                    sample, n = truncate_sample(sample, self.schema, self.cap), self.cap
                gate.good()
                buffer.append((self.layout.aligned_length(n), sid, sample))
            pending.clear()

        def emit(final: bool):
            sizes = np.array([b[0] for b in buffer], dtype=np.int64)
            bins = best_fit_decreasing(sizes, self.cap)
            bins.sort(key=lambda b: (-int(sizes[b].sum()), min(buffer[i][1] for i in b)))
            keep = len(bins) if final else max(1, len(bins) // 2)  # the fuller half out; the rest may still grow
            out, used = bins[:keep], set()
            for b in out:
                used.update(b)
                yield b
            rest = [buffer[i] for i in range(len(buffer)) if i not in used]
            buffer[:] = rest

        def collated(bin_, snapshot):
            samples = [snapshot[i][2] for i in bin_]
            batch = self.collator(samples)
            batch["sample_index"] = torch.tensor([snapshot[i][1] for i in bin_], dtype=torch.int64)
            batch["is_filler"] = False
            batch["epoch"] = self.epoch
            batch["microbatch"] = -1
            ev = list(events)
            events.clear()
            return (pack_batch(batch) if self.pack else batch), ev

        for shard, ordinal, loc, item in self._mine():
            where = self.source.where(loc) if loc is not None else f"shard {shard}"
            if isinstance(item, Skip):
                events.append([item.reason, item.where, None])
                continue
            if isinstance(item, Exception):
                rec = error_record(item)
                bad(record_reason(rec), where, error_from_record(rec))
                continue
            try:
                sample = self.source.apply_transform(item, loc)
            except SampleError as exc:
                bad(record_reason(error_record(exc)), where, exc)
                continue
            pending.append((stream_id(shard, ordinal), where, sample))
            if len(pending) >= _CHUNK or len(buffer) + len(pending) >= self.buffer_size:
                validate()
            if len(buffer) >= self.buffer_size:
                snapshot = list(buffer)
                for b in list(emit(final=False)):
                    yield collated(b, snapshot)
        validate()
        while buffer:
            snapshot = list(buffer)
            for b in list(emit(final=True)):
                yield collated(b, snapshot)
        if events:  # bad data after the last micro-batch: an empty hand-over carries it
            yield None, list(events)


class StreamingPackedLoader:
    """Iterable of packed micro-batches from a stream (see the module docstring). ``source``: any
    :class:`~prealign.loaders.sources.source.Source` (``HFSource`` over an ``IterableDataset``, a webdataset of
    any size); nothing is indexed. ``buffer_size``: samples each reader holds before packing.
    ``group``: the process group of the end-of-epoch agreement (default: the world)."""

    def __init__(self, source: Source, *, schema: BatchSchema, layout: ParallelLayout, token_budget: int,
                 dp_rank: int = 0, dp_size: int = 1, cp_rank: int | None = None, num_workers: int = 0, seed: int = 0,
                 buffer_size: int = 1024, oversize: Oversize | str = Oversize.ERROR,
                 bad_data: BadDataPolicy | None = None, collator: Callable | None = None, group=None,
                 loading: LoadingOptions | None = None):
        check_dp(dp_rank, dp_size)
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 2:
            raise PlanError(f"buffer_size: expected an int >= 2, got {buffer_size!r}")
        num_workers = check_count("num_workers", num_workers)
        if loading is not None and not isinstance(loading, LoadingOptions):
            raise PlanError(f"loading: expected a LoadingOptions or None, got {type(loading).__name__}")
        if bad_data is not None and not isinstance(bad_data, BadDataPolicy):
            raise PlanError(f"bad_data: expected a BadDataPolicy or None, got {type(bad_data).__name__}")
        self.source, self.schema, self.layout, self.token_budget = source, schema, layout, int(token_budget)
        self.dp_rank, self.dp_size, self.cp_rank, self.num_workers = dp_rank, dp_size, cp_rank, num_workers
        self.seed, self.buffer_size = check_count("seed", seed), buffer_size
        self.oversize = coerce_enum(Oversize, oversize, "oversize")
        self.bad_data = bad_data or BadDataPolicy()
        self.collator = collator or THDCollator(schema=schema, layout=layout, cp_rank=cp_rank)
        self.cap = microbatch_capacity(layout, self.token_budget)
        self.group, self.loading = group, loading or LoadingOptions()
        """DataLoader settings of the readers (:class:`LoadingOptions`, as :class:`PackedLoader` takes them;
        ``persistent_workers`` does not apply: each epoch starts its readers afresh)."""
        self.report = BadDataReport()
        """Everything skipped so far (by reason), as the readers met it."""
        self._epoch, self._position = 0, 0
        self._filler: dict | None = None

    # ---- the collective ------------------------------------------------------------------------------
    def _any_rank(self, has_batch: bool) -> bool:
        import torch.distributed as dist

        if self.dp_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return has_batch
        flag = torch.tensor([int(has_batch)], dtype=torch.int64)
        if dist.get_backend(self.group) == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

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
                raise BadSampleError(sample=None, field=None, expected="at least one good sample in the stream",
                                     actual="none")
            self._filler = self.collator([filler_sample(template, self.schema, self.layout.seq_multiple)])
        batch = dict(self._filler)
        batch.update(sample_index=torch.zeros(0, dtype=torch.int64), is_filler=True, epoch=epoch, microbatch=position)
        return batch

    # ---- iteration -----------------------------------------------------------------------------------
    def _reader(self, epoch: int) -> DataLoader:
        reader = _Reader(self.source, self.schema, self.collator, self.layout, self.cap, self.buffer_size,
                         self.oversize, self.bad_data, self.dp_rank, self.dp_size, self.seed, epoch,
                         pack=self.num_workers > 0)
        lo, workers = self.loading, self.num_workers > 0
        kw = {"prefetch_factor": lo.prefetch_factor} if workers and lo.prefetch_factor is not None else {}
        return DataLoader(reader, batch_size=None, num_workers=self.num_workers, pin_memory=lo.pin_memory,
                          multiprocessing_context=lo.multiprocessing_context if workers else None,
                          worker_init_fn=worker_heap if workers else None, timeout=lo.timeout, **kw)

    def _take(self, it):
        """The next real micro-batch of this rank's stream, or None at its end (bad-data events counted)."""
        for batch, events in it:
            for reason, where, rec in events:
                self.report.add(reason, where, rec["message"] if isinstance(rec, dict) and "message" in rec
                                else str(error_from_record(rec)) if isinstance(rec, dict) else reason)
            if batch is not None:
                return unpack_batch(batch) if isinstance(batch, PackedBatch) else batch
        return None

    def __iter__(self):
        epoch, start = self._epoch, self._position
        it = iter(self._reader(epoch))
        exhausted = False
        for _ in range(start):  # resume: re-read and re-pack the stream up to the saved position
            if self._take(it) is None:
                exhausted = True
                break
        position = start
        while True:
            batch = None if exhausted else self._take(it)
            exhausted = batch is None
            if not self._any_rank(batch is not None):
                break
            if batch is None:
                batch = self._filler_batch(epoch, position)
            batch["epoch"], batch["microbatch"] = epoch, position
            position += 1
            self._position = position
            yield batch
        self._epoch, self._position = epoch + 1, 0

    # ---- state ---------------------------------------------------------------------------------------
    def _config(self) -> dict:
        return {"seed": self.seed, "dp_size": self.dp_size, "token_budget": self.token_budget,
                "layout": self.layout.to_dict(), "schema": self.schema.fingerprint(), "buffer_size": self.buffer_size,
                "num_workers": self.num_workers, "oversize": self.oversize.value, "source": self.source.describe().get("kind"),
                "num_shards": self.source.num_shards}

    def state_dict(self) -> dict:
        """``{"kind", "version", "epoch", "position", "config"}``: JSON, the same on every rank."""
        return {"kind": STATE_KIND, "version": STATE_VERSION, "epoch": self._epoch, "position": self._position,
                "config": self._config()}

    def load_state_dict(self, state) -> None:
        """Resume from :meth:`state_dict`; :class:`ResumeError` for a state of another configuration (the
        packing depends on the buffer, the worker count, the budget and the layout)."""
        if isinstance(state, (str, bytes)):
            try:
                state = json.loads(state)
            except (ValueError, RecursionError) as exc:
                raise ResumeError(f"not a {STATE_KIND} state: not JSON ({exc})") from None
        if not isinstance(state, dict) or state.get("kind") != STATE_KIND or state.get("version") != STATE_VERSION:
            raise ResumeError(f"not a {STATE_KIND} state of version {STATE_VERSION}: {str(state)[:200]}")
        for key in ("epoch", "position"):  # never coerced (2.7, "3", True)
            v = state.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ResumeError(f"{STATE_KIND} state: {key} must be an int >= 0, got {v!r}")
        if not isinstance(state.get("config"), dict):
            raise ResumeError(f"{STATE_KIND} state: config must be a dict, got {str(state.get('config'))[:100]}")
        here = self._config()
        diff = [f"{k}: saved {state['config'].get(k)!r}, this run {here.get(k)!r}" for k in sorted(here)
                if state.get("config", {}).get(k) != here[k]]
        if diff:
            raise ResumeError("cannot resume this streaming loader state:\n  " + "\n  ".join(diff))
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
