"""The GPU check (``benchmarks/gpu_megatron_te.py``) stays runnable: it compiles, and its CPU part
(the batches with ``cu_seqlens_padded != cu_seqlens`` and the three PackedSeqParams feeds) runs
here."""

from __future__ import annotations

import importlib.util
import py_compile
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_megatron_te.py"


@pytest.fixture(scope="module")
def script():
    py_compile.compile(str(SCRIPT), doraise=True)
    spec = importlib.util.spec_from_file_location("gpu_megatron_te", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_builds_padded_batches_and_every_feed(script, capsys):
    pytest.importorskip("megatron.core")
    assert script.main(["--dry-run"]) == 0
    assert "no CUDA used" in capsys.readouterr().out
    built = script.build_batches()
    assert len(built) == len(script.cases()) >= 3
    for _, _, samples, batch in built:
        assert not torch.equal(batch["cu_seqlens"], batch["cu_seqlens_padded"])
        f = script.feeds(batch)
        assert f["broken"].cu_seqlens_q_padded is None and torch.equal(
            f["broken"].cu_seqlens_q, batch["cu_seqlens"]
        )
        assert torch.equal(f["padded"].cu_seqlens_q_padded, batch["cu_seqlens_padded"])
    # at least one case pads a sequence before the last, so the broken feed must be caught there
    assert any(bool((b["cu_seqlens"][:-1] != b["cu_seqlens_padded"][:-1]).any()) for *_, b in built)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="platform: a GPU is here: the real check would run"
)
def test_without_a_gpu_it_says_so_and_exits_2(script, capsys):
    assert script.main(["--no-install"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().out
