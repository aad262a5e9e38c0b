"""mRoPE positions from hostile grids and merge sizes: a typed error naming the sample and the
field, never positions computed from a negative grid (silently wrong), a raw numpy ValueError for a
grid row of two numbers, or a merge size of 0 dividing by zero."""

from __future__ import annotations

import pytest
import torch

from prealign.collate.mrope import mrope_position_ids
from prealign.schemas.errors import ArgumentError, SampleError

TYPES = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 0, 0])
CU = torch.tensor([0, 10])


@pytest.mark.parametrize("grid", [[1, -4, -6], [-1, 4, -6], [-1, -4, 6]], ids=repr)
def test_a_grid_with_a_negative_dim_is_a_sample_error(grid):
    """``t*h*w`` of [1, -4, -6] is 24, the run's 6 tokens matched it: positions were computed."""
    with pytest.raises(SampleError, match=r"sample 0, field 'image_grid_thw': expected positive t"):
        mrope_position_ids(TYPES, torch.tensor([grid]), CU)


def test_a_grid_row_of_two_numbers_is_a_sample_error():
    with pytest.raises(SampleError, match=r"field 'image_grid_thw': expected rows of \(t, h, w\)"):
        mrope_position_ids(TYPES, torch.tensor([[4, 6]]), CU)


@pytest.mark.parametrize("merge", [0, -2, "2", 2.0, True], ids=repr)
def test_a_merge_size_not_a_positive_int_is_an_argument_error(merge):
    with pytest.raises(ArgumentError, match="spatial_merge_size: expected a positive int, got"):
        mrope_position_ids(TYPES, torch.tensor([[1, 4, 6]]), CU, spatial_merge_size=merge)


def test_valid_grids_keep_their_positions():
    got = mrope_position_ids(TYPES, torch.tensor([[1, 4, 6]]), CU, spatial_merge_size=2)
    assert got[2].tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]
