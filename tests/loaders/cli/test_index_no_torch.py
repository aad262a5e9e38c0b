"""``prealign index --text`` imports no torch (issue #28: torch's import was two thirds of the
command's CPU at 100k samples): not in the command's process (``--merge``, ``--workers``), not in
its pool of index workers. Each case runs the
real entry point (``python -m prealign``) in a fresh interpreter and reads its ``sys.modules``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from prealign.loaders.sources.shard_files import SUFFIX
from tests.loader_helpers import sample_lengths, write_shards

_RUN = """
import json, runpy, sys
sys.argv = ["prealign", *sys.argv[1:]]
try:
    runpy.run_module("prealign", run_name="__main__")
except SystemExit as exc:
    rc = exc.code
print(json.dumps({"rc": rc, "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}))
"""

_POOL = """
import glob, json, os, sys
from prealign.loaders.index import header_pass
header_pass._POOL_MIN = 0  # (a pool even for a few shards)
pools = []
def counted(*args, _pool=header_pass._pool, **kwargs):
    pools.append(args[1])
    return _pool(*args, **kwargs)
header_pass._pool = counted
from prealign.loaders.cli.main import main
rc = main(["index", "--text", "--force", "--workers", "2", *sys.argv[1:]])
def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # (a process that ended meanwhile)
        return ""
me = str(os.getpid())
children = [p for p in os.listdir("/proc") if p.isdigit()
            and read(f"/proc/{p}/stat").rpartition(")")[2].split()[1:2] == [me]]
torch_children = [p for p in children if "libtorch" in read(f"/proc/{p}/maps")]
print(json.dumps({"rc": rc, "pools": pools, "children": len(children),
                  "torch_children": torch_children, "torch": "torch" in sys.modules}))
"""


def _run(script: str, args: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def shards(tmp_path) -> list[str]:
    return write_shards(str(tmp_path / "data"), sample_lengths(30), num_shards=3)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [["--force"], ["--force", "--merge"], ["--force", "--workers", "2"]],
    ids=["plain", "merge", "workers"],
)
def test_index_text_imports_no_torch(shards, tmp_path, flags):
    out_dir = str(tmp_path / "idx")
    got = _run(_RUN, ["index", "--text", *flags, "--out", out_dir, *shards])
    assert got == {"rc": 0, "torch": []}
    names = sorted(os.listdir(out_dir))
    assert [n for n in names if n.endswith(SUFFIX)] == sorted(
        os.path.basename(p) + SUFFIX for p in shards
    )
    assert any("merged" in n for n in names) == ("--merge" in flags)


@pytest.mark.slow
@pytest.mark.skipif(
    not os.path.exists(f"/proc/{os.getpid()}/maps"), reason="platform: no /proc maps to read"
)
def test_index_text_pool_imports_no_torch(shards, tmp_path):
    """The pool's forkserver (alive until the command exits) has not loaded torch's library, so
    neither has any worker it forked."""
    got = _run(_POOL, ["--out", str(tmp_path / "idx"), *shards])
    assert got["rc"] == 0 and got["pools"] == [2] and got["children"] >= 1
    assert got["torch_children"] == [] and got["torch"] is False
