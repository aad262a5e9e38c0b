"""A mixture file whose components name model config folders builds each family's own transform
(as ``prealign inspect --model-config`` does), serves batches of that family's schema, and refuses
components that collate to different schemas, naming both (issue #32)."""

from __future__ import annotations

import json

import pytest
import torch

from prealign.loaders import PackedLoader, PlannerConfig, ShardWriter
from prealign.loaders.media.families import MixedFamiliesError, common_schema
from prealign.loaders.media.llava_onevision import LlavaOnevisionSampleTransform
from prealign.loaders.mixture import Mixture
from prealign.schemas import ParallelLayout
from prealign.schemas.validate import validate_batch
from tests.families import llava_onevision_reference as ref
from tests.families.test_llava_onevision_transform import PINS, sample

transformers = pytest.importorskip("transformers")


def model_folder(path, *, tile: int = 56, pins=PINS, processor: bool = True) -> str:
    """A LLaVA-OneVision model folder: ``config.json``, the tokenizer, and (``processor``) the
    image processor's ``preprocessor_config.json``."""
    path.mkdir()
    ref.config(tile=tile, pinpoints=pins).save_pretrained(str(path))
    ref.hf_tokenizer().save_pretrained(str(path))
    if processor:
        ref.image_processor(tile, pins).save_pretrained(str(path))
    return str(path)


def shards(folder, n: int, seed: int) -> None:
    """``n`` LLaVA-OneVision samples (0-2 images each) in one shard under ``folder``."""
    folder.mkdir()
    with ShardWriter(str(folder / "s-%03d.tar"), sidecars=False) as w:
        for i in range(n):
            images = [(40 + 7 * i, 30 + 5 * ((i + seed) % 4))] * (i % 3)
            raw = sample(f"{seed}-{i}", ["<image>" * len(images) + "what?", "\nok."], images, i)[0]
            w.write({**raw, "json": json.loads(raw["json"])})


def write_mixture(tmp_path, components: dict) -> str:
    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"by": "samples", "components": components}))
    return str(path)


def test_a_mixture_of_two_llava_onevision_folders_serves_its_family_batches(tmp_path):
    model = model_folder(tmp_path / "model")
    shards(tmp_path / "a", 9, 0)
    shards(tmp_path / "b", 6, 1)
    path = write_mixture(
        tmp_path,
        {
            "a": {"path": "a", "transform": "model", "repeat": 1},
            "b": {"path": "b", "transform": "model", "repeat": 1},
        },
    )
    mix = Mixture.from_file(path)
    transforms = {n: c.source.transform for n, c in mix.components.items()}
    assert all(isinstance(t, LlavaOnevisionSampleTransform) for t in transforms.values())
    assert transforms["a"].processor is not None  # the folder's preprocessor_config.json
    schema = common_schema(transforms)
    assert schema == transforms["a"].family.batch_schema(
        pad_token_id=ref.hf_tokenizer().pad_token_id, vocab_size=len(ref.hf_tokenizer())
    )
    layout = ParallelLayout(tp=2, cp=2)
    loader = PackedLoader(
        mix,
        schema=schema,
        layout=layout,
        token_budget=2048,
        cp_rank=0,
        seed=0,
        planner=PlannerConfig(chunk_size=64),
    )
    batches = list(loader)
    assert batches and model
    served = 0
    for batch in batches:
        validate_batch(batch, schema, layout)
        served += len(batch["sample_component"])
        assert batch["pixel_values"].shape[1:] == (3, 56, 56)
        assert set(batch["sample_component"].tolist()) <= {0, 1}
    images = int(torch.cat([b["batch_num_images"] for b in batches]).sum())
    assert served == 9 + 6 and images == 9 + 6  # one pass of each (0, 1, 2 images in turn)


def test_components_that_collate_to_different_schemas_are_refused_naming_both(tmp_path):
    """Another tile size (42 px: another pixel shape) in a second folder: refused when the file is
    read, naming both components and the field that differs."""
    model_folder(tmp_path / "m56")
    model_folder(tmp_path / "m42", tile=42, pins=((42, 42), (42, 84), (84, 42)), processor=False)
    shards(tmp_path / "a", 3, 0)
    shards(tmp_path / "b", 3, 1)
    path = write_mixture(
        tmp_path,
        {
            "left": {"path": "a", "transform": "m56", "weight": 0.5},
            "right": {"path": "b", "transform": "m42", "weight": 0.5},
            "plain": {"path": "a", "weight": 0.1},  # no transform: token ids, not compared
        },
    )
    with pytest.raises(MixedFamiliesError) as err:
        Mixture.from_file(path)
    message = str(err.value)
    assert "'left'" in message and "'right'" in message and "llava_onevision" in message
    assert "pixel_values" in message and "(3, 56, 56)" in message and "(3, 42, 42)" in message


def test_inspect_a_mixture_file_of_llava_onevision_folders(tmp_path, capsys):
    """``prealign inspect mix.json``: the components' own transforms, every batch valid against
    their family's schema (not Qwen's)."""
    from prealign.loaders.cli.main import main

    model_folder(tmp_path / "model")
    shards(tmp_path / "a", 6, 0)
    shards(tmp_path / "b", 4, 1)
    path = write_mixture(
        tmp_path,
        {
            "a": {"path": "a", "transform": "model", "weight": 0.6},
            "b": {"path": "b", "transform": "model", "weight": 0.4},
        },
    )
    args = ["inspect", path, "--workers", "0", "--tp", "1", "--token-budget", "2048"]
    assert main([*args, "--out", str(tmp_path / "x.png")]) == 0
    out = capsys.readouterr().out
    assert "schema llava_onevision" in out and "batches valid" in out
    assert "mixture (shares of the samples)" in out
