"""What every slot of a collated batch must hold, computed from the Megatron/TE definition alone.

This is the validator's own arithmetic: it shares no code with the collator (``prealign.collate``
builds run tables and cumulative sums; this module filters global rows by a mask), so a bug in one
is caught by the other. Definitions (README, megatron-core ``get_batch_on_this_cp_rank``, TE's THD
partition):

- a THD batch is the padded sequences back to back, ``T = sum(P_i)`` global rows; row ``g`` of
  sequence ``i`` sits at position ``g - cu_seqlens_padded[i]`` and is a pad when that position is
  ``>= L_i``;
- zigzag CP: each padded sequence is cut into ``2*cp`` equal chunks and rank ``r`` holds chunks
  ``r`` and ``2cp-1-r``, in that (ascending) order; contiguous CP: rank ``r`` holds global rows
  ``[r*T/cp, (r+1)*T/cp)`` (THD) or columns ``[r*S/cp, (r+1)*S/cp)`` of every row (BSHD);
- a BSHD batch is THD with every ``P_i = S``.

>>> s = expected_slots(torch.tensor([5, 3]), torch.tensor([8, 4]), cp=2, rank=0, zigzag=True)
>>> s.positions.tolist(), s.is_pad.tolist(), s.next_slot.tolist()
([0, 1, 6, 7, 0, 3], [False, False, True, True, False, True], [1, -1, -1, -1, -1, -1])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Slots:
    """The expected content of the ``T_out`` local slots. Every tensor is ``[T_out]``."""

    positions: torch.Tensor
    """int64: position of the slot inside its padded sequence (pads keep counting)."""
    is_pad: torch.Tensor
    """bool: True on pad slots."""
    seq: torch.Tensor
    """int64: the sequence the slot belongs to."""
    last: torch.Tensor
    """bool: the slot holds its sequence's last real token."""
    next_slot: torch.Tensor
    """int64: the local slot holding the next token of the same sequence; -1 when there is none
    (pads, a sequence's last token) or another CP rank holds it."""

    @property
    def num_slots(self) -> int:
        return self.positions.numel()


def held_rows(
    padded: torch.Tensor,
    *,
    cp: int,
    rank: int | None,
    zigzag: bool,
    per_sequence_contiguous: bool = False,
) -> torch.Tensor:
    """int64 ``[T_out]``: the global rows CP rank ``rank`` holds, in output order (``None``: all).

    ``padded`` int64 ``[N]``: padded lengths (multiples of ``2*cp`` for zigzag). Contiguous CP cuts
    the global buffer (THD) or, with ``per_sequence_contiguous``, every sequence (BSHD rows).
    """
    total = int(padded.sum())
    if rank is None or cp == 1:
        return torch.arange(total)
    if not zigzag and not per_sequence_contiguous:
        local = total // cp
        return torch.arange(rank * local, (rank + 1) * local)
    seq, pos = _row_seq_pos(padded)
    pieces = 2 * cp if zigzag else cp
    piece = pos // (padded // pieces)[seq]
    keep = (piece == rank) | (piece == 2 * cp - 1 - rank) if zigzag else piece == rank
    return torch.nonzero(keep).flatten()


def expected_slots(
    lengths: torch.Tensor,
    padded: torch.Tensor,
    *,
    cp: int,
    rank: int | None,
    zigzag: bool,
    per_sequence_contiguous: bool = False,
) -> Slots:
    """:class:`Slots` of the rows rank ``rank`` holds, for true ``lengths`` and ``padded`` lengths
    (int64 ``[N]`` each). Allocates a few ``[T]`` tensors: callers compare ``T`` with the batch's
    real size first."""
    seq_all, pos_all = _row_seq_pos(padded)
    rows = held_rows(
        padded, cp=cp, rank=rank, zigzag=zigzag, per_sequence_contiguous=per_sequence_contiguous
    )
    seq, pos = seq_all[rows], pos_all[rows]
    length = lengths[seq]
    is_pad = pos >= length
    last = pos == length - 1
    local_of = torch.full(
        (int(padded.sum()) + 1,), -1, dtype=torch.int64
    )  # global row -> local slot
    local_of[rows] = torch.arange(rows.numel())
    has_next = ~is_pad & ~last
    next_slot = torch.where(has_next, local_of[torch.where(has_next, rows + 1, -1)], -1)
    return Slots(positions=pos, is_pad=is_pad, seq=seq, last=last, next_slot=next_slot)


def _row_seq_pos(padded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[T]`` each: the sequence of every global row and its position inside it."""
    seq = torch.repeat_interleave(torch.arange(padded.numel()), padded)
    starts = torch.cumsum(padded, 0) - padded
    return seq, torch.arange(seq.numel()) - starts[seq]
