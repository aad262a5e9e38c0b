"""The ``prealign`` command: ``demo`` end to end (table + PNG), ``inspect`` on shards and on an HF
dataset, ``--help``; the synthetic data builder and the PNG drawer."""

from __future__ import annotations

import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch

from prealign.loaders.cli import main
from prealign.loaders.cli.demo_data import build_demo_dataset
from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
from prealign.loaders.media.vlm import VLMSampleTransform

pytest.importorskip("transformers")


@pytest.mark.slow
def test_demo_help_works_as_a_console_command(subprocess_env):
    out = subprocess.run(
        [sys.executable, "-m", "prealign", "demo", "--help"],
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=120,
    )
    assert out.returncode == 0 and "usage: prealign demo" in out.stdout and "--out" in out.stdout


def test_demo_prints_the_table_and_writes_the_png(tmp_path, capsys):
    png = tmp_path / "layout.png"
    assert (
        main(
            [
                "demo",
                "--samples",
                "40",
                "--out",
                str(png),
                "--workers",
                "0",
                "--token-budget",
                "2048",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "T_local per CP rank" in out and "valid" in out
    assert (
        "skipped        3 sample(s)" in out
        and "corrupt_image" in out
        and "placeholder_mismatch" in out
    )
    n = int(out.split("micro-batches  ")[1].split(" ")[0])
    assert n > 1 and f"{2 * n}/{2 * n} batches valid" in out
    assert "mrope_position_ids      int64     [3, 1, " in out
    from PIL import Image

    with Image.open(png) as img:
        assert img.format == "PNG" and img.size[0] > 1000 and img.size[1] > 300


def test_inspect_shards_and_deferred_cp_shard(tmp_path, capsys):
    ds = build_demo_dataset(
        str(tmp_path / "wds"), num_samples=24, samples_per_shard=12, topk=4, bad=()
    )
    png = tmp_path / "i.png"
    rc = main(
        [
            "inspect",
            *ds.shards,
            "--topk",
            "4",
            "--out",
            str(png),
            "--workers",
            "0",
            "--defer-cp-shard",
            "--token-budget",
            "2048",
            "--limit",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "deferred CP shard" in out and "cp_gather_index" in out and png.exists()
    assert "skipped        none" in out


def test_inspect_hf_dataset_text_mode(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(0)
    rows = [rng.integers(8, 264, size=int(n)).tolist() for n in rng.integers(20, 300, size=30)]
    ds = datasets.Dataset.from_dict({"input_ids": rows})
    ds.save_to_disk(str(tmp_path / "hf"))
    rc = main(
        [
            "inspect",
            "--hf",
            str(tmp_path / "hf"),
            "--text",
            "--workers",
            "0",
            "--out",
            str(tmp_path / "h.png"),
            "--token-budget",
            "1024",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "causal_lm" in out and "30 sequences" in out


def test_inspect_needs_exactly_one_input(capsys):
    assert main(["inspect"]) == 2


# ---- the synthetic data
# ------------------------------------------------------------------------------
def _members(path: str) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def test_demo_data_is_deterministic_and_teacher_rows_match_the_expanded_tokens(tmp_path):
    a = build_demo_dataset(str(tmp_path / "a"), num_samples=14, samples_per_shard=7, topk=3, seed=5)
    b = build_demo_dataset(str(tmp_path / "b"), num_samples=14, samples_per_shard=7, topk=3, seed=5)
    assert [_members(p) for p in a.shards] == [_members(p) for p in b.shards]
    assert len(a.bad) == 3
    transform = VLMSampleTransform(tokenizer=ByteTokenizer(), topk=3)
    good, images, sizes = 0, 0, set()
    for path in a.shards:
        members = _members(path)
        for key in sorted({n.split(".")[0] for n in members}):
            raw = {
                "__key__": key,
                **{n.split(".", 1)[1]: v for n, v in members.items() if n.startswith(key + ".")},
            }
            if key in a.bad:
                continue
            out = transform(raw)  # teacher [L, K] must match the expanded length, or this raises
            good += 1
            images += out["image_grid_thw"].shape[0]
            sizes |= {tuple(g) for g in out["image_grid_thw"].tolist()}
            ids = out["teacher_topk_ids"]
            assert torch.equal(ids[:-1, 0], out["input_ids"][1:])  # column 0: the next token
            assert bool((out["teacher_topk_log_probs"].diff(dim=1) <= 0).all())
    assert good == 11 and images > 5 and len(sizes) > 3  # varied image sizes


def test_tokenizer_round_trips_text_and_marks_specials():
    tok = ByteTokenizer()
    text = "Zürich — 東京 <image>?"
    assert tok.decode(tok.encode(text)) == text
    assert int(tok.encode(text).max()) < tok.vocab_size and int(tok.encode(text).min()) >= 8
    assert tok.vision.image_token_id == 6 and tok.vision.spatial_merge_size == 2


def test_plot_draws_one_panel_per_microbatch(tmp_path):
    from PIL import Image

    from prealign.loaders.cli.plot import Panel, draw_packed_layout
    from prealign.schemas import ParallelLayout

    cu, cup = (
        torch.tensor([0, 5, 8], dtype=torch.int32),
        torch.tensor([0, 8, 12], dtype=torch.int32),
    )
    image = torch.zeros(12, dtype=torch.bool)
    image[1:3] = True
    path = draw_packed_layout(
        [Panel(cu, cup, image, title="a"), Panel(cu, cup, None, title="b")],
        ParallelLayout(tp=2, cp=2),
        str(tmp_path / "p.png"),
        title="t",
    )
    with Image.open(path) as img:
        px = np.asarray(img.convert("RGB"))
    assert px.shape[0] > 200 and len({tuple(p) for p in px.reshape(-1, 3)[::7]}) > 6


def test_plot_keeps_a_tiny_pad_visible(tmp_path):
    """Two pad slots among 4096 still show, hatched (the hatch colour appears at all) and at least
    3 pixels wide in the global row."""
    from PIL import Image

    from prealign.loaders.cli.plot import _HATCH, Panel, draw_packed_layout
    from prealign.schemas import ParallelLayout

    cu, cup = (
        torch.tensor([0, 2046, 4094], dtype=torch.int32),
        torch.tensor([0, 2048, 4096], dtype=torch.int32),
    )
    path = draw_packed_layout(
        [Panel(cu, cup, None, title="a")], ParallelLayout(tp=2, cp=2), str(tmp_path / "p.png")
    )
    with Image.open(path) as img:
        px = np.asarray(img.convert("RGB"))
    hatch = np.all(px == np.array(_HATCH, np.uint8), axis=-1)
    assert hatch.any()
    cols = np.flatnonzero(hatch.any(axis=0))
    assert len(cols) >= 3


@pytest.mark.slow
def test_demo_command_with_glm4v(tmp_path, capsys):
    """``prealign demo --model glm4v``: every batch on every CP rank valid, mRoPE positions, GLM's
    images."""
    args = [
        "demo",
        "--model",
        "glm4v",
        "--samples",
        "30",
        "--out",
        str(tmp_path / "l.png"),
        "--workers",
        "0",
        "--token-budget",
        "4096",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    n = int(out.split("micro-batches  ")[1].split(" ")[0])
    assert f"{2 * n}/{2 * n} batches valid" in out and "mrope_position_ids" in out


@pytest.mark.parametrize("model", ["glm4v", "glm4v_moe"])
def test_glm4v_demo_data_in_glm_frame_and_header_index_equals_the_full_pass(tmp_path, model):
    """``prealign demo --model glm4v`` data: rendered in GLM's own chat frame (``[gMASK]<sop>``,
    ``<|user|>`` role tags; GLM-4.5V's think block), images only (one media kind per GLM forward),
    and the header-only index gives every sample the length and media flag the full transform
    gives."""
    import json

    from prealign.loaders import BadDataPolicy, WebDatasetSource, build_index
    from prealign.loaders.cli.demo_data import demo_transform
    from prealign.loaders.index.header_pass import write_sidecars
    from prealign.schemas import vlm_schema

    ds = build_demo_dataset(
        str(tmp_path), num_samples=16, samples_per_shard=8, topk=4, model=model, bad=()
    )
    t = demo_transform(model, ByteTokenizer(), 4)
    schema = vlm_schema(topk=4, vocab_size=ds.vocab_size)
    policy = BadDataPolicy(on_error="raise")
    full = build_index(
        WebDatasetSource(list(ds.shards), transform=t, image="bytes", sidecars=False),
        schema,
        policy=policy,
    )
    write_sidecars(WebDatasetSource(list(ds.shards), transform=t, image="bytes"), schema)
    side = build_index(
        WebDatasetSource(list(ds.shards), transform=t, image="bytes"), schema, policy=policy
    )
    assert len(full) == len(side) == 16 and full.lengths.tolist() == side.lengths.tolist()
    assert full.media.tolist() == side.media.tolist() and bool(full.media.any())
    with tarfile.open(ds.shards[0]) as tar:
        raw = {
            m.name.split(".", 1)[1]: tar.extractfile(m).read()
            for m in tar.getmembers()
            if m.name.startswith("s000000.")
        }
    assert "videos" not in json.loads(raw["json"])
    text = ByteTokenizer().decode(t({"__key__": "s000000", **raw})["input_ids"])
    assert (
        text.startswith("[gMASK]<sop><|user|>\n")
        and "<|assistant|>" in text
        and "<|im_start|>" not in text
    )
    assert ("<think></think>" in text) == (model == "glm4v_moe")
