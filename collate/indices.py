"""Index arithmetic shared by every collator: which input row lands in which output slot.

Everything here is a fixed number of tensor ops per batch, independent of the number of sequences.

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

import torch

from schemas.layout import CPLayout, ParallelLayout


def lengths_to_cu_seqlens(lengths: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """``[N]`` lengths -> ``[N+1]`` offsets starting at 0.

    >>> lengths_to_cu_seqlens(torch.tensor([5, 3])).tolist()
    [0, 5, 8]
    """
    cu = torch.zeros(lengths.numel() + 1, dtype=dtype)
    torch.cumsum(lengths, 0, out=cu[1:])
    return cu


def cu_seqlens_to_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[N+1]`` offsets -> int64 ``[N]`` lengths."""
    return cu_seqlens.diff().to(torch.int64)


@dataclass(frozen=True)
class Chunks:
    """Runs of one sequence's padded positions, in output order. All int64 ``[C]``."""

    seq: torch.Tensor  # sequence index of the chunk
    start: torch.Tensor  # position inside the padded sequence of the chunk's first slot
    length: torch.Tensor  # number of slots


def cp_chunks(padded: torch.Tensor, layout: ParallelLayout, cp_rank: int | None) -> Chunks:
    """The chunks CP rank ``cp_rank`` holds (``None``: the whole padded batch, unsharded).

    ``padded``: int64 ``[N]`` padded lengths, each a multiple of ``2*cp`` for the zigzag layout.
    """
    n = padded.numel()
    seq = torch.arange(n)
    if cp_rank is None or layout.cp == 1:
        return Chunks(seq, torch.zeros_like(padded), padded)
    cp = layout.cp
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank must be in [0, {cp}), got {cp_rank}")
    if layout.cp_layout is CPLayout.ZIGZAG:
        c = torch.div(padded, 2 * cp, rounding_mode="floor")
        # chunk r then chunk 2cp-1-r of every sequence, sequence after sequence
        starts = torch.stack((c * cp_rank, c * (2 * cp - 1 - cp_rank)), 1).reshape(-1)
        return Chunks(seq.repeat_interleave(2), starts, c.repeat_interleave(2))
    # contiguous: rank r owns global rows [r*T_local, (r+1)*T_local)
    cu = lengths_to_cu_seqlens(padded, torch.int64)
    local = int(cu[-1]) // cp
    lo, hi = cp_rank * local, (cp_rank + 1) * local
    begin = cu[:-1].clamp(lo, hi)
    end = cu[1:].clamp(lo, hi)
    return Chunks(seq, begin - cu[:-1], end - begin)


@dataclass(frozen=True)
class GatherPlan:
    """For each output slot: where its value comes from. Built once per batch, used by every field.

    ``src`` / ``src_next`` index the flat concatenation of all samples' rows with one extra pad row
    appended at index ``num_real`` (so a field is ``cat(samples + [pad_row]).index_select(src)``).
    """

    positions: torch.Tensor  # int64 [T_out], position of the slot inside its padded sequence
    is_pad: torch.Tensor  # bool  [T_out]
    src: torch.Tensor  # int64 [T_out], flat row of the slot's token, num_real on pads
    src_next: torch.Tensor  # int64 [T_out], flat row of the next token of the same sequence, num_real if none
    num_real: int  # sum of true lengths


def gather_plan(lengths: torch.Tensor, chunks: Chunks, cu_seqlens: torch.Tensor | None = None) -> GatherPlan:
    """Build the :class:`GatherPlan` of ``chunks`` for sequences of true ``lengths`` (int64 ``[N]``)."""
    if cu_seqlens is None:
        cu_seqlens = lengths_to_cu_seqlens(lengths, torch.int64)
    num_real = int(cu_seqlens[-1])
    out_start = torch.cumsum(chunks.length, 0) - chunks.length
    # Per chunk: position offset, true length and flat start of its sequence; one repeat for all three.
    table = torch.stack((chunks.start - out_start, lengths[chunks.seq], cu_seqlens[chunks.seq].to(torch.int64)), 1)
    per_slot = table.repeat_interleave(chunks.length, dim=0)
    slot = torch.arange(per_slot.shape[0])
    positions = slot + per_slot[:, 0]
    true_len = per_slot[:, 1]
    is_pad = positions >= true_len
    row = positions + per_slot[:, 2]
    src = row.masked_fill(is_pad, num_real)
    src_next = (row + 1).masked_fill(positions + 1 >= true_len, num_real)
    return GatherPlan(positions=positions, is_pad=is_pad, src=src, src_next=src_next, num_real=num_real)


def global_slots(chunks: Chunks, cu_padded: torch.Tensor) -> torch.Tensor:
    """int64 ``[T_out]``: the global padded row of every output slot (for the inverse maps)."""
    out_start = torch.cumsum(chunks.length, 0) - chunks.length
    offset = cu_padded.to(torch.int64)[chunks.seq] + chunks.start - out_start
    return torch.arange(int(chunks.length.sum())) + offset.repeat_interleave(chunks.length)


def real_rows(lengths: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """int64 ``[sum(lengths)]``: ``starts[i] + 0 .. starts[i] + lengths[i] - 1`` for every i."""
    cu = lengths_to_cu_seqlens(lengths, torch.int64)
    return torch.arange(int(cu[-1])) + (starts.to(torch.int64) - cu[:-1]).repeat_interleave(lengths)
