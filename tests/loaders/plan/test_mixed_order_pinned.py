"""A mixture"s epoch order is pinned bit for bit: hashes of :func:`mixed_order`"s ``ids``,
``component``, ``draw`` and ``targets`` taken from the implementation before the in-place interleave
(commit ba98b5b), over seeds, weights, ``by``, served draws, repeats and fixed lengths; and
:func:`interleave` against its definition (a stable sort of the concatenated finish times)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from prealign.loaders.plan.mixing import MixSpec, interleave, mixed_order

NAMES = ("a", "b", "c")


def _hash(*arrays: np.ndarray) -> str:
    d = hashlib.sha256()
    for a in arrays:
        d.update(np.ascontiguousarray(a).tobytes())
        d.update(str(a.dtype).encode())
    return d.hexdigest()[:16]


def _lengths() -> list[np.ndarray]:
    rng = np.random.default_rng(5)  # the last component has 0-token samples
    return [rng.integers(1, 300, 500), rng.integers(100, 2000, 70), rng.integers(0, 5, 40)]


GRID = [
    (by, w, seed, served)
    for by in ("samples", "tokens")
    for w in ((1 / 3, 1 / 3, 1 / 3), (0.6, 0.3, 0.1), (0.5, 0.49, 0.01))
    for seed in (0, 7)
    for served in (False, True)
]
GRID_HASHES = [
    "63930d13fa1c2afa", "78aae61a17a2e4ac", "22bc0ff3ba2f4cb0", "fe52ef31f6c40200",
    "4ac7716a9b353574", "9fe8752d7dfe4ff2", "a35ac5dbcda950ff", "4611c1f04ca9cf09",
    "b162df38d1bf3761", "92a9bc174230f029", "59bf2bb8c29c6077", "02b7b6401575592f",
    "484b67e3995016a5", "7b303e8eeca9fc5f", "a431cf841ff87052", "7c41e3fd7233ef1f",
    "7080218b9985fdde", "897fb8fbc9c42fe8", "34dac5d27feadff4", "6b95a9159b2c4895",
    "ebb60c73cfc16b0c", "e635569a4d3944e0", "65d270af5d30ec23", "b52e8a5adaae85ff",
]


@pytest.mark.parametrize(("case", "expect"), list(zip(GRID, GRID_HASHES)))
def test_mixed_order_is_unchanged_bit_for_bit(case, expect):
    by, weights, seed, served = case
    done = [np.array([0, 3, 5]), np.zeros(0, np.int64), np.array([2])] if served else None
    mo = mixed_order(
        MixSpec(names=NAMES, weights=weights, by=by),
        _lengths(),
        epoch=1,
        seed=seed,
        shuffle=seed > 0,
        served=done,
    )
    assert _hash(mo.ids, mo.component, mo.draw, mo.targets) == expect


SPECS = [
    MixSpec(names=NAMES, weights=(0.7, 0.3, None), repeats=(None, None, 2.0), by="tokens"),
    MixSpec(names=NAMES, weights=(0.2, 0.3, 0.5), by="samples", length=333),
    MixSpec(names=NAMES, weights=(0.2, 0.3, 0.5), by="tokens", length="all_exhausted"),
]


SPEC_HASHES = ["1c5f4c0dcec6b450", "4a49ee806f2bd372", "331fb59b9c8313d7"]


@pytest.mark.parametrize(("spec", "expect"), list(zip(SPECS, SPEC_HASHES)))
def test_repeats_and_fixed_lengths_are_unchanged_bit_for_bit(spec, expect):
    mo = mixed_order(spec, _lengths(), epoch=0, seed=3, shuffle=True)
    assert _hash(mo.ids, mo.component, mo.draw, mo.targets) == expect


def test_interleave_with_empty_and_zero_unit_components_is_unchanged():
    units = [np.array([1, 1, 1]), np.array([3]), np.zeros(0, np.int64), np.array([0, 2, 0])]
    assert _hash(*interleave(units)) == "e744d437fe8846f8"


@pytest.mark.parametrize("seed", range(5))
def test_interleave_is_a_stable_sort_of_the_finish_times(seed):
    rng = np.random.default_rng(seed)
    units = [rng.integers(0, 50, rng.integers(0, 200)) for _ in range(rng.integers(1, 5))]
    units[0] = np.ones(100, np.int64) * 7  # equal shares: ties across components
    units.append(np.ones(100, np.int64) * 7)
    total = float(sum(u.sum() for u in units))
    tags = [(np.cumsum(u) - u / 2.0) / (u.sum() / total) for u in units if u.size]
    sizes = [u.size for u in units]
    order = np.argsort(np.concatenate(tags), kind="stable")
    comp = np.repeat(np.arange(len(units)), sizes)[order]
    draw = np.concatenate([np.arange(n) for n in sizes])[order]
    got = interleave(units)
    assert got[0].tolist() == comp.tolist() and got[1].tolist() == draw.tolist()
