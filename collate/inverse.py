"""The exact inverse of collation: CP shards -> whole batch -> per-sample tensors.

Use it to map model outputs (log-probs, values, entropies) back to samples. ``dim`` is the token
dim of the packed tensor (1 for ``[1, T, ...]``, 2 for mRoPE-like ``[3, 1, T]``); the batch dim is
``dim - 1``.

>>> import torch
>>> from prealign.schemas import ParallelLayout, causal_lm_schema
>>> from prealign.collate import THDCollator
>>> samples = [{"input_ids": torch.arange(1, 6)}, {"input_ids": torch.arange(6, 9)}]
>>> lay = ParallelLayout(tp=2, cp=2)
>>> shards = [THDCollator(schema=causal_lm_schema(), layout=lay, cp_rank=r)(samples)
...           for r in range(2)]
>>> whole = unshard_cp([s["input_ids"] for s in shards],
...                    cu_seqlens_padded=shards[0]["cu_seqlens_padded"])
>>> [t.tolist() for t in unpack_thd(whole, cu_seqlens=shards[0]["cu_seqlens"],
...                                  cu_seqlens_padded=shards[0]["cu_seqlens_padded"])]
[[1, 2, 3, 4, 5], [6, 7, 8]]
"""

from __future__ import annotations

import numbers
from typing import Sequence

import torch

from prealign.schemas.errors import ArgumentError
from prealign.schemas.layout import CPLayout, ParallelLayout

from .bshd import bshd_chunks
from .indices import cp_chunks, global_slots, num_sequences, real_rows


def _int(name: str, value, what: str) -> None:
    """``value`` is an int (not a bool, a float or a str), or an :class:`ArgumentError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentError(f"{name}: expected an int {what}, got {value!r}")


def _check_shards(shards: Sequence[torch.Tensor], dim: int, cp_size) -> int:
    """The CP size the shards describe (their count), checked against ``cp_size`` when given; the
    shards agree in shape, dtype and device."""
    _int("dim", dim, "(the token dim)")
    if cp_size is not None:
        _int("cp_size", cp_size, "or None")
    if isinstance(shards, torch.Tensor) or not isinstance(shards, Sequence) or not shards:
        raise ArgumentError(
            f"shards: expected a list of one tensor per CP rank, got "
            f"{type(shards).__name__ if not isinstance(shards, Sequence) or shards else 'none'}"
        )
    if any(not isinstance(s, torch.Tensor) for s in shards):
        raise ArgumentError(f"shards: expected tensors, got {[type(s).__name__ for s in shards]}")
    ref = shards[0].shape
    if not 1 <= dim < len(ref):
        raise ArgumentError(
            f"dim: expected the token dim of a [.., 1, T, ...] shard (1 <= dim < {len(ref)}), got "
            f"{dim}"
        )
    for r, s in enumerate(shards):
        if s.shape != ref:
            raise ArgumentError(
                f"shards: shard of CP rank {r} has shape {tuple(s.shape)}, rank 0 has {tuple(ref)}"
            )
        if (
            s.dtype != shards[0].dtype or s.device != shards[0].device
        ):  # torch.cat would promote or fail later
            raise ArgumentError(
                f"shards: expected one dtype and device (rank 0's {shards[0].dtype} on "
                f"{shards[0].device}), got {s.dtype} on {s.device} from CP rank {r}"
            )
    if cp_size is not None and cp_size != len(shards):
        raise ArgumentError(
            f"shards: expected cp_size={cp_size} shards (one per CP rank), got {len(shards)}"
        )
    return len(shards)


def _cp_layout(value) -> CPLayout:
    try:
        return CPLayout(value)
    except ValueError:
        raise ArgumentError(
            f"cp_layout: expected one of {[c.value for c in CPLayout]} (the batch's "
            f"'cp_layout'), got {value!r}"
        ) from None


def _offsets(name: str, cu) -> torch.Tensor:
    """int64 ``[N+1]`` offsets from 0, non-decreasing, or an :class:`ArgumentError` naming
    ``name``."""
    if (
        not isinstance(cu, torch.Tensor)
        or cu.ndim != 1
        or cu.numel() < 2
        or cu.is_floating_point()
        or cu.dtype == torch.bool
    ):
        raise ArgumentError(
            f"{name}: expected an integer tensor [N+1], got "
            f"{type(cu).__name__} {tuple(getattr(cu, 'shape', ()))}"
        )
    cu = cu.detach().to("cpu", torch.int64)
    if int(cu[0]) != 0 or bool((cu.diff() < 0).any()):
        raise ArgumentError(
            f"{name}: expected non-decreasing offsets from 0, got {cu.tolist()[:8]}..."
        )
    return cu


def unshard_cp(
    shards: Sequence[torch.Tensor],
    *,
    cu_seqlens_padded: torch.Tensor,
    cp_layout: CPLayout | str = CPLayout.ZIGZAG,
    dim: int = 1,
    cp_size: int | None = None,
) -> torch.Tensor:
    """Per-rank THD shards ``[1, T/cp, ...]`` (in CP-rank order) -> the whole packed ``[1, T,
    ...]``.

    ``cp_layout``: how the shards were cut; a collated batch carries it as ``batch["cp_layout"]``
    (and its CP size as ``batch["cp_size"]``: pass it as ``cp_size`` to have the count checked).
    The shards must hold exactly the ``T`` rows ``cu_seqlens_padded`` describes.
    """
    cp = _check_shards(shards, dim, cp_size)
    cp_layout = _cp_layout(cp_layout)
    cup = _offsets("cu_seqlens_padded", cu_seqlens_padded)
    total, held = int(cup[-1]), shards[0].shape[dim]
    if total != held * cp:
        raise ArgumentError(
            f"unshard_cp: cu_seqlens_padded describes {total} rows, the {cp} shard(s) hold "
            f"{cp} x {held} (a missing or extra shard, or offsets of another batch)"
        )
    if cp == 1:
        return shards[0]
    layout = ParallelLayout(cp=cp, cp_layout=_cp_layout(cp_layout))
    padded = cup.diff()
    if layout.cp_layout is CPLayout.ZIGZAG and bool((padded % (2 * cp)).any()):
        i = int(torch.nonzero(padded % (2 * cp))[0])
        raise ArgumentError(
            f"unshard_cp: padded length {int(padded[i])} of sequence {i} is not a multiple of "
            f"2*cp = "
            f"{2 * cp}, so these shards were not cut zigzag; pass cp_layout=batch['cp_layout']"
        )
    slots = torch.cat([global_slots(cp_chunks(padded, layout, r), cup) for r in range(cp)])
    stacked = torch.cat(list(shards), dim)
    return torch.empty_like(stacked).index_copy_(dim, slots.to(stacked.device), stacked)


def unpack_thd(
    packed: torch.Tensor, *, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, dim: int = 1
) -> list[torch.Tensor]:
    """Whole packed ``[1, T, ...]`` -> list of ``[L_i, ...]`` (views of one gathered tensor), one
    per real sequence: the trailing entries of static offsets (``max_seqs``) that only repeat the
    total are no sequences and give nothing.

    Every true length must fit its padded one, and ``cu_seqlens_padded[-1]`` must be ``T``: checked
    before anything is allocated."""
    _int("dim", dim, "(the token dim)")
    if not isinstance(packed, torch.Tensor) or not 1 <= dim < packed.ndim:
        raise ArgumentError(
            f"packed: expected a tensor [.., 1, T, ...] with token dim {dim}, got "
            f"{type(packed).__name__} {tuple(getattr(packed, 'shape', ()))}"
        )
    if packed.shape[dim - 1] != 1:
        raise ArgumentError(
            f"packed: expected a batch dim of 1 before token dim {dim} (a THD batch [.., 1, T, "
            f"...]), got shape {tuple(packed.shape)}"
        )
    cu, cup = _offsets("cu_seqlens", cu_seqlens), _offsets("cu_seqlens_padded", cu_seqlens_padded)
    if cu.numel() != cup.numel():
        raise ArgumentError(
            f"cu_seqlens_padded: expected {cu.numel()} offsets like cu_seqlens, got {cup.numel()}"
        )
    if int(cup[-1]) != packed.shape[dim]:
        raise ArgumentError(
            f"cu_seqlens_padded: describes {int(cup[-1])} rows, packed holds {packed.shape[dim]} "
            f"(unshard the CP shards first, or offsets of another batch)"
        )
    lengths, padded = cu.diff(), cup.diff()
    over = torch.nonzero(lengths > padded).flatten()
    if over.numel():
        i = int(over[0])
        raise ArgumentError(
            f"cu_seqlens: true length {int(lengths[i])} of sequence {i} exceeds its padded length "
            f"{int(padded[i])} (it would read into the next sequence)"
        )
    lengths = lengths[: num_sequences(cup)]
    rows = real_rows(lengths, cup[: lengths.numel()])
    flat = packed.index_select(dim, rows.to(packed.device)).squeeze(dim - 1)
    return list(torch.split(flat, lengths.tolist(), dim=dim - 1))


def unshard_bshd(
    shards: Sequence[torch.Tensor],
    *,
    cp_layout: CPLayout | str = CPLayout.ZIGZAG,
    dim: int = 1,
    cp_size: int | None = None,
) -> torch.Tensor:
    """Per-rank BSHD shards ``[B, S/cp, ...]`` -> ``[B, S, ...]``.

    Shapes alone cannot tell 3 shards of cp=2 data from cp=3 data: pass ``cp_size=batch["cp_size"]``
    to have the count checked (zigzag shards must also hold ``S/cp`` columns that split into 2
    chunks)."""
    cp = _check_shards(shards, dim, cp_size)
    cp_layout = _cp_layout(cp_layout)
    if cp == 1:
        return shards[0]
    layout = ParallelLayout(cp=cp, cp_layout=_cp_layout(cp_layout))
    local = shards[0].shape[dim]
    if layout.cp_layout is CPLayout.ZIGZAG and local % 2:
        raise ArgumentError(
            f"unshard_bshd: a zigzag shard holds 2 chunks per row, so an even number of columns; "
            f"got {local} (shards of the contiguous layout? pass cp_layout=batch['cp_layout'])"
        )
    s = local * cp
    cu_row = torch.tensor([0, s])
    cols = torch.cat([global_slots(bshd_chunks(1, s, layout, r), cu_row) for r in range(cp)])
    stacked = torch.cat(list(shards), dim)
    return torch.empty_like(stacked).index_copy_(dim, cols.to(stacked.device), stacked)


def unpack_bshd(
    padded: torch.Tensor, *, cu_seqlens: torch.Tensor, dim: int = 1
) -> list[torch.Tensor]:
    """Whole ``[B, S, ...]`` -> list of ``[L_i, ...]`` (true lengths from ``cu_seqlens``; each ``<=
    S``)."""
    _int("dim", dim, "(the token dim)")
    if not isinstance(padded, torch.Tensor) or not 1 <= dim < padded.ndim:
        raise ArgumentError(
            f"padded: expected a tensor [B, S, ...] with token dim {dim}, got "
            f"{type(padded).__name__} {tuple(getattr(padded, 'shape', ()))}"
        )
    lengths = _offsets("cu_seqlens", cu_seqlens).diff()
    b, s = padded.shape[dim - 1], padded.shape[dim]
    if lengths.numel() != b:
        raise ArgumentError(
            f"cu_seqlens: expected B+1 = {b + 1} offsets, got {lengths.numel() + 1}"
        )
    if int(lengths.max()) > s:
        i = int(torch.argmax(lengths))
        raise ArgumentError(
            f"cu_seqlens: true length {int(lengths[i])} of row {i} exceeds the row length S = {s} "
            f"(it would read into the next row)"
        )
    flat = padded.flatten(dim - 1, dim)
    rows = real_rows(lengths, torch.arange(b) * s)
    return list(
        torch.split(
            flat.index_select(dim - 1, rows.to(padded.device)), lengths.tolist(), dim=dim - 1
        )
    )
