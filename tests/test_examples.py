"""Every file under ``examples/`` runs as a user runs it (a subprocess, offline, small data) and
succeeds; each checks its own results (the SFT labels, local == http batches, resume ==
uninterrupted run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
TORCHRUN = {
    "megatron_torchrun.py": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4"]
}


@pytest.mark.slow
def test_every_example_is_listed_here():
    assert {
        "hf_sft.py",
        "webdataset_shards.py",
        "vlm_qwen2vl.py",
        "hf_trainer.py",
        "hf_trainer_budget.py",
        "megatron_torchrun.py",
    } <= set(EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name, tmp_path):
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TMPDIR": str(tmp_path),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, *TORCHRUN.get(name, []), str(ROOT / "examples" / name)]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    assert out.stdout.strip(), f"{name} printed nothing"
