"""The inverse maps on model-output-like tensors (hidden dims, mRoPE leading dims), independent of
the collators: shard a known whole tensor with the reference rule, then invert."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate import (
    lengths_to_cu_seqlens,
    unpack_bshd,
    unpack_thd,
    unshard_bshd,
    unshard_cp,
)
from prealign.schemas import ArgumentError, CPLayout
from tests.conftest import examples, naive_round_up


def reference_shard(
    whole: torch.Tensor, padded: list[int], cp: int, rank: int, cp_layout: CPLayout, dim: int
) -> torch.Tensor:
    """Rank ``rank``'s rows of ``whole`` along ``dim`` (zigzag per sequence, or a contiguous
    block)."""
    if cp_layout is CPLayout.CONTIGUOUS:
        return whole.chunk(cp, dim)[rank]
    parts = []
    for seq in whole.split(padded, dim):
        chunks = seq.chunk(2 * cp, dim)
        parts += [chunks[rank], chunks[2 * cp - 1 - rank]]
    return torch.cat(parts, dim)


@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=5),
    cp=st.integers(1, 8),
    cp_layout=st.sampled_from(list(CPLayout)),
    mrope=st.booleans(),
)
@examples(100)
def test_thd_outputs_unshard_and_unpack(lengths, cp, cp_layout, mrope):
    padded = [naive_round_up(n, 2 * cp) for n in lengths]
    cu, cup = (
        lengths_to_cu_seqlens(torch.tensor(lengths)),
        lengths_to_cu_seqlens(torch.tensor(padded)),
    )
    t = sum(padded)
    # [1, T, H] hidden states, or mRoPE-like [3, 1, T] with the token dim at 2
    whole = (
        torch.arange(t * 3, dtype=torch.float32).reshape(1, t, 3)
        if not mrope
        else torch.arange(3 * t).reshape(3, 1, t)
    )
    dim = 2 if mrope else 1
    shards = [reference_shard(whole, padded, cp, r, cp_layout, dim) for r in range(cp)]
    back = unshard_cp(shards, cu_seqlens_padded=cup, cp_layout=cp_layout.value, dim=dim)
    assert torch.equal(back, whole)
    rows = unpack_thd(back, cu_seqlens=cu, cu_seqlens_padded=cup, dim=dim)
    starts = cup[:-1].tolist()
    for row, start, n in zip(rows, starts, lengths):
        want = whole[0, start : start + n] if not mrope else whole[:, 0, start : start + n]
        assert torch.equal(row, want)


@given(
    lengths=st.lists(st.integers(1, 100), min_size=1, max_size=4),
    cp=st.integers(1, 6),
    cp_layout=st.sampled_from(list(CPLayout)),
)
@examples(60)
def test_bshd_outputs_unshard_and_unpack(lengths, cp, cp_layout):
    s = naive_round_up(max(lengths), 2 * cp)
    whole = torch.randn(len(lengths), s, 2)
    shards = [reference_shard(whole, [s], cp, r, cp_layout, 1) for r in range(cp)]
    assert torch.equal(unshard_bshd(shards, cp_layout=cp_layout), whole)
    rows = unpack_bshd(whole, cu_seqlens=lengths_to_cu_seqlens(torch.tensor(lengths)))
    assert [r.shape for r in rows] == [(n, 2) for n in lengths]
    assert all(torch.equal(r, whole[i, :n]) for i, (r, n) in enumerate(zip(rows, lengths)))


def test_unshard_keeps_autograd_and_a_single_rank_is_identity():
    cup = torch.tensor([0, 8, 12], dtype=torch.int32)
    shards = [torch.randn(1, 6, requires_grad=True) for _ in range(2)]
    whole = unshard_cp(shards, cu_seqlens_padded=cup)
    whole.sum().backward()
    assert all(torch.equal(s.grad, torch.ones(1, 6)) for s in shards)
    one = torch.randn(1, 12)
    assert unshard_cp([one], cu_seqlens_padded=cup) is one and unshard_bshd([one]) is one


@pytest.mark.parametrize(
    "shards, cup, match",
    [
        ([], [0, 4], "one tensor per CP rank, got none"),
        ([torch.zeros(1, 6), torch.zeros(1, 4)], [0, 8, 12], "shard of CP rank 1 has shape"),
        (
            [torch.zeros(1, 4), torch.zeros(1, 4)],
            [0, 8, 12],
            r"describes 12 rows, the 2 shard\(s\) hold 2 x 4",
        ),
    ],
)
def test_unshard_rejects_inconsistent_shards(shards, cup, match):
    with pytest.raises(ArgumentError, match=match):
        unshard_cp(shards, cu_seqlens_padded=torch.tensor(cup))
