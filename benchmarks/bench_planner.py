"""Planner benchmark: utilisation and DP imbalance of BFD vs first-fit vs in-order, and planning
time.

Data
  gsm8k/words  GSM8K train+test (read from ../shared/data/gsm8k/ relative to the repo root, never
               copied), question + "\\n" + answer, tokenised by a deterministic regex standing in
               for a BPE tokenizer (none can be downloaded here): one token per run of letters, per
               group of up to 3 digits and per other non-space character, plus BOS and EOS. Mean
               ~155 tokens, close to what Llama/Qwen tokenizers give on GSM8K. Budget 8192.
  gsm8k/bytes  the same text as UTF-8 bytes (a byte-level tokenizer, as ByT5), plus BOS/EOS. Budget
  8192. longtail     100k synthetic lengths, lognormal(5.5, 1.1) clipped to 32..8000 (seed 0).
        Budget 16384.
Layout tp=2, cp=2 (sequence parallel), dp=4.

Columns: utilisation = real tokens / (micro-batches x budget); steady = the same without the final
(short) step; bound = what any planner could at best do under the equal-count rule:
real / (round_up(ceil(sum aligned / capacity), dp) x budget);
imbalance = sum over steps of the max rank load / sum of the mean load (worst step in brackets);
max T = the largest padded micro-batch (must be <= budget). ``--quick`` uses 20k synthetic samples.
Plan time: the three strategies planned alternately over ``--rounds`` rounds (the order rotating),
wall and CPU seconds (``time.process_time``) as median [min..max]. ``--gsm8k DIR`` reads GSM8K from
DIR (a folder with train.jsonl and test.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from prealign.loaders import plan_microbatches  # noqa: E402
from prealign.loaders.plan.planner import microbatch_capacity  # noqa: E402
from prealign.schemas import ParallelLayout  # noqa: E402

GSM8K = os.path.join(ROOT, "..", "shared", "data", "gsm8k")
_WORDS = re.compile(r"[A-Za-z]+|\d{1,3}|[^\sA-Za-z\d]")


def gsm8k_texts(folder: str = GSM8K) -> list[str] | None:
    texts = []
    for split in ("train", "test"):
        path = os.path.join(folder, f"{split}.jsonl")
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            texts += [r["question"] + "\n" + r["answer"] for r in map(json.loads, f)]
    return texts


def words_tokenizer(text: str) -> int:
    return len(_WORDS.findall(text)) + 2


def bytes_tokenizer(text: str) -> int:
    return len(text.encode("utf-8")) + 2


def longtail(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.5, 1.1, n).astype(np.int64), 32, 8000)


def bound(lengths: np.ndarray, layout: ParallelLayout, budget: int, dp: int) -> float:
    cap = microbatch_capacity(layout, budget)
    m = layout.seq_multiple
    bins = -(-int((-(-lengths // m) * m).sum()) // cap)
    return float(lengths.sum()) / (-(-bins // dp) * dp * budget)


STRATEGIES = ("bfd", "first_fit", "in_order")


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}..{max(xs):.3f}]"


def run(
    name: str, lengths: np.ndarray, budget: int, layout: ParallelLayout, dp: int, rounds: int = 5
) -> list[dict]:
    plans, wall, cpu = {}, {k: [] for k in STRATEGIES}, {k: [] for k in STRATEGIES}
    for r in range(rounds):  # interleaved, the order rotating: no strategy always runs first
        for strategy in STRATEGIES[r % 3 :] + STRATEGIES[: r % 3]:
            t0, c0 = time.perf_counter(), time.process_time()
            plans[strategy] = plan_microbatches(
                lengths, layout=layout, token_budget=budget, dp_size=dp, strategy=strategy, seed=0
            )
            wall[strategy].append(time.perf_counter() - t0)
            cpu[strategy].append(time.process_time() - c0)
    rows = []
    for strategy in STRATEGIES:
        plan = plans[strategy]
        s = plan.stats
        body = plan.real_tokens[:, : s.microbatches_per_rank - plan.steps[-1]]
        rows.append(
            {
                "data": name,
                "strategy": strategy,
                "samples": len(lengths),
                "mb/rank": s.microbatches_per_rank,
                "utilisation": s.utilisation,
                "steady": float(body.sum()) / max(body.size * budget, 1),
                "bound": bound(lengths, layout, budget, dp),
                "imbalance": s.imbalance,
                "worst step": s.worst_step_imbalance,
                "max T": s.max_padded_length,
                "budget": budget,
                "plan s": statistics.median(wall[strategy]),
                "plan wall s": _spread(wall[strategy]),
                "plan CPU s": _spread(cpu[strategy]),
            }
        )
        assert s.max_padded_length <= budget
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="20k synthetic samples instead of 100k")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--gsm8k", default=GSM8K, help="folder of GSM8K's train/test.jsonl")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of plan time")
    args = ap.parse_args(argv)
    layout, dp, k = ParallelLayout(tp=2, cp=2), 4, args.rounds
    rows = []
    texts = gsm8k_texts(args.gsm8k)
    if texts is None:
        print(f"(GSM8K not found under {args.gsm8k}: skipped)")
    else:
        words = np.array([words_tokenizer(t) for t in texts])
        rows += run("gsm8k/words", words, 8192, layout, dp, k)
        nbytes = np.array([bytes_tokenizer(t) for t in texts])
        rows += run("gsm8k/bytes", nbytes, 8192, layout, dp, k)
    rows += run("longtail", longtail(20_000 if args.quick else 100_000), 16384, layout, dp, k)
    head = (
        f"{'data':<12} {'strategy':<9} {'samples':>7} {'mb/rank':>7} {'util':>6} {'steady':>6} "
        f"{'bound':>6} {'imbalance (worst)':>17} {'max T':>6} {'budget':>6} {'plan s':>7}"
    )
    print(f"tp=2 cp=2 dp={dp}\n{head}\n{'-' * len(head)}")
    for r in rows:
        print(
            f"{r['data']:<12} {r['strategy']:<9} {r['samples']:>7} {r['mb/rank']:>7} "
            f"{r['utilisation']:>6.4f} "
            f"{r['steady']:>6.4f} {r['bound']:>6.4f} {r['imbalance']:>8.4f} "
            f"({r['worst step']:.3f}) {r['max T']:>6} {r['budget']:>6} {r['plan s']:>7.3f}"
        )
    print(f"\nplan time, median [min..max] over {args.rounds} interleaved rounds")
    for r in rows:
        print(
            f"{r['data']:<12} {r['strategy']:<9} wall s {r['plan wall s']}  CPU s {r['plan CPU s']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
