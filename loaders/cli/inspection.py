"""Stream a source through :class:`~prealign.loaders.PackedLoader` on every CP rank at once,
validate every batch, and keep only what the report and the picture need (batches are dropped as
they go).

    source ──index pass (once, bad-data policy)──► SampleIndex
        └─► PackedLoader(cp_rank=0) ┐
            PackedLoader(cp_rank=1) ┼─ zip: the same micro-batch on every CP rank ─► validate each
            ...                     ┘        ─► BatchStats, first panels for the PNG
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from prealign.collate.indices import num_sequences
from prealign.collate.thd import THDCollator
from prealign.loaders.cli.errors import NothingLoadedError
from prealign.loaders.cli.plot import Panel
from prealign.loaders.cli.report import BatchStats, batch_stats
from prealign.loaders.errors import BadSampleError
from prealign.loaders.index.build import build_index, merge_shards, scan_shards
from prealign.loaders.index.sample_index import SampleIndex
from prealign.loaders.loader import PackedLoader
from prealign.loaders.mixture import Mixture
from prealign.loaders.options import IndexOptions
from prealign.loaders.plan.planner import PlannerConfig
from prealign.loaders.policy import BadDataPolicy, BadDataReport
from prealign.loaders.sources.source import Source
from prealign.schemas.layout import ParallelLayout
from prealign.schemas.schema import BatchSchema
from prealign.schemas.vlm import IMAGE_TOKEN_TYPE, validate_vlm_batch


@dataclass
class Inspection:
    """What :func:`inspect_source` saw."""

    stats: list[BatchStats]
    panels: list[Panel]
    report: BadDataReport
    num_samples: int
    """Good samples in the index."""
    index_seconds: float
    load_seconds: float
    """Wall time of loading, collating and validating every micro-batch on every CP rank."""
    first_violations: list[str] = field(default_factory=list)
    steady_seconds: float = 0.0
    """From the first micro-batch's arrival to the last's (worker start-up and the first batch left
    out)."""
    steady_batches: int = 0
    """Micro-batches after the first (what ``steady_seconds`` timed)."""
    steady_tokens: int = 0
    """Their real tokens."""
    mixture: dict | None = None
    """Over a :class:`~prealign.loaders.mixture.Mixture`: ``PackedLoader.mixture_report()`` after
    the epoch."""


class Progress:
    """``label: done/total`` on one self-overwriting stderr line (a line per 10% when not a TTY)."""

    def __init__(self, label: str, total: int | None, stream=None):
        self.label, self.total, self.stream = label, total, stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done, self._shown = 0, -1

    def step(self, n: int = 1) -> None:
        self.done += n
        tenth = 10 * self.done // self.total if self.total else self.done // 100
        if self.tty or tenth != self._shown:
            self._shown = tenth
            total = f"/{self.total}" if self.total else ""
            self.stream.write(f"\r{self.label}: {self.done}{total}" + ("" if self.tty else "\n"))
            self.stream.flush()

    def close(self, note: str = "") -> None:
        self.stream.write(
            f"\r{self.label}: {self.done} done{note}\n"
            if self.tty
            else f"{self.label}: done{note}\n"
        )
        self.stream.flush()


def _panel(index: int, rank_batches: list[dict]) -> Panel:
    """The whole micro-batch's layout from its CP ranks' batches (image tokens un-sharded)."""
    from prealign.collate.inverse import unshard_cp

    b0 = rank_batches[0]
    types = None
    if "mm_token_type_ids" in b0:
        if "cp_gather_index" in b0 or b0.get("cp_rank", -1) == -1:
            types = b0["mm_token_type_ids"].reshape(-1)
        else:
            types = unshard_cp(
                [b["mm_token_type_ids"] for b in rank_batches],
                cu_seqlens_padded=b0["cu_seqlens_padded"],
            ).reshape(-1)
    n = num_sequences(b0["cu_seqlens_padded"])  # (static shapes repeat the total past the last one)
    return Panel(
        b0["cu_seqlens"],
        b0["cu_seqlens_padded"],
        None if types is None else types == IMAGE_TOKEN_TYPE,
        title=f"micro-batch {index}: {n} sequences, T = {int(b0['cu_seqlens_padded'][-1])}",
    )


def inspect_source(
    source: Source,
    *,
    schema: BatchSchema,
    layout: ParallelLayout,
    token_budget: int,
    num_workers: int = 0,
    seed: int = 0,
    defer_cp_shard: bool = False,
    bad_data: BadDataPolicy | None = None,
    index: SampleIndex | None = None,
    panels: int = 3,
    limit: int | None = None,
    validate: Callable[[dict], list] | None = None,
    progress: bool = True,
    planner: PlannerConfig | None = None,
) -> Inspection:
    """Index ``source`` once, then load one epoch on every CP rank of DP rank 0 in lockstep.

    Every bad sample is skipped and counted (no limit on bad samples in a row: the report is the
    point); :class:`NothingLoadedError` (with that report) when none is left."""
    policy = bad_data or BadDataPolicy(on_error="skip", warn=False, max_consecutive=2**62)
    validate = validate or (lambda b: validate_vlm_batch(b, schema, layout, raise_on_error=False))
    t0 = time.perf_counter()
    if index is None and isinstance(
        source, Mixture
    ):  # each component's pass (its bad samples its own)
        index = source.build_index(schema, policy=policy, num_workers=num_workers)
    if index is None:
        index = _index(source, schema, policy, num_workers, progress)
    t1 = time.perf_counter()
    loaders = [
        PackedLoader(
            source,
            schema=schema,
            layout=layout,
            token_budget=token_budget,
            cp_rank=r,
            num_workers=num_workers,
            seed=seed,
            bad_data=policy,
            indexing=IndexOptions(prebuilt=index),
            planner=planner,
            collator=THDCollator(
                schema=schema, layout=layout, cp_rank=r, defer_cp_shard=defer_cp_shard
            ),
        )
        for r in range(layout.cp)
    ]
    total = len(loaders[0]) if limit is None else min(limit, len(loaders[0]))
    bar = Progress(f"loading micro-batches on {layout.cp} CP rank(s)", total) if progress else None
    stats, kept, first_bad = [], [], []
    t_first = None
    for i, rank_batches in enumerate(zip(*loaders)):
        if i >= total:
            break
        if t_first is None:
            t_first = time.perf_counter()
        bad = [v for b in rank_batches for v in validate(b)]
        first_bad += [str(v) for v in bad[: max(0, 5 - len(first_bad))]]
        stats.append(batch_stats(i, list(rank_batches), len(bad)))
        if len(kept) < panels:
            kept.append(_panel(i, list(rank_batches)))
        if bar:
            bar.step()
    t2 = time.perf_counter()
    if bar:
        bar.close(f" in {t2 - t1:.1f} s")
    report = loaders[0].report
    mixture = loaders[0].mixture_report() if isinstance(source, Mixture) else None
    return Inspection(
        mixture=mixture,
        stats=stats,
        panels=kept,
        report=report,
        num_samples=len(index),
        index_seconds=t1 - t0,
        load_seconds=t2 - t1,
        first_violations=first_bad,
        steady_seconds=t2 - t_first if t_first is not None else 0.0,
        steady_batches=max(len(stats) - 1, 0),
        steady_tokens=sum(s.real_tokens for s in stats[1:]),
    )


def _index(
    source: Source, schema: BatchSchema, policy: BadDataPolicy, num_workers: int, progress: bool
):
    """The index as a loader builds it: from the sidecars where they exist (``prealign index``), the
    other shards scanned (decode, transform, validate every sample once); what it did said on
    stderr."""
    from prealign.loaders.sources import remote
    from prealign.loaders.sources.shard_files import sidecar_path

    urls = getattr(source, "urls", None)
    have = 0
    if urls is not None and getattr(source, "sidecars", False):
        paths = [sidecar_path(u, getattr(source, "index_dir", None)) for u in urls]
        have = sum(1 for p in paths if remote.is_remote(p) or os.path.exists(remote.local_path(p)))
    if progress:
        total = source.num_shards
        scan = (
            ""
            if have == total
            else (
                f" (decode, transform and validate every sample once"
                f"{'' if have else '; `prealign index` makes it instant'})"
            )
        )
        sys.stderr.write(
            f"indexing {total} shard(s): {have} from sidecars, {total - have} scanned{scan}...\n"
        )
        sys.stderr.flush()
    t0 = time.perf_counter()
    bar = (
        Progress("scanned shards", source.num_shards - have)
        if progress and have < source.num_shards
        else None
    )
    try:
        index = build_index(
            source,
            schema,
            policy=policy,
            num_workers=num_workers,
            progress=bar.step if bar else None,
        )
    except BadSampleError as exc:
        if "at least one good sample" not in str(exc):
            raise
        results = scan_shards(
            source, schema, list(range(source.num_shards)), num_workers=num_workers
        )
        raise NothingLoadedError(
            _name(source),
            merge_shards(results, policy, width=1, where=source.where, schema=schema).report,
        ) from None
    if bar:
        bar.close()
    if progress:
        sys.stderr.write(f"indexed {len(index):,} samples in {time.perf_counter() - t0:.1f} s\n")
    return index


def _name(source: Source) -> str:
    """``"2 webdataset shard(s)"`` / ``"HF dataset <name>"``, for messages."""
    info = source.describe()
    kind = info.get("kind", type(source).__name__)
    if kind == "webdataset":
        return f"{source.num_shards} webdataset shard(s)"
    return f"{kind} {info.get('name', '')}".strip()
