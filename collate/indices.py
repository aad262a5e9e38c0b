"""Index arithmetic shared by every collator: which input row lands in which output slot.

Per-sequence metadata (lengths, chunk tables: a few hundred numbers) is computed with numpy, where
an op costs about a microsecond; per-token work is a fixed number of full-size numpy ops per batch
(a few repeats and adds), independent of the number of sequences.

A batch is described by *chunks*: runs of consecutive padded positions of one sequence that are
stored consecutively in the output (whole sequences without CP; two chunks per sequence under CP
zigzag; range intersections under the contiguous CP layout). Worked example, tp=1, cp=2, L=[5,3]:

    padded  P=[8,4]  cu_seqlens_padded=[0,8,12]
    global  a0 a1 a2 a3 a4 _  _  _ | b0 b1 b2 _          (_ = pad)
    chunks  [ c0 ][ c1 ][ c2 ][ c3 ]|[c0][c1][c2][c3]     (2*cp chunks per sequence)
    rank 0  c0 c3 of a, c0 c3 of b  ->  a0 a1 _ _ b0 _
    rank 1  c1 c2 of a, c1 c2 of b  ->  a2 a3 a4 _ b1 b2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

import numpy as np
import torch

from prealign.schemas.errors import ArgumentError, BucketOverflowError, OffsetOverflowError
from prealign.schemas.layout import (
    MAX_PACKED_LENGTH,
    CPLayout,
    ParallelLayout,
    thd_padding,
)

INT32_MAX = MAX_PACKED_LENGTH
T = TypeVar("T")


def as_numpy(x) -> np.ndarray:
    """int64 numpy view of a CPU tensor / array / list (zero-copy for an int64 CPU tensor)."""
    if type(x) is np.ndarray and x.dtype == np.int64:
        return x
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.int64 and x.device.type == "cpu" and not x.requires_grad:
            return x.numpy()
        return x.detach().cpu().to(torch.int64).numpy()
    return np.asarray(x, dtype=np.int64)


def lengths_to_cu_seqlens(lengths, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """``[N]`` lengths -> ``[N+1]`` offsets starting at 0.

    >>> lengths_to_cu_seqlens(torch.tensor([5, 3])).tolist()
    [0, 5, 8]
    """
    lengths = as_numpy(lengths)
    cu = np.empty(lengths.size + 1, dtype=np.int64)
    cu[0] = 0
    lengths.cumsum(out=cu[1:])
    if dtype == torch.int32:
        if cu[-1] > INT32_MAX:
            raise OffsetOverflowError(
                f"a packed length of {int(cu[-1])} rows does not fit int32 cu_seqlens (max "
                f"{INT32_MAX}, what megatron-core and TE take); lower the token budget"
            )
        return torch.from_numpy(cu.astype(np.int32))  # (numpy's cast: cheaper than torch's)
    return torch.from_numpy(cu) if dtype == torch.int64 else torch.from_numpy(cu).to(dtype)


def padded_lengths(layout: ParallelLayout, lengths: np.ndarray) -> np.ndarray:
    """int64 ``[N]``: :meth:`ParallelLayout.padded_lengths` of int64 ``lengths`` (all >= 1) in a
    few in-place numpy ops: every length rounded up to ``layout.seq_multiple``, then the last one
    grown to ``layout.total_length`` of their sum (the layout's :func:`thd_padding`, read once per
    layout).

    >>> padded_lengths(ParallelLayout(tp=2, cp=2), np.array([5, 3])).tolist()
    [8, 4]
    """
    pad = thd_padding(layout)
    m = pad.seq_multiple
    padded = lengths + (m - 1)
    padded //= m
    padded *= m
    aligned = int(np.add.reduce(padded))
    padded[-1] += pad.total(aligned) - aligned
    return padded


def static_offsets(cu: torch.Tensor, max_seqs: int | None) -> torch.Tensor:
    """``[N+1]`` offsets -> ``[max_seqs+1]``, the trailing entries repeating the total (CUDA graphs
    need a fixed length); ``cu`` itself when ``max_seqs`` is None. More than ``max_seqs`` sequences
    is a :class:`~prealign.schemas.errors.BucketOverflowError` (the planner never builds such a
    batch).

    >>> static_offsets(torch.tensor([0, 5, 8]), 4).tolist()
    [0, 5, 8, 8, 8]
    """
    if max_seqs is None:
        return cu
    n = cu.numel() - 1
    if n > max_seqs:
        raise BucketOverflowError(
            f"a batch of {n} sequences exceeds the layout's max_seqs = {max_seqs} (static "
            f"cu_seqlens of {max_seqs + 1} entries); plan with the same layout or raise max_seqs"
        )
    return torch.cat((cu, cu[-1:].expand(max_seqs - n)))


def num_sequences(cu_seqlens_padded: torch.Tensor) -> int:
    """The real sequences of a batch's ``[N+1]`` padded offsets: N without the trailing entries that
    only repeat the total (static shapes, see :func:`static_offsets`).

    >>> num_sequences(torch.tensor([0, 8, 64, 64, 64])), num_sequences(torch.tensor([0, 5, 8]))
    (2, 2)
    """
    return int(torch.searchsorted(cu_seqlens_padded, cu_seqlens_padded[-1:]))


def cu_seqlens_to_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[N+1]`` offsets -> int64 ``[N]`` lengths."""
    return cu_seqlens.diff().to(torch.int64)


@dataclass(frozen=True)
class Chunks:
    """Runs of one sequence's padded positions, in output order. int64 numpy ``[C]`` each."""

    seq: np.ndarray  # sequence index of the chunk (non-decreasing)
    start: np.ndarray  # position inside the padded sequence of the chunk's first slot
    length: np.ndarray  # number of slots


def cp_chunks(padded, layout: ParallelLayout, cp_rank: int | None) -> Chunks:
    """The chunks CP rank ``cp_rank`` holds (``None``: the whole padded batch, unsharded).

    ``padded``: ``[N]`` padded lengths, each a multiple of ``2*cp`` for the zigzag layout.
    """
    padded = as_numpy(padded)
    n = padded.size
    if cp_rank is None or layout.cp == 1:
        return Chunks(_arange(n), np.zeros(n, np.int64), padded)
    cp = layout.cp
    if not 0 <= cp_rank < cp:
        raise ArgumentError(f"cp_rank: expected an int in [0, {cp}) (cp={cp}), got {cp_rank!r}")
    if layout.cp_layout is CPLayout.ZIGZAG:
        c = padded // (2 * cp)
        # chunk r then chunk 2cp-1-r of every sequence, sequence after sequence
        return Chunks(
            _arange(n).repeat(2),
            _interleave(c * cp_rank, c * (2 * cp - 1 - cp_rank)),
            c.repeat(2),
        )
    seq = np.arange(n, dtype=np.int64)
    # contiguous: rank r owns global rows [r*T_local, (r+1)*T_local)
    cu = np.concatenate(([0], np.cumsum(padded)))
    local = int(cu[-1]) // cp
    lo, hi = cp_rank * local, (cp_rank + 1) * local
    begin, end = np.clip(cu[:-1], lo, hi), np.clip(cu[1:], lo, hi)
    return Chunks(seq, begin - cu[:-1], end - begin)


@dataclass
class GatherPlan:
    """For each output slot: where its value comes from. Built once per batch, used by every field.

    ``src`` indexes the rows of all samples concatenated, followed by two pad rows: row
    ``num_real`` holds a field's pad value (pad slots point there) and row ``num_real + 1`` the
    value of a slot that has no next token. A next-token field (``labels``) reads the same ``src``
    shifted by one row (:meth:`next_rows`): row ``src + 1`` is the next token, and a pad slot reads
    row ``num_real + 1``; only the slots holding a sequence's last token (``last_slots``, at most
    one per sequence) are then overwritten.
    """

    positions: torch.Tensor  # int64 [T_out], position of the slot inside its padded sequence
    is_pad: torch.Tensor  # bool  [T_out]
    src: torch.Tensor  # int32 (int64 past 2**31 rows) [T_out], row of the slot's token; num_real
    # on pads
    last_slots: torch.Tensor  # int64 [<= N], slots holding a sequence's last token
    num_real: int  # sum of true lengths
    chunk_seq: np.ndarray  # int64 [C], sequence of each non-empty chunk, in output order
    chunk_out_start: np.ndarray  # int64 [C], first output slot of each non-empty chunk
    run_ends: np.ndarray  # int64 [<= C], last slot of each chunk's run of real slots (if any)
    pad_slots: np.ndarray  # int64 [T_out - real slots], the pad slots, ascending

    @property
    def num_slots(self) -> int:
        return self.positions.numel()

    def next_rows(self, gathered: torch.Tensor, dim: int, no_next) -> torch.Tensor:
        """``gathered`` (rows ``src + 1`` along ``dim``, in place; a tensor, or a 1-D numpy array)
        with ``no_next`` in every slot holding a sequence's last token: there row ``src + 1`` is the
        next sequence's first."""
        if isinstance(gathered, np.ndarray):  # 1-D, built in numpy (see assemble)
            gathered[self.last_slots.numpy()] = no_next
            return gathered
        return gathered.index_fill_(dim, self.last_slots, no_next)

    def blocks(self, cu_seqlens, rows_per_block: int) -> list[tuple[int, int, int, int]]:
        """Split the batch into runs of whole sequences of about ``rows_per_block`` input rows:
        ``(first_seq, end_seq, first_slot, end_slot)`` each; a block's slots read only its
        sequences."""
        cu = as_numpy(cu_seqlens)
        n = cu.size - 1
        cuts = np.searchsorted(cu, np.arange(rows_per_block, self.num_real, rows_per_block))
        bounds = np.unique(np.concatenate(([0, n], np.clip(cuts, 0, n))))
        # first output slot of each bound sequence (slots are in sequence order; none held: the next
        # one's)
        starts = np.append(self.chunk_out_start, self.num_slots)[
            np.searchsorted(self.chunk_seq, bounds)
        ]
        return [
            (int(bounds[i]), int(bounds[i + 1]), int(starts[i]), int(starts[i + 1]))
            for i in range(bounds.size - 1)
        ]


def once(build: Callable[[], T]) -> Callable[[], T]:
    """``build`` called on the first call only, its result returned to every call (a plan built only
    when a field needs it; cheaper than ``functools.cache``, whose wrapper costs a few µs per
    batch)."""
    box: list = []

    def get() -> T:
        if not box:
            box.append(build())
        return box[0]

    return get


def _interleave(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.empty(2 * a.size, dtype=a.dtype if a.dtype == b.dtype else np.result_type(a, b))
    out[0::2], out[1::2] = a, b
    return out


_ARANGE = {np.dtype(np.int64): np.arange(0, dtype=np.int64)}
_REAL_THEN_PAD = [np.zeros(0, dtype=bool)]


_ARANGE_CACHED = 1 << 22
"""Slots of the longest cached range (32 MiB in int64); a longer batch builds its own."""


def _arange(n: int, dtype=np.int64) -> np.ndarray:
    """Read-only ``0 .. n-1`` of ``dtype``: a view of one cached range per dtype, grown (doubled)
    when a batch needs more, up to :data:`_ARANGE_CACHED` slots."""
    dtype = np.dtype(dtype)
    if n > _ARANGE_CACHED:
        return np.arange(n, dtype=dtype)
    cached = _ARANGE.get(dtype)
    if cached is None or cached.size < n:
        size = cached.size if cached is not None else 0
        cached = np.arange(min(max(n, 2 * size), _ARANGE_CACHED), dtype=dtype)
        cached.flags.writeable = False
        _ARANGE[dtype] = cached
    return cached[:n]


def _runs(first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """int64 ``first[i] .. first[i] + counts[i] - 1`` for every i, concatenated.

    >>> _runs(np.array([3, 10]), np.array([2, 1])).tolist()
    [3, 4, 10]
    """
    ends = counts.cumsum()
    out = (first - (ends - counts)).repeat(counts)
    out += _arange(out.size)
    return out


def _real_then_pad(num_chunks: int) -> np.ndarray:
    """Read-only bool ``[False, True] * num_chunks`` (each chunk's real run, then its pad run),
    cached."""
    if _REAL_THEN_PAD[0].size < 2 * num_chunks:
        a = np.tile(np.array([False, True]), max(num_chunks, _REAL_THEN_PAD[0].size))
        a.flags.writeable = False
        _REAL_THEN_PAD[0] = a
    return _REAL_THEN_PAD[0][: 2 * num_chunks]


def gather_plan(lengths, chunks: Chunks, cu_seqlens=None) -> GatherPlan:
    """Build the :class:`GatherPlan` of ``chunks`` for sequences of true ``lengths`` (``[N]``).

    Every per-slot quantity is a per-chunk constant repeated over the chunk's slots, plus the slot
    number: positions ``= slot + (start - out_start)``, ``src = slot + (cu[seq] + start -
    out_start)`` on real slots and ``num_real`` on pads, ``is_pad`` a run of False (the chunk's
    real tokens) then a run of True (its pads). Five full-size numpy ops per batch (three
    ``np.repeat``, two in-place adds), whatever the number of sequences; the pad slots of ``src``
    are set by their indices (a few per sequence), the per-chunk tables are numpy too. ``src`` is
    int32 when the rows fit (half the bytes to write; ``index_select`` takes either).
    """
    lengths = as_numpy(lengths)
    cu = np.concatenate(([0], lengths.cumsum())) if cu_seqlens is None else as_numpy(cu_seqlens)
    num_real = int(cu[-1])
    seq, start, length = chunks.seq, chunks.start, chunks.length
    if np.count_nonzero(length) < length.size:  # contiguous CP: sequences this rank lacks
        keep = length > 0
        seq, start, length = seq[keep], start[keep], length[keep]
    ends = length.cumsum()
    out_start = ends - length
    total = int(ends[-1]) if ends.size else 0
    rest = lengths[seq] - start  # real tokens from the chunk's first slot on (may be <= 0)
    n_real = np.minimum(np.maximum(rest, 0), length)  # (np.clip: ~5x the call cost)

    delta = start - out_start  # position of a chunk's slot = slot + delta
    positions = delta.repeat(length)
    positions += _arange(total)
    n_pad = length - n_real
    is_pad = _real_then_pad(seq.size).repeat(_interleave(n_real, n_pad))
    index_dtype = np.int32 if num_real + 2 <= INT32_MAX else np.int64
    src = (cu[seq] + delta).astype(index_dtype).repeat(length)
    src += _arange(total, index_dtype)
    real_end = out_start + n_real  # first pad slot of each chunk
    pad_slots = _runs(real_end, n_pad)
    src[pad_slots] = num_real

    last_real = real_end - 1
    # chunks holding their sequence's last token (0 < rest <= length)
    last_slots = last_real[(rest > 0) & (rest <= length)]
    return GatherPlan(
        positions=torch.from_numpy(positions),
        is_pad=torch.from_numpy(is_pad),
        src=torch.from_numpy(src),
        last_slots=torch.from_numpy(last_slots),
        num_real=num_real,
        chunk_seq=seq,
        chunk_out_start=out_start,
        run_ends=last_real[n_real > 0],
        pad_slots=pad_slots,
    )


def global_slots(chunks: Chunks, cu_padded) -> torch.Tensor:
    """int64 ``[T_out]``: the global padded row of every output slot (for the inverse maps)."""
    out_start = np.cumsum(chunks.length) - chunks.length
    offset = as_numpy(cu_padded)[chunks.seq] + chunks.start - out_start
    return torch.arange(int(chunks.length.sum())) + torch.from_numpy(
        np.repeat(offset, chunks.length)
    )


def real_rows(lengths, starts) -> torch.Tensor:
    """int64 ``[sum(lengths)]``: ``starts[i] + 0 .. starts[i] + lengths[i] - 1`` for every i."""
    lengths = as_numpy(lengths)
    cu = np.concatenate(([0], np.cumsum(lengths)))
    return torch.arange(int(cu[-1])) + torch.from_numpy(
        np.repeat(as_numpy(starts) - cu[:-1], lengths)
    )
