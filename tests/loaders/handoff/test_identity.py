"""A transform's identity (loaders/handoff/identity.py): the share key and the index key are the
code, the globals it reads and its state, the same in every process; what has no stable form is
refused (issue
#31)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from prealign.loaders import WebDatasetSource
from prealign.loaders.handoff.fingerprint import transform_fingerprint
from prealign.loaders.handoff.identity import Unfingerprintable, canonical_digest, identity_fields
from prealign.schemas.errors import ConfigError
from tests import ROOT as REPO
from tests.loader_helpers import sample_lengths, write_shards

ROOT = str(REPO)  # cwd and PYTHONPATH of the child processes


def _module(folder, source: str):
    """``source`` loaded as the module ``jobmod`` from ``folder`` (two folders: two modules of one
    name)."""
    import importlib.util

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "jobmod.py")
    with open(path, "w") as f:
        f.write(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location("jobmod", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# the attacks of issue #31, as jobmod.py sources: (job A, job B), the same names, other outputs
PLAIN = (
    "import numpy as np\ndef transform(s):\n    return {'input_ids': "
    "np.asarray(s['input_ids.npy'])}\n",
    "import numpy as np\ndef transform(s):\n    return {'input_ids': "
    "np.asarray(s['input_ids.npy']) + 1}\n",
)
GLOBAL = tuple(
    f"""
import numpy as np
OFFSET = {k}
class Shift:
    def __call__(self, s):
        return {{'input_ids': np.asarray(s['input_ids.npy']) + OFFSET}}
def make():
    return Shift()
"""
    for k in (0, 3)
)


def _transform(mod):
    return mod.make() if hasattr(mod, "make") else mod.transform


@pytest.mark.parametrize("sources", [PLAIN, GLOBAL], ids=["function body", "module global"])
def test_same_names_other_code_or_globals_other_fingerprints(tmp_path, sources):
    a, b = (_transform(_module(tmp_path / n, s)) for n, s in zip("ab", sources))
    assert transform_fingerprint(a, owner="t") != transform_fingerprint(b, owner="t")
    again = _transform(_module(tmp_path / "c", sources[0]))
    assert transform_fingerprint(again, owner="t") == transform_fingerprint(
        a, owner="t"
    )  # same code, same key


def test_the_index_key_is_the_same_identity(tmp_path):
    from prealign.loaders.index.sidecar import config_key, transform_difference, transform_fields

    paths = write_shards(str(tmp_path / "d"), sample_lengths(6), num_shards=1)
    a, b = (
        WebDatasetSource(paths, transform=_transform(_module(tmp_path / n, s)))
        for n, s in zip("ab", PLAIN)
    )
    assert config_key(a) != config_key(b)
    assert "transform_code: indexed with" in transform_difference(
        {"transform": transform_fields(a)}, b
    )


def _closure(k):
    def f(x):
        return x + k

    return f


def _defaults(x, k=1):
    return x + k


def _kwdefaults(x, *, k=1):
    return x + k


def _recursive(n):
    return 1 if n < 1 else n * _recursive(n - 1)


def test_closures_defaults_and_cycles():
    assert canonical_digest(_closure(1)) != canonical_digest(_closure(2))
    assert canonical_digest(_closure(1)) == canonical_digest(_closure(1))
    before = (
        canonical_digest(_defaults),
        canonical_digest(_kwdefaults),
        canonical_digest(_recursive),
    )
    _defaults.__defaults__, _kwdefaults.__kwdefaults__ = (2,), {"k": 2}
    try:
        assert (
            canonical_digest(_defaults) != before[0] and canonical_digest(_kwdefaults) != before[1]
        )
    finally:
        _defaults.__defaults__, _kwdefaults.__kwdefaults__ = (1,), {"k": 1}
    assert canonical_digest(_recursive) == before[2]  # a function naming itself: followed once
    assert canonical_digest(0.1) != canonical_digest(0.1 + 1e-17 * 2) or 0.1 == 0.1 + 2e-17
    assert canonical_digest(0.0) != canonical_digest(-0.0)  # floats exactly


def test_a_transform_with_no_stable_form_is_refused_naming_it(tmp_path):
    sock = socket.socket()
    try:
        with pytest.raises(
            ConfigError,
            match=r"the transform .*<lambda> cannot be fingerprinted .*closure sock"
            r".*socket.*transform_key",
        ):
            transform_fingerprint(lambda s: sock, owner="BatchShare")
    finally:
        sock.close()
    with open(tmp_path / "f", "w") as handle:
        with pytest.raises(Unfingerprintable, match="TextIOWrapper"):
            identity_fields(_Holding(handle))
    assert transform_fingerprint(_Holding(handle), owner="t", key="named") == "key:named"


class _Holding:
    def __init__(self, thing):
        self.thing = thing

    def __call__(self, s):
        return s


class _WithSet:
    def __init__(self):
        self.stop = {f"tok{i}" for i in range(50)}
        self.table = {frozenset({"a", "b", str(i)}): i for i in range(20)}

    def __call__(self, s):
        return s


def _fingerprint_here() -> None:
    print(transform_fingerprint(_WithSet(), owner="t"))


@pytest.mark.slow
def test_a_transform_holding_a_set_has_one_fingerprint_in_every_process():
    prints = set()
    for seed in ("1", "2", "3", "4"):
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "from tests.loaders.handoff.test_identity import _fingerprint_here as f; f()",
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": ROOT},
            capture_output=True,
            text=True,
            check=True,
        )
        prints.add(out.stdout.strip())
    assert len(prints) == 1, prints


# ---- two jobs on one node, one run name: real BatchShare, two processes
# ------------------------------------
def job_main(shards, index_path, module_dir, out, *, cp_rank, cache, ready, crash=False):
    """One CP rank (of 2) of a job whose transform is ``module_dir``/jobmod.py: its unshared
    batches, then its batches with ``BatchShare(run="same")`` once every job named in ``ready`` has
    come this far."""
    import time

    from prealign.loaders import BatchShare, IndexOptions, PackedLoader, SampleIndex
    from prealign.schemas import ParallelLayout, causal_lm_schema
    from tests.loaders.handoff.test_media_share import _digest

    sys.path.insert(0, module_dir)
    import jobmod

    source = WebDatasetSource(shards, transform=_transform(jobmod))
    index = SampleIndex.load(index_path)

    def loader(share=None):
        return PackedLoader(
            source,
            schema=causal_lm_schema(),
            layout=ParallelLayout(cp=2),
            token_budget=256,
            cp_rank=cp_rank,
            indexing=IndexOptions(prebuilt=index),
            share=share,
        )

    own = [_digest(b) for b in loader()]
    open(ready[cp_rank], "w").close()
    while not all(os.path.exists(r) for r in ready):
        time.sleep(0.01)
    shared = loader(BatchShare(run="same", cache_dir=cache))
    got = [_digest(b) for b in shared]
    stats = shared._loader.collate_fn.stats
    with open(out, "w") as f:
        json.dump({"own": own, "got": got, "shared": stats.shared, "computed": stats.computed}, f)
    if crash:  # no exit hooks: its published records stay behind, as a crashed job's do
        os._exit(0)


def _run_jobs(tmp_path, shards, index_path, jobs, *, together: bool) -> list[dict]:
    """``jobs``: (module folder, cp_rank, crash) each; run at once or one after the other."""
    ready = [str(tmp_path / f"ready{r}") for r in range(2)]
    if not together:
        for r in ready:
            open(r, "w").close()
    procs, outs = [], []
    for i, (folder, rank, crash) in enumerate(jobs):
        outs.append(str(tmp_path / f"out{i}.json"))
        code = (
            f"from tests.loaders.handoff.test_identity import job_main; job_main({shards!r}, "
            f"{index_path!r}, {str(folder)!r}, "
            f"{outs[-1]!r}, cp_rank={rank}, cache={str(tmp_path / 'cache')!r}, ready={ready!r}, "
            f"crash={crash})"
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}
            )
        )
        if not together:
            assert procs[-1].wait(timeout=300) == 0
    for p in procs:
        assert p.wait(timeout=300) == 0
    return [json.load(open(o)) for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["function body", "module global", "fixed and restarted"])
def test_two_jobs_with_one_run_name_read_none_of_each_others_batches(tmp_path, case):
    """Issue #31: 11 of 11 batches came from the peer job. Job A (CP rank 0) and job B (CP rank 1)
    of one node, one ``BatchShare(run=...)``, transforms of one name and other outputs: each gets
    its own batches, 0 read from the other. "fixed and restarted": job A publishes an epoch and
    crashes (its records stay), then its fixed transform restarts under the same run name."""
    from prealign.loaders import build_index
    from prealign.schemas import causal_lm_schema

    shards = write_shards(str(tmp_path / "data"), sample_lengths(40, high=50), num_shards=2)
    index_path = str(tmp_path / "index.npz")
    build_index(WebDatasetSource(shards), causal_lm_schema(), num_workers=0).save(index_path)
    sources = GLOBAL if case == "module global" else PLAIN
    folders = []
    for name, src in zip("ab", sources):
        folders.append(tmp_path / name)
        _module(folders[-1], src)
    crash = case == "fixed and restarted"
    a, b = _run_jobs(
        tmp_path,
        shards,
        index_path,
        [(folders[0], 0, crash), (folders[1], 1, False)],
        together=not crash,
    )
    assert a["own"] != b["own"]  # the two transforms indeed give other batches
    for job in (a, b):
        assert job["got"] == job["own"] and len(job["got"]) >= 5
        assert job["shared"] == 0 and job["computed"] == len(job["own"])
