"""The inverse (unshard_cp, unpack_thd, unshard_bshd, unpack_bshd) given arguments of the wrong kind
or shape: an ArgumentError naming the argument, what was expected and what came, never a TypeError
or a RuntimeError from inside torch."""

from __future__ import annotations

import pytest
import torch

from prealign.collate import unpack_bshd, unpack_thd, unshard_bshd, unshard_cp
from prealign.schemas.errors import ArgumentError

CU = torch.tensor([0, 3, 5], dtype=torch.int32)
CUP = torch.tensor([0, 4, 8], dtype=torch.int32)
SHARDS = [torch.arange(4).view(1, 4), torch.arange(4, 8).view(1, 4)]


@pytest.mark.parametrize("dim", ["1", 1.0, True, None], ids=repr)
@pytest.mark.parametrize(
    "call",
    [
        lambda dim: unpack_thd(torch.zeros(1, 8), cu_seqlens=CU, cu_seqlens_padded=CUP, dim=dim),
        lambda dim: unshard_cp(SHARDS, cu_seqlens_padded=CUP, dim=dim),
        lambda dim: unshard_bshd([torch.zeros(2, 4)] * 2, dim=dim),
        lambda dim: unpack_bshd(torch.zeros(2, 4), cu_seqlens=torch.tensor([0, 3, 5]), dim=dim),
    ],
    ids=["unpack_thd", "unshard_cp", "unshard_bshd", "unpack_bshd"],
)
def test_a_dim_not_an_int_is_an_argument_error(call, dim):
    with pytest.raises(ArgumentError, match=f"dim: expected an int .*, got {dim!r}"):
        call(dim)


def test_unpack_thd_of_a_batch_dim_not_1_is_an_argument_error():
    """A ``[2, T]`` tensor (two packed rows, or a BSHD batch) was a RuntimeError from
    ``torch.split``."""
    with pytest.raises(ArgumentError, match=r"packed: expected a batch dim of 1 .* shape \(2, 8\)"):
        unpack_thd(torch.zeros(2, 8), cu_seqlens=CU, cu_seqlens_padded=CUP)


def test_bool_offsets_are_an_argument_error():
    """A bool mask passed as cu_seqlens was read as the offsets [0, 1]."""
    with pytest.raises(ArgumentError, match="cu_seqlens: expected an integer tensor"):
        unpack_thd(
            torch.zeros(1, 8),
            cu_seqlens=torch.tensor([False, True]),
            cu_seqlens_padded=torch.tensor([0, 8]),
        )


@pytest.mark.parametrize("cp_size", ["2", 2.0], ids=repr)
def test_a_cp_size_not_an_int_is_an_argument_error(cp_size):
    """``cp_size="2"`` said "expected cp_size=2 shards, got 2"."""
    with pytest.raises(ArgumentError, match=f"cp_size: expected an int or None, got {cp_size!r}"):
        unshard_cp(SHARDS, cu_seqlens_padded=CUP, cp_size=cp_size)
