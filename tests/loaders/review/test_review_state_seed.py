"""A loader resumes from the state it saved itself, whatever seed it was given: ``seed`` is any int
>= 0 (``np.random.default_rng`` takes ints of any size: ``SeedSequence().entropy`` is a 128-bit
int), so the hostile-state check's int64 bound must not refuse the loader's own seed."""

from __future__ import annotations

import json
from itertools import islice

import pytest

from tests.loader_helpers import sample_lengths, write_shards
from tests.loaders.test_state_hostile import _batches, _packed
from tests.loaders.test_stream_cursors import _make

BIG_SEEDS = [2**63, 2**64 + 7, 0x8F3A_61D2_0C55_B7E4_1D09_A6F3_22C8_7B15]


def _resumes(make, stop: int = 3, **state_kw) -> None:
    a = make()
    it = iter(a)
    list(islice(it, stop))
    state = json.loads(json.dumps(a.state_dict(**state_kw)))  # (as a checkpoint holds it)
    rest = _batches(it)
    b = make()
    b.load_state_dict(state)
    assert _batches(b) == rest and rest


@pytest.mark.parametrize("mixture", [False, True])
@pytest.mark.parametrize("seed", BIG_SEEDS)
def test_a_packed_loader_resumes_from_its_own_state_with_a_seed_past_int64(seed, mixture):
    _resumes(lambda: _packed("", mixture=mixture, seed=seed))


@pytest.mark.parametrize("seed", BIG_SEEDS[1:])
def test_a_streaming_loader_resumes_from_its_own_state_with_a_seed_past_int64(seed, tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(40, seed=2), num_shards=2)
    _resumes(lambda: _make(paths, seed=seed), cursors=True)
