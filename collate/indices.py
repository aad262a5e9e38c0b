"""Index arithmetic shared by every collator: which input row lands in which output slot.

Per-sequence metadata (lengths, chunk tables: a few hundred numbers) is computed with numpy, where
an op costs about a microsecond; per-token work is a fixed number of full-size torch ops per batch,
independent of the number of sequences.

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

import numpy as np
import torch

from schemas.layout import CPLayout, ParallelLayout


def as_numpy(x) -> np.ndarray:
    """int64 numpy view of a CPU tensor / array / list (zero-copy for an int64 CPU tensor)."""
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
    cu = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(as_numpy(lengths), out=cu[1:])
    return torch.from_numpy(cu).to(dtype)


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
    seq = np.arange(n, dtype=np.int64)
    if cp_rank is None or layout.cp == 1:
        return Chunks(seq, np.zeros(n, np.int64), padded)
    cp = layout.cp
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank must be in [0, {cp}), got {cp_rank}")
    if layout.cp_layout is CPLayout.ZIGZAG:
        c = padded // (2 * cp)
        # chunk r then chunk 2cp-1-r of every sequence, sequence after sequence
        starts = np.stack((c * cp_rank, c * (2 * cp - 1 - cp_rank)), 1).reshape(-1)
        return Chunks(np.repeat(seq, 2), starts, np.repeat(c, 2))
    # contiguous: rank r owns global rows [r*T_local, (r+1)*T_local)
    cu = np.concatenate(([0], np.cumsum(padded)))
    local = int(cu[-1]) // cp
    lo, hi = cp_rank * local, (cp_rank + 1) * local
    begin, end = np.clip(cu[:-1], lo, hi), np.clip(cu[1:], lo, hi)
    return Chunks(seq, begin - cu[:-1], end - begin)


@dataclass(frozen=True)
class GatherPlan:
    """For each output slot: where its value comes from. Built once per batch, used by every field.

    ``src`` / ``src_next`` index the rows of all samples concatenated, followed by two pad rows:
    row ``num_real`` holds a field's pad value (pad slots point there) and row ``num_real + 1`` the
    value of a slot that has no next token (``src_next`` of a sequence's last token and of pads).
    """

    positions: torch.Tensor  # int64 [T_out], position of the slot inside its padded sequence
    is_pad: torch.Tensor  # bool  [T_out]
    src: torch.Tensor  # int64 [T_out], row of the slot's token; num_real on pads
    src_next: torch.Tensor  # int64 [T_out], row of the next token of the same sequence; num_real + 1 if none
    seq_out_start: np.ndarray  # int64 [N+1], first output slot of each sequence (slots are in sequence order)
    num_real: int  # sum of true lengths

    def blocks(self, cu_seqlens, rows_per_block: int) -> list[tuple[int, int, int, int]]:
        """Split the batch into runs of whole sequences of about ``rows_per_block`` input rows:
        ``(first_seq, end_seq, first_slot, end_slot)`` each; a block's slots read only its sequences."""
        n = self.seq_out_start.size - 1
        cuts = np.searchsorted(as_numpy(cu_seqlens), np.arange(rows_per_block, self.num_real, rows_per_block))
        bounds = np.unique(np.concatenate(([0, n], np.clip(cuts, 0, n))))
        starts = self.seq_out_start[bounds]
        return [(int(bounds[i]), int(bounds[i + 1]), int(starts[i]), int(starts[i + 1])) for i in range(bounds.size - 1)]


def _runs(slot_steps: torch.Tensor, starts: np.ndarray, firsts: np.ndarray, steps: np.ndarray,
          lengths: np.ndarray) -> torch.Tensor:
    """Piecewise-linear sequence, in place over ``slot_steps``: run j covers slots
    ``[starts[j], starts[j] + lengths[j])`` with values ``firsts[j] + steps[j] * i``. ``slot_steps``
    holds every slot's step; runs are non-empty, sorted and tile the output. Two full-size ops."""
    last = firsts + steps * (lengths - 1)
    jumps = firsts - np.concatenate(([0], last[:-1])) - steps
    slot_steps.index_add_(0, torch.from_numpy(starts), torch.from_numpy(jumps))
    return slot_steps.cumsum_(0)


def gather_plan(lengths, chunks: Chunks, cu_seqlens=None) -> GatherPlan:
    """Build the :class:`GatherPlan` of ``chunks`` for sequences of true ``lengths`` (``[N]``).

    Every per-slot quantity is a piecewise-linear run per chunk, built as the cumulative sum of
    per-slot steps with the jumps scattered at run starts: about ten full-size torch ops per batch,
    whatever the number of sequences.
    """
    lengths = as_numpy(lengths)
    cu = np.concatenate(([0], np.cumsum(lengths))) if cu_seqlens is None else as_numpy(cu_seqlens)
    num_real = int(cu[-1])
    all_out_start = np.cumsum(chunks.length) - chunks.length
    total = int(chunks.length.sum())
    first_chunk = np.searchsorted(chunks.seq, np.arange(lengths.size))
    seq_out_start = np.append(np.append(all_out_start, total)[first_chunk], total)
    keep = chunks.length > 0
    seq, start, length, out_start = chunks.seq[keep], chunks.start[keep], chunks.length[keep], all_out_start[keep]
    n_real = np.minimum(np.maximum(lengths[seq] - start, 0), length)
    ones = np.ones_like(start)

    positions = _runs(torch.ones(total, dtype=torch.int64), out_start, start, ones, length)

    # src: per chunk a real run (step 1 from the token's row) then a pad run (constant num_real)
    run_start = np.stack((out_start, out_start + n_real), 1).reshape(-1)
    run_len = np.stack((n_real, length - n_real), 1).reshape(-1)
    run_first = np.stack((cu[seq] + start, np.full_like(start, num_real)), 1).reshape(-1)
    run_step = np.stack((ones, 0 * ones), 1).reshape(-1)
    live = run_len > 0
    run_start, run_len, run_first, run_step = run_start[live], run_len[live], run_first[live], run_step[live]
    steps = torch.zeros(total, dtype=torch.int64)
    steps.index_add_(0, torch.from_numpy(run_start), torch.from_numpy(np.diff(run_step, prepend=0)))
    steps.cumsum_(0)
    is_pad = steps == 0
    src = _runs(steps, run_start, run_first, run_step, run_len)

    src_next = src + 1  # pads: num_real + 1
    ends = (start + n_real == lengths[seq]) & (n_real > 0)  # chunks holding their sequence's last token
    src_next[torch.from_numpy((out_start + n_real - 1)[ends])] = num_real + 1
    return GatherPlan(positions=positions, is_pad=is_pad, src=src, src_next=src_next,
                      seq_out_start=seq_out_start, num_real=num_real)


def global_slots(chunks: Chunks, cu_padded) -> torch.Tensor:
    """int64 ``[T_out]``: the global padded row of every output slot (for the inverse maps)."""
    out_start = np.cumsum(chunks.length) - chunks.length
    offset = as_numpy(cu_padded)[chunks.seq] + chunks.start - out_start
    return torch.arange(int(chunks.length.sum())) + torch.from_numpy(np.repeat(offset, chunks.length))


def real_rows(lengths, starts) -> torch.Tensor:
    """int64 ``[sum(lengths)]``: ``starts[i] + 0 .. starts[i] + lengths[i] - 1`` for every i."""
    lengths = as_numpy(lengths)
    cu = np.concatenate(([0], np.cumsum(lengths)))
    return torch.arange(int(cu[-1])) + torch.from_numpy(np.repeat(as_numpy(starts) - cu[:-1], lengths))
