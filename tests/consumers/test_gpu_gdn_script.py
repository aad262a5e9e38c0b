"""The GDN GPU check (``benchmarks/gpu_gdn.py``) stays runnable: it compiles, its dry run builds the
packed batch and the model kwargs (``seq_idx`` naming each slot's padded sequence), and without a
GPU it says so."""

from __future__ import annotations

import runpy
import types
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_gdn.py"


@pytest.fixture(scope="module")
def script():
    """The script's functions (run as a module that is not ``__main__``: nothing starts)."""
    return types.SimpleNamespace(**runpy.run_path(str(SCRIPT), run_name="gpu_gdn"))


def test_dry_run_builds_the_packed_kwargs(script, capsys):
    pytest.importorskip("transformers")
    assert script.main(["--dry-run"]) == 0
    assert "no CUDA used" in capsys.readouterr().out
    samples, batch = script.packed_batch()
    kw = script.model_kwargs(batch, script.model_config(), check=False)
    padded = batch["cu_seqlens_padded"].tolist()
    for i in range(len(samples)):  # every slot of padded sequence i says i
        assert bool((kw["seq_idx"][0, padded[i] : padded[i + 1]] == i).all())


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="platform: a GPU is here: the real check would run"
)
def test_without_a_gpu_it_says_so_and_exits_2(script, capsys):
    assert script.main([]) == 2
    assert "nothing measured" in capsys.readouterr().out
