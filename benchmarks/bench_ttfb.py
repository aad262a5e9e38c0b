"""Time to first batch and index throughput, with and without sidecar indexes (issue #7).

    python benchmarks/bench_ttfb.py [--sizes 10000 100000 1000000] [--vlm 5000] [--dir DIR]
                                    [--no-full N]

For each size: pre-tokenized webdataset shards (``<key>.input_ids.npy`` int64, 8..128 tokens, 10k
samples per shard, written as raw tar bytes), then

* ``full``      PackedLoader built and its first batch taken, the index pass in process (no
  sidecars)
* ``index``     ``write_sidecars`` (what ``prealign index`` runs): samples/s with 1 and 2 processes,
  and per CPU-second (what one free core does, whatever else shares the machine)
* ``sidecars``  PackedLoader built and its first batch taken from the sidecars (written once before
  the rounds)

and the demo's VLM set (chat + images + teacher top-k): the full pass against the header pass (with
and without the pixel check), one shard after another on one thread, CPU seconds, lengths compared.
Every phase runs in a fresh process (no warm caches but the OS page cache). The phases of a size run
once per round over ``--rounds`` rounds, the order rotating; wall and CPU seconds (the process and
its joined children) are given as median [min..max], with the per-round ratios (the VLM passes
alternate in one process, ``--rounds`` times). Prints a Markdown table; ``--json`` also writes the
numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

PER_SHARD = 10_000


def _tar_header(name: bytes, size: int) -> bytes:
    head = bytearray(512)
    head[0 : len(name)] = name
    head[100:108] = b"0000644\0"
    head[108:116] = b"0000000\0"
    head[116:124] = b"0000000\0"
    head[124:136] = b"%011o\0" % size
    head[136:148] = b"00000000000\0"
    head[156:157] = b"0"
    head[257:263] = b"ustar\0"
    head[263:265] = b"00"
    head[148:156] = b" " * 8
    head[148:156] = b"%06o\0 " % sum(head)
    return bytes(head)


def write_text_shards(root: str, n: int, seed: int = 0, per_shard: int = PER_SHARD) -> list[str]:
    """``ceil(n / per_shard)`` tar shards of pre-tokenized samples (int64 ``[8..128]``), raw tar
    bytes."""
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 129, n)
    paths = []
    for s in range(-(-n // per_shard)):
        path = os.path.join(root, f"text-{s:05d}.tar")
        paths.append(path)
        if os.path.exists(path):
            continue
        out = []
        for i in range(s * per_shard, min(n, (s + 1) * per_shard)):
            n_tok = int(lengths[i])
            header = b"{'descr': '<i8', 'fortran_order': False, 'shape': (%d,), }" % n_tok
            header = header + b" " * (127 - 10 - len(header)) + b"\n"
            data = (
                b"\x93NUMPY\x01\x00"
                + len(header).to_bytes(2, "little")
                + header
                + ((np.arange(n_tok, dtype=np.int64) * 7 + i) % 30000 + 1).tobytes()
            )
            out.append(_tar_header(b"%09d.input_ids.npy" % i, len(data)))
            out.append(data + bytes(-len(data) % 512))
        out.append(bytes(1024))
        body = b"".join(out)
        with open(path + ".part", "wb") as f:
            f.write(body + bytes(-len(body) % 10240))
        os.replace(path + ".part", path)
    return paths


def _phase(code: str) -> dict:
    """Run ``code`` (defines ``result``) in a fresh interpreter; return its JSON result."""
    prog = "import json, time\n" + code + "\nprint('RESULT' + json.dumps(result))"
    out = subprocess.run(
        [sys.executable, "-c", prog], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.rsplit("RESULT", 1)[1])


_CPU = """
import resource
def cpu():
    return sum(getattr(resource.getrusage(w), a)
               for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for a in ("ru_utime", "ru_stime"))
"""

_TTFB = (
    _CPU
    + """
from prealign.loaders import IndexOptions, PackedLoader, WebDatasetSource
from prealign.loaders.sources.webdataset import numpy_fields
from prealign.schemas import ParallelLayout, causal_lm_schema
paths = {paths!r}
t0, c0 = time.perf_counter(), cpu()
loader = PackedLoader(WebDatasetSource(paths, sidecars={sidecars}), schema=causal_lm_schema(),
                      layout=ParallelLayout(tp=2, cp=2), token_budget=8192,
                      indexing=IndexOptions(workers={workers}), num_workers=0).prepare()
t1 = time.perf_counter()
batch = next(iter(loader))
t2 = time.perf_counter()
result = {{"build_s": t1 - t0, "ttfb_s": t2 - t0, "cpu_s": cpu() - c0,
           "samples": len(loader.index), "tokens": int(batch["input_ids"].numel())}}
"""
)

_INDEX = (
    _CPU
    + """
from prealign.loaders import WebDatasetSource
from prealign.loaders.index.header_pass import write_sidecars
from prealign.schemas import causal_lm_schema
paths = {paths!r}
t0, c0 = time.perf_counter(), cpu()
stats = write_sidecars(WebDatasetSource(paths), causal_lm_schema(), workers={workers}, force=True)
result = {{"s": time.perf_counter() - t0, "cpu_s": cpu() - c0, "samples": stats["samples"]}}
"""
)

_VLM = """
import numpy as np, torch
from prealign.loaders import WebDatasetSource, build_index, BadDataPolicy
from prealign.loaders.index.header_pass import header_index_shard
from prealign.loaders.index.build import index_shard
from prealign.loaders.cli.demo_data import build_demo_dataset
from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
from prealign.loaders.media.vlm import VLMSampleTransform
from prealign.schemas.vlm import vlm_schema
import warnings; warnings.simplefilter("ignore")
torch.set_num_threads(1)  # one core each way: the ratio is per CPU
root = {root!r}
if not os.path.exists(os.path.join(root, "done")):
    build_demo_dataset(root, num_samples={n}, samples_per_shard=500, topk=8)
    open(os.path.join(root, "done"), "w").close()
shards = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".tar"))
src = WebDatasetSource(shards, transform=VLMSampleTransform(tokenizer=ByteTokenizer(), topk=8),
                       image="bytes", sidecars=False)
schema = vlm_schema(topk=8, vocab_size=ByteTokenizer.vocab_size)
passes = {{
    "full": lambda s: index_shard(src, schema, s),
    "header": lambda s: header_index_shard(src, schema, s)[0],
    "header_only": lambda s: header_index_shard(src, schema, s, verify_images=False)[0],
}}
names, result, outs = list(passes), {{}}, {{}}
for r in range({rounds}):  # interleaved, the order rotating
    for name in names[r % 3:] + names[:r % 3]:
        t, c = time.perf_counter(), time.process_time()
        outs[name] = [passes[name](s) for s in range(len(shards))]
        result.setdefault(name + "_s", []).append(time.perf_counter() - t)
        result.setdefault(name + "_cpu", []).append(time.process_time() - c)
full, head = outs["full"], outs["header"]
same = all(f["lengths"] == h["lengths"] and f["locations"] == h["locations"]
           for f, h in zip(full, head))
result.update(identical=bool(same), samples=sum(len(f["lengths"]) for f in full))
"""


def _rounds(phases: dict, rounds: int) -> dict:
    """{name: [result of each round]}: every phase once a round in a fresh process, the order
    rotating."""
    names, got = list(phases), {name: [] for name in phases}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            got[name].append(_phase(phases[name]))
    return got


def _spread(xs, fmt: str = "{:.2f}") -> str:
    """``median [min..max]`` of ``xs``."""
    return f"{fmt.format(float(np.median(xs)))} [{fmt.format(min(xs))}..{fmt.format(max(xs))}]"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="*", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--vlm", type=int, default=5000)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "prealign-bench-ttfb"))
    ap.add_argument(
        "--no-full-above", type=int, default=10**9, help="skip the full pass above this size"
    )
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every phase")
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    rows, numbers = [], {}
    for n in args.sizes:
        paths = write_text_shards(os.path.join(args.dir, f"text-{n}"), n)
        for p in paths:  # fresh sidecars each run
            if os.path.exists(p + ".prealign-index.npz"):
                os.remove(p + ".prealign-index.npz")
        _phase(_INDEX.format(paths=paths, workers=1))  # the sidecars the "sidecars" phase reads
        phases = {
            "index_1": _INDEX.format(paths=paths, workers=1),
            f"index_{args.workers}": _INDEX.format(paths=paths, workers=args.workers),
            "sidecars": _TTFB.format(paths=paths, sidecars=True, workers=args.workers),
        }
        if n <= args.no_full_above:
            phases["full"] = _TTFB.format(paths=paths, sidecars=False, workers=args.workers)
        got = _rounds(phases, args.rounds)
        numbers[n] = got
        idx1, idx2, side = got["index_1"], got[f"index_{args.workers}"], got["sidecars"]
        full = got.get("full")
        rows.append(
            f"| {n:,} text | {_spread([r['ttfb_s'] for r in full])} s "
            f"(CPU {_spread([r['cpu_s'] for r in full])}) |"
            if full
            else f"| {n:,} text | (not run) |"
        )
        rows[-1] += (
            f" {_spread([r['ttfb_s'] for r in side])} s (CPU {_spread([r['cpu_s'] for r in side])})"
            f" | {_spread([r['samples'] / r['s'] for r in idx1], '{:,.0f}')} / s | "
            f"{_spread([r['samples'] / r['s'] for r in idx2], '{:,.0f}')} / s | "
            f"{_spread([r['samples'] / r['cpu_s'] for r in idx1], '{:,.0f}')} / s |"
        )
        if full:
            rows[-1] += (
                f" {_spread([f['ttfb_s'] / s['ttfb_s'] for f, s in zip(full, side)], '{:.1f}')}x |"
            )
        print(rows[-1], flush=True)
    if args.vlm:
        root = os.path.join(args.dir, f"vlm-{args.vlm}")
        os.makedirs(root, exist_ok=True)
        v = _phase(
            "import os\n"
            + _VLM.format(root=root, n=args.vlm, workers=args.workers, rounds=args.rounds)
        )
        numbers["vlm"] = v

        def vs(name):
            per = [f / h for f, h in zip(v["full_cpu"], v[name + "_cpu"])]
            return f"{_spread(v[name + '_cpu'], '{:.1f}')} ({_spread(per, '{:.1f}')}x)"

        rows.append(
            f"| {args.vlm:,} VLM (demo), index CPU s | full pass "
            f"{_spread(v['full_cpu'], '{:.1f}')} | header pass {vs('header')} | --header-only "
            f"{vs('header_only')} | lengths identical: {v['identical']} | | |"
        )
        print(rows[-1], flush=True)
    print(
        f"\nmedian [min..max] of {args.rounds} interleaved rounds\n"
        "| data | first batch, no sidecars | first batch, sidecars | index, 1 process | "
        f"index, {args.workers} processes | index per CPU-second | no sidecars / sidecars (wall), "
        "per round |\n|---|---|---|---|---|---|---|"
    )
    print("\n".join(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(numbers, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
