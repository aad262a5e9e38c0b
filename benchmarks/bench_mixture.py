"""Mixtures: plan time to the first batch, and realized shares per step against Megatron's
BlendedDataset.

(a) Time to the first micro-batch's request (what a loader does before its first batch once the
    index is in memory: the epoch's order, the oversize screening and the first chunk's plan) for a
    3-component ``Mixture`` of N samples each vs one source of 3N samples with the same lengths;
    median [min..max] over interleaved rounds, and their ratio (target <= 1.2). Equal work:
    ``by="samples"``, weights 1/3 each (3N draws, as the single source's epoch). Then, for scale,
    ``by="tokens"`` with 0.6 / 0.3 / 0.1 on mean lengths 100 / 1,000 / 4,000: the 100-token
    component is up-sampled ~30x to hold 60% of the tokens, so that epoch has ~11x the draws (its
    time is printed with its draw count; no ratio).
(b) Realized token share per window of 16 global steps (DP 2, budget 8,192) of three components of
    mean lengths 100 / 1,000 / 4,000 tokens (uniform +-50%), token weights 0.6 / 0.3 / 0.1: ours,
    and megatron-core's ``BlendedDataset`` index (``helpers.build_blending_indices``) given sample
    weights converted by hand from the token weights by the mean lengths, its order packed by the
    same planner. Max absolute deviation from the weight over the epoch and over any 16-step window.

    .venv/bin/python benchmarks/bench_mixture.py [--samples 1000000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from prealign.loaders.index.sample_index import SampleIndex
from prealign.loaders.mixture import Mixture, steps_served
from prealign.loaders.plan.mixing import MixSpec, mixed_order, window_shares
from prealign.loaders.plan.planner import PlannerConfig
from prealign.loaders.plan.schedule import Schedule
from prealign.loaders.policy import BadDataReport, PackStrategy
from prealign.loaders.sources.source import Source
from prealign.schemas.layout import ParallelLayout

WEIGHTS = (0.6, 0.3, 0.1)


class _Unread(Source):
    """A placeholder component: planning reads index lengths only."""

    num_shards = 1

    def scan(self, shard):
        return iter(())

    def read(self, location):
        raise NotImplementedError

    def describe(self):
        return {"kind": "bench"}


def _part(lengths: np.ndarray) -> SampleIndex:
    n = lengths.size
    return SampleIndex(
        lengths=lengths.astype(np.int64),
        locations=np.arange(n, dtype=np.int64)[:, None],
        shards=np.zeros(n, np.int64),
        report=BadDataReport(),
    )


def _lengths(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(50, 151, n), rng.integers(500, 1501, n), rng.integers(3000, 5001, n)]


def _schedule(index: SampleIndex, order_of, strategy, dp=2, budget=8192) -> Schedule:
    return Schedule(
        index,
        layout=ParallelLayout(),
        token_budget=budget,
        dp_size=dp,
        planner=PlannerConfig(strategy=strategy),
        seed=0,
        shuffle=True,
        sequential=False,
        window=1,
        step_window=1 if order_of else None,
        order_of=order_of,
    )


def first_batch(parts, mixed: bool, by: str = "samples") -> tuple[float, float]:
    """(wall s, CPU s) to the first micro-batch's request."""
    t, c = time.perf_counter(), time.process_time()
    if mixed:
        weights = WEIGHTS if by == "tokens" else (1 / 3, 1 / 3, 1 / 3)
        mix = Mixture({n: (_Unread(), w) for n, w in zip("abc", weights)}, by=by)
        index = mix.merged(parts)
        sch = _schedule(
            index,
            lambda e, served: mix.epoch_order(e, seed=0, shuffle=True, window=1, served=served),
            PackStrategy.STEP_FIT,
        )
    else:
        index = _part(np.concatenate([p.lengths for p in parts]))
        sch = _schedule(index, None, PackStrategy.BFD)
    sch.screening()
    next(iter(sch(0, 0)))
    return time.perf_counter() - t, time.process_time() - c


def deviations(ids, bounds, comp_of, lengths):
    comp, units = comp_of[ids], lengths[ids]
    epoch = window_shares(comp, units, np.array([0]), np.array([ids.size]), 3)[0]
    n = bounds.size - 1
    win = window_shares(comp, units, bounds[: n - 15], bounds[16:], 3)
    return np.abs(epoch - WEIGHTS).max(), np.abs(win - WEIGHTS).max(axis=0)


def shares_vs_megatron():
    from megatron.core.datasets import helpers

    lengths = _lengths(20000)
    lengths = [lengths[0], lengths[1][:2000], lengths[2][:500]]
    parts = [_part(x) for x in lengths]
    mix = Mixture({n: (_Unread(), w) for n, w in zip(("web", "code", "math"), WEIGHTS)})
    index = mix.merged(parts)
    comp_of, flat = mix.component_of(), index.lengths
    ours = _schedule(
        index,
        lambda e, s: mix.epoch_order(e, seed=0, shuffle=True, window=1, served=s),
        PackStrategy.STEP_FIT,
    )
    ids, bounds = steps_served(ours, 0)
    o_epoch, o_win = deviations(ids, bounds, comp_of, flat)
    w = np.array(WEIGHTS) / np.array([x.mean() for x in lengths])
    w /= w.sum()
    size = ids.size
    d_idx, s_idx = np.zeros(size, np.int16), np.zeros(size, np.int64)
    helpers.build_blending_indices(d_idx, s_idx, w, 3, size, False)
    streams = [
        mixed_order(
            MixSpec(names=("x",), weights=(1.0,), by="samples", length=size),
            [x],
            epoch=0,
            seed=0,
            shuffle=True,
        ).ids
        for x in lengths
    ]
    offsets = np.cumsum([0] + [len(x) for x in lengths])
    theirs_order = np.array([offsets[d] + streams[d][j] for d, j in zip(d_idx, s_idx)])
    theirs = _schedule(index, lambda e, s: theirs_order, PackStrategy.STEP_FIT)
    t_epoch, t_win = deviations(*steps_served(theirs, 0), comp_of, flat)
    print(
        "(b) token share deviation from 0.6 / 0.3 / 0.1, DP 2, budget 8192, windows of 16 global "
        "steps"
    )
    print(
        f"    prealign Mixture(by='tokens'):          epoch {o_epoch:.4f}, 16-step windows "
        f"{np.round(o_win, 4).tolist()} (max {o_win.max():.4f})"
    )
    print(
        f"    Megatron BlendedDataset (hand weights):  epoch {t_epoch:.4f}, 16-step windows "
        f"{np.round(t_win, 4).tolist()} (max {t_win.max():.4f})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--samples", type=int, default=1_000_000, help="samples per component [%(default)s]"
    )
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    parts = [_part(x) for x in _lengths(args.samples)]
    times = {True: [], False: []}
    for r in range(args.rounds):  # interleaved, the order alternating
        for mixed in (False, True) if r % 2 == 0 else (True, False):
            times[mixed].append(first_batch(parts, mixed))

    def fmt(v):
        return f"{np.median(v):.3f} s [{min(v):.3f}..{max(v):.3f}]"

    print(f"(a) first micro-batch, 3 x {args.samples} samples, {args.rounds} interleaved rounds:")
    for i, what in ((0, "wall"), (1, "CPU")):
        mix, one = [t[i] for t in times[True]], [t[i] for t in times[False]]
        ratio = [m / s for m, s in zip(mix, one)]
        print(
            f"    {what}: mixture {fmt(mix)}, one source of {3 * args.samples} {fmt(one)}; "
            f"per-round ratio {np.median(ratio):.2f} [{min(ratio):.2f}..{max(ratio):.2f}] "
            f"(target <= 1.2)"
        )
    t = [first_batch(parts, True, "tokens") for _ in range(max(1, args.rounds // 2))]
    print(
        f"    by='tokens' 0.6 / 0.3 / 0.1 (~{_draws(parts) / 1e6:.0f}M draws in the epoch): "
        f"wall {fmt([x[0] for x in t])}, CPU {fmt([x[1] for x in t])}"
    )
    shares_vs_megatron()


def _draws(parts) -> int:
    mix = MixSpec(names=("a", "b", "c"), weights=WEIGHTS, by="tokens")
    return int(mixed_order(mix, [p.lengths for p in parts], epoch=0, seed=0, shuffle=True).ids.size)


if __name__ == "__main__":
    main()
