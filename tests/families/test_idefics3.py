"""SmolVLM / Idefics3: prealign's transform equals transformers' ``Idefics3Processor`` +
``apply_chat_template`` (input ids, tiles, pixel values, rows and columns) on random conversations
with SmolVLM's and Idefics3's image processors; the image text equals SmolVLM's own
``get_image_prompt_string``; lengths from image headers alone equal the full pass; the tiling rule
equals transformers'; and tiny SmolVLM and Idefics3 models (float64) give the same logits for a
packed THD batch (cp=2, every rank unsharded back) as for each sample alone, while a row whose
positions do not restart is caught."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from prealign.collate.vision import Idefics3, vision_family
from prealign.collate.vision.idefics3 import tile_grid
from prealign.loaders.media.idefics3 import Idefics3SampleTransform, pil_image_processor_class
from prealign.loaders.media.vlm import MediaError
from prealign.schemas import ConfigError
from tests.conftest import examples
from tests.consumers.models import CORRUPT
from tests.families import idefics3_reference as ref
from tests.families.chat_samples import CHAT_TEXT, image_items, png, raw_sample
from tests.families.chat_samples import model_samples as transformed
from tests.families.header_index import assert_header_index_equals_full_pass, run_demo
from tests.families.packing import assert_plain_packing, hf_kwargs, packed_batch, worst_gap

transformers = pytest.importorskip("transformers")
TOL = 1e-6
S = ref.TILE


def transform(model_type: str = "smolvlm", **kw) -> Idefics3SampleTransform:
    return Idefics3SampleTransform(
        model_config=ref.tiny_config(model_type),
        tokenizer=ref.hf_tokenizer(),
        processor=ref.image_processor(model_type, **kw),
    )


def reference(messages: list[dict], images: list[bytes], processor) -> dict:
    from PIL import Image

    def content(text):
        return image_items(text) if "<image>" in text else text

    chat = [{"role": m["role"], "content": content(m["content"])} for m in messages]
    text = processor.apply_chat_template(chat, tokenize=False)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return processor(
        text=[text], images=[pil] if pil else None, return_tensors="pt", add_special_tokens=False
    )


@given(
    contents=st.lists(CHAT_TEXT, min_size=1, max_size=4),
    system=st.booleans(),
    seed=st.integers(0, 99),
    model_type=st.sampled_from(["smolvlm", "idefics3"]),
    split=st.booleans(),
)
@examples(25)
def test_ids_tiles_and_pixels_equal_the_processor(contents, system, seed, model_type, split):
    roles = (["system"] if system else []) + ["user", "assistant"] * 3
    messages = [{"role": r, "content": c} for r, c in zip(roles, contents)]
    n = sum(m["content"].count("<image>") for m in messages)
    assume(n <= 3)
    images = [png(seed + i) for i in range(n)]
    t = transform(model_type, split=split)
    ours = t(raw_sample(messages, images))
    want = reference(messages, images, ref.hf_processor(model_type, split=split))
    assert ours["input_ids"].tolist() == want["input_ids"][0].tolist()
    if n:
        assert torch.equal(ours["pixel_values"], want["pixel_values"][0].to(torch.float32))
        assert ours["pixel_values"].shape[0] == int((ours["image_rows_cols"].prod(-1) + 1).sum())
    else:
        assert ours["pixel_values"].shape == (0, 3, S, S) and "pixel_values" not in want
    assert t.header_ids(raw_sample(messages, images))[0].tolist() == ours["input_ids"].tolist()
    assert torch.equal(ours["mm_token_type_ids"], (ours["input_ids"] == ref.tid("<image>")).long())
    trained = ours["input_ids"][ours["loss_mask"] > 0]
    assert int((trained == ref.tid("<end_of_utterance>")).sum()) == sum(
        m["role"] == "assistant" for m in messages
    )


@given(
    st.integers(1, 5000),
    st.integers(1, 5000),
    st.sampled_from([(1456, 364), (2048, 512), (128, 32), (364, 364)]),
)
@examples(200)
def test_tile_grid_equals_transformers(h, w, sizes):
    edge, tile = sizes
    ip = ref.image_processor("idefics3", longest_edge=edge)
    from transformers.image_utils import SizeDict

    resized = ip.resize(np.zeros((1, h, w), np.float32), SizeDict(longest_edge=edge))
    assume(min(resized.shape[-2:]) >= 1)
    split = ip.resize_for_vision_encoder(resized, tile)
    assume(min(split.shape[-2:]) >= 1)
    _, rows, cols = ip.split_images(split, {"longest_edge": tile})
    assert tile_grid(h, w, edge, tile) == (rows, cols)


def test_image_text_equals_smolvlms_own_prompt_string():
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    t = transform()
    for rows, cols in ((0, 0), (1, 1), (2, 3)):
        from prealign.loaders.media.chat_tokenizer import encode_segments

        ids, _ = encode_segments(t.tokenizer, t.image_segments(rows, cols))
        text = get_image_prompt_string(
            rows,
            cols,
            16,
            fake_token_around_image="<fake_token_around_image>",
            image_token="<image>",
            global_image_token="<global-img>",
        )
        assert ids.tolist() == ref.hf_tokenizer()(text, add_special_tokens=False)["input_ids"]


def test_golden_sample_and_the_released_families():
    fam = vision_family(
        transformers.Idefics3Config(vision_config={"image_size": 364, "patch_size": 14})
    )
    assert isinstance(fam, Idefics3) and (fam.image_seq_len, fam.tile_size, fam.longest_edge) == (
        169,
        364,
        1456,
    )
    smol = vision_family(
        transformers.SmolVLMConfig(
            vision_config={"image_size": 512, "patch_size": 16}, scale_factor=4
        )
    )
    assert (smol.image_seq_len, smol.rows_cols(480, 640)) == (
        64,
        (3, 4),
    )  # 2048 x 1536 -> 4 x 3 tiles of 512
    messages = [
        {"role": "user", "content": "<image>\nwhat?"},
        {"role": "assistant", "content": " a "},
    ]
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40, 20)).save(
        buf, format="PNG"
    )  # 128 x 64 -> 4 x 2 tiles... of 32 px: 2 rows, 4 cols
    ours = transform()(raw_sample(messages, [buf.getvalue()]))
    text = ref.hf_tokenizer().decode(ours["input_ids"].tolist())
    tile = "<image>" * 16
    rows = "".join(
        "".join(f"<fake_token_around_image><row_{r}_col_{c}>{tile}" for c in range(1, 5)) + "\n"
        for r in (1, 2)
    )
    assert text == (
        "<|im_start|>User:" + rows + f"\n<fake_token_around_image><global-img>{tile}"
        "<fake_token_around_image>\nwhat?<end_of_utterance>\nAssistant:  a <end_of_utterance>\n"
    )
    assert (
        ref.hf_tokenizer().decode(ours["input_ids"][ours["loss_mask"] > 0].tolist())
        == " a <end_of_utterance>"
    )
    assert ours["image_rows_cols"].tolist() == [[2, 4]] and ours["pixel_values"].shape == (
        9,
        3,
        S,
        S,
    )


def test_bad_samples_are_typed_errors():
    with pytest.raises(MediaError, match="placeholder"):
        transform()(raw_sample([{"role": "user", "content": "<image> <image>"}], [png(1)]))
    with pytest.raises(ConfigError, match="smolvlm or idefics3"):
        Idefics3SampleTransform(
            model_config=transformers.Qwen2VLConfig(), tokenizer=ref.hf_tokenizer()
        )
    with pytest.raises(ConfigError, match="image_token_id 99"):
        Idefics3SampleTransform(
            model_config=transformers.SmolVLMConfig(image_token_id=99), tokenizer=ref.hf_tokenizer()
        )
    with pytest.raises(ConfigError, match="image_size"):  # 364-px tiles from a 32-px tower
        Idefics3SampleTransform(
            model_config=ref.tiny_config(),
            tokenizer=ref.hf_tokenizer(),
            processor=pil_image_processor_class("idefics3")(),
        )


@pytest.mark.parametrize("model_type", ["smolvlm", "idefics3"])
def test_the_contract_is_plain_packing_on_every_consumer(model_type):
    assert_plain_packing(ref.tiny_config(model_type))


# ---- in-model
# ---------------------------------------------------------------------------------------
def model_samples(model_type: str) -> list[dict]:
    return transformed(transform(model_type), hi=70)


def alone(sample: dict) -> dict:
    kwargs = {"input_ids": sample["input_ids"][None], "use_cache": False}
    if sample["pixel_values"].shape[0]:
        kwargs["pixel_values"] = sample["pixel_values"][None].to(torch.float64)
    return kwargs


def packed(model_type: str, samples: list[dict]) -> tuple[dict, dict]:
    """THD tp=2 cp=2, every CP rank unsharded back; the model's kwargs from ``to_hf_kwargs``."""
    tok, config = ref.hf_tokenizer(), ref.tiny_config(model_type)
    schema = vision_family(config).batch_schema(
        pad_token_id=tok.pad_token_id, vocab_size=len(tok), pixel_dtypes=("float32",)
    )
    whole = packed_batch(schema, samples)
    keys = ["input_ids", "mm_token_type_ids", "pixel_values", "position_ids", "use_cache"]
    return whole, hf_kwargs(whole, keys, config)


def worst(model_type: str, batch: dict, kwargs: dict, samples: list[dict]) -> float:
    return worst_gap(ref.tiny_model(model_type), kwargs, batch, samples, alone)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["smolvlm", "idefics3"])
def test_packed_logits_equal_each_sample_alone(model_type):
    samples = model_samples(model_type)
    assert [s["image_rows_cols"].shape[0] for s in samples] == [1, 0, 2]
    batch, kwargs = packed(model_type, samples)
    assert kwargs["pixel_values"].shape[:2] == (1, sum(s["pixel_values"].shape[0] for s in samples))
    assert worst(model_type, batch, kwargs, samples) < TOL


@pytest.mark.slow
def test_positions_that_do_not_restart_are_caught():
    samples = model_samples("smolvlm")
    batch, kwargs = packed("smolvlm", samples)
    kwargs["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
    assert worst("smolvlm", batch, kwargs, samples) > CORRUPT


# ---- the demo and the header pass
# -------------------------------------------------------------------
@pytest.mark.slow
def test_demo_command_with_smolvlm(tmp_path, capsys):
    """``prealign demo --model smolvlm``: every batch on every CP rank valid against the family's
    schema, the synthetic teacher rows as long as the transform's ids, whole tiles in
    pixel_values."""
    out = run_demo(tmp_path, capsys, "smolvlm", token_budget=4096)
    assert "smolvlm_topk" in out
    assert re.search(r"pixel_values +float32 +\[\d+, 3, 128, 128\]", out) and re.search(
        r"image_rows_cols +int64", out
    )


def test_header_index_equals_the_full_pass(tmp_path):
    """``prealign demo --model smolvlm`` data: the header-only index (image headers sized, the chat
    rendered by the tokenizer alone) gives every sample the length and media flag the full transform
    gives."""
    assert_header_index_equals_full_pass(tmp_path, "smolvlm", 16)
