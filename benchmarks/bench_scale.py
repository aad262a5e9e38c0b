"""Start and index at scale (issue #22): first batch and resume against the shard count, state_dict() against
the sample count, index workers, import time; side by side with Megatron-Energon where it is importable.

    python benchmarks/bench_scale.py [--samples 100000] [--shards 20 2000 10 1000 10000] [--index 10000 100000]
                                     [--state 10000 1000000] [--energon PATH] [--json out.json]

* ``start``     the same ``--samples`` text samples (``<key>.input_ids.npy``, 8..128 tokens) cut into each of
                ``--shards`` shard counts; ``prealign index --merge`` run once; then, in fresh processes (best of
                ``--repeat``): a PackedLoader's first batch (sidecars, and the merged index), and a resume (a new
                loader, ``load_state_dict`` of a state taken 8 batches in, its first batch)
* ``state``     ``state_dict()`` of a prepared loader over ``--state`` samples (mean of 200 calls)
* ``index``     ``write_sidecars`` (what ``prealign index`` runs) with 1 and 2 workers
* ``import``    ``import prealign.loaders`` in a fresh process (and ``import torch`` alone, which it needs)
* ``energon``   with ``--energon`` (a folder holding the ``megatron-energon`` package, e.g. made by
                ``pip install --target DIR megatron-energon`` and its light dependencies; never a dependency of
                prealign): ``energon prepare`` of the same shards, first batch and resume of its loader, and both
                loaders' samples/s over the same text samples (2 workers each)

Every phase runs in a fresh interpreter; the machine's load only adds time, so each start number is the best
of ``--repeat`` tries. Prints Markdown tables; ``--json`` also writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ttfb import write_text_shards  # noqa: E402 - the benchmarks folder is not a package

_TIMED = """
t1, c1 = time.perf_counter(), time.process_time()
first = loader()
it = iter(first)
next(it)
t2, c2 = time.perf_counter(), time.process_time()
for _ in range(7):
    next(it)
state = save(first)
t3, c3 = time.perf_counter(), time.process_time()
again = loader()
restore(again, state)
next(iter(again))
t4, c4 = time.perf_counter(), time.process_time()
result = {{"first_s": t2 - t1, "resume_s": t4 - t3, "first_cpu_s": c2 - c1, "resume_cpu_s": c4 - c3}}
"""
"""First batch of a fresh loader; resume: a new loader restored to a state taken 8 batches in, its first batch
(wall and CPU seconds: no workers, so the CPU time is the work, whatever else loads the machine). Each side
defines ``loader()``, ``save(loader)`` and ``restore(loader, state)``."""

_START = """
import glob
from prealign.loaders import PackedLoader, WebDatasetSource
from prealign.schemas import ParallelLayout, causal_lm_schema
paths = sorted(glob.glob({root!r} + "/*.tar"))
def loader():
    return PackedLoader(WebDatasetSource(paths), schema=causal_lm_schema(), layout=ParallelLayout(tp=2, cp=2),
                        token_budget=8192, seed=1)
def save(loader):
    return loader.state_dict()
def restore(loader, state):
    loader.load_state_dict(state)
""" + _TIMED

_STATE = """
import numpy as np
from prealign.loaders import IndexOptions, PackedLoader, SampleIndex, WebDatasetSource
from prealign.loaders.policy import BadDataReport
from prealign.schemas import ParallelLayout, causal_lm_schema
paths = {paths!r}
n = {n}
rng = np.random.default_rng(0)
shard = np.arange(n) % len(paths)
start = (np.arange(n) // len(paths)) * 1024
locations = np.stack([shard, start, start + 1024, np.zeros(n, np.int64)], axis=1)
index = SampleIndex(lengths=rng.integers(8, 129, n), locations=locations, shards=shard, report=BadDataReport())
loader = PackedLoader(WebDatasetSource(paths, sidecars=False), schema=causal_lm_schema(), layout=ParallelLayout(),
                      token_budget=8192, indexing=IndexOptions(prebuilt=index)).prepare()
loader.state_dict()
t = time.perf_counter()
for _ in range(200):
    loader.state_dict()
result = {{"state_dict_ms": (time.perf_counter() - t) / 200 * 1e3, "samples": n}}
"""

_INDEX = """
from prealign.loaders import WebDatasetSource
from prealign.loaders.index.header_pass import write_sidecars
from prealign.schemas import causal_lm_schema
import resource
def cpu():  # this process and its children (a pool's workers)
    return sum(getattr(resource.getrusage(w), a) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for a in ("ru_utime", "ru_stime"))
if __name__ == "__main__":
    t, c = time.perf_counter(), cpu()
    stats = write_sidecars(WebDatasetSource({paths!r}), causal_lm_schema(), workers={workers}, force=True)
    result = {{"s": time.perf_counter() - t, "cpu_s": cpu() - c, "samples": stats["samples"]}}
"""

_IMPORT = """
t = time.perf_counter()
import {module}
result = {{"s": time.perf_counter() - t}}
"""

_ENERGON_START = """
import glob, warnings
warnings.simplefilter("ignore")
sys.path.append({energon!r})
from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset
def loader():
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    ds = get_train_dataset({root!r}, batch_size=64, shuffle_buffer_size=None, max_samples_per_sequence=None,
                           worker_config=wc, task_encoder=Encoder())
    return get_savable_loader(ds)
def save(loader):
    return loader.save_state_rank()
def restore(loader, state):
    loader.restore_state_rank(state)
""" + _TIMED

_ENERGON_ENCODER = """
import sys
sys.path.append({energon!r})
from megatron.energon import DefaultTaskEncoder
class Encoder(DefaultTaskEncoder):
    def batch(self, samples):
        return samples  # variable-length token arrays: a list (prealign packs them; energon's default stacks)
"""

_PREPARE = """
import glob, warnings
warnings.simplefilter("ignore")
sys.path.append({energon!r})
from megatron.energon.epathlib import EPath
from megatron.energon.flavors import BaseWebdatasetFactory
root = {root!r}
paths = sorted(os.path.basename(p) for p in glob.glob(root + "/*.tar"))
t = time.perf_counter()
BaseWebdatasetFactory.prepare_dataset(EPath(root), paths, split_parts_ratio=[("train", 1.0)], workers={workers},
                                      shuffle_seed=None)
with open(os.path.join(root, ".nv-meta", "dataset.yaml"), "w") as f:
    f.write("sample_type:\\n  __module__: megatron.energon\\n  __class__: TextSample\\nfield_map:\\n  text: input_ids.npy\\n")
result = {{"s": time.perf_counter() - t}}
"""

_THROUGHPUT = """
import glob, warnings
warnings.simplefilter("ignore")
paths = sorted(glob.glob({root!r} + "/*.tar"))
kind = {kind!r}
if kind == "prealign":
    from prealign.loaders import PackedLoader, WebDatasetSource
    from prealign.schemas import ParallelLayout, causal_lm_schema
    loader = PackedLoader(WebDatasetSource(paths), schema=causal_lm_schema(), layout=ParallelLayout(),
                          token_budget=8192, num_workers=2, seed=1)
    def count(batch):
        return len(batch["sample_index"])
else:
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset
    wc = WorkerConfig(rank=0, world_size=1, num_workers=2)
    loader = get_loader(get_train_dataset({root!r}, batch_size=64, shuffle_buffer_size=None,
                                          max_samples_per_sequence=None, worker_config=wc, task_encoder=Encoder()))
    def count(batch):
        return len(batch)
it = iter(loader)
for _ in range(5):
    next(it)  # workers started, first batches out
n, t = 0, time.perf_counter()
while n < {samples}:
    n += count(next(it))
result = {{"samples_per_s": n / (time.perf_counter() - t)}}
"""


def _phase(code: str) -> dict:
    """Run ``code`` (defines ``result``) in a fresh interpreter; return its JSON result."""
    prog = "import json, os, sys, time\n" + code + "\nif 'result' in globals(): print('RESULT' + json.dumps(result))"
    run = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True)
    if run.returncode or "RESULT" not in run.stdout:
        raise RuntimeError(f"phase failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.rsplit("RESULT", 1)[1])


def _index_and_merge(root: str) -> None:
    _phase(f"""
import glob
from prealign.loaders import WebDatasetSource
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.index.merged import merge_sidecars
from prealign.schemas import causal_lm_schema
if __name__ == "__main__":
    source = WebDatasetSource(sorted(glob.glob({root!r} + "/*.tar")))
    write_sidecars(source, causal_lm_schema())
    merge_sidecars(source)
    result = {{}}
""")


def _best(code: str, repeat: int, key: str) -> dict:
    tries = [_phase(code) for _ in range(repeat)]
    best = min(tries, key=lambda t: t[key])
    return {**best, f"all_{key}": [t[key] for t in tries]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--shards", type=int, nargs="*", default=[20, 2000, 10, 1000, 10_000],
                    help="shard counts; the first two are compared (the issue's target: <= 1.5x)")
    ap.add_argument("--index", type=int, nargs="*", default=[10_000, 100_000])
    ap.add_argument("--state", type=int, nargs="*", default=[10_000, 1_000_000])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--energon", help="a folder holding megatron-energon (pip install --target)")
    ap.add_argument("--throughput", type=int, default=50_000, help="samples timed per loader")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "prealign-bench-scale"))
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    numbers: dict = {}
    enc = _ENERGON_ENCODER.format(energon=args.energon) if args.energon else ""

    print(f"\n| {args.samples:,} samples in | prealign first batch | prealign resume | energon first batch | "
          "energon resume |\n|---|---|---|---|---|", flush=True)

    def cell(r: dict, key: str) -> str:
        return f"{r[key + '_s']:.3f} s ({r[key + '_cpu_s']:.3f} CPU s)"

    for count in args.shards:
        root = os.path.join(args.dir, f"text-{args.samples}-{count}")
        paths = write_text_shards(root, args.samples, per_shard=-(-args.samples // count))
        if not os.path.exists(os.path.join(root, "prealign-index.merged.npz")):
            _index_and_merge(root)
        row = {"prealign": _best(_START.format(root=root), args.repeat, "first_s")}
        if args.energon:
            if not os.path.exists(os.path.join(root, ".nv-meta", "dataset.yaml")):
                row["energon_prepare"] = _phase(_PREPARE.format(energon=args.energon, root=root, workers=2))
            row["energon"] = _best(enc + _ENERGON_START.format(energon=args.energon, root=root), args.repeat,
                                   "first_s")
        numbers[f"start_{count}"] = row
        e = row.get("energon")
        p = row["prealign"]
        print(f"| {len(paths):,} shards | {cell(p, 'first')} | {cell(p, 'resume')} | "
              + (f"{cell(e, 'first')} | {cell(e, 'resume')} |" if e else "(not run) | |"), flush=True)
    if len(args.shards) >= 2:
        first, last = (numbers[f"start_{c}"]["prealign"] for c in args.shards[:2])
        print(f"\nprealign, {args.shards[1]:,} vs {args.shards[0]:,} shards: first batch "
              f"{last['first_s'] / first['first_s']:.2f}x ({last['first_cpu_s'] / first['first_cpu_s']:.2f}x in CPU s), "
              f"resume {last['resume_s'] / first['resume_s']:.2f}x ({last['resume_cpu_s'] / first['resume_cpu_s']:.2f}x "
              f"in CPU s)", flush=True)

    if args.energon and args.shards:
        root = os.path.join(args.dir, f"text-{args.samples}-{args.shards[0]}")
        tp = {k: _phase((enc if k == "energon" else "") + _THROUGHPUT.format(root=root, kind=k,
                                                                             samples=args.throughput))
              for k in ("prealign", "energon")}
        numbers["throughput"] = tp
        print(f"\ntext loader, 2 workers: prealign {tp['prealign']['samples_per_s']:,.0f} samples/s, energon "
              f"{tp['energon']['samples_per_s']:,.0f} samples/s "
              f"({tp['prealign']['samples_per_s'] / tp['energon']['samples_per_s']:.2f}x)", flush=True)

    print("\n| samples | state_dict() |\n|---|---|")
    small = write_text_shards(os.path.join(args.dir, "text-state"), 20_000)
    for n in args.state:
        numbers[f"state_{n}"] = s = _phase(_STATE.format(paths=small, n=n))
        print(f"| {n:,} | {s['state_dict_ms']:.4f} ms |", flush=True)

    print("\n| samples | index, 1 worker | index, 2 workers |\n|---|---|---|")
    for n in args.index:
        paths = write_text_shards(os.path.join(args.dir, f"text-index-{n}"), n)
        one = _best(_INDEX.format(paths=paths, workers=1), args.repeat, "s")
        two = _best(_INDEX.format(paths=paths, workers=2), args.repeat, "s")
        numbers[f"index_{n}"] = {"1": one, "2": two}
        print(f"| {n:,} | {one['s']:.2f} s ({one['cpu_s']:.2f} CPU s) | {two['s']:.2f} s ({two['cpu_s']:.2f} CPU s) |",
              flush=True)

    imports = {m: _best(_IMPORT.format(module=m), args.repeat, "s") for m in ("torch", "prealign.loaders")}
    numbers["import"] = imports
    print(f"\nimport prealign.loaders {imports['prealign.loaders']['s']:.2f} s (import torch alone "
          f"{imports['torch']['s']:.2f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(numbers, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
