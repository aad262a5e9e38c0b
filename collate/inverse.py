"""The exact inverse of collation: CP shards -> whole batch -> per-sample tensors.

Use it to map model outputs (log-probs, values, entropies) back to samples. ``dim`` is the token
dim of the packed tensor (1 for ``[1, T, ...]``, 2 for mRoPE-like ``[3, 1, T]``); the batch dim is
``dim - 1``.

>>> import torch
>>> from prealign.schemas import ParallelLayout, causal_lm_schema
>>> from prealign.collate import THDCollator
>>> samples = [{"input_ids": torch.arange(1, 6)}, {"input_ids": torch.arange(6, 9)}]
>>> lay = ParallelLayout(tp=2, cp=2)
>>> shards = [THDCollator(schema=causal_lm_schema(), layout=lay, cp_rank=r)(samples) for r in range(2)]
>>> whole = unshard_cp([s["input_ids"] for s in shards], cu_seqlens_padded=shards[0]["cu_seqlens_padded"])
>>> [t.tolist() for t in unpack_thd(whole, cu_seqlens=shards[0]["cu_seqlens"],
...                                  cu_seqlens_padded=shards[0]["cu_seqlens_padded"])]
[[1, 2, 3, 4, 5], [6, 7, 8]]
"""
from __future__ import annotations

from typing import Sequence

import torch

from prealign.schemas.layout import CPLayout, ParallelLayout
from .bshd import bshd_chunks
from .indices import cp_chunks, cu_seqlens_to_lengths, global_slots, real_rows


def _check_shards(shards: Sequence[torch.Tensor], dim: int) -> None:
    if not shards:
        raise ValueError("unshard: expected one shard per CP rank, got none")
    ref = shards[0].shape
    for r, s in enumerate(shards):
        if s.shape != ref:
            raise ValueError(f"unshard: shard of CP rank {r} has shape {tuple(s.shape)}, rank 0 has {tuple(ref)}")


def unshard_cp(shards: Sequence[torch.Tensor], *, cu_seqlens_padded: torch.Tensor,
               cp_layout: CPLayout | str = CPLayout.ZIGZAG, dim: int = 1) -> torch.Tensor:
    """Per-rank THD shards ``[1, T/cp, ...]`` (in CP-rank order) -> the whole packed ``[1, T, ...]``.

    ``cp_layout``: how the shards were cut; a collated batch carries it as ``batch["cp_layout"]``.
    """
    _check_shards(shards, dim)
    cp = len(shards)
    if cp == 1:
        return shards[0]
    layout = ParallelLayout(cp=cp, cp_layout=CPLayout(cp_layout))
    padded = cu_seqlens_to_lengths(cu_seqlens_padded)
    if layout.cp_layout is CPLayout.ZIGZAG and bool((padded % (2 * cp)).any()):
        i = int(torch.nonzero(padded % (2 * cp))[0])
        raise ValueError(f"unshard_cp: padded length {int(padded[i])} of sequence {i} is not a multiple of 2*cp = "
                         f"{2 * cp}, so these shards were not cut zigzag; pass cp_layout=batch['cp_layout']")
    total = int(padded.sum())
    if total != shards[0].shape[dim] * cp:
        raise ValueError(f"unshard_cp: cu_seqlens_padded describes {total} rows, shards hold "
                         f"{cp} x {shards[0].shape[dim]}")
    slots = torch.cat([global_slots(cp_chunks(padded, layout, r), cu_seqlens_padded) for r in range(cp)])
    stacked = torch.cat(list(shards), dim)
    return torch.empty_like(stacked).index_copy_(dim, slots, stacked)


def unpack_thd(packed: torch.Tensor, *, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor,
               dim: int = 1) -> list[torch.Tensor]:
    """Whole packed ``[1, T, ...]`` -> list of ``[L_i, ...]`` (views of one gathered tensor)."""
    lengths = cu_seqlens_to_lengths(cu_seqlens)
    rows = real_rows(lengths, cu_seqlens_padded[:-1])
    flat = packed.index_select(dim, rows).squeeze(dim - 1)
    return list(torch.split(flat, lengths.tolist(), dim=dim - 1))


def unshard_bshd(shards: Sequence[torch.Tensor], *, cp_layout: CPLayout | str = CPLayout.ZIGZAG,
                 dim: int = 1) -> torch.Tensor:
    """Per-rank BSHD shards ``[B, S/cp, ...]`` -> ``[B, S, ...]``."""
    _check_shards(shards, dim)
    cp = len(shards)
    if cp == 1:
        return shards[0]
    layout = ParallelLayout(cp=cp, cp_layout=CPLayout(cp_layout))
    s = shards[0].shape[dim] * cp
    cu_row = torch.tensor([0, s])
    cols = torch.cat([global_slots(bshd_chunks(1, s, layout, r), cu_row) for r in range(cp)])
    stacked = torch.cat(list(shards), dim)
    return torch.empty_like(stacked).index_copy_(dim, cols, stacked)


def unpack_bshd(padded: torch.Tensor, *, cu_seqlens: torch.Tensor, dim: int = 1) -> list[torch.Tensor]:
    """Whole ``[B, S, ...]`` -> list of ``[L_i, ...]`` (true lengths from ``cu_seqlens``)."""
    lengths = cu_seqlens_to_lengths(cu_seqlens)
    b, s = padded.shape[dim - 1], padded.shape[dim]
    flat = padded.flatten(dim - 1, dim)
    rows = real_rows(lengths, torch.arange(b) * s)
    return list(torch.split(flat.index_select(dim - 1, rows), lengths.tolist(), dim=dim - 1))
