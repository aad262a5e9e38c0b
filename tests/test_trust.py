"""Issue #31, third trust pass: one URL once, empty samples as bad data, max_seqs in BSHD, unknown tar members
counted, ShardWriter refusals, typed errors for crafted configs and folder paths."""
from __future__ import annotations

import os

import pytest

from prealign.loaders import WebDatasetSource
from tests.loader_helpers import sample_lengths, write_shards


# ---- one URL once (issue #31: a shard listed twice was served twice, 30 samples per epoch, 20 distinct) -------
@pytest.mark.parametrize("twice", [lambda p: p, lambda p: "file://" + p,
                                   lambda p: os.path.join(os.path.dirname(p), ".", os.path.basename(p))])
def test_a_shard_listed_twice_is_refused_naming_both_positions(tmp_path, twice):
    from prealign.loaders import PackedLoader
    from prealign.schemas import ParallelLayout, causal_lm_schema
    from prealign.schemas.errors import ConfigError

    a, b = write_shards(str(tmp_path), sample_lengths(20), num_shards=2)
    with pytest.raises(ConfigError, match=r"\(position 0\) and .* \(position 2\) are one shard"):
        source = WebDatasetSource([a, b, twice(a)])
        next(iter(PackedLoader(source, schema=causal_lm_schema(), layout=ParallelLayout(), token_budget=4096)))
    assert len(WebDatasetSource([a, b]).urls) == 2
