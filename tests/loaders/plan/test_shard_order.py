"""The sequential epoch order's shards in their seeded order (issue #28, 100k one-sample shards):
shards of one sample count take a few ops on the permutation, others a repeat; both give exactly the
order the repeat gives (a saved position resumes to the same samples), for any shard layout."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from prealign.loaders.index.sample_index import SampleIndex
from prealign.loaders.plan.schedule import _shards_in_order, epoch_order
from prealign.loaders.policy import BadDataReport
from tests.conftest import examples


def _by_repeat(starts, counts, perm, n):
    first, count = starts[perm], counts[perm]
    return np.arange(n) + np.repeat(first - (np.cumsum(count) - count), count)


@examples(300)
@given(
    st.one_of(
        st.lists(st.integers(1, 5), min_size=1, max_size=12),
        st.tuples(st.integers(1, 12), st.integers(1, 6)).map(lambda t: [t[1]] * t[0]),
    ),
    st.integers(0, 2**32 - 1),
)
def test_shards_in_order_is_the_repeat(counts, seed):
    counts = np.asarray(counts, np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    perm = np.random.default_rng(seed).permutation(len(counts))
    n = int(counts.sum())
    got = _shards_in_order(starts, counts, perm, n)
    assert got.dtype == np.int64 and got.tolist() == _by_repeat(starts, counts, perm, n).tolist()


def test_one_sample_shards_give_the_order_of_the_shard_permutation():
    n = 1000
    index = SampleIndex(
        lengths=np.full(n, 8),
        locations=np.zeros((n, 4), np.int64),
        shards=np.arange(n),
        report=BadDataReport(),
    )
    order = epoch_order(index, epoch=2, seed=7, shuffle=True, sequential=True, window=1)
    rng = np.random.default_rng([7, 2])
    assert order.tolist() == rng.permutation(n)[np.arange(n)].tolist()
