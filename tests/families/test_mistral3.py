"""Mistral3 (Mistral Small 3.1) / Pixtral: prealign's transform equals transformers'
``PixtralProcessor`` + ``apply_chat_template`` (input ids, pixel values, image sizes) on random
conversations; lengths from image headers alone equal the full pass; the resize rule equals
transformers'; and a tiny Mistral3 (float64) gives the same logits for a packed THD batch (cp=2,
every rank unsharded back) as for each sample alone, while a row whose
positions do not restart is caught."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from prealign.collate.vision import Mistral3, vision_family
from prealign.collate.vision.mistral3 import hf_pixel_values, resized_size
from prealign.loaders.media.mistral3 import Mistral3SampleTransform
from prealign.loaders.media.vlm import MediaError
from prealign.schemas import ConfigError
from tests.conftest import examples
from tests.consumers.models import CORRUPT
from tests.families import chat_samples
from tests.families import mistral3_reference as ref
from tests.families.chat_samples import CHAT_TEXT, image_items, png
from tests.families.header_index import assert_header_index_equals_full_pass, run_demo
from tests.families.packing import assert_plain_packing, hf_kwargs, packed_batch, worst_gap

transformers = pytest.importorskip("transformers")
TOL = 1e-6


def transform(**kw) -> Mistral3SampleTransform:
    return Mistral3SampleTransform(
        model_config=ref.tiny_config(), tokenizer=ref.hf_tokenizer(), **kw
    )


def raw_sample(messages, images) -> dict:
    return chat_samples.raw_sample(messages, images, "m")


def reference(messages: list[dict], images: list[bytes], processor=None) -> dict:
    from PIL import Image

    processor = processor or ref.hf_processor()
    chat = [
        {"role": m["role"], "content": image_items(m["content"])} if m["role"] == "user" else m
        for m in messages
    ]
    text = processor.apply_chat_template(chat, tokenize=False)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return processor(text=[text], images=pil or None, return_tensors="pt", add_special_tokens=False)


@given(
    contents=st.lists(CHAT_TEXT, min_size=1, max_size=4),
    system=st.booleans(),
    seed=st.integers(0, 99),
)
@examples(25)
def test_ids_pixels_and_image_sizes_equal_the_processor(contents, system, seed):
    roles = (["system"] if system else []) + ["user", "assistant"] * 3
    messages = [{"role": r, "content": c} for r, c in zip(roles, contents)]
    assume(all("<image>" not in m["content"] for m in messages if m["role"] != "user"))
    n = sum(m["content"].count("<image>") for m in messages)
    assume(n <= 3)
    images = [png(seed + i) for i in range(n)]
    t = transform()
    ours = t(raw_sample(messages, images))
    want = reference(messages, images)
    assert ours["input_ids"].tolist() == want["input_ids"][0].tolist()
    if n:
        assert ours["image_sizes"].tolist() == want["image_sizes"].tolist()
        assert torch.equal(
            hf_pixel_values(ours["pixel_values"], ours["image_sizes"]),
            want["pixel_values"].to(torch.float32),
        )
    else:
        assert ours["pixel_values"].shape == (0, 3, 4, 4) and "pixel_values" not in want
    assert t.header_ids(raw_sample(messages, images))[0].tolist() == ours["input_ids"].tolist()
    assert torch.equal(ours["mm_token_type_ids"], (ours["input_ids"] == ref.tid("[IMG]")).long())
    trained = ours["input_ids"][ours["loss_mask"] > 0]
    assert int((trained == ref.tid("</s>")).sum()) == sum(
        m["role"] == "assistant" for m in messages
    )


@given(
    st.integers(1, 5000),
    st.integers(1, 5000),
    st.sampled_from([64, 112, 1024, 1540]),
    st.sampled_from([14, 16, 28]),
)
@examples(200)
def test_resize_rule_equals_transformers(h, w, edge, step):
    from transformers.models.pixtral.image_processing_pil_pixtral import (
        get_resize_output_image_size,
    )

    want = get_resize_output_image_size(
        np.zeros((3, h, w)),
        size=(edge, edge),
        patch_size=(step, step),
        input_data_format="channels_first",
    )
    assert resized_size(h, w, edge, step) == tuple(want)


def test_golden_sample_and_the_mistral_small_3_1_family():
    fam = vision_family(transformers.Mistral3Config())
    assert isinstance(fam, Mistral3) and (
        fam.image_token_id,
        fam.patch_size,
        fam.spatial_merge_size,
        fam.longest_edge,
    ) == (10, 14, 2, 1540)
    assert fam.token_grid(600, 800) == (22, 29) and fam.token_grid(3000, 100) == (
        55,
        2,
    )  # 1540 / 28 = 55
    pixtral = Mistral3.from_config(
        transformers.LlavaConfig(vision_config={"model_type": "pixtral"})
    )
    assert (pixtral.patch_size, pixtral.spatial_merge_size, pixtral.longest_edge) == (16, 1, 1024)
    with pytest.raises(ConfigError, match="pixtral"):
        Mistral3.from_config(transformers.LlavaConfig())
    messages = [
        {"role": "user", "content": "\nlook <image>?"},
        {"role": "assistant", "content": " a "},
    ]
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (20, 9)).save(
        buf, format="PNG"
    )  # 20x9 -> 24x16 pixels: 2 rows of 3 tokens (8 px each)
    ours = transform()(raw_sample(messages, [buf.getvalue()]))
    text = ref.hf_tokenizer().decode(ours["input_ids"].tolist())
    assert (
        text
        == "<s>[INST]\nlook "
        + "[IMG]" * 3
        + "[IMG_BREAK]"
        + "[IMG]" * 3
        + "[IMG_END]?[/INST] a </s>"
    )
    assert ref.hf_tokenizer().decode(ours["input_ids"][ours["loss_mask"] > 0].tolist()) == " a </s>"
    assert ours["image_sizes"].tolist() == [[16, 24]] and ours["pixel_values"].shape == (
        4 * 6,
        3,
        4,
        4,
    )


def test_a_default_system_prompt_is_written_only_when_asked():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    plain = transform()(raw_sample(messages, []))["input_ids"].tolist()
    with_system = transform(system="be brief")(raw_sample(messages, []))["input_ids"].tolist()
    assert plain == reference(messages, [])["input_ids"][0].tolist()
    assert (
        with_system
        == reference([{"role": "system", "content": "be brief"}, *messages], [])["input_ids"][
            0
        ].tolist()
    )


def test_bad_samples_are_typed_errors():
    with pytest.raises(MediaError, match="placeholder"):
        transform()(raw_sample([{"role": "user", "content": "<image> <image>"}], [png(1)]))
    with pytest.raises(MediaError, match="user turns only"):
        transform()(
            raw_sample(
                [{"role": "user", "content": "x"}, {"role": "assistant", "content": "<image>"}],
                [png(1)],
            )
        )
    with pytest.raises(ConfigError, match="mistral3"):
        Mistral3SampleTransform(
            model_config=transformers.Qwen2VLConfig(), tokenizer=ref.hf_tokenizer()
        )
    with pytest.raises(ConfigError, match="image_token_id 99"):
        Mistral3SampleTransform(
            model_config=transformers.Mistral3Config(image_token_id=99),
            tokenizer=ref.hf_tokenizer(),
        )


def test_the_contract_is_plain_packing_on_every_consumer():
    assert_plain_packing(ref.tiny_config())


# ---- in-model
# ---------------------------------------------------------------------------------------
def schema():
    tok = ref.hf_tokenizer()
    return Mistral3.from_config(ref.tiny_config()).batch_schema(
        pad_token_id=tok.pad_token_id, vocab_size=len(tok), pixel_dtypes=("float32",)
    )


def model_samples(pixtral: bool = False) -> list[dict]:
    t = Mistral3SampleTransform(
        model_config=ref.tiny_pixtral_config() if pixtral else ref.tiny_config(),
        tokenizer=ref.hf_tokenizer(),
    )
    return chat_samples.model_samples(t, hi=90, key="m")


def alone(sample: dict) -> dict:
    kwargs = {"input_ids": sample["input_ids"][None], "use_cache": False}
    if sample["image_sizes"].shape[0]:
        kwargs["pixel_values"] = hf_pixel_values(sample["pixel_values"], sample["image_sizes"]).to(
            torch.float64
        )
        kwargs["image_sizes"] = sample["image_sizes"]
    return kwargs


def packed(samples: list[dict], config=None) -> tuple[dict, dict]:
    """THD tp=2 cp=2, every CP rank unsharded back; the model's kwargs from ``to_hf_kwargs``."""
    whole = packed_batch(schema(), samples)
    keys = ["image_sizes", "input_ids", "mm_token_type_ids", "pixel_values", "position_ids"]
    return whole, hf_kwargs(whole, [*keys, "use_cache"], config or ref.tiny_config())


def worst(batch: dict, kwargs: dict, samples: list[dict], model=None) -> float:
    return worst_gap(model or ref.tiny_model(), kwargs, batch, samples, alone)


@pytest.mark.slow
def test_packed_logits_equal_each_sample_alone():
    samples = model_samples()
    assert [s["image_sizes"].shape[0] for s in samples] == [1, 0, 2]
    batch, kwargs = packed(samples)
    assert kwargs["pixel_values"].shape[0] == 3 and worst(batch, kwargs, samples) < TOL


@pytest.mark.slow
def test_positions_that_do_not_restart_are_caught():
    samples = model_samples()
    batch, kwargs = packed(samples)
    kwargs["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
    assert worst(batch, kwargs, samples) > CORRUPT


def test_pixtral_llava_ids_and_pixels_equal_the_processor():
    """Pixtral (a ``llava`` config, no patch merger): a token per 4-px patch, as
    ``PixtralProcessor`` with ``spatial_merge_size=1`` writes it."""
    t = Mistral3SampleTransform(
        model_config=ref.tiny_pixtral_config(), tokenizer=ref.hf_tokenizer()
    )
    assert (t.family.model_type, t.family.spatial_merge_size, t.family.token_step) == (
        "llava",
        1,
        4,
    )
    for seed in range(4):
        messages = [
            {"role": "user", "content": "\nlook <image> and<image>"},
            {"role": "assistant", "content": "x"},
        ]
        images = [png(seed), png(seed + 50)]
        ours, want = (
            t(raw_sample(messages, images)),
            reference(messages, images, ref.hf_processor(merge=1)),
        )
        assert ours["input_ids"].tolist() == want["input_ids"][0].tolist()
        assert ours["image_sizes"].tolist() == want["image_sizes"].tolist()
        assert torch.equal(
            hf_pixel_values(ours["pixel_values"], ours["image_sizes"]), want["pixel_values"]
        )


@pytest.mark.slow
def test_pixtral_packed_logits_equal_each_sample_alone():
    samples = model_samples(pixtral=True)
    batch, kwargs = packed(samples, ref.tiny_pixtral_config())
    assert worst(batch, kwargs, samples, ref.tiny_pixtral_model()) < TOL
    kwargs["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
    assert worst(batch, kwargs, samples, ref.tiny_pixtral_model()) > CORRUPT


# ---- the demo and the header pass
# -------------------------------------------------------------------
@pytest.mark.slow
def test_demo_command_with_mistral3(tmp_path, capsys):
    """``prealign demo --model mistral3``: every batch on every CP rank valid against the family's
    schema, the synthetic teacher rows as long as the transform's ids, patches of 14 px in
    pixel_values."""
    out = run_demo(tmp_path, capsys, "mistral3", token_budget=2048)
    assert "mistral3_topk" in out
    assert re.search(r"pixel_values +float32 +\[\d+, 3, 14, 14\]", out) and re.search(
        r"image_sizes +int64", out
    )


def test_header_index_equals_the_full_pass(tmp_path):
    """``prealign demo --model mistral3`` data: the header-only index (image headers sized, the chat
    rendered by the tokenizer alone) gives every sample the length and media flag the full transform
    gives."""
    assert_header_index_equals_full_pass(tmp_path, "mistral3", 24)


@pytest.mark.parametrize("height, width", [(1, 320), (320, 1), (2, 4000)])
def test_an_image_too_thin_to_keep_a_row_is_a_typed_error(height, width):
    """Scaled to fit the longest edge, a side floors to 0 pixels (transformers' processor fails on
    it too): a SampleError naming the sample and the size (bad data, counted under skip), never an
    IndexError or an image of no rows."""
    from PIL import Image

    from prealign.schemas.errors import SampleError

    family = Mistral3(
        model_type="mistral3",
        image_token_id=10,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=1,
        longest_edge=112,
    )
    with pytest.raises(SampleError, match=f"sample s7, field 'img'.*{width}x{height}"):
        family.token_grid(height, width, sample="s7", field="img")
    t = transform()  # and an image 1 pixel high, twice the transform's longest edge wide
    buf = io.BytesIO()
    Image.new("RGB", (2 * t.longest_edge + 2, 1)).save(buf, format="PNG")
    with pytest.raises(SampleError, match=f"{2 * t.longest_edge + 2}x1") as err:
        t(raw_sample([{"role": "user", "content": "<image> x"}], [buf.getvalue()]))
    assert err.value.sample == "m", repr(err.value)
