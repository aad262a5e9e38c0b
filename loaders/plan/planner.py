"""Token-budget micro-batch planner: pure, deterministic, seeded.

Which samples go together, and on which DP rank. Every DP rank runs the same plan on the same
lengths and keeps its own row, so no communication is needed::

    lengths L ──oversize policy──► aligned A_i = layout.aligned_length(L_i)  (cap from the budget)
        │
        ▼ stream order (seeded shuffle, or as given)
    ┌──────────────── bounded buffer (buffer_size samples) ────────────────┐
    │ window sorted by A desc ──best fit──► open micro-batches ──► closed  │
    └───────────────────────────────────────────────────────────────────────┘
        │ closed micro-batches, pooled (step_pool steps) and sorted by load
        ▼
    steps of dp_size * k micro-batches ──LPT deal (k per rank)──► rank 0 | rank 1 | ... | rank dp-1
        │ stream end: the last r < dp*k micro-batches are re-spread over round_up(r, dp)
        ▼ micro-batches: one shorter final step, still the same count on every rank

A micro-batch is valid when its padded THD length ``layout.total_length(sum A_i)`` is at most the
token budget: the exact length the collator will produce (alignment, FP8 multiple, min rows and
length buckets included). The capacity ``cap`` is the largest aligned sum with that property.

>>> from prealign.schemas import ParallelLayout
>>> plan = plan_microbatches([5, 3, 7, 2, 6], layout=ParallelLayout(cp=2), token_budget=16,
...                         dp_size=2)
>>> plan.microbatches
(((0, 2),), ((4, 1, 3),))
>>> plan.padded_lengths.tolist(), plan.real_tokens.tolist()
([[16], [16]], [[12], [11]])
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from prealign.loaders.errors import OversizeSampleError, PlanError
from prealign.loaders.plan.cost import CostModel, balanced_steps
from prealign.loaders.plan.mixing import split_bins, step_fit
from prealign.loaders.plan.packing import StreamFit, next_fit, spread
from prealign.loaders.policy import Oversize, PackStrategy, coerce_enum
from prealign.schemas.checks import fields_of, int_at_least
from prealign.schemas.errors import BucketOverflowError
from prealign.schemas.layout import ParallelLayout, round_up, round_up_array

MAX_DP_SIZE = 1 << 20
"""DP ranks a plan is made for: each step holds a micro-batch per rank, so the plan's memory and
work grow with ``dp_size`` whatever the data (a million ranks: seconds and a GiB for 20 samples);
more is a :class:`PlanError`, not a ``MemoryError``."""


def check_dp_size(dp_size) -> int:
    """``dp_size`` as an ``int`` when it is an int in ``[1, MAX_DP_SIZE]``, else
    :class:`PlanError`."""
    size = _int_at_least("dp_size", dp_size, 1)
    if size > MAX_DP_SIZE:
        raise PlanError(f"dp_size: expected an int <= {MAX_DP_SIZE:,} (DP ranks), got {size:,}")
    return size


def _int_at_least(name: str, value, low: int) -> int:
    return int_at_least(name, value, low, PlanError)


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """How micro-batches are filled. Validated at construction.

    >>> PlannerConfig(strategy="first_fit").strategy
    <PackStrategy.FIRST_FIT: 'first_fit'>
    """

    strategy: PackStrategy = PackStrategy.BFD
    buffer_size: int = 2048
    """Samples the planner holds at once (new window + open micro-batches): bounds memory and how
    far apart in the stream two samples of one micro-batch can be."""
    oversize: Oversize = Oversize.ERROR
    """A sample longer than the budget allows even alone: raise, truncate to fit, or skip
    (counted)."""
    microbatches_per_step: int = 1
    """``k``: micro-batches each DP rank gets per step (gradient accumulation); the last step may be
    shorter."""
    max_age: int = 4
    """A micro-batch left open for this many windows closes (bounds stream locality)."""
    step_pool: int = 8
    """Closed micro-batches are sorted by load in pools of this many steps before dealing, so that
    the micro-batches of one step have similar loads (lower DP imbalance)."""
    chunk_size: int = 16384
    """Samples planned together (:class:`ChunkedPlan`): a loader plans the chunk its next
    micro-batch comes from when it gets there, so the first batch costs one chunk's planning
    whatever the size of the dataset (about 1.5 us a sample on one core)."""
    cost: CostModel | None = None
    """Balance each step's DP ranks by compute (:class:`~prealign.loaders.plan.cost.CostModel`)
    instead of tokens: the micro-batches of a pool are grouped into equal-cost shares of ``k``
    (:func:`~prealign.loaders.plan.cost.balanced_steps`). ``None``: by tokens (the plans of
    before)."""
    hybrid_cp: bool = False
    """Hybrid context parallelism (megatron-core's ``hybrid_context_parallel``), planned in the
    loader: each micro-batch's sequences are assigned to aligned CP sub-groups of 1, 2, 4, ... ranks
    (:func:`~prealign.loaders.plan.hybrid_cp.assign_cp_blocks`) and each CP rank's batch holds its
    sub-group's zigzag shards with ``local_cp_size``. Needs :attr:`cost`: the split trades a
    sequence's attention (``cost.quadratic``) against its K/V exchange (``cp_comm_ratio *
    cost.linear``), a ratio only the model knows (:meth:`CostModel.from_hf_config`). The
    micro-batches and steps are those of ``cost``."""
    cp_comm_ratio: float = 0.05
    """Hybrid CP only: the cost of receiving one token's K/V relative to ``cost.linear`` (about 0.02
    to 0.1 over NVLink, several times that across nodes)."""

    def __post_init__(self):
        object.__setattr__(self, "strategy", coerce_enum(PackStrategy, self.strategy, "strategy"))
        object.__setattr__(self, "oversize", coerce_enum(Oversize, self.oversize, "oversize"))
        _int_at_least("buffer_size", self.buffer_size, 2)
        _int_at_least("microbatches_per_step", self.microbatches_per_step, 1)
        _int_at_least("max_age", self.max_age, 1)
        _int_at_least("step_pool", self.step_pool, 1)
        _int_at_least("chunk_size", self.chunk_size, 1)
        if isinstance(self.cost, Mapping):
            cost = fields_of("cost", self.cost, CostModel, PlanError)
            object.__setattr__(self, "cost", CostModel(**cost))
        if self.cost is not None and not isinstance(self.cost, CostModel):
            raise PlanError(f"cost: expected a CostModel, its dict or None, got {self.cost!r}")
        if not isinstance(self.hybrid_cp, bool):
            raise PlanError(f"hybrid_cp: expected a bool, got {self.hybrid_cp!r}")
        ratio = self.cp_comm_ratio
        if (
            isinstance(ratio, bool)
            or not isinstance(ratio, (int, float))
            or not 0 <= ratio < float("inf")
        ):
            raise PlanError(f"cp_comm_ratio: expected a finite number >= 0, got {ratio!r}")
        if self.hybrid_cp and self.cost is None:
            raise PlanError(
                "hybrid_cp: needs cost=CostModel(...) (e.g. "
                "CostModel.from_hf_config(model_config)) to "
                "weigh a sequence's attention against its K/V exchange when choosing its CP "
                "sub-group"
            )

    def to_dict(self) -> dict:
        return {
            "strategy": self.strategy.value,
            "buffer_size": self.buffer_size,
            "oversize": self.oversize.value,
            "microbatches_per_step": self.microbatches_per_step,
            "max_age": self.max_age,
            "step_pool": self.step_pool,
            "chunk_size": self.chunk_size,
            **(
                {"cost": self.cost.to_dict()} if self.cost is not None else {}
            ),  # (fingerprints of before)
            **(
                {"hybrid_cp": True, "cp_comm_ratio": float(self.cp_comm_ratio)}
                if self.hybrid_cp
                else {}
            ),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "PlannerConfig":
        """The inverse of :meth:`to_dict`; a non-dict or an unknown key is a :class:`PlanError`."""
        return cls(**fields_of("planner", data, cls, PlanError))


@dataclass(frozen=True, kw_only=True)
class PlanStats:
    """Summary of a plan (JSON-friendly via :meth:`to_dict`)."""

    num_samples: int
    """Samples placed in some micro-batch (skipped ones excluded)."""
    microbatches_per_rank: int
    num_steps: int
    token_budget: int
    capacity: int
    """Largest aligned-length sum whose padded length fits the budget."""
    real_tokens: int
    padded_tokens: int
    """Sum over micro-batches of the collator's padded length T."""
    utilisation: float
    """real tokens / (micro-batches x budget), over all ranks."""
    imbalance: float
    """Step-synchronous DP imbalance: sum over steps of the max rank load / sum of the mean rank
    load (1.0 = perfect; the time-weighted slowdown of the slowest rank). Load = real tokens, or
    their cost under :attr:`PlannerConfig.cost`."""
    worst_step_imbalance: float
    """max over steps of (max rank load / mean rank load)."""
    max_padded_length: int
    num_empty: int
    """Micro-batches with no sample (only when there are fewer samples than micro-batches to
    fill)."""
    num_truncated: int
    truncated_tokens: int
    num_skipped: int
    """Oversize samples left out by ``Oversize.SKIP``."""
    num_skipped_media: int = 0
    """Oversize samples carrying media left out under ``Oversize.TRUNCATE`` (never cut)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class MicrobatchPlan:
    """The result of :func:`plan_microbatches`.

    ``microbatches[r][i]`` is the tuple of sample indices (into the ``lengths`` given) of DP rank
    ``r``'s i-th micro-batch; every rank has the same number. ``steps[s]`` is how many micro-batches
    each rank gets in step ``s``.
    """

    microbatches: tuple[tuple[tuple[int, ...], ...], ...]
    steps: tuple[int, ...]
    real_tokens: np.ndarray
    """int64 ``[dp_size, microbatches_per_rank]`` true tokens (after truncation) of each
    micro-batch."""
    padded_lengths: np.ndarray
    """int64 ``[dp_size, microbatches_per_rank]`` padded THD length T the collator will produce (0
    if empty)."""
    truncated: dict[int, int]
    """sample index -> length it is cut to (``Oversize.TRUNCATE``)."""
    skipped: tuple[int, ...]
    """sample indices left out (``Oversize.SKIP``)."""
    stats: PlanStats
    skipped_media: tuple[int, ...] = ()
    """sample indices left out under ``Oversize.TRUNCATE`` because they carry media (``has_media``):
    a cut could split an image's tokens from its ``pixel_values`` / ``image_grid_thw``."""

    @property
    def dp_size(self) -> int:
        return len(self.microbatches)


def budget_for(layout: ParallelLayout, length: int) -> int:
    """The smallest ``token_budget`` whose micro-batch holds a sample of ``length`` tokens alone.

    >>> budget_for(ParallelLayout(tp=2, cp=2), 101)  # (aligned to 2 * cp * tp)
    104
    """
    step = layout.seq_multiple
    return int(layout.total_length(-(-length // step) * step))


def microbatch_capacity(layout: ParallelLayout, token_budget: int) -> int:
    """Largest aligned-length sum ``A`` with ``layout.total_length(A) <= token_budget`` (a multiple
    of ``layout.seq_multiple``); raises :class:`PlanError` when not even one aligned token block
    fits.

    >>> layout = ParallelLayout(tp=2, cp=2)
    >>> microbatch_capacity(layout, 8192), microbatch_capacity(layout, 8190)
    (8192, 8188)
    """
    budget = _int_at_least("token_budget", token_budget, 1)

    def fits(a: int) -> bool:
        try:
            return layout.total_length(a) <= budget
        except BucketOverflowError:
            return False

    step = layout.seq_multiple
    if not fits(step):
        raise PlanError(
            f"token_budget {budget} is below the smallest padded micro-batch "
            f"({_smallest(layout)} tokens under {layout.to_dict()}); raise the budget"
        )
    lo, hi = (
        1,
        budget // step,
    )  # in units of seq_multiple; fits(lo*step) holds, total_length is monotone
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid - 1)
    return lo * step


def _smallest(layout: ParallelLayout) -> str:
    try:
        return str(layout.total_length(layout.seq_multiple))
    except BucketOverflowError as exc:
        return f"none: {exc}"


_INT64_MAX = 2**63 - 1


def _as_lengths(lengths) -> np.ndarray:
    arr = np.asarray(lengths.numpy() if hasattr(lengths, "numpy") else lengths)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise PlanError(
            f"lengths: expected a 1-D sequence of ints, got shape {arr.shape} dtype {arr.dtype}"
        )
    if arr.size and arr.dtype.kind == "u" and int(arr.max()) > _INT64_MAX:  # (before the cast)
        i = int(np.flatnonzero(arr > np.uint64(_INT64_MAX))[0])
        raise OversizeSampleError(
            sample=i,
            field="input_ids",
            expected=f"length <= {_INT64_MAX} (int64)",
            actual=str(int(arr[i])),
        )
    arr = arr.astype(np.int64, copy=False)
    if arr.size and int(arr.min()) < 1:
        i = int(np.argmin(arr))
        raise OversizeSampleError(
            sample=i, field="input_ids", expected="length >= 1", actual=str(int(arr[i]))
        )
    return arr


def _as_flags(flags, n: int) -> np.ndarray:
    if flags is None:
        return np.zeros(n, bool)
    arr = np.asarray(flags.numpy() if hasattr(flags, "numpy") else flags)
    if arr.shape != (n,) or (arr.size and arr.dtype != bool):
        raise PlanError(
            f"has_media: expected bool [{n}] (one flag per length), got shape {arr.shape} "
            f"dtype {arr.dtype}"
        )
    return arr


def plan_microbatches(
    lengths,
    *,
    layout: ParallelLayout,
    token_budget: int,
    dp_size: int = 1,
    config: PlannerConfig | None = None,
    seed: int | None = None,
    has_media=None,
    **options,
) -> MicrobatchPlan:
    """Group samples into micro-batches whose padded THD length never exceeds ``token_budget``,
    dealt to ``dp_size`` ranks with the same count per step and balanced token loads.

    ``lengths``: int ``[N]`` true token lengths (list, numpy or torch). ``seed``: shuffle the stream
    order first (``None``: plan in the order given). ``options`` override :class:`PlannerConfig`
    fields (``strategy="first_fit"``, ``buffer_size=...``, ``oversize="skip"``, ...).
    ``has_media``: optional bool ``[N]``, samples that carry media (images): under
    ``Oversize.TRUNCATE`` an oversize one is left out (``skipped_media``) instead of cut.
    The token budget is the global padded length of one micro-batch (one CP group); each CP rank
    holds ``budget / cp`` of it. The whole plan of :class:`ChunkedPlan` (which loaders plan lazily).
    """
    return ChunkedPlan(
        lengths,
        layout=layout,
        token_budget=token_budget,
        dp_size=dp_size,
        config=config,
        seed=seed,
        has_media=has_media,
        **options,
    ).full()


@dataclass(frozen=True)
class PlannedChunk:
    """The micro-batches of one chunk (see :class:`ChunkedPlan`), already dealt to the DP ranks."""

    microbatches: tuple[tuple[tuple[int, ...], ...], ...]
    """``[dp][i]``: sample indices (into the plan's ``lengths``) of rank r's i-th micro-batch of the
    chunk."""
    steps: tuple[int, ...]
    real_tokens: np.ndarray
    padded_lengths: np.ndarray
    load_max: float
    """sum over the chunk's steps of the largest rank load (for :attr:`PlanStats.imbalance`)."""
    load_mean: float
    worst: float


@dataclass(frozen=True)
class Screening:
    """What the oversize policy did to a stream (it depends on lengths and media flags only, so it
    is the same every epoch). Indices are into the plan's ``lengths``."""

    capacity: int
    truncated: dict[int, int]
    skipped: tuple[int, ...]
    skipped_media: tuple[int, ...]
    cut_tokens: int


def chunk_bounds(n: int, chunk_size: int) -> list[int]:
    """Start of each chunk, then ``n``: chunks of ``chunk_size`` samples, the last one taking a
    remainder under half a chunk (so no chunk is tiny).

    >>> chunk_bounds(9, 4), chunk_bounds(10, 4), chunk_bounds(3, 4), chunk_bounds(0, 4)
    ([0, 4, 9], [0, 4, 8, 10], [0, 3], [0, 0])
    """
    k = max(1, n // chunk_size + (n % chunk_size >= chunk_size / 2))
    return [min(i * chunk_size, n) for i in range(k)] + [n]


class ChunkedPlan:
    """The plan of :func:`plan_microbatches`, computed one chunk at a time, on demand.

    The stream (the samples in the order given, after the oversize policy) is cut into chunks of
    ``config.chunk_size`` samples (:func:`chunk_bounds`). One streaming packing pass
    (:class:`~prealign.loaders.plan.packing.StreamFit`) runs over the whole stream, advanced to the
    end of a chunk when the chunk is planned (its last window may run past the chunk, to the
    stream's end; the chunks after the end are then empty): the micro-batches are those of a single
    pass (``in_order`` closes its micro-batch at each chunk end). A chunk's micro-batches are dealt
    in whole steps; those short of a step are carried into the next chunk, so only the epoch's last
    step is short. The tail re-spread (every rank one more micro-batch) draws on the chunk where the
    pass ends: with chunks far smaller than the default and too few samples left, it can leave a
    filler one pass would not. Steps are pooled by load within a chunk. Chunk ``c`` needs chunks
    ``0..c-1`` planned first and nothing after it: a loader's first batch costs one chunk, whatever
    the dataset's size. The oversize policy (``truncated``, ``skipped``, ``skipped_media``) is
    settled for the whole stream at construction, vectorised.

    >>> from prealign.schemas import ParallelLayout
    >>> plan = ChunkedPlan([5, 3, 7, 2, 6, 4], layout=ParallelLayout(), token_budget=8,
    ...                    chunk_size=2)
    >>> plan.num_chunks, plan.chunk(0).microbatches, plan.planned  # its first window reads on...
    (3, (((4, 3), (0, 1), (2,), (5,)),), 1)
    >>> plan.chunk(2).microbatches, plan.full().microbatches  # ... to the end: the rest is empty
    (((),), (((4, 3), (0, 1), (2,), (5,)),))
    """

    def __init__(
        self,
        lengths,
        *,
        layout: ParallelLayout,
        token_budget: int,
        dp_size: int = 1,
        config: PlannerConfig | None = None,
        seed: int | None = None,
        has_media=None,
        groups=None,
        **options,
    ):
        cfg = self.config = dataclasses.replace(
            config or PlannerConfig(), **fields_of("options", options, PlannerConfig, PlanError)
        )
        if seed is not None:
            _int_at_least("seed", seed, 0)
        self.layout, self.token_budget = layout, token_budget
        self.dp = check_dp_size(dp_size)
        true_len = _as_lengths(lengths)
        media = _as_flags(has_media, true_len.size)
        self.cap = cap = microbatch_capacity(layout, token_budget)
        max_len = cap  # aligned_length(cap) == cap, so a sample of cap tokens fits alone
        order = (
            np.arange(true_len.size)
            if seed is None
            else np.random.default_rng(seed).permutation(true_len.size)
        )
        self.truncated: dict[int, int] = {}
        """sample index -> length it is cut to (``Oversize.TRUNCATE``)."""
        self.cut_tokens = 0
        self.skipped: tuple[int, ...] = ()
        self.skipped_media: tuple[int, ...] = ()
        over = np.nonzero(true_len > max_len)[0]
        if over.size:
            if cfg.oversize is Oversize.ERROR:
                i = int(over[0])
                need = budget_for(layout, int(true_len[over].max()))
                err = OversizeSampleError(
                    sample=i,
                    field="input_ids",
                    expected=f"length <= {max_len}",
                    actual=str(int(true_len[i])),
                    hint=f"{over.size} sample(s) exceed token_budget {token_budget} under "
                    f"{layout.to_dict()}; give token_budget={need} (the longest fits), or "
                    f"cut or leave them out: planner=PlannerConfig(oversize='truncate') "
                    f"(or 'skip') to the loader",
                )
                err.token_budget = need
                raise err
            if cfg.oversize is Oversize.TRUNCATE:
                whole = over[
                    media[over]
                ]  # cutting would split an image's tokens from its pixels: leave out
                over = over[~media[over]]
                self.skipped_media = tuple(int(i) for i in whole)
                self.truncated = {int(i): max_len for i in over}
                self.cut_tokens = int((true_len[over] - max_len).sum())
                if whole.size:
                    keep = np.ones(true_len.size, bool)
                    keep[whole] = False
                    order = order[keep[order]]
                true_len = np.minimum(true_len, max_len)
            else:
                self.skipped = tuple(int(i) for i in over)
                order = order[true_len[order] <= max_len]
        self.order = order
        """int64 ``[M]``: the sample indices the plan places, in stream order (oversize ones left
        out)."""
        self._true_len = true_len
        self._aligned = round_up_array(
            true_len, layout.seq_multiple
        )  # exactly the collator's P_i before extension
        self._sizes = self._aligned[order]
        self._groups = None if groups is None else np.asarray(groups)[order]
        """int ``[M]`` by stream position (``groups``: a label per sample, e.g. its mixture
        component): under ``STEP_FIT`` a micro-batch holds one label only."""
        self._costs = (
            None if cfg.cost is None else cfg.cost.of(true_len[order])
        )  # float64 [M], by position
        self._bounds = chunk_bounds(order.size, cfg.chunk_size)
        self._chunks: list[PlannedChunk] = []
        self._carry: list[list[int]] = []
        self._fit: StreamFit | None = None
        self._ended = False

    @property
    def screening(self) -> Screening:
        return Screening(
            capacity=self.cap,
            truncated=self.truncated,
            skipped=self.skipped,
            skipped_media=self.skipped_media,
            cut_tokens=self.cut_tokens,
        )

    @property
    def num_chunks(self) -> int:
        return len(self._bounds) - 1

    @property
    def planned(self) -> int:
        """Chunks planned so far."""
        return len(self._chunks)

    def chunk(self, c: int) -> PlannedChunk:
        """Chunk ``c`` (planning it, and the chunks before it, if not done yet)."""
        if not 0 <= c < self.num_chunks:
            raise PlanError(f"chunk {c} out of range: the plan has {self.num_chunks} chunk(s)")
        while len(self._chunks) <= c:
            self._chunks.append(self._plan_chunk(len(self._chunks)))
        return self._chunks[c]

    def _plan_chunk(self, c: int) -> PlannedChunk:
        cfg, cap, sizes = self.config, self.cap, self._sizes
        lo, hi = self._bounds[c], self._bounds[c + 1]
        if self._ended:  # the packing pass reached the stream's end in an earlier chunk
            return _assemble(
                [], self.order, self._true_len, self._aligned, self.layout, self.dp, cap, cfg.cost
            )
        if cfg.strategy is PackStrategy.IN_ORDER:
            bins = [[lo + i for i in b] for b in next_fit(sizes[lo:hi], cap, self.layout.max_seqs)]
            self._ended = c == self.num_chunks - 1
        elif (
            cfg.strategy is PackStrategy.STEP_FIT
        ):  # each step the next stretch of the stream (mixtures)
            groups = None if self._groups is None else self._groups[lo:hi]
            bins = [
                [lo + i for i in b]
                for b in step_fit(
                    sizes[lo:hi],
                    cap,
                    self.dp * cfg.microbatches_per_step,
                    self.layout.max_seqs,
                    groups,
                )
            ]
            self._ended = c == self.num_chunks - 1
        else:  # one packing pass over the whole stream, advanced a chunk at a time
            if self._fit is None:
                self._fit = StreamFit(
                    sizes,
                    cap,
                    buffer_size=cfg.buffer_size,
                    best=cfg.strategy is PackStrategy.BFD,
                    max_age=cfg.max_age,
                    max_items=self.layout.max_seqs,
                )
            bins = self._fit.advance(hi)
            self._ended = self._fit.pos >= sizes.shape[0]  # its last window may run past this chunk
            if self._ended:
                bins += self._fit.finish()
                self._fit = None  # (it holds every sample's bin)
        bins = self._carry + bins  # positions into the whole stream
        if (
            self._ended
        ):  # the epoch's tail: re-spread over every rank here, with this chunk's steps to draw on
            self._carry = []
        else:  # whole steps only; the rest joins the next chunk
            per_step = self.dp * cfg.microbatches_per_step
            full = len(bins) - len(bins) % per_step
            bins, self._carry = bins[:full], bins[full:]
        steps = _form_steps(
            bins,
            sizes,
            cap,
            self.dp,
            cfg,
            self._costs,
            self.layout.max_seqs,
            grouped=self._groups is not None,
        )
        return _assemble(
            steps, self.order, self._true_len, self._aligned, self.layout, self.dp, cap, cfg.cost
        )

    def full(self) -> MicrobatchPlan:
        """Every chunk, as one :class:`MicrobatchPlan` with its statistics."""
        chunks = [self.chunk(c) for c in range(self.num_chunks)]
        dp, budget = self.dp, self.token_budget
        per_rank = [[mb for ch in chunks for mb in ch.microbatches[r]] for r in range(dp)]
        real = np.concatenate([ch.real_tokens for ch in chunks], axis=1)
        padded = np.concatenate([ch.padded_lengths for ch in chunks], axis=1)
        steps = tuple(s for ch in chunks for s in ch.steps)
        load_max, load_mean = sum(ch.load_max for ch in chunks), sum(ch.load_mean for ch in chunks)
        total = real.size
        stats = PlanStats(
            num_samples=int(self.order.size),
            microbatches_per_rank=len(per_rank[0]),
            num_steps=len(steps),
            token_budget=budget,
            capacity=self.cap,
            real_tokens=int(real.sum()),
            padded_tokens=int(padded.sum()),
            utilisation=float(real.sum()) / (total * budget) if total else 0.0,
            imbalance=load_max / load_mean if load_mean else 1.0,
            worst_step_imbalance=max((ch.worst for ch in chunks), default=1.0),
            max_padded_length=int(padded.max()) if total else 0,
            num_empty=int(sum(1 for rk in per_rank for mb in rk if not mb)),
            num_truncated=len(self.truncated),
            truncated_tokens=self.cut_tokens,
            num_skipped=len(self.skipped),
            num_skipped_media=len(self.skipped_media),
        )
        return MicrobatchPlan(
            microbatches=tuple(tuple(rk) for rk in per_rank),
            steps=steps,
            real_tokens=real,
            padded_lengths=padded,
            truncated=self.truncated,
            skipped=self.skipped,
            stats=stats,
            skipped_media=self.skipped_media,
        )


def _form_steps(
    bins: list[list[int]],
    sizes: np.ndarray,
    cap: int,
    dp: int,
    cfg: PlannerConfig,
    costs: np.ndarray | None = None,
    max_items: int | None = None,
    grouped: bool = False,
) -> list[list[list[int]]]:
    """Closed bins -> steps (lists of ``dp * k_s`` bins); the tail re-spread to a multiple of
    ``dp``. With ``costs`` (float64, by stream position) the steps come dealt, rank-major
    (:func:`balanced_steps`)."""
    per_step = dp * cfg.microbatches_per_step
    full = len(bins) - len(bins) % per_step
    head, tail = bins[:full], bins[full:]
    tail_steps: list[list[list[int]]] = []
    if tail:
        last = round_up(len(tail), dp)  # the final step: round_up(r, dp) micro-batches
        pulled = 0
        while (
            sum(map(len, tail)) < pulled * per_step + last and head
        ):  # too few samples: take a step back
            head, tail = head[:-per_step], head[-per_step:] + tail
            pulled += 1
        # one group per bin (pack_within_component): items moved out alone, never into another bin
        if grouped:
            spread_bins = split_bins(tail, pulled * per_step + last)
        else:
            spread_bins = spread(tail, sizes, pulled * per_step + last, cap, max_items)
        spread_bins.sort(key=lambda b: -int(sizes[b].sum()) if b else 0)
        cut = pulled * per_step
        if costs is not None:
            tail_steps = _cost_steps(
                spread_bins[:cut], costs, dp, cfg.microbatches_per_step
            ) + _cost_steps(spread_bins[cut:], costs, dp, last // dp)
        else:
            tail_steps = [spread_bins[i : i + per_step] for i in range(0, cut, per_step)] + [
                spread_bins[cut:]
            ]
    out: list[list[list[int]]] = []
    pool = per_step * (
        1 if cfg.strategy is PackStrategy.STEP_FIT else cfg.step_pool
    )  # (STEP_FIT: as formed)
    all_loads = _bin_loads(head, sizes) if costs is None else None
    for start in range(0, len(head), pool):
        chunk = head[start : start + pool]
        if costs is not None:
            out.extend(_cost_steps(chunk, costs, dp, cfg.microbatches_per_step))
            continue
        loads = all_loads[start : start + pool]
        ranked = [chunk[j] for j in np.argsort(-loads, kind="stable")]
        out.extend(ranked[i : i + per_step] for i in range(0, len(ranked), per_step))
    return out + tail_steps


def _bin_loads(bins: list[list[int]], sizes: np.ndarray) -> np.ndarray:
    """int64 ``[len(bins)]``: the sum of ``sizes`` over each bin's positions (vectorised: one
    cumsum)."""
    counts = np.fromiter((len(b) for b in bins), np.int64, len(bins))
    flat = np.fromiter(itertools.chain.from_iterable(bins), np.int64, int(counts.sum()))
    return _bin_sums(sizes[flat], np.cumsum(counts), counts)


def _cost_steps(bins: list[list[int]], costs: np.ndarray, dp: int, k: int) -> list[list[list[int]]]:
    """:func:`balanced_steps` of whole steps of ``bins``, their costs summed from ``costs`` (by
    position)."""
    if not bins:
        return []
    sizes = np.fromiter((len(b) for b in bins), np.int64, len(bins))
    flat = np.fromiter((i for b in bins for i in b), np.int64, int(sizes.sum()))
    bin_cost = np.zeros(len(bins))
    np.add.at(bin_cost, np.repeat(np.arange(len(bins)), sizes), costs[flat])
    return balanced_steps(bins, bin_cost, dp, k)


def _deal(loads: list[int], dp: int) -> list[list[int]]:
    """Bins of one step (their loads) -> per-rank bin positions, ``len(loads) / dp`` each, LPT
    order."""
    k = len(loads) // dp
    ranked = sorted(range(len(loads)), key=lambda j: (-loads[j], j))
    if k == 1:  # every rank starts empty: the r-th largest goes to rank r
        return [[j] for j in ranked]
    rank_load = [0] * dp
    out: list[list[int]] = [[] for _ in range(dp)]
    for j in ranked:
        r = min((r for r in range(dp) if len(out[r]) < k), key=lambda r: (rank_load[r], r))
        out[r].append(j)
        rank_load[r] += loads[j]
    return [sorted(o) for o in out]


def _assemble(
    steps, order, true_len, aligned, layout, dp, cap, cost: CostModel | None = None
) -> PlannedChunk:
    """Steps of bins (positions) -> this chunk's per-rank micro-batches (sample indices) and
    statistics. Without ``cost`` each step is dealt by tokens (:func:`_deal`); with it the steps
    come dealt, rank-major. Per sample: a few numpy calls over the whole chunk (ids, lengths,
    per-bin sums); Python runs per micro-batch and per step only (a resume re-plans the chunk it
    resumes in: issues #28, #31)."""
    bins = [b for step in steps for b in step]
    counts = np.fromiter((len(b) for b in bins), np.int64, len(bins))
    ends = np.cumsum(counts)
    flat = np.fromiter(itertools.chain.from_iterable(bins), np.int64, int(ends[-1]) if bins else 0)
    ids = order[flat]
    real_of = _bin_sums(true_len[ids], ends, counts)  # int64 [bins]: true tokens of each bin
    aligned_of = _bin_sums(aligned[ids], ends, counts)
    if aligned_of.size and int(aligned_of.max()) > cap:
        raise AssertionError(
            f"planner bug: micro-batch over capacity ({int(aligned_of.max())} > {cap})"
        )
    id_list, bounds = ids.tolist(), (ends - counts).tolist()
    members = [tuple(id_list[a : a + c]) for a, c in zip(bounds, counts.tolist())]
    real_list = real_of.tolist()
    per_rank: list[list[int]] = [[] for _ in range(dp)]  # bin numbers (into ``bins``) of each rank
    step_sizes: list[int] = []
    max_sum = mean_sum = 0.0
    worst = 1.0
    first = 0
    for step in steps:
        if cost is None:
            loads = real_list[first : first + len(step)]
            dealt = _deal(loads, dp)
        else:
            loads = [
                float(cost.of(true_len[list(mb)]).sum()) if mb else 0.0
                for mb in members[first : first + len(step)]
            ]
            k = len(step) // dp
            dealt = [list(range(r * k, (r + 1) * k)) for r in range(dp)]
        rank_loads = [sum(loads[j] for j in d) for d in dealt]
        for r in range(dp):
            per_rank[r].extend(first + j for j in dealt[r])
        step_sizes.append(len(step) // dp)
        mean = sum(rank_loads) / dp
        max_sum += max(rank_loads)
        mean_sum += mean
        if mean > 0:
            worst = max(worst, max(rank_loads) / mean)
        first += len(step)
    where = np.asarray(per_rank, np.int64).reshape(dp, -1)  # [dp, micro-batches per rank]
    real = real_of[where] if where.size else np.zeros(where.shape, np.int64)
    padded = np.zeros(where.shape, np.int64)
    totals: dict[int, int] = {}  # aligned sum -> padded length (a few distinct values)
    for a in np.unique(aligned_of[counts > 0]).tolist():
        totals[a] = layout.total_length(a)
    if where.size:
        used = counts[where] > 0
        padded[used] = [totals[a] for a in aligned_of[where][used].tolist()]
    return PlannedChunk(
        microbatches=tuple(tuple(members[j] for j in rk) for rk in per_rank),
        steps=tuple(step_sizes),
        real_tokens=real,
        padded_lengths=padded,
        load_max=max_sum,
        load_mean=mean_sum,
        worst=worst,
    )


def _bin_sums(values: np.ndarray, ends: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """int64 ``[len(counts)]``: the sum of ``values`` (by flat position) over each bin (``ends``:
    cumsum of ``counts``), one cumsum for all bins."""
    sums = np.concatenate([np.zeros(1, np.int64), np.cumsum(values, dtype=np.int64)])
    return sums[ends] - sums[ends - counts]
