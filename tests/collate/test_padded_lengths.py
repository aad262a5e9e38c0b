"""The collators pad with :func:`prealign.collate.indices.padded_lengths` (in-place numpy, issue
#28): equal to :meth:`ParallelLayout.padded_lengths` for every layout and batch, input untouched."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate.indices import padded_lengths
from tests.conftest import examples, layout_st, lengths_st


@st.composite
def lengths_and_layout(draw):
    lengths = draw(lengths_st)
    return lengths, draw(layout_st(lengths))


@given(case=lengths_and_layout())
@examples(200)
def test_padded_lengths_equal_the_layouts(case):
    lengths, layout = case
    given_lengths = np.array(lengths, dtype=np.int64)
    ours = padded_lengths(layout, given_lengths)
    assert ours.dtype == np.int64
    assert ours.tolist() == layout.padded_lengths(torch.tensor(lengths)).tolist()
    assert given_lengths.tolist() == lengths  # a new array: the lengths are not rounded in place
