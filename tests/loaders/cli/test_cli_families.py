"""``prealign inspect`` / ``prealign index`` with ``--model-config`` of a family that is not Qwen's:
Gemma 3, LLaVA-OneVision, Mistral3 and SmolVLM (their own transforms), InternVL (its tiles): each
runs its family's transform and batch schema on that family's demo shards; with ``--tokenizer`` /
``--processor`` folders the model's own tokenizer and image
processor are read."""

from __future__ import annotations

import pytest

from prealign.loaders.cli import main
from prealign.loaders.cli.demo_data import build_demo_dataset, demo_model_config

pytest.importorskip("transformers")
SCHEMA = {
    "gemma3": "image_tokens_topk",
    "internvl": "internvl_topk",
    "llava_onevision": "llava_onevision_topk",
    "mistral3": "mistral3_topk",
    "smolvlm": "smolvlm_topk",
}


@pytest.fixture(scope="module", params=sorted(SCHEMA))
def family_data(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    ds = build_demo_dataset(
        str(tmp), num_samples=12, samples_per_shard=6, topk=4, model=request.param
    )
    demo_model_config(request.param).save_pretrained(str(tmp / "model"))
    return request.param, ds, str(tmp / "model"), tmp


def test_inspect_runs_the_family_transform_and_schema(family_data, capsys):
    model, ds, folder, tmp = family_data
    assert (
        main(
            [
                "inspect",
                *ds.shards,
                "--model-config",
                folder,
                "--topk",
                "4",
                "--workers",
                "0",
                "--out",
                str(tmp / "inspect.png"),
            ]
        )
        == 0
    )
    said = capsys.readouterr()
    out = said.out + said.err
    n = int(out.split("validated")[1].split("/")[0])
    assert n > 0 and f"{n}/{n} batches valid (schema {SCHEMA[model]}" in out
    assert f"({model})" in out  # the report names the family the config gave


def test_index_equals_the_full_pass(family_data, capsys):
    """The sidecars ``prealign index --model-config`` writes give every sample the length the
    family's transform gives it (the bad ones refused by both)."""
    from argparse import Namespace

    from prealign.loaders import BadDataPolicy, WebDatasetSource, build_index
    from prealign.loaders.cli.index_cmd import transform_schema, vlm_transform

    model, ds, folder, tmp = family_data
    out_dir = str(tmp / "index")
    assert (
        main(["index", *ds.shards, "--model-config", folder, "--topk", "4", "--out", out_dir]) == 0
    )
    assert f"{len(ds.bad)} sample(s) refused" in capsys.readouterr().err
    t, _ = vlm_transform(
        Namespace(model_config=folder, tokenizer=None, processor=None), 4
    )  # as a loader's
    assert (
        type(t).__name__
        == {
            "gemma3": "Gemma3SampleTransform",
            "internvl": "VLMSampleTransform",
            "llava_onevision": "LlavaOnevisionSampleTransform",
            "mistral3": "Mistral3SampleTransform",
            "smolvlm": "Idefics3SampleTransform",
        }[model]
    )
    schema, policy = transform_schema(t, 4), BadDataPolicy(on_error="skip")
    full = build_index(
        WebDatasetSource(list(ds.shards), transform=t, image="bytes", sidecars=False),
        schema,
        policy=policy,
    )
    side = build_index(
        WebDatasetSource(list(ds.shards), transform=t, image="bytes", index_dir=out_dir),
        schema,
        policy=policy,
    )
    assert len(full) == len(side) == 12 - len(ds.bad)
    assert full.lengths.tolist() == side.lengths.tolist()


def test_the_model_tokenizer_and_image_processor_are_read(tmp_path, capsys):
    """LLaVA-OneVision with its own tokenizer (``<image>``, ``<|im_start|>`` ...) and image
    processor saved in folders, as a checkpoint holds them; without teacher top-k (the demo's is the
    byte tokenizer's)."""
    from tests.families import llava_onevision_reference as ref

    ds = build_demo_dataset(
        str(tmp_path), num_samples=6, samples_per_shard=6, topk=4, model="llava_onevision"
    )
    ref.config().save_pretrained(str(tmp_path / "model"))
    ref.hf_tokenizer().save_pretrained(str(tmp_path / "model"))
    ref.image_processor().save_pretrained(str(tmp_path / "model"))
    folder = str(tmp_path / "model")
    args = [
        "inspect",
        *ds.shards,
        "--model-config",
        folder,
        "--tokenizer",
        folder,
        "--processor",
        folder,
        "--topk",
        "0",
        "--workers",
        "0",
        "--out",
        str(tmp_path / "inspect.png"),
    ]
    assert main(args) == 0
    said = capsys.readouterr()
    out = said.out + said.err
    assert "(schema llava_onevision " in out.split("validated")[1]
    assert f"tokenizer: {folder} (" in out and f"vocabulary {len(ref.hf_tokenizer())})" in out


def test_a_processor_of_another_geometry_is_refused(tmp_path, capsys):
    """An image processor whose tiles are not the config's: the transform's typed refusal, one
    line."""
    from tests.families import llava_onevision_reference as ref

    ds = build_demo_dataset(
        str(tmp_path), num_samples=6, samples_per_shard=6, topk=4, model="llava_onevision"
    )
    demo_model_config("llava_onevision").save_pretrained(str(tmp_path / "model"))
    ref.image_processor(tile=56).save_pretrained(str(tmp_path / "model"))
    folder = str(tmp_path / "model")
    assert (
        main(
            [
                "inspect",
                *ds.shards,
                "--model-config",
                folder,
                "--processor",
                folder,
                "--workers",
                "0",
                "--out",
                str(tmp_path / "inspect.png"),
            ]
        )
        == 2
    )
    assert "pinpoints" in capsys.readouterr().err
