"""Equal work, not equal tokens: step-cost balance, hybrid CP and plan time, on one long-tail length
set.

Lengths: N lognormal(log 2048, 1.0) clipped to 512..32768 (seed 0); budget 32768 tokens per
micro-batch, k = 2 micro-batches per rank per step; cost 24576*L + L**2 per sequence (verl's 7B
constants).

(a) step-cost imbalance, dp = 8: sum over steps of the slowest rank's cost / sum of the mean (worst
    step in brackets), for the token-balanced plan, the compute-balanced one
    (``PlannerConfig(cost=...)``) and megatron-core 0.16.1's ``BalancedCPScheduler`` scheduling each
    step's samples (CP off: every sample on one rank; its groups run one after the other, so a step
    costs the sum of each group's slowest rank). Then dp = 2, cp = 4 (same 8 ranks): predicted step
    makespan (sum over steps of the slowest DP rank, a micro-batch taking its slowest CP block) of
    fixed CP, of the loader's hybrid CP (``assign_cp_blocks``) and of ``BalancedCPScheduler`` over
    the 8 DP x CP ranks (``max_seq_len_per_rank = budget / cp``), all with one time model: a
    sequence of L tokens on k ranks takes ``cost(L)/k + 0.05 * 24576 * L * (k-1)/k``. Relative to
    the ideal (total / ranks).
(b) CPU proof, dp = 4 gloo processes (one thread each) run their own micro-batches step by step (an
    all-gather of the step's times ends each step), lengths and budget scaled by 1/8 (64..4096,
    budget 4096). Two workloads: ``attention``, torch sdpa causal over each sequence of the
    micro-batch (hidden 128, 4 heads), and ``layer``, a whole transformer layer (QKV, attention,
    output projection, MLP; the matmuls over the packed micro-batch at once). The cost model is
    fitted to this layer's measured time (``--flops`` uses ``CostModel.from_hf_config`` instead).
    Step time = the slowest rank's CPU time in the step (the CPU time of each rank, not wall time:
    this machine's cores are shared, and ranks queueing for a core would hide the imbalance); wall
    time is printed too. The two plans run alternately over ``--cpu-rounds`` rounds in the same
    processes: median [min..max] and the per-round ratio.
(c) plan time per global batch of 512 samples (whole plan of the set, one core), tokens vs compute,
    CPU (``time.process_time``) and wall, median [min..max] of ``--rounds`` interleaved rounds.
(d) collation per CP rank in the loader, cp = 4: a fixed-CP rank's ``THDCollator`` vs hybrid CP's
    ``HybridCPCollator`` (``PlannerConfig(hybrid_cp=True)``: the whole micro-batch collated as a
    fixed-CP rank, then the rank's block again when the micro-batch splits), summed over every rank
    and 48 micro-batches spread over the compute-balanced plan, side by side over ``--rounds``
    interleaved rounds (CPU and wall, median [min..max], the per-round ratio); and the block
    assignment alone.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import time
import warnings

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from prealign.loaders import CostModel, plan_microbatches  # noqa: E402
from prealign.loaders.plan.hybrid_cp import assign_cp_blocks, predicted_time, sequence_time  # noqa: E402
from prealign.schemas import ParallelLayout  # noqa: E402

COST = CostModel(linear=24576, quadratic=1)
COMM = 0.05


def long_tail(n: int, seed: int = 0, scale: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (np.clip(rng.lognormal(np.log(2048), 1.0, n), 512, 32768) // scale).astype(np.int64)


def steps_of(plan):
    """[(step, rank, [micro-batches])]: each step's micro-batches per rank."""
    bounds = np.cumsum((0,) + plan.steps)
    return [
        [list(rank[a:b]) for rank in plan.microbatches] for a, b in zip(bounds[:-1], bounds[1:])
    ]


def imbalance(step_rank_cost) -> tuple[float, float]:
    worst, total_max, total_mean = 1.0, 0.0, 0.0
    for ranks in step_rank_cost:
        ranks = np.asarray(ranks, dtype=np.float64)
        total_max, total_mean = total_max + ranks.max(), total_mean + ranks.mean()
        worst = max(worst, ranks.max() / ranks.mean())
    return total_max / total_mean, worst


class _Group:
    """What ``BalancedCPScheduler`` reads of its process group: the size (no communication
    happens)."""

    def __init__(self, n: int):
        self.n = n

    def size(self) -> int:
        return self.n


def megatron_step_time(lengths, ranks: int, max_per_rank: int, time_of) -> tuple[float, float]:
    """(makespan, total) of one step's samples under megatron-core's BalancedCPScheduler."""
    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
        warnings.simplefilter("ignore")
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    sched = BalancedCPScheduler(max_seq_len_per_rank=max_per_rank, dp_cp_group=_Group(ranks))
    _, id_groups = sched.get_groups_and_subsamples(
        [(i, int(n)) for i, n in enumerate(lengths)], None
    )
    makespan, placed = 0.0, set()
    for group in id_groups:
        holders: dict[int, int] = {}
        for ids in group:
            for i in ids:
                holders[i] = holders.get(i, 0) + 1
        per_rank = [sum(time_of(lengths[i], holders[i]) for i in ids) for ids in group]
        makespan += max(per_rank, default=0.0)
        placed |= set(holders)
    assert placed == set(range(len(lengths))), "megatron-core's schedule lost samples"
    return makespan, sum(time_of(n, 1) for n in lengths)


def part_a(lengths) -> None:
    kw = dict(
        layout=ParallelLayout(), token_budget=32768, dp_size=8, microbatches_per_step=2, seed=0
    )
    plans = {
        "tokens": plan_microbatches(lengths, **kw),
        "compute": plan_microbatches(lengths, cost=COST, **kw),
    }
    print(f"(a) {len(lengths)} samples, dp=8, k=2, budget 32768, cost 24576*L + L^2")
    for name, plan in plans.items():
        costs = [
            [sum(COST.of(lengths[list(mb)]).sum() for mb in rank) for rank in step]
            for step in steps_of(plan)
        ]
        avg, worst = imbalance(costs)
        print(
            f"    {name:<28} step cost max/mean {avg:.3f} (worst step {worst:.3f}), "
            f"{len(plan.steps)} steps"
        )
    step_time = lambda n, k: float(COST.of([n])[0]) / k  # noqa: E731  (DP only: every sample on one rank)
    costs = []
    for step in steps_of(plans["tokens"]):
        samples = [i for rank in step for mb in rank for i in mb]
        makespan, total = megatron_step_time(lengths[samples], 8, 32768, step_time)
        costs.append((makespan, total / 8))
    total_max, total_mean = map(sum, zip(*costs))
    print(
        f"    {'megatron BalancedCPScheduler':<28} step cost max/mean "
        f"{total_max / total_mean:.3f} (same steps' samples, "
        f"worst {max(a / b for a, b in costs):.3f})"
    )

    dp, cp, budget = 2, 4, 32768
    layout = ParallelLayout(cp=cp)
    plan = plan_microbatches(
        lengths,
        layout=layout,
        token_budget=budget,
        dp_size=dp,
        microbatches_per_step=2,
        seed=0,
        cost=COST,
    )
    t = lambda n, k: float(sequence_time([n], k, COST, COMM)[0])  # noqa: E731
    fixed = hybrid = meg = ideal = 0.0
    splits = 0
    for step in steps_of(plan):
        fixed += max(
            sum(float(sequence_time(lengths[list(mb)], cp, COST, COMM).sum()) for mb in rank)
            for rank in step
        )
        rank_times = []
        for rank in step:
            total = 0.0
            for mb in rank:
                blocks = assign_cp_blocks(
                    lengths[list(mb)],
                    layout=layout,
                    token_budget=budget,
                    cost=COST,
                    comm_ratio=COMM,
                )
                splits += len(blocks) > 1
                total += predicted_time(lengths[list(mb)], blocks, COST, COMM)
            rank_times.append(total)
        hybrid += max(rank_times)
        samples = [i for rank in step for mb in rank for i in mb]
        makespan, total = megatron_step_time(lengths[samples], dp * cp, budget // cp, t)
        meg += makespan
        ideal += total / (dp * cp)
    n_mb = sum(plan.steps) * dp
    print(
        f"    dp={dp} x cp={cp}, predicted step makespan / ideal (sum over {len(plan.steps)} "
        f"steps):"
    )
    print(
        f"      fixed CP {fixed / ideal:.3f}   hybrid CP (loader) {hybrid / ideal:.3f} "
        f"({splits}/{n_mb} micro-batches "
        f"split, 0 collectives)   megatron BalancedCPScheduler {meg / ideal:.3f} (all-gather + "
        f"all-to-all per step)"
    )


# ---- (b) the CPU proof
# ----------------------------------------------------------------------------------
HIDDEN, HEADS, SCALE = 128, 4, 8


def _workload(kind: str, seed: int = 0):
    """``run(lengths)``: one micro-batch, packed THD. ``attention``: causal sdpa sequence by
    sequence (what a varlen kernel does) on random q, k, v. ``layer``: a whole transformer layer,
    the projections and MLP over the micro-batch's tokens at once, the attention sequence by
    sequence."""
    import torch

    g = torch.Generator().manual_seed(seed)
    w = {
        name: torch.randn(shape, generator=g) / shape[0] ** 0.5
        for name, shape in (
            ("qkv", (HIDDEN, 3 * HIDDEN)),
            ("out", (HIDDEN, HIDDEN)),
            ("up", (HIDDEN, 4 * HIDDEN)),
            ("down", (4 * HIDDEN, HIDDEN)),
        )
    }

    def attention(qkv, lengths):
        out, start = [], 0
        for n in lengths:
            q, k, v = qkv[:, :, start : start + n].unsqueeze(1)
            out.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)[0])
            start += n
        return torch.cat(out, 1)

    def run(lengths) -> None:
        total = int(sum(lengths))
        if kind == "attention":
            attention(torch.randn(3, HEADS, total, HIDDEN // HEADS), lengths)
            return
        x = torch.randn(total, HIDDEN)
        qkv = (
            (x @ w["qkv"]).view(-1, 3, HEADS, HIDDEN // HEADS).permute(1, 2, 0, 3)
        )  # [3, heads, T, d]
        x = x + attention(qkv, lengths).permute(1, 0, 2).reshape(-1, HIDDEN) @ w["out"]
        _ = x + torch.nn.functional.gelu(x @ w["up"]) @ w["down"]

    return run


def fitted_cost(kind: str) -> CostModel:
    """linear and quadratic (ns) of the workload's measured CPU time, least squares over a few
    lengths."""
    import torch

    torch.set_num_threads(1)
    run = _workload(kind)
    sizes, times = [64, 512, 1024, 2048, 3072, 4096], []
    with torch.no_grad():
        for n in sizes:
            run([n])
            reps = []
            for _ in range(5):
                t = time.thread_time()
                run([n])
                reps.append(time.thread_time() - t)
            times.append(float(np.median(reps)))
    a = np.array([[n, n * n] for n in sizes], dtype=np.float64)
    (linear, quadratic), *_ = np.linalg.lstsq(a, np.array(times), rcond=None)
    return CostModel(linear=max(linear, 1e-12) * 1e9, quadratic=max(quadratic, 0.0) * 1e9)


def _rank(
    rank: int, world: int, port: int, kind: str, plans: dict, lengths, rounds: int, out
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
    )
    run = _workload(kind)
    result = {name: [] for name in plans}
    names = list(plans)
    with torch.no_grad():
        run([256])
        for r in range(rounds):  # interleaved, the order alternating
            for name in names if r % 2 == 0 else names[::-1]:
                result[name].append(_steps(run, plans[name], rank, world, lengths))
    if rank == 0:
        out.update(result)
    dist.destroy_process_group()


def _steps(run, steps, rank: int, world: int, lengths) -> tuple[float, float]:
    """(sum over steps of the slowest rank's CPU s, wall s) of one pass over ``steps``."""
    import torch
    import torch.distributed as dist

    cpu = []
    dist.barrier()
    wall = time.perf_counter()
    for step in steps:
        t = time.thread_time()
        for mb in step[rank]:
            if mb:
                run(lengths[list(mb)].tolist())
        mine = torch.tensor([time.thread_time() - t], dtype=torch.float64)
        every = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(every, mine)  # the step's end: every rank waits for the slowest
        cpu.append(max(float(e) for e in every))
    return sum(cpu), time.perf_counter() - wall


def part_b(n: int, flops: bool, rounds: int = 3) -> None:
    import torch.multiprocessing as mp
    from transformers import GPT2Config

    lengths = long_tail(n, seed=1, scale=SCALE)
    budget = 32768 // SCALE
    print(
        f"(b) CPU proof: {n} samples ({lengths.min()}..{lengths.max()} tokens), dp=4, k=2, budget "
        f"{budget}"
    )
    for kind in ("attention", "layer"):
        if flops and kind == "layer":
            cost = CostModel.from_hf_config(
                GPT2Config(n_embd=HIDDEN, n_layer=1, n_head=HEADS), lm_head=False
            )
        else:
            cost = fitted_cost(kind)
        kw = dict(
            layout=ParallelLayout(), token_budget=budget, dp_size=4, microbatches_per_step=2, seed=0
        )
        plans = {
            "tokens": plan_microbatches(lengths, **kw),
            "compute": plan_microbatches(lengths, cost=cost, **kw),
        }
        steps = {name: steps_of(plan) for name, plan in plans.items()}
        predicted = {
            name: sum(
                max(sum(cost.of(lengths[list(mb)]).sum() for mb in rank) for rank in step)
                for step in plan_steps
            )
            for name, plan_steps in steps.items()
        }
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(_rank, args=(4, port, kind, steps, lengths, rounds, out), nprocs=4, join=True)
            got = dict(out)
        print(
            f"    {kind}: cost {cost.linear:.0f}*L + {cost.quadratic:.2f}*L^2 "
            f"({'FLOPs' if flops and kind == 'layer' else 'ns, fitted to this CPU'})"
        )
        for name in plans:
            cpu, wall = zip(*got[name])
            print(
                f"      {name:<8} sum of step times (slowest rank's CPU time) {_spread(cpu)} s   "
                f"wall {_spread(wall)} s   {len(plans[name].steps)} steps"
            )
        faster = [t[0] / c[0] for t, c in zip(got["tokens"], got["compute"])]
        print(
            f"      compute-balanced steps faster by {_spread(faster, '{:.3f}')}x per round, "
            f"median [min..max] of {rounds} interleaved rounds (the cost model predicts "
            f"{predicted['tokens'] / predicted['compute']:.3f}x)"
        )


def part_c(lengths, rounds: int = 5) -> None:
    kw = dict(
        layout=ParallelLayout(), token_budget=32768, dp_size=8, microbatches_per_step=2, seed=0
    )
    got = _interleaved(
        {
            name: (lambda cost=cost: plan_microbatches(lengths, cost=cost, **kw))
            for name, cost in (("tokens", None), ("compute", COST))
        },
        rounds,
    )
    print(
        f"(c) plan time per global batch of 512 samples, ms, median [min..max] of {rounds} "
        f"interleaved rounds (whole plan of {len(lengths)} / {len(lengths) / 512:.1f})"
    )
    per = 1e3 * 512 / len(lengths)
    for name, (wall, cpu) in got.items():
        print(
            f"    {name:<8} CPU {_spread([c * per for c in cpu])}   wall "
            f"{_spread([w * per for w in wall])}"
        )


def part_d(lengths, microbatches: int = 48, rounds: int = 5) -> None:
    import torch

    from prealign.collate import THDCollator
    from prealign.loaders.plan.hybrid_cp import HybridCPCollator
    from prealign.schemas import causal_lm_schema

    cp, budget, schema = 4, 32768, causal_lm_schema()
    layout = ParallelLayout(cp=cp)
    plan = plan_microbatches(
        lengths, layout=layout, token_budget=budget, dp_size=1, cost=COST, oversize="truncate"
    )
    mbs = [mb for mb in plan.microbatches[0] if mb]
    mbs = mbs[:: max(len(mbs) // microbatches, 1)][
        :microbatches
    ]  # spread over the plan (sorted by cost)
    batches = [
        [
            {"input_ids": torch.arange(min(int(lengths[i]), budget), dtype=torch.int64) % 30000 + 1}
            for i in mb
        ]
        for mb in mbs
    ]
    fixed = [THDCollator(schema=schema, layout=layout, cp_rank=r) for r in range(cp)]
    hybrid = [
        HybridCPCollator(collator=c, token_budget=budget, cost=COST, comm_ratio=COMM) for c in fixed
    ]

    def run(collators):
        for samples in batches:
            for c in collators:
                c(samples)

    run(fixed), run(hybrid)  # warm-up
    lens = [[min(int(lengths[i]), budget) for i in mb] for mb in mbs]
    got = _interleaved(
        {
            "fixed": lambda: run(fixed),
            "hybrid": lambda: run(hybrid),
            "assign": lambda: [
                assign_cp_blocks(x, layout=layout, token_budget=budget, cost=COST) for x in lens
            ],
        },
        rounds,
    )
    split = sum(
        len(assign_cp_blocks(x, layout=layout, token_budget=budget, cost=COST)) > 1 for x in lens
    )
    per = 1e3 / (len(batches) * cp)
    print(
        f"(d) collation per CP rank and micro-batch, ms, cp = {cp}, budget {budget} "
        f"({len(batches)} micro-batches, {split} split into sub-groups; median [min..max] of "
        f"{rounds} interleaved rounds)"
    )
    for i, what in ((1, "CPU"), (0, "wall")):
        fx, hy = got["fixed"][i], got["hybrid"][i]
        print(
            f"    {what}: fixed CP {_spread([t * per for t in fx])}   hybrid CP "
            f"{_spread([t * per for t in hy])}   hybrid / fixed per round "
            f"{_spread([h / f for h, f in zip(hy, fx)])}x   block assignment "
            f"{_spread([t * 1e3 / len(batches) for t in got['assign'][i]], '{:.3f}')} per "
            f"micro-batch"
        )


def _interleaved(contenders: dict, rounds: int) -> dict:
    """{name: ([wall s], [CPU s])}: each contender once per round, the order rotating."""
    names, got = list(contenders), {name: ([], []) for name in contenders}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t, c = time.perf_counter(), time.process_time()
            contenders[name]()
            got[name][0].append(time.perf_counter() - t)
            got[name][1].append(time.process_time() - c)
    return got


def _spread(xs, fmt: str = "{:.2f}") -> str:
    """``median [min..max]`` of ``xs``."""
    return f"{fmt.format(float(np.median(xs)))} [{fmt.format(min(xs))}..{fmt.format(max(xs))}]"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--samples", type=int, default=6000)
    ap.add_argument("--cpu-samples", type=int, default=3000, help="samples of the CPU proof (b)")
    ap.add_argument(
        "--flops",
        action="store_true",
        help="(b) layer: plan with the FLOPs cost model, not the fitted one",
    )
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of (c) and (d)")
    ap.add_argument("--cpu-rounds", type=int, default=3, help="interleaved rounds of (b)")
    args = ap.parse_args()
    lengths = long_tail(args.samples)
    part_a(lengths)
    if not args.skip_cpu:
        part_b(args.cpu_samples, args.flops, args.cpu_rounds)
    part_c(lengths, args.rounds)
    part_d(lengths, rounds=args.rounds)


if __name__ == "__main__":
    main()
