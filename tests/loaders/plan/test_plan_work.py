"""The plan of a chunk at the start (issue #28): the same plan bit for bit as before its per-sample
Python was cut, and a work count (function calls, not time) per sample of the chunk.

The digests were taken from the planner before the change (a best fit with a method call per sample,
a micro-batch assembled sample by sample); any change to a plan changes them."""

from __future__ import annotations

import cProfile
import hashlib
import json
import pstats

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prealign.loaders.plan.cost import CostModel
from prealign.loaders.plan.packing import stream_fit
from prealign.loaders.plan.planner import ChunkedPlan, plan_microbatches
from prealign.schemas import ParallelLayout

# (samples, longest, dp, k, strategy, buffer, chunk, seed, layout, budget, max_seqs, oversize) ->
# digest
GOLDEN = [
    (
        (20000, 128, 1, 1, "bfd", 2048, 16384, 1, dict(tp=2, cp=2), 8192, None, "error"),
        "780844a2467efdad",
    ),
    ((5000, 2000, 2, 1, "bfd", 64, 16384, 3, dict(cp=2), 4096, None, "error"), "0e424d3f6d5281b5"),
    (
        (5000, 3000, 4, 2, "first_fit", 128, 1000, 5, dict(), 4096, None, "truncate"),
        "ad77ca448fa8f86e",
    ),
    ((3000, 500, 2, 2, "bfd", 32, 700, None, dict(tp=2), 2048, 8, "skip"), "4bbcf9fffbb04b30"),
    (
        (40000, 256, 8, 1, "bfd", 2048, 16384, 7, dict(tp=2, cp=2), 8192, None, "error"),
        "df2a8b77fcb225e0",
    ),
    ((777, 64, 3, 1, "bfd", 8, 100, 9, dict(), 256, 4, "error"), "0cb952fdc6f9938e"),
]
GOLDEN_COST = [((2, 1), "8980e56669f73fc9"), ((4, 2), "559a5d36b18d8082")]


def _digest(plan) -> str:
    h = hashlib.sha256()
    h.update(
        json.dumps(
            [
                plan.microbatches,
                plan.steps,
                plan.truncated and sorted(plan.truncated.items()),
                plan.skipped,
            ]
        ).encode()
    )
    h.update(plan.real_tokens.tobytes())
    h.update(plan.padded_lengths.tobytes())
    h.update(json.dumps(plan.stats.to_dict(), sort_keys=True).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("case,want", GOLDEN)
def test_plans_unchanged(case, want):
    n, hi, dp, k, strategy, buf, chunk, seed, layout, budget, max_seqs, oversize = case
    lengths = np.random.default_rng(n).integers(1, hi, n)
    lay = ParallelLayout(**layout, **({"max_seqs": max_seqs} if max_seqs else {}))
    plan = plan_microbatches(
        lengths,
        layout=lay,
        token_budget=budget,
        dp_size=dp,
        seed=seed,
        strategy=strategy,
        buffer_size=buf,
        chunk_size=chunk,
        microbatches_per_step=k,
        oversize=oversize,
    )
    assert _digest(plan) == want


@pytest.mark.parametrize("dpk,want", GOLDEN_COST)
def test_cost_plans_unchanged(dpk, want):
    lengths = np.random.default_rng(0).integers(1, 900, 6000)
    plan = plan_microbatches(
        lengths,
        layout=ParallelLayout(cp=2),
        token_budget=2048,
        dp_size=dpk[0],
        seed=2,
        microbatches_per_step=dpk[1],
        cost=CostModel(linear=1.0, quadratic=0.003),
        chunk_size=1500,
    )
    assert _digest(plan) == want


def _reference_stream_fit(sizes, cap, buffer_size, max_age, max_items):
    """Streaming best-fit decreasing as the packing module's docstring states it, written plainly (a
    list scan per sample): the oracle of the inlined best fit."""
    sizes = [int(s) for s in sizes]
    items, load, born, open_, closed = [], [], [], [], []
    held, pos, window = 0, 0, 0
    limit, smallest = max(buffer_size // 2, 1), min(sizes) if sizes else 0
    while pos < len(sizes):
        end = min(len(sizes), pos + max(buffer_size - held, 1))
        for i in sorted(range(pos, end), key=lambda i: (-sizes[i], i)):
            fits = [b for b in open_ if cap - load[b] >= sizes[i]]
            if fits:
                b = min(fits, key=lambda b: (cap - load[b], b))
            else:
                b = len(items)
                items.append([])
                load.append(0)
                born.append(window)
                open_.append(b)
            items[b].append(i)
            load[b] += sizes[i]
            if max_items is not None and len(items[b]) >= max_items:
                open_.remove(b)
                closed.append(b)
                held -= len(items[b])
        held += end - pos
        pos = end
        by_room = sorted(open_, key=lambda b: (cap - load[b], b))
        for b in [b for b in by_room if cap - load[b] < smallest or born[b] <= window - max_age]:
            open_.remove(b)
            closed.append(b)
            held -= len(items[b])
        while held > limit and open_:
            b = min(open_, key=lambda b: (cap - load[b], b))
            open_.remove(b)
            closed.append(b)
            held -= len(items[b])
        window += 1
    return [items[b] for b in closed], [
        items[b] for b in sorted(open_, key=lambda b: (cap - load[b], b))
    ]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 64), min_size=1, max_size=300),
    cap=st.integers(64, 200),
    buffer_size=st.integers(2, 40),
    max_age=st.integers(1, 5),
    max_items=st.one_of(st.none(), st.integers(1, 6)),
    over=st.lists(st.integers(0, 299), max_size=3),
)
def test_best_fit_matches_reference(sizes, cap, buffer_size, max_age, max_items, over):
    """``over``: positions (modulo the stream's length) whose size is past ``cap`` (each a bin of
    its own, as the reference and the first-fit path place it)."""
    from prealign.loaders.plan.packing import StreamFit

    for p in over:
        sizes[p % len(sizes)] = cap + 1 + p % 7
    fit = StreamFit(
        np.asarray(sizes, np.int64),
        cap,
        buffer_size=buffer_size,
        best=True,
        max_age=max_age,
        max_items=max_items,
    )
    closed = fit.advance(len(sizes))
    still_open = [fit.bins.items[k & ((1 << 32) - 1)] for k in fit.bins.keys]
    assert (closed, still_open) == _reference_stream_fit(
        sizes, cap, buffer_size, max_age, max_items
    )
    whole = stream_fit(
        np.asarray(sizes, np.int64),
        cap,
        buffer_size=buffer_size,
        best=True,
        max_age=max_age,
        max_items=max_items,
    )
    assert sorted(i for b in whole for i in b) == list(range(len(sizes)))


@pytest.mark.parametrize("best", [False, True], ids=["first_fit", "best_fit"])
def test_a_sample_over_the_capacity_is_a_bin_of_its_own(best):
    """A size past ``cap`` (only a direct call can pass one: the planner refuses or cuts an
    oversize sample first) gets a bin of its own on both paths, as before the best fit was
    inlined; the inlined one made bins that took none of it, forever."""
    assert stream_fit(np.array([20, 4]), 16, buffer_size=8, best=best) == [[0], [1]]
    sizes = np.array([20, 4, 20, 3, 17, 1])
    got = stream_fit(sizes, 16, buffer_size=4, best=best)
    assert sorted(i for b in got for i in b) == list(range(len(sizes)))
    assert [b for b in got if sizes[b].sum() > 16] == [[0], [2], [4]]


def _calls(n: int, layout: ParallelLayout) -> int:
    lengths = np.random.default_rng(0).integers(8, 129, n)
    plan = ChunkedPlan(lengths, layout=layout, token_budget=8192, seed=1)
    prof = cProfile.Profile()
    prof.enable()
    plan.chunk(0)
    prof.disable()
    return pstats.Stats(prof).total_calls


@pytest.mark.parametrize(
    "layout", [ParallelLayout(tp=2, cp=2), ParallelLayout()], ids=["aligned-8", "unaligned"]
)
def test_chunk_plan_calls_per_sample(layout):
    """Planning one chunk (what a start and a resume pay) makes fewer than one function call per
    sample at the margin (every builtin counted): the best fit places a run of equal sizes a bin at
    a time, the micro-batches are assembled with a few numpy calls. Before: 11.4 calls per sample
    (two method calls of the open bins, a bisect and an insort per sample, a generator step per
    sample to assemble the micro-batches)."""
    _calls(1000, layout)  # (first calls: caches)
    small, big = _calls(4000, layout), _calls(16000, layout)
    assert (big - small) / 12000 <= 1.0, (small, big)
