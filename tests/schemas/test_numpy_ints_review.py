"""Review of the shared int check (``schemas/checks.py``, issue #28 follow-up): the geometry
classes now take numpy ints where they took Python ints only, so each must keep the value as a
Python int. A ``uint8``/``int8`` kept as it is wraps in the arithmetic that follows (``merge**2``,
``patch * merge``): silently wrong token counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prealign.collate.vision.grids import VisionGeometry
from prealign.schemas.vlm import VisionTokens


@pytest.mark.parametrize("kind", [np.int8, np.uint8, np.int16, np.int64])
def test_vision_tokens_keeps_a_numpy_merge_size_as_an_int(kind):
    ids = dict(image_token_id=1, vision_start_token_id=2, vision_end_token_id=3)
    tokens = VisionTokens(**ids, spatial_merge_size=kind(12))
    assert type(tokens.spatial_merge_size) is int
    assert tokens.tokens_per_image(torch.tensor([[1, 24, 24]])).tolist() == [4]


@pytest.mark.parametrize("kind", [np.uint8, np.int16, np.int64])
def test_vision_geometry_keeps_numpy_sizes_as_ints(kind):
    geometry = VisionGeometry(patch_size=kind(16), merge_size=kind(16))
    assert type(geometry.patch_size) is int and type(geometry.merge_size) is int
    assert geometry.patch_size * geometry.merge_size == 256
