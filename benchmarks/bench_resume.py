"""Resume deep into a 1M-sample epoch from sidecars, same and other DP sizes (issue #21);
``--stream``: the streaming loader resumed at sample 1M, by its reader cursors and by replaying the
stream (issue #28).

    python benchmarks/bench_resume.py [--size 1000000] [--dir DIR] [--at 0.9] [--json out.json]
    nice -n 10 python benchmarks/bench_resume.py --stream [--size 1100000] [--stream-at 1000000]
        [--rounds 3] [--replay-rounds N] [--elastic [--elastic-workers W]] [--mixture]

Data: ``--size`` pre-tokenized webdataset samples (int64 ``[8..128]`` tokens, 10k a shard, the
writer of ``bench_ttfb.py``) with sidecar indexes (``write_sidecars``, written once and kept in
``--dir``). Layout tp=2, cp=2, budget 8192, seed 0. A setup process plans the epoch at dp=4 and
finds the position ``p`` (micro-batches per rank) where ``--at`` of the epoch's samples have been
served; the state there is what a dp=4 run saves. Each phase then runs in a fresh process (no warm
caches but the OS page cache) and times, from nothing: the loader built from the sidecars
(``prepare``), ``load_state_dict`` and the first batch after it.

* ``same``     dp 4 -> 4 (today's resume: the plan up to ``p``)
* ``elastic``  dp 4 -> 3 (the dp-4 plan up to ``p``, what it served left out, the rest planned for
  dp 3)
* ``chained``  dp 4 -> 3 at half of ``p``'s samples -> 5 at ``p`` (two earlier segments to
  recompute)
* ``replay``   what replaying the skipped micro-batches would cost instead: the time to load 200
               micro-batches (one rank, no workers) times the ``p`` a rank skips, side by side

Target: resume (built + loaded + first batch) <= 5 s at 900k of 1M.

``--stream``: ``StreamingPackedLoader`` over the same kind of shards (``--size`` samples, no
sidecars: nothing is indexed), tp=2 cp=2, budget 8192, one rank, no workers, default buffer (1,024).
A setup process serves the stream until ``--stream-at`` samples are out and saves the state there
twice: ``state_dict(cursors=True)`` (``seek``) and ``state_dict()`` (``replay``, the path before
cursors; still what a state without cursors does). Each round runs both in fresh processes,
interleaved, and times build + ``load_state_dict`` + first batch; the first batches must be equal.
Reported: median [min..max] over rounds and the per-round ratio. Target: the seek <= 10 s at sample
1M.

``--stream --elastic``: the same shards served by both ranks of a dp-2 run (simulated one after the
other in the setup process) until ``--stream-at`` samples are out together; each rank's
``state_dict(cursors=True)`` merged (``merge_rank_states``: a version-5 state, what
``state_dict(cursors="all")`` gathers) and the plain state saved. Each round resumes both on one
rank with ``--elastic-workers`` workers, in fresh processes, interleaved: ``skip`` (the consumed
shards skipped, the partly consumed ones entered by seek) and ``replay`` (every old rank's stream
replayed, ids only, as an elastic resume did before). Target (issue #28): <= 5 µs per served
sample, or skipped.

``--stream --mixture`` (with or without ``--elastic``): the same shards as a 2-component
:class:`~prealign.loaders.Mixture` (the first half of the shards ``a``, the rest ``b``, weighted 0.6
/ 0.4 by tokens): the seek reads each component's stream from its own cursor and restores the
interleave. Target: the seek <= 10 s at sample 1M. The replay grows with the position: measure it
at a smaller ``--stream-at`` (or in ``--replay-rounds 1``) and scale by the samples served.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_ttfb import write_text_shards  # noqa: E402

_COMMON = """
import json, time
from itertools import islice
from prealign.loaders import PackedLoader, WebDatasetSource
from prealign.schemas import ParallelLayout, causal_lm_schema
paths = {paths!r}
def make(dp, rank=0):
    return PackedLoader(WebDatasetSource(paths, sidecars=True), schema=causal_lm_schema(),
                        layout=ParallelLayout(tp=2, cp=2), token_budget=8192, dp_size=dp,
                        dp_rank=rank, cp_rank=0)
"""

_SETUP = (
    _COMMON
    + """
def first_position(loader, target, base=0):
    # the first position of the loader's (current) plan where base + the samples served reach target
    ep = loader._schedule._epoch(loader.epoch)  # (a benchmark peeks; the library never needs to)
    lo, hi = 0, len(loader)
    while lo < hi:
        mid = (lo + hi) // 2
        if base + int(ep.samples_before(mid).size) < target:
            lo = mid + 1
        else:
            hi = mid
    return lo, base + int(ep.samples_before(lo).size)
a = make(4).prepare()
p, served = first_position(a, {target})
base = a.state_dict()
q, half = first_position(a, {target} // 2)
b = make(3)
b.load_state_dict({{**base, "position": q}})
r, _ = first_position(b, {target}, half)
result = {{"state": {{**base, "position": p}}, "chained": {{**b.state_dict(), "position": r}},
          "position": p, "per_rank": len(a), "served": served, "half_position": q,
          "second_position": r}}
"""
)

_RESUME = (
    _COMMON
    + """
state = json.loads({state!r})
t0 = time.perf_counter()
loader = make({dp}).prepare()
t1 = time.perf_counter()
loader.load_state_dict(state)
t2 = time.perf_counter()
batch = next(iter(loader))
t3 = time.perf_counter()
result = {{"prepare_s": t1 - t0, "load_state_s": t2 - t1, "first_batch_s": t3 - t2,
          "total_s": t3 - t0, "microbatch": batch["microbatch"],
          "state_after": loader.state_dict()}}
"""
)

_REPLAY = (
    _COMMON
    + """
loader = make(4).prepare()
it = iter(loader)
next(it)
t0 = time.perf_counter()
k = sum(1 for _ in islice(it, 200))
result = {{"per_microbatch_s": (time.perf_counter() - t0) / k}}
"""
)


_STREAM_COMMON = """
import json, time
from prealign.loaders import Mixture, StreamingPackedLoader, WebDatasetSource
from prealign.schemas import ParallelLayout, causal_lm_schema
paths = {paths!r}
def source():
    if not {mixture!r}:
        return WebDatasetSource(paths)
    half = len(paths) // 2  # two components, weighted 0.6 / 0.4 by tokens
    return Mixture({{"a": (WebDatasetSource(paths[:half]), 0.6),
                    "b": (WebDatasetSource(paths[half:]), 0.4)}}, by="tokens")
def make(dp=1, rank=0, workers=0):
    return StreamingPackedLoader(source(), schema=causal_lm_schema(),
                                 layout=ParallelLayout(tp=2, cp=2), token_budget=8192, cp_rank=0,
                                 dp_size=dp, dp_rank=rank, num_workers=workers)
"""

_ELASTIC_SETUP = (
    _STREAM_COMMON
    + """
from itertools import islice
from prealign.loaders.streaming import merge_rank_states
# both ranks of a dp-2 run (simulated one after the other) serve p micro-batches, p the first
# position where they served {target} samples together (rank 0's count doubled to find it)
t0 = time.perf_counter()
counts = []
for batch in make(2, 0):
    counts.append(int(batch["sample_index"].numel()))
    if 2 * sum(counts) >= {target}:
        break
p, states, served = len(counts), [], 0
for rank in range(2):
    a = make(2, rank)
    it = iter(a)
    served += sum(int(b["sample_index"].numel()) for b in islice(it, p))
    states.append(a.state_dict(cursors=True))
    plain = a.state_dict()
    it.close()
result = {{"skip": merge_rank_states(states), "replay": plain, "served": served, "position": p,
          "serve_s": time.perf_counter() - t0}}
"""
)

_STREAM_SETUP = (
    _STREAM_COMMON
    + """
a = make()
served, t0 = 0, time.perf_counter()
for batch in a:
    served += int(batch["sample_index"].numel())
    if served >= {target}:
        break
result = {{"seek": a.state_dict(cursors=True), "replay": a.state_dict(), "served": served,
          "serve_s": time.perf_counter() - t0}}
"""
)

_STREAM_RESUME = (
    _STREAM_COMMON
    + """
state = json.loads({state!r})
t0 = time.perf_counter()
loader = make(workers={workers})
loader.load_state_dict(state)
t1 = time.perf_counter()
batch = next(iter(loader))
t2 = time.perf_counter()
result = {{"load_state_s": t1 - t0, "first_batch_s": t2 - t1, "total_s": t2 - t0,
          "first_ids": batch["sample_index"].tolist(), "microbatch": batch["microbatch"]}}
"""
)


def _spread(xs: list[float]) -> str:
    """``median [min..max]``."""
    s = sorted(xs)
    mid = s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2
    return f"{mid:.2f} [{s[0]:.2f}..{s[-1]:.2f}]"


def _stream_setup(args, name: str, setup_code: str) -> tuple[list[str], dict]:
    """The shards and the setup's states (run once, kept in ``--dir``)."""
    root = os.path.join(args.dir, f"stream-{args.size}")
    paths = write_text_shards(root, args.size)
    kind = "-mixture" if args.mixture else ""
    cached = os.path.join(root, f"{name}{kind}-{args.stream_at}.json")
    if not os.path.exists(cached):
        code = setup_code.format(paths=paths, target=args.stream_at, mixture=args.mixture)
        setup = _phase(code)
        with open(cached + ".part", "w") as f:
            json.dump(setup, f)
        os.replace(cached + ".part", cached)
    with open(cached) as f:
        return paths, json.load(f)


def _interleaved(args, paths, setup, names, workers: int) -> tuple[dict, int]:
    """``--rounds`` rounds, each resuming ``setup[name]`` for both names in fresh processes (the
    second, the replay, only in the first ``--replay-rounds``); (rounds by name, replay rounds)."""
    rounds: dict[str, list[dict]] = {n: [] for n in names}
    replays = args.rounds if args.replay_rounds is None else args.replay_rounds
    for i in range(args.rounds):
        for name in names[: 2 if i < replays else 1]:
            code = _STREAM_RESUME.format(
                paths=paths, state=json.dumps(setup[name]), workers=workers, mixture=args.mixture
            )
            rounds[name].append(_phase(code))
    return rounds, replays


def stream_main(args) -> int:
    """The streaming loader resumed at ``--stream-at`` samples: cursors (seek) vs replay,
    interleaved rounds."""
    if args.stream_at >= args.size:
        raise SystemExit(f"--stream-at {args.stream_at} must be below --size {args.size}")
    if args.elastic:
        return elastic_main(args)
    paths, setup = _stream_setup(args, "states", _STREAM_SETUP)
    rounds, replays = _interleaved(args, paths, setup, ("seek", "replay"), 0)
    for s, r in zip(rounds["seek"], rounds["replay"]):
        if s["first_ids"] != r["first_ids"]:
            raise SystemExit("the seek and the replay resumed at different batches")
    position = setup["seek"]["position"]
    what = "a 2-component Mixture (0.6 / 0.4 by tokens) of " if args.mixture else ""
    print(
        f"StreamingPackedLoader over {what}{args.size:,} samples in {len(paths)} shards, "
        f"resumed at "
        f"micro-batch {position} ({setup['served']:,} samples served; serving them took "
        f"{setup['serve_s']:.0f} s), {args.rounds} rounds (replay: {replays}), median [min..max]\n"
    )
    ratios = _table("resume", rounds, setup["served"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "served": setup["served"],
                    "position": position,
                    "rounds": rounds,
                    "ratios": ratios,
                },
                f,
                indent=1,
            )
    return 0


def elastic_main(args) -> int:
    """``--stream --elastic``: a dp-2 stream state resumed on one rank (``--elastic-workers``
    DataLoader workers): skipping what the old readers consumed (a merged version-5 state) vs
    replaying both old ranks (a plain state, what an elastic resume did before), interleaved."""
    paths, setup = _stream_setup(args, "elastic", _ELASTIC_SETUP)
    rounds, replays = _interleaved(args, paths, setup, ("skip", "replay"), args.elastic_workers)
    served = setup["served"]
    what = "a 2-component Mixture (0.6 / 0.4 by tokens) of " if args.mixture else ""
    print(
        f"StreamingPackedLoader over {what}{args.size:,} samples in {len(paths)} shards, a dp-2 "
        f"state at "
        f"micro-batch {setup['position']} of each rank ({served:,} samples served) resumed at "
        f"dp 1 with {args.elastic_workers} workers, {args.rounds} rounds (replay: {replays}), "
        f"median [min..max]\n"
    )
    ratios = _table("elastic resume", rounds, served)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"served": served, "rounds": rounds, "ratios": ratios}, f, indent=1)
    return 0


def _table(what: str, rounds: dict[str, list[dict]], served: int) -> list[float]:
    """Print the rounds of two contenders (the fast one first, ``replay`` second) as a table of
    median [min..max] and their per-round ratio; returns the ratios."""
    fast, slow = rounds
    print(
        f"| {what} | load_state_dict | first batch | total | per served sample |\n"
        "|---|---|---|---|---|"
    )
    for name, rs in rounds.items():
        if not rs:
            continue
        load = _spread([r["load_state_s"] for r in rs])
        first = _spread([r["first_batch_s"] for r in rs])
        total = _spread([r["total_s"] for r in rs])
        per = _spread([r["total_s"] / served * 1e6 for r in rs])
        print(f"| {name} | {load} s | {first} s | {total} s | {per} µs |")
    ratios = [r["total_s"] / s["total_s"] for s, r in zip(rounds[fast], rounds[slow])]
    if ratios:
        print(f"\n{slow} / {fast} per round: {_spread(ratios)}x")
    return ratios


def state_size_main(args) -> int:
    """``--state-size``: the bytes of a version-5 state (``state_dict(cursors="all")``) as a
    function of DP ranks, workers and ``buffer_size``. One rank's real ``state_dict(cursors=True)``
    (a stream of ``[8..128]``-token samples served until every reader's buffer is full) is copied
    to every rank (``dp_rank`` changed) and merged with ``merge_rank_states``, as the gather does;
    its JSON size is what the all-gather delivers to every rank, and what ``dst`` delivers to one.
    ``lists``: the same state with its samples as lists (version 5); ``packed``: as written
    (version 6, one int array per reader).
    """
    from itertools import islice

    from prealign.loaders import StreamingPackedLoader, WebDatasetSource
    from prealign.loaders.plan.planner import PlannerConfig
    from prealign.loaders.state import unpack_cursor
    from prealign.loaders.streaming import merge_rank_states
    from prealign.schemas import ParallelLayout, causal_lm_schema

    paths = write_text_shards(os.path.join(args.dir, "size-40000"), 40_000, per_shard=2_000)
    print(
        "| DP ranks | workers | buffer_size | merged, lists (v5) | merged, packed (v6) | "
        "each rank receives: all-gather | with dst (the others) |\n|---|---|---|---|---|---|---|"
    )
    for workers, buffer in ((1, 256), (8, 256), (8, 1024)):
        loader = StreamingPackedLoader(
            WebDatasetSource(paths),
            schema=causal_lm_schema(),
            layout=ParallelLayout(tp=2, cp=2),
            token_budget=8192,
            cp_rank=0,
            dp_size=1,
            dp_rank=0,
            num_workers=workers,
            planner=PlannerConfig(buffer_size=buffer),
        )
        it = iter(loader)
        list(islice(it, 4 * workers))
        own = loader.state_dict(cursors=True)
        it.close()
        for ranks in (8, 64, 512):
            per = [
                {
                    **own,
                    "config": {**own["config"], "dp_size": ranks},
                    "cursors": {**own["cursors"], "dp_rank": r, "dp_size": ranks},
                }
                for r in range(ranks)
            ]
            merged = merge_rank_states(per)
            lists = [
                {**e, "readers": [unpack_cursor(c, "") for c in e["readers"]]}
                for e in merged["stream"]["ranks"]
            ]
            plain = len(json.dumps({**merged, "stream": {**merged["stream"], "ranks": lists}}))
            packed = len(json.dumps(merged))
            print(
                f"| {ranks} | {workers} | {buffer} | {plain / 1e6:.1f} MB | {packed / 1e6:.1f} MB "
                f"| {packed / 1e6:.1f} MB (v5: {plain / 1e6:.1f} MB) | 0 |"
            )
    return 0


def _phase(code: str) -> dict:
    prog = code + "\nprint('RESULT' + json.dumps(result))"
    out = subprocess.run(
        [sys.executable, "-c", prog], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.rsplit("RESULT", 1)[1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1_000_000)
    ap.add_argument(
        "--at", type=float, default=0.9, help="fraction of the epoch's samples served at the state"
    )
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "prealign-bench-resume"))
    ap.add_argument("--workers", type=int, default=2, help="processes writing the sidecars")
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument(
        "--stream",
        action="store_true",
        help="the streaming loader's resume instead (see the docstring)",
    )
    ap.add_argument(
        "--stream-at", type=int, default=1_000_000, help="samples served at the streaming state"
    )
    ap.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds of the streaming resume"
    )
    ap.add_argument(
        "--replay-rounds", type=int, help="of which the replay runs in the first N (default: all)"
    )
    ap.add_argument(
        "--elastic",
        action="store_true",
        help="with --stream: a dp-2 state resumed at dp 1, skip vs replay (see the docstring)",
    )
    ap.add_argument(
        "--elastic-workers", type=int, default=0, help="DataLoader workers of the elastic resume"
    )
    ap.add_argument(
        "--mixture",
        action="store_true",
        help="with --stream: the shards as a 2-component Mixture (see the docstring)",
    )
    ap.add_argument(
        "--state-size",
        action="store_true",
        help="the size of a gathered stream state by ranks, workers and buffer (see its docstring)",
    )
    args = ap.parse_args()
    if args.state_size:
        return state_size_main(args)
    if args.stream:
        return stream_main(args)
    paths = write_text_shards(os.path.join(args.dir, f"text-{args.size}"), args.size)
    if not all(os.path.exists(p + ".prealign-index.npz") for p in paths):
        from prealign.loaders import WebDatasetSource
        from prealign.loaders.index.header_pass import write_sidecars
        from prealign.schemas import causal_lm_schema

        write_sidecars(WebDatasetSource(paths), causal_lm_schema(), workers=args.workers)
    setup = _phase(_SETUP.format(paths=paths, target=int(args.at * args.size)))
    runs = {
        "same": _phase(_RESUME.format(paths=paths, dp=4, state=json.dumps(setup["state"]))),
        "elastic": _phase(_RESUME.format(paths=paths, dp=3, state=json.dumps(setup["state"]))),
        "chained": _phase(_RESUME.format(paths=paths, dp=5, state=json.dumps(setup["chained"]))),
    }
    replay = _phase(_REPLAY.format(paths=paths))
    replay_s = replay["per_microbatch_s"] * setup["position"]
    print(
        f"{args.size:,} samples; state at micro-batch {setup['position']} of {setup['per_rank']} "
        f"per rank (dp 4), "
        f"{setup['served']:,} samples served; chained: dp 4 for {setup['half_position']}, dp 3 for "
        f"{setup['second_position']}\n"
    )
    print(
        "| resume | build from sidecars | load_state_dict | first batch | total | replaying "
        "instead |\n|---|---|---|---|---|---|"
    )
    for name, label in (
        ("same", "dp 4 -> 4"),
        ("elastic", "dp 4 -> 3"),
        ("chained", "dp 4 -> 3 -> 5"),
    ):
        r = runs[name]
        print(
            f"| {label} | {r['prepare_s']:.2f} s | {r['load_state_s']:.2f} s | "
            f"{r['first_batch_s']:.3f} s | "
            f"{r['total_s']:.2f} s | {replay_s:.0f} s ({replay_s / r['total_s']:.0f}x) |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "setup": {k: v for k, v in setup.items() if k not in ("state", "chained")},
                    "runs": runs,
                    "replay": {**replay, "estimated_s": replay_s},
                },
                f,
                indent=1,
                default=str,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
