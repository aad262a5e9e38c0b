"""Leftovers of the hostile mRoPE pass: a sample's grid that is not ``[num, 3]`` rows of positive
ints, given to :class:`MRoPECollator`, is a :class:`SampleError` naming the sample and the field,
never a raw torch RuntimeError / TypeError, a ``[3, 2]`` grid silently read as ``[2, 3]``, a
fraction truncated, or a zero-frame video miscounted as "0 runs expected"."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import Qwen3VLConfig

from prealign.collate import THDCollator
from prealign.collate.mrope import MRoPECollator, mrope_position_ids
from prealign.schemas import ParallelLayout, vlm_schema
from prealign.schemas.errors import SampleError

IMAGE_TYPES = [0, 0, 1, 1, 1, 1, 1, 1, 0, 0]
VIDEO_TYPES = [0, 0, 2, 2, 2, 2, 2, 2, 0, 0]


def _collator(family: bool) -> MRoPECollator:
    thd = THDCollator(schema=vlm_schema(), layout=ParallelLayout())
    return MRoPECollator(collator=thd, model_config=Qwen3VLConfig() if family else None)


def _batch(grid, key: str) -> list[dict]:
    """A text sample, then one whose image (video) run of 6 tokens has ``grid``."""
    text = {"input_ids": torch.arange(4), "mm_token_type_ids": torch.zeros(4, dtype=torch.int64)}
    types = IMAGE_TYPES if key == "image_grid_thw" else VIDEO_TYPES
    sample = {"input_ids": torch.arange(10), "mm_token_type_ids": torch.tensor(types), key: grid}
    for s in (text, sample):
        s.setdefault("image_grid_thw", torch.zeros(0, 3, dtype=torch.int64))
    return [text, sample]


SHAPES = [
    (torch.tensor([[4, 6]]), "shape (1, 2)"),
    (torch.tensor([[1, 4], [6, 1], [4, 6]]), "shape (3, 2)"),  # was read as [[1, 4, 6], [1, 4, 6]]
    (torch.tensor([4, 6]), "shape (2,)"),
    (torch.ones(1, 1, 3, dtype=torch.int64), "shape (1, 1, 3)"),
    (torch.tensor(7), "shape ()"),
]


@pytest.mark.parametrize("family", [False, True], ids=["qwen2_vl", "qwen3_vl"])
@pytest.mark.parametrize("key", ["image_grid_thw", "video_grid_thw"])
@pytest.mark.parametrize("grid, got", SHAPES, ids=lambda x: getattr(x, "shape", x))
def test_a_grid_not_of_rows_of_three_is_a_sample_error(family, key, grid, got):
    expected = r"expected rows of \(t, h, w\): \[num, 3\]"
    match = rf"sample 1, field '{key}': {expected}, got {re.escape(got)}"
    with pytest.raises(SampleError, match=match):
        _collator(family)(_batch(grid, key))


@pytest.mark.parametrize("family", [False, True], ids=["qwen2_vl", "qwen3_vl"])
@pytest.mark.parametrize("key", ["image_grid_thw", "video_grid_thw"])
@pytest.mark.parametrize(
    "grid, got",
    [
        ([[0, 4, 6]], "[0, 4, 6]"),
        ([[1, -4, -6]], "[1, -4, -6]"),
        ([[1, 4, 6], [0, 0, 0]], "[0, 0, 0]"),  # a zero row after a good one
    ],
    ids=repr,
)
def test_a_grid_with_a_dim_below_one_is_a_sample_error(family, key, grid, got):
    """Qwen3-VL splits a video into t runs: t=0 gave "expected 0 runs of video tokens"."""
    match = rf"sample 1, field '{key}': expected positive t, h and w, got {re.escape(got)}"
    with pytest.raises(SampleError, match=match):
        _collator(family)(_batch(torch.tensor(grid), key))


@pytest.mark.parametrize(
    "grid, got",
    [
        (torch.tensor([[1.5, 4.0, 6.0]]), "torch.float32"),
        ("146", "str"),
        ([[1, "4", 6]], "list"),
        (torch.tensor([[True, True, True]]), "torch.bool"),
    ],
    ids=repr,
)
def test_a_grid_not_of_ints_is_a_sample_error(grid, got):
    """1.5 frames were truncated to 1 (positions of another grid); a str was a raw TypeError."""
    match = r"sample 1, field 'image_grid_thw': expected rows of \(t, h, w\) ints"
    with pytest.raises(SampleError, match=match) as info:
        _collator(False)(_batch(grid, "image_grid_thw"))
    assert got in str(info.value)


def test_the_batch_function_refuses_fractions_and_rows_of_three_in_a_deeper_tensor():
    types, cu = torch.tensor(IMAGE_TYPES), torch.tensor([0, 10])
    with pytest.raises(SampleError, match=r"expected rows of \(t, h, w\) ints"):
        mrope_position_ids(types, torch.tensor([[1.5, 4.0, 6.0]]), cu)
    with pytest.raises(SampleError, match=r"\[num, 3\], got shape \(1, 1, 3\)"):
        mrope_position_ids(types, torch.ones(1, 1, 3, dtype=torch.int64), cu)


@pytest.mark.parametrize(
    "grid",
    [
        torch.tensor([[1, 4, 6]]),
        [[1, 4, 6]],
        torch.tensor([[1, 4, 6]], dtype=torch.int32),
    ],
    ids=repr,
)
def test_valid_grids_keep_their_positions(grid):
    thd = THDCollator(schema=vlm_schema(), layout=ParallelLayout())
    collate = MRoPECollator(collator=thd)
    batch = _batch(grid, "image_grid_thw")
    batch[0]["pixel_values"], batch[1]["pixel_values"] = torch.zeros(0, 1176), torch.zeros(24, 1176)
    got = collate(batch)["mrope_position_ids"][:, 0]
    assert got[2, 4:].tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]
    assert got[1, 4:].tolist() == [0, 1, 2, 2, 2, 3, 3, 3, 5, 6]
