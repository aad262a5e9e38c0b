"""Collate speed and memory, side by side in one run: prealign vs verl vs a torch.cat floor.

For B in {8, 64, 256, 1024} sequences of 16..1024 tokens, tp=2 cp=2, CP rank 0, every sequence
padded to a multiple of 2 * tp * cp as verl pads it (``PadPolicy.PER_SEQUENCE``: equal padding on
both sides):
  ours         THDCollator(cp_rank=0) on a list of sample dicts (all fields: ids, labels,
               loss_mask, positions, padding mask [+ teacher top-k log-probs/ids, K=64])
  ours-nested  the same collator on verl's input format (dict of jagged nested tensors)
  verl         verl 0.9.1 preprocess_thd_engine applied to each input field (nested tensors)
  floor        torch.cat of the same input tensors + one memcpy of as many bytes as our output
  peak/out     peak extra resident memory of one collate call / bytes of its output
               (measured in a fresh subprocess with /proc/self/clear_refs + VmHWM, default malloc)
Timed runs pin glibc's malloc thresholds (see ``pin_allocator``) so that no contender's time
depends on the allocator state the previous one left.
Times are CPU seconds of the process (``time.process_time``; torch on one thread, ``--threads``, on
every side alike) and wall seconds. Rounds interleave the contenders (a round: verl once, each other
contender 5 calls back to back, their median); each time is the median [min..max] over the rounds,
and ours / floor is given both ways: the median [min..max] of the per-round ratios and the ratio of
the medians (on a loaded machine they can differ; both are the figure). Absolute times depend on the
machine.

    python benchmarks/bench_collate.py            # full table
    python benchmarks/bench_collate.py --quick    # B in {8, 64, 256}, fewer repeats
    python benchmarks/bench_collate.py --sizes 256 --cases tokens --no-verl --no-memory --repeat 41
                                                  # the ids-only figure (issue #28: <= 5x the floor)
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import subprocess
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

from prealign.collate import THDCollator  # noqa: E402
from prealign.schemas import ParallelLayout, causal_lm_schema  # noqa: E402
from prealign.schemas.layout import PadPolicy  # noqa: E402

K = 64
LAYOUT = ParallelLayout(tp=2, cp=2, pad_policy=PadPolicy.PER_SEQUENCE)


def make_samples(batch_size: int, topk: bool, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed + batch_size)
    lengths = torch.randint(16, 1025, (batch_size,), generator=g).tolist()
    samples = []
    for n in lengths:
        s = {"input_ids": torch.randint(0, 32000, (n,), generator=g)}
        if topk:
            s["teacher_topk_log_probs"] = -torch.rand(n, K, generator=g)
            s["teacher_topk_ids"] = torch.randint(0, 32000, (n, K), generator=g)
        samples.append(s)
    return samples


def fields_of(samples: list[dict]) -> list[str]:
    return list(samples[0].keys())


def nested(samples: list[dict]) -> dict:
    return {
        k: torch.nested.nested_tensor([s[k] for s in samples], layout=torch.jagged)
        for k in fields_of(samples)
    }


def out_bytes(batch: dict) -> int:
    return sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
"""CPU seconds of this process (torch on one thread: what a call costs, whatever else the machine
runs) and wall seconds (on a shared machine it adds the time other processes held the core)."""


def timeit_side_by_side(fns: dict, repeat: int, inner: int = 5, slow: tuple = ("verl",)) -> dict:
    """Seconds of each function in ``repeat`` rounds (interleaved, so every contender sees the same
    machine): ``{name: {"cpu": [seconds of each round], "wall": [...]}}``. A round calls each of
    ``slow`` once and each other contender ``inner`` times back to back, its value the median of
    those calls: a call right after a 0.2-10 s verl call measures the caches and allocator state
    verl left, and is not the contender's steady state, so the per-round ratio compares calls made
    under the same conditions."""
    for fn in fns.values():
        fn()
    times = {name: {clock: [] for clock in CLOCKS} for name in fns}
    cpu, wall = CLOCKS["cpu"], CLOCKS["wall"]
    for _ in range(repeat):
        for name, fn in fns.items():
            calls = {"cpu": [], "wall": []}
            for _ in range(1 if name in slow else inner):
                c0, w0 = cpu(), wall()
                fn()
                w1, c1 = wall(), cpu()
                calls["cpu"].append(c1 - c0)
                calls["wall"].append(w1 - w0)
            for clock, xs in calls.items():
                times[name][clock].append(statistics.median(xs))
    return times


def median(xs: list) -> float:
    return statistics.median(xs)


def spread(xs: list, scale: float = 1e3, fmt: str = "{:.3f}") -> str:
    """``median [min..max]`` of ``xs`` times ``scale``."""
    return (
        f"{fmt.format(median(xs) * scale)} "
        f"[{fmt.format(min(xs) * scale)}..{fmt.format(max(xs) * scale)}]"
    )


def _rss(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024


def memory_probe(batch_size: int, topk: bool) -> None:
    """Run in a fresh process: print peak extra RSS of one collate call and its output size."""
    samples = make_samples(batch_size, topk)
    coll = THDCollator(schema=causal_lm_schema(topk=K if topk else None), layout=LAYOUT, cp_rank=0)
    coll(make_samples(8, topk, seed=1))  # warm up code paths on a small batch
    gc.collect()
    base = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    batch = coll(samples)
    print(_rss("VmHWM") - base, out_bytes(batch))


def peak_ratio(batch_size: int, topk: bool) -> float | None:
    try:
        res = subprocess.run(
            [sys.executable, __file__, "--memory-probe", str(batch_size), str(int(topk))],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        peak, out = map(int, res.stdout.split()[-2:])
        return peak / out
    except (subprocess.SubprocessError, ValueError, OSError):
        return None


def run(
    batch_sizes, repeat: int, cases=("tokens", "topk"), with_verl: bool = True, memory: bool = True
) -> list[dict]:
    verl = None
    if with_verl:
        try:
            from verl_reference import load_verl_mcore_util, patched_parallel_state

            verl = load_verl_mcore_util()
        except ImportError as exc:
            print(f"(verl not available: {exc}; its column is empty)")
    rows = []
    for topk in [c == "topk" for c in cases]:
        schema = causal_lm_schema(topk=K if topk else None)
        coll = THDCollator(schema=schema, layout=LAYOUT, cp_rank=0)
        for b in batch_sizes:
            samples = make_samples(b, topk)
            nt = nested(samples)
            batch = coll(samples)
            nbytes = out_bytes(batch)
            src = torch.empty(nbytes, dtype=torch.uint8)

            def floor():
                for k in fields_of(samples):
                    torch.cat([s[k] for s in samples])
                torch.empty_like(src).copy_(src)

            row = {
                "B": b,
                "case": "top-k K=64" if topk else "tokens",
                "T_local": batch["input_ids"].shape[1],
                "out_MiB": nbytes / 2**20,
            }
            fns = {"ours": lambda: coll(samples), "ours_nested": lambda: coll(nt), "floor": floor}
            if verl is not None:

                def run_verl():
                    with patched_parallel_state(verl, tp=LAYOUT.tp, cp=LAYOUT.cp, cp_rank=0):
                        for k in fields_of(samples):
                            verl.preprocess_thd_engine(nt[k], pre_process=True)

                fns["verl"] = run_verl
            # verl is 100-1000x slower: fewer rounds at large B (every contender in every round
            # alike)
            row.update(
                timeit_side_by_side(
                    fns, max(5, repeat // 4) if verl is not None and b >= 256 else repeat
                )
            )
            row["peak/out"] = peak_ratio(b, topk) if memory else None
            rows.append(row)
            print_row(row)
    return rows


HEADER = (
    "| B | case | T_local | out MiB | ours ms | nested ms | verl ms | floor ms | verl/ours | "
    "ours / floor: per round | ratio of medians | wall: ours ms | floor ms | per round | ratio of "
    "medians | peak/out |\n" + "|---" * 16 + "|"
)


def ratios(r: dict, clock: str) -> tuple[list[float], float]:
    """ours / floor on ``clock``: each round's ratio, and the ratio of the medians."""
    ours, floor = r["ours"][clock], r["floor"][clock]
    return [o / f for o, f in zip(ours, floor)], median(ours) / median(floor)


def print_row(r: dict) -> None:
    verl, peak = r.get("verl"), r.get("peak/out")
    cpu, cpu_of_medians = ratios(r, "cpu")
    wall, wall_of_medians = ratios(r, "wall")
    speedup = (
        "-"
        if verl is None
        else spread([v / o for v, o in zip(verl["cpu"], r["ours"]["cpu"])], 1, "{:.0f}x")
    )
    print(
        f"| {r['B']} | {r['case']} | {r['T_local']} | {r['out_MiB']:.2f} | "
        f"{spread(r['ours']['cpu'])} | {spread(r['ours_nested']['cpu'])} | "
        f"{'-' if verl is None else spread(verl['cpu'], 1e3, '{:.1f}')} | "
        f"{spread(r['floor']['cpu'])} | {speedup} | {spread(cpu, 1, '{:.2f}x')} | "
        f"{cpu_of_medians:.2f}x | {spread(r['ours']['wall'])} | {spread(r['floor']['wall'])} | "
        f"{spread(wall, 1, '{:.2f}x')} | "
        f"{wall_of_medians:.2f}x | {'-' if peak is None else f'{peak:.2f}x'} |",
        flush=True,
    )


def pin_allocator() -> bool:
    """Pin glibc's malloc thresholds for the timed runs. Its dynamic mmap threshold otherwise moves
    with whatever ran before, so whether a fresh multi-MiB buffer costs page faults depended on the
    previous contender (the floor's time alone varied 0.2-0.9 ms at B=256). Pinned high, every
    contender runs in the steady state of a long-lived DataLoader worker. Linux/glibc only."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(
            libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 30)
        )
    except (OSError, AttributeError):
        return False


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="B in {8, 64, 256} and fewer repeats")
    p.add_argument("--repeat", type=int, default=None, help="rounds per cell (median [min..max])")
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (both sides alike; default 1)"
    )
    p.add_argument(
        "--sizes", type=int, nargs="+", default=None, help="batch sizes B (default: per --quick)"
    )
    p.add_argument(
        "--cases",
        nargs="+",
        choices=("tokens", "topk"),
        default=("tokens", "topk"),
        help="tokens: ids only (labels, loss mask, positions derived); topk: + teacher top-k",
    )
    p.add_argument(
        "--no-verl", action="store_true", help="leave verl out (it takes most of the time)"
    )
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocess")
    p.add_argument(
        "--memory-probe", nargs=2, type=int, metavar=("B", "TOPK"), help=argparse.SUPPRESS
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_probe:
        memory_probe(args.memory_probe[0], bool(args.memory_probe[1]))
        return
    sizes = args.sizes or ((8, 64, 256) if args.quick else (8, 64, 256, 1024))
    pinned = pin_allocator()
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), layout tp={LAYOUT.tp} "
        f"cp={LAYOUT.cp} (rank 0), padding {LAYOUT.pad_policy.value}, "
        f"lengths 16..1024, malloc thresholds {'pinned' if pinned else 'default'}"
    )
    print(HEADER)
    run(
        sizes,
        args.repeat or (11 if args.quick else 31),
        args.cases,
        not args.no_verl,
        not args.no_memory,
    )


if __name__ == "__main__":
    main()
