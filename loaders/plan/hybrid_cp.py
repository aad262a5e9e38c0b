"""Hybrid context parallelism planned in the loader: which CP sub-group runs each sequence of a
micro-batch.

A CP group of ``cp`` ranks (a power of two) is cut into aligned blocks of ``local_cp_size`` in
{1, 2, 4, ..., cp} ranks, the sub-groups megatron-core 0.16.1 builds for hybrid CP
(``parallel_state.create_hybrid_dp_cp_groups``: consecutive ranks ``[j*k, (j+1)*k)``). Each sequence
of the micro-batch runs on one block: a long one spans a large block, short ones stay on one rank
and skip the CP exchange. Every rank of a block gets the block's sequences packed THD and
zigzag-sharded over the block (chunks ``r`` and ``2k-1-r`` of each sequence for rank ``r`` of the
block: what megatron-core's ``get_batch_on_this_cp_rank`` cuts), and the batch says ``local_cp_size
= k``.

The assignment is a pure function of the micro-batch's lengths, so every rank computes the same one
from the index with no collective (megatron-core all-gathers the lengths and reroutes the samples
with an all-to-all instead). It bisects the rank tree: a block is split in two halves when every
sequence fits a half (per-rank rows never above the fixed-CP share ``token_budget / cp``), both
halves get work, and the predicted time of the slower half is below the block's. A sequence of ``L``
tokens on ``k`` ranks is predicted to take ``cost(L) / k + comm * L * (k - 1) / k`` (its share of
the compute, plus the K/V a rank receives from the other ``k - 1``), ``comm = comm_ratio *
cost.linear``.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

import numpy as np

from prealign.loaders.errors import PlanError
from prealign.loaders.plan.cost import CostModel
from prealign.schemas.errors import BucketOverflowError, ConfigError, SampleError
from prealign.schemas.layout import CPLayout, ParallelLayout, is_power_of_two


@dataclass(frozen=True)
class CPBlock:
    """``size`` consecutive CP ranks from ``first`` running the micro-batch's sequences ``members``
    (positions into the micro-batch, ascending)."""

    first: int
    size: int
    members: tuple[int, ...]

    def holds(self, cp_rank: int) -> bool:
        return self.first <= cp_rank < self.first + self.size


def sequence_time(lengths, k: int, cost: CostModel, comm_ratio: float) -> np.ndarray:
    """float64 ``[N]``: predicted time (cost units) of each sequence on ``k`` CP ranks."""
    n = np.asarray(lengths, dtype=np.float64)
    return cost.of(n) / k + comm_ratio * cost.linear * n * (k - 1) / k


def _check(layout: ParallelLayout, comm_ratio) -> None:
    if not is_power_of_two(layout.cp):
        raise PlanError(
            f"hybrid CP: cp must be a power of two (the sub-groups are 1, 2, 4, ... ranks), got "
            f"cp={layout.cp}"
        )
    if layout.cp_layout is not CPLayout.ZIGZAG:
        raise PlanError(
            f"hybrid CP: the blocks are zigzag-sharded (megatron-core's "
            f"get_batch_on_this_cp_rank), got cp_layout={layout.cp_layout.value!r}"
        )
    if (
        isinstance(comm_ratio, bool)
        or not isinstance(comm_ratio, numbers.Real)
        or not comm_ratio >= 0
    ):
        raise PlanError(f"hybrid CP: comm_ratio must be a number >= 0, got {comm_ratio!r}")


def assign_cp_blocks(
    lengths, *, layout: ParallelLayout, token_budget: int, cost: CostModel, comm_ratio: float = 0.05
) -> tuple[CPBlock, ...]:
    """The blocks (ascending ``first``, covering ranks ``0..cp-1`` exactly once) running one
    micro-batch of true ``lengths`` (int ``[N]``, N >= 1), planned with ``token_budget`` under
    ``layout``.

    ``comm_ratio``: the cost of receiving one token's K/V relative to ``cost.linear`` (about 0.02 to
    0.1 over NVLink for GQA / MHA models, several times that across nodes).

    >>> from prealign.schemas import ParallelLayout
    >>> cost = CostModel(linear=24576, quadratic=1)
    >>> cp4 = ParallelLayout(cp=4)
    >>> for block in assign_cp_blocks([2000, 500, 500, 500, 500], layout=cp4, token_budget=8192,
    ...                               cost=cost):
    ...     print(block)
    CPBlock(first=0, size=2, members=(0,))
    CPBlock(first=2, size=1, members=(1, 3))
    CPBlock(first=3, size=1, members=(2, 4))
    >>> assign_cp_blocks([6000, 700, 500], layout=cp4, token_budget=8192, cost=cost)  # one rules
    (CPBlock(first=0, size=4, members=(0, 1, 2)),)
    """
    _check(layout, comm_ratio)
    true = np.asarray(lengths, dtype=np.int64)
    if true.ndim != 1 or true.size == 0:
        raise PlanError(
            f"hybrid CP: expected the lengths of a non-empty micro-batch, got shape {true.shape}"
        )
    per_rank = token_budget // layout.cp
    layouts = {layout.cp: layout}  # (one validated ParallelLayout per block size, not one per test)

    def fits(members, k: int) -> bool:
        lay = layouts.get(k) or layouts.setdefault(k, dataclasses.replace(layout, cp=k))
        aligned = int(
            (
                (true[list(members)] + lay.seq_multiple - 1) // lay.seq_multiple * lay.seq_multiple
            ).sum()
        )
        try:
            return lay.total_length(aligned) // k <= per_rank
        except BucketOverflowError:
            return False

    def split(members: list[int], first: int, size: int) -> tuple[list[CPBlock], float]:
        whole = [CPBlock(first, size, tuple(sorted(members)))]
        whole_time = float(sequence_time(true[members], size, cost, comm_ratio).sum())
        if size == 1 or len(members) < 2:
            return whole, whole_time
        half = size // 2
        times = sequence_time(true[members], half, cost, comm_ratio)
        parts: tuple[list[int], list[int]] = ([], [])
        load = [0.0, 0.0]
        for j in np.argsort(
            -times, kind="stable"
        ).tolist():  # costliest first, into the lighter half that fits
            for h in sorted((0, 1), key=lambda h: (load[h], h)):
                if fits(parts[h] + [members[j]], half):
                    parts[h].append(members[j])
                    load[h] += float(times[j])
                    break
            else:
                return whole, whole_time
        if not parts[0] or not parts[1]:
            return whole, whole_time
        left, t_left = split(parts[0], first, half)
        right, t_right = split(parts[1], first + half, half)
        if max(t_left, t_right) < whole_time:
            return left + right, max(t_left, t_right)
        return whole, whole_time

    if not fits(range(true.size), layout.cp):
        raise PlanError(
            f"hybrid CP: a micro-batch of lengths {true.tolist()[:8]} does not fit token_budget "
            f"{token_budget} under {layout.to_dict()}; plan it with the same budget and layout"
        )
    blocks, _ = split(list(range(true.size)), 0, layout.cp)
    return tuple(blocks)


def hybrid_cp_plan(
    plan,
    lengths,
    *,
    layout: ParallelLayout,
    token_budget: int,
    cost: CostModel,
    comm_ratio: float = 0.05,
) -> tuple[tuple[tuple[CPBlock, ...] | None, ...], ...]:
    """The blocks of every micro-batch of a :class:`~prealign.loaders.plan.planner.MicrobatchPlan`
    (``[dp][i]``, None for an empty micro-batch), from the same ``lengths`` (int ``[N]``, truncation
    applied as the plan did), layout and budget the plan was made with."""
    true = np.asarray(lengths, dtype=np.int64)
    return tuple(
        tuple(
            assign_cp_blocks(
                [plan.truncated.get(i, int(true[i])) for i in mb],
                layout=layout,
                token_budget=token_budget,
                cost=cost,
                comm_ratio=comm_ratio,
            )
            if mb
            else None
            for mb in rank
        )
        for rank in plan.microbatches
    )


def block_of(blocks: tuple[CPBlock, ...], cp_rank: int) -> CPBlock:
    """The block CP rank ``cp_rank`` belongs to."""
    for block in blocks:
        if block.holds(cp_rank):
            return block
    raise PlanError(f"hybrid CP: no block holds cp_rank {cp_rank} (blocks {blocks})")


def predicted_time(
    lengths, blocks: tuple[CPBlock, ...], cost: CostModel, comm_ratio: float = 0.05
) -> float:
    """Predicted time of the micro-batch: its slowest block."""
    true = np.asarray(lengths, dtype=np.int64)
    return max(
        float(sequence_time(true[list(b.members)], b.size, cost, comm_ratio).sum()) for b in blocks
    )


def hybrid_cp_batch(
    samples: list,
    blocks: tuple[CPBlock, ...],
    *,
    schema,
    layout: ParallelLayout,
    cp_rank: int,
    **collator_options,
) -> dict:
    """This CP rank's batch of a hybrid-CP micro-batch: its block's samples (``samples`` is the
    whole micro-batch, in plan order) collated THD and zigzag-sharded over the block, plus
    ``local_cp_size`` (int, the block's size, also its ``cp_size``) and ``hybrid_cp_members`` (the
    positions in the micro-batch it holds). :func:`~prealign.collate.to_packed_seq_params` fills
    ``local_cp_size``."""
    from prealign.collate import THDCollator

    return _block_batch(
        THDCollator(schema=schema, layout=layout, cp_rank=cp_rank, **collator_options),
        samples,
        blocks,
    )


def _thd(collator):
    """The :class:`~prealign.collate.THDCollator` of ``collator`` (itself, or the one an
    :class:`~prealign.collate.mrope.MRoPECollator` wraps), else None."""
    from prealign.collate import THDCollator
    from prealign.collate.mrope import MRoPECollator

    inner = collator.collator if isinstance(collator, MRoPECollator) else collator
    return inner if isinstance(inner, THDCollator) else None


def _block_batch(collator, samples: list, blocks: tuple[CPBlock, ...]) -> dict:
    """``collator`` (a THDCollator of the whole CP group with this rank's ``cp_rank``, optionally
    inside an MRoPECollator) run as the collator of this rank's block over the block's samples; a
    :class:`SampleError` names the position in ``samples``."""
    inner = _thd(collator)
    rank = inner.cp_rank or 0
    block = block_of(blocks, rank)
    sub = dataclasses.replace(
        inner,
        layout=dataclasses.replace(inner.layout, cp=block.size),
        cp_rank=rank - block.first if inner.cp_rank is not None else None,
    )
    if inner is not collator:  # inside an MRoPECollator
        sub = dataclasses.replace(collator, collator=sub)
    try:
        batch = sub([samples[i] for i in block.members])
    except SampleError as exc:
        pos = exc.sample
        if not isinstance(pos, bool) and isinstance(pos, int) and 0 <= pos < len(block.members):
            exc.sample = block.members[pos]
            exc.args = (str(exc).replace(f"sample {pos}", f"sample {exc.sample}", 1),)
        raise
    batch["local_cp_size"] = block.size
    batch["hybrid_cp_members"] = block.members
    return batch


@dataclass(frozen=True, kw_only=True)
class HybridCPCollator:
    """The collate_fn of a loader under ``PlannerConfig(hybrid_cp=True)``: a whole micro-batch's
    samples (the same list on every CP rank) -> this CP rank's batch (:func:`hybrid_cp_batch`: its
    block's THD zigzag shards, ``local_cp_size``, ``hybrid_cp_members``).

    Every rank first collates the whole micro-batch as a fixed-CP rank does (``collator``), so every
    sample is checked on every rank, values included: a bad sample fails on all CP ranks alike and
    none goes on alone into its sub-group's collectives. The blocks come from that batch's lengths
    (the index's, truncation applied, which :func:`hybrid_cp_plan` reads from the plan). A rank
    whose block is the whole group keeps that batch; the others collate their block's samples again
    (at most twice the collation of fixed CP, on the micro-batches that split).

    ``collator``: the :class:`~prealign.collate.THDCollator` of the whole CP group with this rank's
    ``cp_rank`` (``None`` only without CP), optionally inside an
    :class:`~prealign.collate.mrope.MRoPECollator` (a sequence's 3-D positions do not depend on what
    it is packed with). ``token_budget``, ``cost``, ``comm_ratio``: as :func:`assign_cp_blocks`, the
    loader's.
    """

    collator: object
    token_budget: int
    cost: CostModel
    comm_ratio: float = 0.05

    def __post_init__(self):
        if _thd(self.collator) is None:
            raise ConfigError(
                f"hybrid CP: the collator must be a THDCollator, optionally inside an "
                f"MRoPECollator (each CP rank's batch is its block's THD shards), got "
                f"{type(self.collator).__name__}"
            )
        _check(self.layout, self.comm_ratio)
        if _thd(self.collator).cp_rank is None and self.layout.cp > 1:
            raise ConfigError(
                f"hybrid CP: cp = {self.layout.cp} but no cp_rank: each CP rank gets its own "
                f"sub-group's batch; pass the loader this rank's cp_rank"
            )

    @property
    def schema(self):
        return self.collator.schema

    @property
    def layout(self) -> ParallelLayout:
        return self.collator.layout

    def __call__(self, samples: list) -> dict:
        whole = self.collator(samples)
        lengths = whole["cu_seqlens"][
            : len(samples) + 1
        ].diff()  # (static offsets repeat the total past N)
        blocks = assign_cp_blocks(
            lengths.numpy(),
            layout=self.layout,
            token_budget=self.token_budget,
            cost=self.cost,
            comm_ratio=self.comm_ratio,
        )
        if len(blocks) > 1:
            return _block_batch(self.collator, samples, blocks)
        whole["local_cp_size"], whole["hybrid_cp_members"] = blocks[0].size, blocks[0].members
        return whole


def hybrid_cp_samples(
    samples: list,
    blocks: tuple[CPBlock, ...],
    *,
    schema,
    layout: ParallelLayout,
    cp_rank: int,
    **collator_options,
) -> list[dict]:
    """megatron-core's per-sample form of this CP rank's share: one :func:`hybrid_cp_batch` per
    sequence of its block (block order), each a forward of its own, as megatron-core's hybrid-CP
    path runs them. Give each ``to_packed_seq_params(batch, qkv_format="sbhd", cp_group=...)``:
    megatron-core 0.16.1's ``GPTModel`` slices RoPE by that group in this form (not in the THD
    one)."""
    block = block_of(blocks, cp_rank)
    return [
        hybrid_cp_batch(
            samples,
            (dataclasses.replace(block, members=(i,)),),
            schema=schema,
            layout=layout,
            cp_rank=cp_rank,
            **collator_options,
        )
        for i in block.members
    ]
