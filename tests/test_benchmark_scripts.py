"""The CPU benchmarks stay runnable against the current API and report what issue #28 asks of them:
wall and CPU as median [min..max] over interleaved rounds (a script that breaks on an API change
is found here, not when a figure is retaken)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_planner_times_every_strategy_over_interleaved_rounds(tmp_path, capsys):
    bench = load("bench_planner")
    rows = bench.run("t", bench.longtail(2000), 16384, bench.ParallelLayout(tp=2, cp=2), 4, 3)
    assert [r["strategy"] for r in rows] == list(bench.STRATEGIES)
    for r in rows:
        for key in ("plan wall s", "plan CPU s"):
            median, spread = r[key].split(" ", 1)
            low, high = (float(x) for x in spread.strip("[]").split(".."))
            assert low <= float(median) <= high
    assert bench.main(["--quick", "--rounds", "2", "--gsm8k", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "GSM8K not found" in out and "over 2 interleaved rounds" in out and "CPU s" in out


def test_mixture_first_batch_gives_wall_and_cpu():
    bench = load("bench_mixture")
    parts = [bench._part(x) for x in bench._lengths(2000)]
    for mixed in (False, True):
        wall, cpu = bench.first_batch(parts, mixed)
        assert wall > 0 and cpu > 0


def test_balance_interleaves_and_spreads():
    bench = load("bench_balance")
    calls = []
    got = bench._interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3)
    assert calls == ["a", "b", "b", "a", "a", "b"]  # the order rotates
    assert all(len(w) == len(c) == 3 for w, c in got.values())
    assert bench._spread([3.0, 1.0, 2.0]) == "2.00 [1.00..3.00]"


@pytest.mark.slow
def test_vlm_stage_split_runs_on_the_current_loader(tmp_path):
    """Both pipelines' per-stage split on a few demo samples (it broke once on the collate_fn's
    argument)."""
    bench = load("bench_vlm_loader")
    from prealign.loaders import BadDataPolicy, WebDatasetSource, build_index
    from prealign.loaders.cli.demo_data import build_demo_dataset
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.schemas import vlm_schema

    data = build_demo_dataset(str(tmp_path), num_samples=16, samples_per_shard=8, bad=())
    source = WebDatasetSource(list(data.shards), transform=bench.make_transform(), image="bytes")
    index = build_index(
        source,
        vlm_schema(vocab_size=ByteTokenizer().vocab_size),
        policy=BadDataPolicy(on_error="raise"),
    )
    split = bench.stages(data.shards, index, 16)
    assert set(split) == {"prealign", "baseline"}
    assert "collate + hand-off packing" in split["prealign"]
    assert all(np.isfinite(v) and v >= 0 for parts in split.values() for v in parts.values())


@pytest.mark.slow
def test_vlm_baseline_writes_the_video_rows_prealign_writes(tmp_path):
    """Equal work (issue #28): on the ``--model`` demo data the hand-written baseline's video pixels
    have prealign's shape (frames paired into temporal patches, not each frame duplicated into its
    own), and its values within resampling noise; ids equal where the family adds no system turn."""
    bench = load("bench_vlm_loader")
    from prealign.loaders import WebDatasetSource
    from prealign.loaders.cli.demo_data import build_demo_dataset

    data = build_demo_dataset(
        str(tmp_path), num_samples=24, samples_per_shard=24, bad=(), model="qwen3_vl"
    )
    ours, theirs = bench.make_transform(model="qwen3_vl"), bench.BaselineSample("qwen3_vl")
    files = 0
    for _, raw in WebDatasetSource(list(data.shards), image="bytes").scan(0):
        videos = bench._json(raw["json"]).get("videos") or []
        if not any(isinstance(v, str) for v in videos):  # mp4 members
            continue
        a, b = ours(dict(raw)), theirs(dict(raw))
        assert a["pixel_values_videos"].shape == b["pixel_values_videos"].shape
        assert (a["pixel_values_videos"].float() - b["pixel_values_videos"]).abs().max() < 0.05
        assert list(a["input_ids"]) == b["input_ids"]
        files += 1
    assert files >= 2
