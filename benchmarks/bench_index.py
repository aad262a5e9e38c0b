"""Index throughput (issue #28): ``prealign index --text`` against ``energon prepare`` and against
Python's ``tarfile`` merely listing the members, on the same shards, in the same run, interleaved
over rounds.

    python benchmarks/bench_index.py [--sizes 10000 100000 1000000] [--workers 1 2] [--rounds 5]
                                     [--dir DIR] [--no-energon] [--json out.json]

Data: ``--sizes`` pre-tokenized samples (``<key>.input_ids.npy``, int32, 16..256 tokens), 2,000 a
shard, written once under ``--dir`` (raw tar bytes, reused by later runs). Each round runs, in fresh
processes and in this order, for each size and worker count:

* ``prealign``  ``prealign index --text --force --workers W --out DIR`` as a user runs it (import
  included)
* ``import``    the same interpreter importing what that command imports, and nothing else
* ``energon``   ``BaseWebdatasetFactory.prepare_dataset(..., workers=W)`` (what ``energon prepare``
  runs; imports included)
* ``energon import``  the interpreter importing what that script imports, and nothing else
* ``tarfile``   ``tarfile.open(shard).getmembers()`` over the same shards (CPU of the listing alone)
* ``--reference``  ``write_sidecars`` in process, its CPU alone: the bulk pass, then the reference
                tar reader (``tar_reader.iter_members``, what every shard took before issue #28)

Wall and CPU seconds of each: the CPU of the process and of every descendant (``RUSAGE_CHILDREN`` of
a small parent that is their subreaper on Linux, so a pool's workers, children of a forkserver that
outlives the pool and exits unreaped by the command, are counted too, as are energon's); the table
gives
median [min..max] over the rounds of wall and CPU seconds, CPU-µs a sample beyond the import, and
per-round ratios (energon / prealign, whole and beyond both imports; prealign beyond its import /
tarfile). The machine's load only adds time: compare ratios from the same run, never figures from
two runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

PER_SHARD = 2_000
_IMPORT = (  # (torch is not among them: the command imports none, issue #28)
    "import prealign.loaders.cli.main, prealign.loaders.cli.index_cmd, "
    "prealign.loaders.index.header_pass, prealign.loaders.index.merged, braceexpand, tarfile"
)
_ENERGON = """
import glob, os, sys, warnings
warnings.simplefilter("ignore")
from megatron.energon.epathlib import EPath
from megatron.energon.flavors import BaseWebdatasetFactory
root = sys.argv[1]
paths = sorted(os.path.basename(p) for p in glob.glob(root + "/*.tar"))
BaseWebdatasetFactory.prepare_dataset(EPath(root), paths, split_parts_ratio=[("train", 1.0)],
                                      workers=int(sys.argv[2]), shuffle_seed=None)
"""
_ENERGON_IMPORT = "from megatron.energon.flavors import BaseWebdatasetFactory"
_IN_PROCESS = """
import glob, sys, tempfile, time
from prealign.loaders import WebDatasetSource
from prealign.loaders.index import header_pass
from prealign.loaders.sources.tar_index import Unhandled
from prealign.schemas import causal_lm_schema
def reference(records, f):
    raise Unhandled("the reference pass")
if sys.argv[2] == "reference":
    header_pass.bulk_text_pass = reference
src = WebDatasetSource(sorted(glob.glob(sys.argv[1] + "/*.tar")), sidecars=False)
c = time.process_time()
header_pass.write_sidecars(src, causal_lm_schema(), out_dir=tempfile.mkdtemp(), force=True)
print(time.process_time() - c)
"""
_TARFILE = """
import glob, sys, tarfile, time
c = time.process_time()
n = sum(len(tarfile.open(p).getmembers()) for p in sorted(glob.glob(sys.argv[1] + "/*.tar")))
print(n, time.process_time() - c)
"""


def _npy_headers() -> np.ndarray:
    """``uint8 [257, 128]``: the version-1 ``.npy`` header of an int32 array of each length
    0..256."""
    out = np.zeros((257, 128), np.uint8)
    for n in range(257):
        text = b"{'descr': '<i4', 'fortran_order': False, 'shape': (%d,), }" % n
        text += b" " * (127 - 10 - len(text)) + b"\n"
        out[n] = np.frombuffer(
            b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text, np.uint8
        )
    return out


def _tar_headers(first: int, sizes: np.ndarray) -> np.ndarray:
    """``uint8 [n, 512]``: ustar headers of members ``%09d.input_ids.npy`` (keys ``first..``) of
    ``sizes`` bytes."""
    n = len(sizes)
    head = np.zeros((n, 512), np.uint8)
    keys = np.arange(first, first + n)
    for d in range(9):  # the key's digits
        head[:, 8 - d] = 48 + (keys // 10**d) % 10
    head[:, 9:23] = np.frombuffer(b".input_ids.npy", np.uint8)
    for at, text in (
        (100, b"0000644\0"),
        (108, b"0000000\0"),
        (116, b"0000000\0"),
        (136, b"00000000000\0"),
        (156, b"0"),
        (257, b"ustar\0"),
        (263, b"00"),
    ):
        head[:, at : at + len(text)] = np.frombuffer(text, np.uint8)
    for d in range(11):  # size: 11 octal digits and a NUL
        head[:, 134 - d] = 48 + (sizes // 8**d) % 8
    head[:, 148:156] = 32
    chk = head.sum(1, dtype=np.int64)
    for d in range(6):  # checksum: 6 octal digits, a NUL, a space
        head[:, 153 - d] = 48 + (chk // 8**d) % 8
    head[:, 154] = 0
    return head


def write_shards(
    root: str,
    n: int,
    per_shard: int = PER_SHARD,
    seed: int = 0,
    distinct: int | None = None,
    like: str | None = None,
) -> list[str]:
    """``ceil(n / per_shard)`` tar shards of pre-tokenized samples (int32, 16..256 tokens); existing
    ones kept. ``distinct``: only the first ``distinct`` shards are written, the others are hard
    links to them in turn (taken from folder ``like`` when it holds them: a large set costs no disk
    and no writing)."""
    os.makedirs(root, exist_ok=True)
    lengths = np.random.default_rng(seed).integers(16, 257, n)
    npy = _npy_headers()
    paths = []
    for s in range(-(-n // per_shard)):
        path = os.path.join(root, f"text-{s:06d}.tar")
        paths.append(path)
        if os.path.exists(path):
            continue
        if distinct is not None and s >= distinct:
            os.link(paths[s % distinct], path)
            continue
        source = os.path.join(like, os.path.basename(path)) if like else None
        if source is not None and os.path.exists(source) and (s + 1) * per_shard <= n:
            os.link(source, path)
            continue
        lo, hi = s * per_shard, min(n, (s + 1) * per_shard)
        ln = lengths[lo:hi]
        sizes = 128 + 4 * ln
        spans = 512 + (sizes + 511) // 512 * 512
        at = np.concatenate([[0], np.cumsum(spans)])
        body = np.zeros(int(at[-1]) + 1024, np.uint8)
        body[at[:-1, None] + np.arange(512)] = _tar_headers(lo, sizes)
        body[at[:-1, None] + 512 + np.arange(128)] = npy[ln]
        for k, (a, m) in enumerate(zip(at[:-1].tolist(), ln.tolist())):
            ids = (np.arange(m, dtype=np.int32) * 7 + lo + k) % 30000 + 1
            body[a + 640 : a + 640 + 4 * m] = ids.view(np.uint8)
        with open(path + ".part", "wb") as f:
            f.write(body.tobytes() + bytes(-len(body) % 10240))
        os.replace(path + ".part", path)
    return paths


_REAPER = """
import ctypes, json, os, resource, subprocess, sys, time
if sys.platform == "linux":  # PR_SET_CHILD_SUBREAPER: orphaned descendants become our children
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
t = time.perf_counter()
out = subprocess.run(sys.argv[1:], capture_output=True, text=True)
wall = time.perf_counter() - t
while True:  # the orphans (a forkserver, what it forked and left): reaped, so their CPU counts
    try:
        os.wait()
    except ChildProcessError:
        break
r = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"wall": wall, "cpu": r.ru_utime + r.ru_stime, "rc": out.returncode,
                  "stdout": out.stdout, "stderr": out.stderr[-3000:]}))
"""


def _run(args: list[str]) -> tuple[float, float, str]:
    """Wall and CPU seconds of a child process (its CPU and every descendant's, reaped by a parent
    that is their subreaper: the parent's own start is not counted), and its stdout."""
    out = subprocess.run([sys.executable, "-c", _REAPER, *args], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"the reaper of {args[:4]} failed:\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if r["rc"]:
        raise SystemExit(f"{args[:4]} failed:\n{r['stderr']}")
    return r["wall"], r["cpu"], r["stdout"]


def _round(
    root: str, paths: list[str], workers: int, energon: bool, tar: bool, reference: bool
) -> dict:
    out_dir = tempfile.mkdtemp(prefix="bench-index-")
    r = {}
    if reference:  # the pass alone, in process, one worker: bulk, then the reference tar reader
        for kind in ("bulk", "reference"):
            wall, _, text = _run([sys.executable, "-c", _IN_PROCESS, root, kind])
            r[f"{kind}_pass"] = (wall, float(text.split()[-1]))
    r["prealign"] = _run(
        [
            sys.executable,
            "-m",
            "prealign.loaders.cli.main",
            "index",
            "--text",
            "--force",
            "--workers",
            str(workers),
            "--out",
            out_dir,
            *paths,
        ]
    )[:2]
    r["import"] = _run([sys.executable, "-c", _IMPORT])[:2]
    if energon:
        r["energon"] = _run([sys.executable, "-c", _ENERGON, root, str(workers)])[:2]
        r["energon_import"] = _run([sys.executable, "-c", _ENERGON_IMPORT])[:2]
    if tar:
        wall, cpu, text = _run([sys.executable, "-c", _TARFILE, root])
        r["tarfile"] = (wall, float(text.split()[1]))
    for name in os.listdir(out_dir):
        os.remove(os.path.join(out_dir, name))
    os.rmdir(out_dir)
    return r


def _spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}..{fmt.format(max(xs))}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "prealign-bench-index"))
    ap.add_argument("--no-energon", action="store_true", help="leave energon prepare out")
    ap.add_argument("--no-tarfile", action="store_true", help="leave the tarfile listing out")
    ap.add_argument(
        "--reference",
        action="store_true",
        help="also the pass alone in process, bulk and "
        "with the reference tar reader (the path before issue #28), CPU of the pass only",
    )
    ap.add_argument("--json", help="write every round's numbers here")
    ap.add_argument(
        "--distinct-shards",
        type=int,
        help="write this many shards, hard-link the rest to them "
        "(a 10M-sample set from the 1M one; then read from the page cache, so an upper bound)",
    )
    args = ap.parse_args()
    energon = not args.no_energon
    smaller = {
        n: os.path.join(args.dir, f"text-{m}")
        for n in args.sizes
        for m in (n // 10, n // 100)
        if os.path.isdir(os.path.join(args.dir, f"text-{m}"))
    }
    data = {
        n: write_shards(
            os.path.join(args.dir, f"text-{n}"),
            n,
            distinct=args.distinct_shards,
            like=smaller.get(n),
        )
        for n in args.sizes
    }
    rounds: dict = {(n, w): [] for n in args.sizes for w in args.workers}
    for k in range(args.rounds):  # interleaved: every contender of every cell once a round
        for n in args.sizes:
            for w in args.workers:
                rounds[n, w].append(
                    _round(
                        os.path.join(args.dir, f"text-{n}"),
                        data[n],
                        w,
                        energon,
                        not args.no_tarfile,
                        args.reference,
                    )
                )
                if (
                    args.json
                ):  # (after every round: a long run stopped early keeps what it measured)
                    with open(args.json, "w") as f:
                        json.dump({f"{n}/{w}": rs for (n, w), rs in rounds.items()}, f, indent=1)
                print(
                    f"round {k + 1}/{args.rounds} {n:,} samples {w} worker(s): "
                    + ", ".join(
                        f"{c} {v[0]:.2f} s / {v[1]:.2f} CPU-s" for c, v in rounds[n, w][-1].items()
                    ),
                    file=sys.stderr,
                    flush=True,
                )
    print(
        "\n| samples | workers | prealign wall s | prealign CPU s | CPU-µs a sample beyond import "
        "| samples per CPU-s beyond import | beyond import / tarfile listing CPU |"
        + (
            " energon wall s | energon CPU s | energon / prealign wall | energon / prealign CPU | "
            "the same CPU, beyond both imports |"
            if energon
            else ""
        )
    )
    print("|---" * (7 + 5 * energon) + "|")
    for (n, w), rs in rounds.items():
        pw, pc = [r["prealign"][0] for r in rs], [r["prealign"][1] for r in rs]
        beyond = [r["prealign"][1] - r["import"][1] for r in rs]
        tar = [r["tarfile"][1] for r in rs] if "tarfile" in rs[0] else [float("nan")] * len(rs)
        row = (
            f"| {n:,} | {w} | {_spread(pw)} | {_spread(pc)} | "
            f"{_spread([1e6 * b / n for b in beyond], '{:.1f}')} | "
            f"{_spread([n / b for b in beyond], '{:,.0f}')} | "
            f"{_spread([b / t for b, t in zip(beyond, tar)])} |"
        )
        if energon:
            ew, ec = [r["energon"][0] for r in rs], [r["energon"][1] for r in rs]
            eb = [r["energon"][1] - r["energon_import"][1] for r in rs]
            row += (
                f" {_spread(ew)} | {_spread(ec)} | {_spread([e / p for e, p in zip(ew, pw)])} | "
                f"{_spread([e / p for e, p in zip(ec, pc)])} | "
                f"{_spread([e / b for e, b in zip(eb, beyond)])} |"
            )
        print(row, flush=True)
    if args.reference:
        print(
            "\n| samples | the pass in process: bulk CPU s | reference tar reader CPU s | "
            "reference / bulk |\n|---|---|---|---|"
        )
        for (n, w), rs in rounds.items():
            bulk, ref = [r["bulk_pass"][1] for r in rs], [r["reference_pass"][1] for r in rs]
            print(
                f"| {n:,} | {_spread(bulk)} | {_spread(ref)} | "
                f"{_spread([b / a for a, b in zip(bulk, ref)])} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
