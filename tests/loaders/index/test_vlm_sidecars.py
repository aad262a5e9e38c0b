"""Sidecars of VLM data know the model family they were built for: a sidecar of Qwen2-VL lengths is
refused by a Qwen3-VL loader (the field named), and the printed `prealign index` command, run as
printed, writes sidecars that loader accepts (`--model-config DIR`)."""

from __future__ import annotations

import json
import shlex
import warnings

import pytest

from prealign.loaders import (
    PackedLoader,
    ShardWriter,
    StaleIndexError,
    VLMSampleTransform,
    WebDatasetSource,
)
from prealign.loaders.cli.main import main
from prealign.loaders.index.build import build_index
from prealign.schemas import ParallelLayout, vlm_schema
from tests.loaders.media.test_vlm_video import png
from tests.vlm_families import TOK, tiny_config

META = json.dumps(
    {
        "messages": [
            {"role": "user", "content": "<image> what?"},
            {"role": "assistant", "content": "a cat"},
        ],
        "images": ["0.png"],
    }
).encode()
SCHEMA = vlm_schema(vocab_size=TOK.vocab_size)


def _shards(tmp_path, transform) -> list[str]:
    with ShardWriter(str(tmp_path / "s-%03d.tar"), max_samples=8, transform=transform) as w:
        for i, (wd, h) in enumerate([(64, 48), (640, 480), (500, 300), (900, 700)]):
            w.write({"__key__": f"k{i}", "json": META, "0.png": png(wd, h, seed=i)})
    return list(w.shards)


def test_sidecars_of_another_family_are_refused_and_the_printed_command_fixes_them(tmp_path):
    qwen2 = VLMSampleTransform(tokenizer=TOK, model_config=tiny_config("qwen2_vl"))
    config = tiny_config("qwen3_vl")
    folder = tmp_path / "qwen3_vl"
    config.save_pretrained(folder)  # what --model-config reads: the model's config.json
    from transformers import AutoConfig

    qwen3 = VLMSampleTransform(tokenizer=TOK, model_config=AutoConfig.from_pretrained(folder))
    paths = _shards(tmp_path, qwen2)  # sidecars written with Qwen2-VL's grids (patch 14)

    def source(sidecars=True):
        return WebDatasetSource(paths, transform=qwen3, image="bytes", sidecars=sidecars)

    with pytest.raises(
        StaleIndexError, match="vision_family: indexed with .*qwen2_vl.*qwen3_vl"
    ) as stale:
        build_index(source(), SCHEMA)
    command = str(stale.value).split("run `")[-1].split("`")[0]
    assert "--model-config" in command
    args = shlex.split(command)
    assert args[:2] == ["prealign", "index"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(args[1:]) == 0  # the command, as printed
    from_sidecars = build_index(source(), SCHEMA)
    assert (
        from_sidecars.lengths.tolist()
        == build_index(source(sidecars=False), SCHEMA).lengths.tolist()
    )
    assert (
        from_sidecars.lengths.tolist()
        != build_index(
            WebDatasetSource(paths, transform=qwen2, image="bytes", sidecars=False), SCHEMA
        ).lengths.tolist()
    )
    loader = PackedLoader(source(), schema=SCHEMA, layout=ParallelLayout(), token_budget=4096)
    assert sum(len(b["sample_index"]) for b in loader) == 4
