"""Start and index at scale (issues #22, #28): first batch and resume against the shard count, with
one sidecar per shard and with a merged index, side by side with Megatron-Energon in the same run;
state_dict() against the sample count, index workers, import time.

    python benchmarks/bench_scale.py [--samples 20000] [--shards 20 2000 100000 20:20000]
                                     [--rounds 5] [--per-shard-max 2000] [--energon-max 2000]
                                     [--no-energon] [--before DIR] [--pattern] [--remote]
                                     [--index 10000 100000]
                                     [--state 10000 1000000] [--floor] [--json out.json]

* ``start``     the same ``--samples`` text samples (``<key>.input_ids.npy``, 8..128 tokens) cut
  into each of ``--shards`` shard counts (a shard count above ``--samples``: one sample per shard,
                so that many samples; ``COUNT:SAMPLES``: that shard count with its own sample
                count, e.g. ``--samples 100000 --shards 20 100000 20:20000`` compares 100,000
                shards with the same samples in 20 shards and with 20,000 samples in 20 shards);
                ``prealign index`` writes a sidecar beside each shard and
                ``prealign index --merge`` one merged index into another folder (``index_dir``), so
                the same shards start both ways. Then, in fresh processes, interleaved over
                ``--rounds`` rounds: a PackedLoader's first batch and a resume (a new loader,
                ``load_state_dict`` of a state taken 8 batches in, its first batch), from the
                per-shard sidecars (up to ``--per-shard-max`` shards), from the merged index, and
                Energon's loader over the same shards (``energon prepare`` run once; up to
                ``--energon-max`` shards); with ``--before DIR`` also the prealign importable from
                ``DIR`` (the code before a change; its sidecars and merged index its own,
                written by it beside hard links to the same shards), in the same rounds. Every
                cell of every shard count runs once per round, in turn. Each cell: median
                [min..max] of wall and CPU seconds (no workers: the CPU time is the work); then
                the ratios the issue sets targets for, of CPU seconds: per-round ratios median
                [min..max], and the ratio of the medians. ``--pattern``: prealign's sides
                (``--before``'s too) name the shards by one brace pattern
                (``"<root>/text-{00000..00019}.tar"``, what the bench writes) instead of a sorted
                glob's list: the start expands it. ``--remote``: also the merged index's start
                with the shards read over HTTP (``http://127.0.0.1:PORT/...``, one URL a shard,
                the list made before the clock starts; the merged index a local ``index_dir``),
                from ``range_server.py`` (ranges, keep-alive) in a process of its own (its CPU not
                counted): what a start over an object store's shards asks of their URLs.
* ``state``     ``state_dict()`` of a prepared loader over ``--state`` samples (mean of 200 calls)
* ``index``     ``write_sidecars`` (what ``prealign index`` runs) with 1 and 2 workers
* ``import``    ``import prealign.loaders`` in a fresh process (and ``import torch`` alone, which it
  needs)
* ``floor``     (``--floor``) the CPU time of the system calls and crc32s reading every per-shard
  sidecar takes (opening and closing each file, reading each, each zip entry's crc32): what no
  reader of that format can go under; and, in the rounds of ``start``, the per-shard start with
  its integrity checks switched off in the benchmark's process (no crc32 of a sidecar, no probe of
  a shard): what the start would cost if those checks were free
* ``throughput`` both loaders' samples/s over the same text samples (2 workers each; ``--throughput
  0``: not run)

Prints Markdown tables; ``--json`` also writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

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
result = {{"first_s": t2 - t1, "resume_s": t4 - t3,
           "first_cpu_s": c2 - c1, "resume_cpu_s": c4 - c3}}
"""
"""First batch of a fresh loader; resume: a new loader restored to a state taken 8 batches in, its
first batch (wall and CPU seconds: no workers, so the CPU time is the work, whatever else loads the
machine). Each side defines ``loader()``, ``save(loader)`` and ``restore(loader, state)``."""

_START = (
    """
import glob
from prealign.loaders import PackedLoader, WebDatasetSource
from prealign.schemas import ParallelLayout, causal_lm_schema
import warnings
warnings.simplefilter("ignore")  # (the per-shard start's advice to merge)
paths = {paths}
def loader():
    return PackedLoader(WebDatasetSource(paths, index_dir={index_dir!r}), schema=causal_lm_schema(),
                        layout=ParallelLayout(tp=2, cp=2), token_budget=8192, seed=1)
def save(loader):
    return loader.state_dict()
def restore(loader, state):
    loader.load_state_dict(state)
"""
    + _TIMED
)

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
index = SampleIndex(lengths=rng.integers(8, 129, n), locations=locations, shards=shard,
                    report=BadDataReport())
loader = PackedLoader(WebDatasetSource(paths, sidecars=False), schema=causal_lm_schema(),
                      layout=ParallelLayout(), token_budget=8192,
                      indexing=IndexOptions(prebuilt=index)).prepare()
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
    return sum(getattr(resource.getrusage(w), a)
               for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for a in ("ru_utime", "ru_stime"))
if __name__ == "__main__":
    t, c = time.perf_counter(), cpu()
    stats = write_sidecars(WebDatasetSource({paths!r}), causal_lm_schema(), workers={workers},
                           force=True)
    result = {{"s": time.perf_counter() - t, "cpu_s": cpu() - c, "samples": stats["samples"]}}
"""

_IMPORT = """
t = time.perf_counter()
import {module}
result = {{"s": time.perf_counter() - t}}
"""


def _shard_urls(root: str, base: str) -> str:
    """The code that names a start's shards as URLs: ``base`` (``http://host:port/folder/``) and
    each file name of a sorted glob of ``root``."""
    return f"[{base!r} + os.path.basename(p) for p in sorted(glob.glob({root!r} + '/*.tar'))]"


def _serve(folder: str) -> tuple[subprocess.Popen, int]:
    """``range_server.py`` over ``folder`` on 127.0.0.1 (ranges and keep-alive, as an object store;
    a process of its own: its CPU is not the loader's), once it answers; ``(process, port)``."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    here = os.path.dirname(os.path.abspath(__file__))
    server = subprocess.Popen(
        [sys.executable, os.path.join(here, "range_server.py"), folder, str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, port
        except OSError:
            time.sleep(0.05)
    server.kill()
    raise RuntimeError("the HTTP server did not start")


def _shard_names(root: str, shards: int, pattern: bool) -> str:
    """The code that names a start's shards: a sorted glob of ``root``, or (``pattern``) one brace
    pattern of them (``write_text_shards`` names shard ``s`` ``text-{s:05d}.tar``)."""
    if not pattern:
        return f"sorted(glob.glob({root!r} + '/*.tar'))"
    if shards > 100_000:
        raise SystemExit(f"--pattern: {shards:,} shards have names of other widths")
    return repr(f"{root}/text-{{00000..{shards - 1:05d}}}.tar")


_ENERGON_START = (
    """
import glob, warnings
warnings.simplefilter("ignore")
sys.path.append({energon!r})
from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset
def loader():
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    ds = get_train_dataset({root!r}, batch_size=64, shuffle_buffer_size=None,
                           max_samples_per_sequence=None, worker_config=wc, task_encoder=Encoder())
    return get_savable_loader(ds)
def save(loader):
    return loader.save_state_rank()
def restore(loader, state):
    loader.restore_state_rank(state)
"""
    + _TIMED
)

_ENERGON_ENCODER = """
import sys
sys.path.append({energon!r})
from megatron.energon import DefaultTaskEncoder
class Encoder(DefaultTaskEncoder):
    def batch(self, samples):
        # variable-length token arrays: a list (prealign packs them; energon's default stacks)
        return samples
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
BaseWebdatasetFactory.prepare_dataset(EPath(root), paths, split_parts_ratio=[("train", 1.0)],
                                      workers={workers}, shuffle_seed=None)
with open(os.path.join(root, ".nv-meta", "dataset.yaml"), "w") as f:
    f.write("sample_type:\\n  __module__: megatron.energon\\n  __class__: TextSample\\n"
            "field_map:\\n  text: input_ids.npy\\n")
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
    loader = PackedLoader(WebDatasetSource(paths), schema=causal_lm_schema(),
                          layout=ParallelLayout(), token_budget=8192, num_workers=2, seed=1)
    def count(batch):
        return len(batch["sample_index"])
else:
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset
    wc = WorkerConfig(rank=0, world_size=1, num_workers=2)
    loader = get_loader(get_train_dataset({root!r}, batch_size=64, shuffle_buffer_size=None,
                                          max_samples_per_sequence=None, worker_config=wc,
                                          task_encoder=Encoder()))
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


def _phase(code: str, path: str | None = None) -> dict:
    """Run ``code`` (defines ``result``) in a fresh interpreter; return its JSON result. ``path``: a
    folder put first on ``PYTHONPATH`` (``--before``: another prealign, imported instead of this
    one)."""
    prog = (
        "import json, os, sys, time\n"
        + code
        + "\nif 'result' in globals(): print('RESULT' + json.dumps(result))"
    )
    env = (
        {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")])),
        }
        if path
        else None
    )
    run = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, env=env)
    if run.returncode or "RESULT" not in run.stdout:
        raise RuntimeError(f"phase failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.rsplit("RESULT", 1)[1])


def _index_and_merge(root: str, merged_dir: str, path: str | None = None) -> None:
    """A sidecar beside each shard of ``root`` (``write_sidecars``, as ``prealign index``),
    and their merged index in ``merged_dir`` alone (a loader with ``index_dir=merged_dir`` reads one
    file); written by the prealign at ``path`` (``--before``: the formats it reads)."""
    _phase(
        f"""
import glob, os
from prealign.loaders import WebDatasetSource
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.index.merged import NAME, merge_sidecars
from prealign.schemas import causal_lm_schema
if __name__ == "__main__":
    source = WebDatasetSource(sorted(glob.glob({root!r} + "/*.tar")))
    # (a pool of 2 on 100k one-sample shards: slower)
    write_sidecars(source, causal_lm_schema(), workers=1)
    os.makedirs({merged_dir!r}, exist_ok=True)
    merge_sidecars(source, os.path.join({merged_dir!r}, NAME))
    result = {{}}
""",
        path,
    )


def _linked(root: str, to: str) -> None:
    """The shards of ``root`` hard-linked into ``to`` (copied where a link fails): the same bytes,
    with sidecars of their own beside them."""
    os.makedirs(to, exist_ok=True)
    for name in sorted(os.listdir(root)):
        there = os.path.join(to, name)
        if name.endswith(".tar") and not os.path.exists(there):
            try:
                os.link(os.path.join(root, name), there)
            except OSError:
                shutil.copyfile(os.path.join(root, name), there)


_FLOOR = """
import glob, itertools, os, struct, time, zipfile, zlib
paths = sorted(glob.glob({root!r} + "/*.prealign-index.npz"))
flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
buf = bytearray(max(map(os.path.getsize, paths)) + 1)
view = memoryview(buf)
entries = []
for p in paths:  # (each zip entry's stored bytes: what its crc32 covers)
    with zipfile.ZipFile(p) as z:
        data = open(p, "rb").read()
        for info in z.infolist():
            at = info.header_offset  # (the local header's own name and extra lengths: its
            name, extra = struct.unpack("<HH", data[at + 26 : at + 30])  # zip64 extra field)
            start = at + 30 + name + extra
            entries.append(data[start : start + info.compress_size])


def opened():
    for fd in list(map(os.open, paths, itertools.repeat(flags))):
        os.close(fd)


def read():
    for fd in list(map(os.open, paths, itertools.repeat(flags))):
        os.preadv(fd, [view], 0)
        os.close(fd)


def crcs():
    list(map(zlib.crc32, entries))


result = {{}}
for name, fn in (("open_close", opened), ("open_read_close", read), ("crc32", crcs)):
    fn()
    times = []
    for _ in range(9):
        c = time.process_time()
        fn()
        times.append(time.process_time() - c)
    result[name] = sorted(times)[4]
result["files"], result["entries"] = len(paths), len(entries)
"""
"""The floor under a start that reads every per-shard sidecar: CPU seconds (median of 9, warm page
cache) to open and close every sidecar file, to open, read and close it (one ``preadv``), and to
take the crc32 of each zip entry (the integrity check a sidecar's format asks for)."""


_UNCHECKED = """
import threading
import numpy as np
import prealign.loaders.index.shard_checks as shard_checks
import prealign.loaders.index.sidecar_bulk as sidecar_bulk
sidecar_bulk._Layout.crc_ok = lambda self, rows: np.ones(len(rows), bool)
recorded = threading.local()
shard_checks.probe_digest = lambda first, last, size, version: recorded.probe
checked = shard_checks.ShardChecks.__call__
def unhashed(self, source, shard, opened=None):
    recorded.probe = self.probes[shard].decode()
    return checked(self, source, shard, opened)
shard_checks.ShardChecks.__call__ = unhashed
"""
"""A counterfactual start from per-shard sidecars (``--floor``, never a mode of the library): no
sidecar's crc32 taken (each file read in bulk taken as intact) and no shard's probe hashed at its
first read (the digest taken as the recorded one; the shard read as the real start reads it, its
size, first and last samples still checked): what the sidecar start would cost if its integrity
checks cost nothing."""


def _stats(values: list[float]) -> dict:
    v = sorted(values)
    return {
        "median": v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2,
        "min": v[0],
        "max": v[-1],
        "all": values,
    }


def _cell(runs: dict, key: str) -> str:
    """``median [min..max] s (CPU median [min..max] s)`` of ``key`` (``first`` or ``resume``)."""
    w, c = runs[key + "_s"], runs[key + "_cpu_s"]
    return (
        f"{w['median']:.3f} [{w['min']:.3f}..{w['max']:.3f}] s (CPU {c['median']:.3f} "
        f"[{c['min']:.3f}..{c['max']:.3f}])"
    )


def _interleaved(contenders: dict, rounds: int) -> dict:
    """``{cell: {key: _stats}}``: each contender (``cell: (code, PYTHONPATH or None)``) run in a
    fresh process once per round, all of them in turn in every round (so a busy moment hits all
    cells of that round)."""
    got: dict = {cell: [] for cell in contenders}
    for r in range(rounds):
        for cell, (code, path) in contenders.items():
            got[cell].append(_phase(code, path))
        print(f"  round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    return {
        cell: {k: _stats([t[k] for t in tries]) for k in tries[0]} for cell, tries in got.items()
    }


def _ratio(num: dict, den: dict, key: str) -> str:
    """``median [min..max]`` of the per-round ratios ``num / den`` of ``key`` (same round, same
    machine moment), then the ratio of the medians."""
    per_round = [a / b for a, b in zip(num[key]["all"], den[key]["all"])]
    r = _stats(per_round)
    return (
        f"{r['median']:.2f}x [{r['min']:.2f}..{r['max']:.2f}] "
        f"(medians {num[key]['median'] / den[key]['median']:.2f}x)"
    )


def _best(code: str, repeat: int, key: str) -> dict:
    tries = [_phase(code) for _ in range(repeat)]
    best = min(tries, key=lambda t: t[key])
    return {**best, f"all_{key}": [t[key] for t in tries]}


def _shard_count(text: str, samples: int) -> tuple[int, int]:
    """``(shards, samples)`` of a ``--shards`` entry: ``COUNT`` (``--samples``, or one sample per
    shard when there are more shards) or ``COUNT:SAMPLES``."""
    count, _, own = text.partition(":")
    return int(count), int(own) if own else max(samples, int(count))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument(
        "--shards",
        nargs="*",
        default=["20", "2000", "100000"],
        help="shard counts (COUNT, or COUNT:SAMPLES for a sample count of its own); each is "
        "compared with every one of fewer shards (the issue's target: <= 1.5x)",
    )
    ap.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds of the start (fresh processes)"
    )
    ap.add_argument(
        "--per-shard-max", type=int, default=2000, help="largest shard count started from sidecars"
    )
    ap.add_argument(
        "--energon-max", type=int, default=2000, help="largest shard count Energon is started on"
    )
    ap.add_argument("--no-energon", action="store_true")
    ap.add_argument(
        "--before",
        help="a folder holding another prealign as an importable package (``prealign/``): "
        "its starts run as more contenders of the same rounds (before / after a change)",
    )
    ap.add_argument(
        "--pattern",
        action="store_true",
        help="prealign's starts name the shards by one brace pattern, not a sorted glob's list",
    )
    ap.add_argument(
        "--remote",
        action="store_true",
        help="also start from the merged index with the shards read over HTTP (127.0.0.1)",
    )
    ap.add_argument(
        "--energon", default="", help="a folder holding megatron-energon, when not installed"
    )
    ap.add_argument("--index", type=int, nargs="*", default=[10_000, 100_000])
    ap.add_argument("--state", type=int, nargs="*", default=[10_000, 1_000_000])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--throughput", type=int, default=50_000, help="samples timed per loader (0: not run)"
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also time the system calls and crc32s that reading every sidecar takes",
    )
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "prealign-bench-scale"))
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    args.shards = [_shard_count(s, args.samples) for s in args.shards]
    numbers: dict = {}
    energon = not args.no_energon
    enc = _ENERGON_ENCODER.format(energon=args.energon) if energon else ""

    print(
        f"\nfirst batch and resume, median [min..max] of {args.rounds} interleaved rounds (fresh "
        f"processes, no workers)",
        flush=True,
    )
    contenders: dict = {}
    sizes = {}
    os.makedirs(args.dir, exist_ok=True)
    server, port = _serve(args.dir) if args.remote else (None, 0)
    for count, n in args.shards:
        root = os.path.join(args.dir, f"text-{n}-{count}")
        merged_dir = root + "-merged"
        sizes[(count, n)] = (len(write_text_shards(root, n, per_shard=-(-n // count))), n)
        names = _shard_names(root, sizes[(count, n)][0], args.pattern)
        if not os.path.exists(os.path.join(merged_dir, "prealign-index.merged.npz")):
            _index_and_merge(root, merged_dir)
        versions = [("", None)] + ([(" (before)", args.before)] if args.before else [])
        for tag, path in versions:
            # each reads the formats it writes: --before's sidecars beside links to the same shards
            data, own = (root + "-before", merged_dir + "-before") if path else (root, merged_dir)
            if path and not (
                os.path.isdir(data)
                and os.path.exists(os.path.join(own, "prealign-index.merged.npz"))
            ):  # (a --dir of an older run may hold the merged file alone)
                _linked(root, data)
                _index_and_merge(data, own, path)
            mine = _shard_names(data, sizes[(count, n)][0], args.pattern) if path else names
            contenders[((count, n), "merged index" + tag)] = (
                _START.format(paths=mine, index_dir=own),
                path,
            )
            if args.remote:
                base = f"http://127.0.0.1:{port}/{os.path.relpath(data, args.dir)}/"
                contenders[((count, n), "merged index, over HTTP" + tag)] = (
                    _START.format(paths=_shard_urls(data, base), index_dir=own),
                    path,
                )
            if count <= args.per_shard_max:
                contenders[((count, n), "sidecars" + tag)] = (
                    _START.format(paths=mine, index_dir=None),
                    path,
                )
            if count <= args.per_shard_max and args.floor and not path:
                contenders[((count, n), "sidecars, crc32 and probes unchecked")] = (
                    _UNCHECKED + _START.format(paths=mine, index_dir=None),
                    None,
                )
        if energon and count <= args.energon_max:
            if not os.path.exists(os.path.join(root, ".nv-meta", "dataset.yaml")):
                numbers[f"energon_prepare_{count}"] = _phase(
                    _PREPARE.format(energon=args.energon, root=root, workers=2)
                )
            contenders[((count, n), "energon")] = (
                enc + _ENERGON_START.format(energon=args.energon, root=root),
                None,
            )
    try:
        got = _interleaved(contenders, args.rounds)
    finally:
        if server is not None:
            server.kill()
            server.wait()
    print("\n| shards (samples) | from | first batch | resume |\n|---|---|---|---|")
    for ((count, n), name), runs in got.items():
        numbers.setdefault(f"start_{count}" + (f"_{n}" if n != args.samples else ""), {})[name] = (
            runs
        )
        print(
            f"| {sizes[(count, n)][0]:,} ({sizes[(count, n)][1]:,}) | {name} | "
            f"{_cell(runs, 'first')} | {_cell(runs, 'resume')} |",
            flush=True,
        )
    print(
        "\nratios, CPU seconds (per-round median [min..max], then the ratio of the medians); the "
        "targets of issue #28: <= 1.5x the start over fewer shards, <= 1.0x Energon's resume\n"
    )
    for big in args.shards:
        for small in args.shards:
            if small[0] >= big[0]:
                continue
            for name in [n for (c, n) in got if c == big and (small, n) in got]:
                now, then = got[(big, name)], got[(small, name)]
                print(
                    f"- {name}, {big[0]:,} shards ({big[1]:,} samples) vs {small[0]:,} "
                    f"({small[1]:,}): first batch {_ratio(now, then, 'first_cpu_s')}, "
                    f"resume {_ratio(now, then, 'resume_cpu_s')}",
                    flush=True,
                )
    for shards in args.shards:
        if (shards, "energon") in got:
            local = [n for (c, n) in got if c == shards and n.startswith("merged index")]
            for name in [n for n in local if "HTTP" not in n]:
                m, e = got[(shards, name)], got[(shards, "energon")]
                print(
                    f"- {name} / Energon at {shards[0]:,} shards: first batch "
                    f"{_ratio(m, e, 'first_cpu_s')}, resume {_ratio(m, e, 'resume_cpu_s')}",
                    flush=True,
                )

    if args.floor:
        print(
            "\n| shards | open + close | open + read + close | crc32 of the entries |\n"
            "|---|---|---|---|"
        )
    for count, n in args.shards if args.floor else ():
        if count > args.per_shard_max:
            continue
        f = _phase(_FLOOR.format(root=os.path.join(args.dir, f"text-{n}-{count}")))
        numbers[f"floor_{count}"] = f
        print(
            f"| {count:,} | {f['open_close'] * 1e3:.2f} ms | {f['open_read_close'] * 1e3:.2f} ms "
            f"| {f['crc32'] * 1e3:.2f} ms ({f['entries']:,} entries) |",
            flush=True,
        )

    if energon and args.shards and args.throughput:
        root = os.path.join(args.dir, f"text-{args.shards[0][1]}-{args.shards[0][0]}")
        tp = {
            k: _phase(
                (enc if k == "energon" else "")
                + _THROUGHPUT.format(root=root, kind=k, samples=args.throughput)
            )
            for k in ("prealign", "energon")
        }
        numbers["throughput"] = tp
        print(
            f"\ntext loader, 2 workers: prealign {tp['prealign']['samples_per_s']:,.0f} "
            f"samples/s, energon {tp['energon']['samples_per_s']:,.0f} samples/s "
            f"({tp['prealign']['samples_per_s'] / tp['energon']['samples_per_s']:.2f}x)",
            flush=True,
        )

    if args.state:
        print("\n| samples | state_dict() |\n|---|---|")
    small = write_text_shards(os.path.join(args.dir, "text-state"), 20_000)
    for n in args.state:
        numbers[f"state_{n}"] = s = _phase(_STATE.format(paths=small, n=n))
        print(f"| {n:,} | {s['state_dict_ms']:.4f} ms |", flush=True)

    if args.index:
        print("\n| samples | index, 1 worker | index, 2 workers |\n|---|---|---|")
    for n in args.index:
        paths = write_text_shards(os.path.join(args.dir, f"text-index-{n}"), n)
        one = _best(_INDEX.format(paths=paths, workers=1), args.repeat, "s")
        two = _best(_INDEX.format(paths=paths, workers=2), args.repeat, "s")
        numbers[f"index_{n}"] = {"1": one, "2": two}
        print(
            f"| {n:,} | {one['s']:.2f} s ({one['cpu_s']:.2f} CPU s) | {two['s']:.2f} s "
            f"({two['cpu_s']:.2f} CPU s) |",
            flush=True,
        )

    imports = {
        m: _best(_IMPORT.format(module=m), args.repeat, "s") for m in ("torch", "prealign.loaders")
    }
    numbers["import"] = imports
    print(
        f"\nimport prealign.loaders {imports['prealign.loaders']['s']:.2f} s (import torch alone "
        f"{imports['torch']['s']:.2f} s)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(numbers, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
