"""Time to first batch and index throughput, with and without sidecar indexes (issue #7).

    python benchmarks/bench_ttfb.py [--sizes 10000 100000 1000000] [--vlm 5000] [--dir DIR]
                                    [--no-full N]

For each size: pre-tokenized webdataset shards (``<key>.input_ids.npy`` int64, 8..128 tokens, 10k
samples per shard, written as raw tar bytes), then

* ``full``      PackedLoader built and its first batch taken, the index pass in process (no
  sidecars)
* ``index``     ``write_sidecars`` (what ``prealign index`` runs): samples/s with 1 and 2 processes,
  and per CPU-second (what one free core does, whatever else shares the machine)
* ``sidecars``  PackedLoader built and its first batch taken from the sidecars (best of ``--repeat``
  fresh processes; all of them in the JSON)

and the demo's VLM set (chat + images + teacher top-k): the full pass against the header pass (with
and without the pixel check), one shard after another on one thread, CPU seconds, lengths compared.
Every phase runs in a fresh process (no warm caches but the OS page cache). Prints a Markdown table;
``--json`` also writes the numbers.
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


_TTFB = """
from prealign.loaders import IndexOptions, PackedLoader, WebDatasetSource
from prealign.loaders.sources.webdataset import numpy_fields
from prealign.schemas import ParallelLayout, causal_lm_schema
paths = {paths!r}
t0 = time.perf_counter()
loader = PackedLoader(WebDatasetSource(paths, sidecars={sidecars}), schema=causal_lm_schema(),
                      layout=ParallelLayout(tp=2, cp=2), token_budget=8192,
                      indexing=IndexOptions(workers={workers}), num_workers=0).prepare()
t1 = time.perf_counter()
batch = next(iter(loader))
t2 = time.perf_counter()
result = {{"build_s": t1 - t0, "ttfb_s": t2 - t0, "samples": len(loader.index),
           "tokens": int(batch["input_ids"].numel())}}
"""

_INDEX = """
from prealign.loaders import WebDatasetSource
from prealign.loaders.index.header_pass import write_sidecars
from prealign.schemas import causal_lm_schema
paths = {paths!r}
import resource
def cpu():
    return sum(getattr(resource.getrusage(w), a)
               for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for a in ("ru_utime", "ru_stime"))
t0, c0 = time.perf_counter(), cpu()
stats = write_sidecars(WebDatasetSource(paths), causal_lm_schema(), workers={workers}, force=True)
result = {{"s": time.perf_counter() - t0, "cpu_s": cpu() - c0, "samples": stats["samples"]}}
"""

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
def timed(fn):
    t, c = time.perf_counter(), time.process_time()
    out = [fn(s) for s in range(len(shards))]
    return out, time.perf_counter() - t, time.process_time() - c
full, full_s, full_cpu = timed(lambda s: index_shard(src, schema, s))
head, head_s, head_cpu = timed(lambda s: header_index_shard(src, schema, s)[0])
only, only_s, only_cpu = timed(lambda s: header_index_shard(src, schema, s, verify_images=False)[0])
same = all(f["lengths"] == h["lengths"] and f["locations"] == h["locations"]
           for f, h in zip(full, head))
result = {{"full_s": full_s, "full_cpu": full_cpu, "header_s": head_s, "header_cpu": head_cpu,
          "header_only_s": only_s, "header_only_cpu": only_cpu, "identical": bool(same),
          "samples": sum(len(f["lengths"]) for f in full)}}
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="*", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--vlm", type=int, default=5000)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "prealign-bench-ttfb"))
    ap.add_argument(
        "--no-full-above", type=int, default=10**9, help="skip the full pass above this size"
    )
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="first batch from sidecars: best of this many fresh processes",
    )
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    rows, numbers = [], {}
    for n in args.sizes:
        paths = write_text_shards(os.path.join(args.dir, f"text-{n}"), n)
        for p in paths:  # fresh sidecars each run
            if os.path.exists(p + ".prealign-index.npz"):
                os.remove(p + ".prealign-index.npz")
        full = (
            _phase(_TTFB.format(paths=paths, sidecars=False, workers=args.workers))
            if n <= args.no_full_above
            else None
        )
        idx1 = _phase(_INDEX.format(paths=paths, workers=1))
        idx2 = _phase(_INDEX.format(paths=paths, workers=args.workers))
        tries = [
            _phase(_TTFB.format(paths=paths, sidecars=True, workers=args.workers))
            for _ in range(args.repeat)
        ]
        side = min(tries, key=lambda t: t["ttfb_s"])  # the VM's noise only adds time
        side["all_ttfb_s"] = [t["ttfb_s"] for t in tries]
        numbers[n] = {
            "full": full,
            "index_1": idx1,
            f"index_{args.workers}": idx2,
            "sidecars": side,
        }
        rows.append(
            f"| {n:,} text | {full['ttfb_s']:.2f} s |" if full else f"| {n:,} text | (not run) |"
        )
        rows[-1] += (
            f" {side['ttfb_s']:.2f} s | {idx1['samples'] / idx1['s']:,.0f} / s | "
            f"{idx2['samples'] / idx2['s']:,.0f} / s | {idx1['samples'] / idx1['cpu_s']:,.0f} / s |"
        )
        print(rows[-1], flush=True)
    if args.vlm:
        root = os.path.join(args.dir, f"vlm-{args.vlm}")
        os.makedirs(root, exist_ok=True)
        v = _phase("import os\n" + _VLM.format(root=root, n=args.vlm, workers=args.workers))
        numbers["vlm"] = v
        rows.append(
            f"| {args.vlm:,} VLM (demo), index CPU s | full pass {v['full_cpu']:.1f} | header pass "
            f"{v['header_cpu']:.1f} ({v['full_cpu'] / v['header_cpu']:.1f}x) | --header-only "
            f"{v['header_only_cpu']:.1f} ({v['full_cpu'] / v['header_only_cpu']:.1f}x) | lengths "
            f"identical: {v['identical']} | |"
        )
        print(rows[-1], flush=True)
    print(
        "\n| data | first batch, no sidecars | first batch, sidecars | index, 1 process | "
        f"index, {args.workers} processes | index per CPU-second |\n|---|---|---|---|---|---|"
    )
    print("\n".join(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(numbers, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
