"""A tiny Gemma 3 (float64, random weights, fixed seed) consumes prealign's packed THD batch (tp=2,
cp=2 layout, every rank unsharded): with the per-layer-type masks ``to_hf_kwargs(attention="mask")``
emits (each image's tokens bidirectional, the sliding window inside each sequence) the logits at
every real token equal those of each sample alone, where the model builds its own masks from
``token_type_ids``. Removing the bidirectional
image block, or the window, is caught. The flex-attention description equals the 4-D masks."""

from __future__ import annotations

import functools

import pytest
import torch

from prealign.collate import THDCollator, to_hf_kwargs
from prealign.collate.vision import model_contract, vision_family
from prealign.collate.vision.attention import TokenMaskIndex, layer_masks, packed_token_mask
from prealign.schemas import BatchSchema, FieldSpec, PadPolicy, ParallelLayout
from prealign.schemas.errors import PackingUnsupportedError
from prealign.schemas.schema import core_token_fields
from tests.consumers.models import (
    CORRUPT,
    assert_flex_equals_dense,
    real_slots,
    tiny_text_config,
)

transformers = pytest.importorskip("transformers")
BOI, EOI, IMAGE, PAD = 4, 5, 6, 0
VOCAB = 64
TOKENS = 4  # image tokens per image (2 x 2, pooled from 4 x 4 patches)
# longer than an image (transformers < 5.24 OR the block over the window), shorter than a sample
WINDOW = 6
SHORT_WINDOW = 2  # shorter than an image: there the releases' window rules differ
TOL = 1e-6
LAYOUT = ParallelLayout(tp=2, cp=2, pad_policy=PadPolicy.PER_SEQUENCE)
SCHEMA = BatchSchema(
    name="gemma3",
    ignore_index=-100,
    fields=(
        *core_token_fields(PAD, -100, VOCAB),
        FieldSpec(
            name="mm_token_type_ids", dtypes=("int64",), pad_value=0, min_value=0, max_value=1
        ),
    ),
)


def tiny_config(attn: str = "sdpa", window: int = WINDOW):
    text = tiny_text_config(
        VOCAB,
        head_dim=8,
        max_position_embeddings=512,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=8,
        pad_token_id=PAD,
        bos_token_id=2,
        eos_token_id=1,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=4,
        num_channels=3,
    )
    return transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TOKENS,
        boi_token_index=BOI,
        eoi_token_index=EOI,
        image_token_index=IMAGE,
        initializer_range=0.3,
        attn_implementation=attn,
    )


@functools.lru_cache(maxsize=None)
def tiny_model(attn: str = "sdpa", window: int = WINDOW):
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(tiny_config(attn, window))
    with torch.no_grad():  # transformers starts the projection at 0: every image token alike
        for name, weight in model.named_parameters():
            if name.endswith("mm_input_projection_weight"):
                weight.normal_(std=0.3)
    return model.to(torch.float64).eval()


def sample(segments: list, seed: int) -> dict:
    """ints: runs of text; "image": ``<start_of_image>`` + 4 image tokens + ``<end_of_image>``."""
    g = torch.Generator().manual_seed(seed)
    ids, types, images = [], [], 0
    for seg in segments:
        if seg == "image":
            ids += [BOI, *[IMAGE] * TOKENS, EOI]
            types += [0, *[1] * TOKENS, 0]
            images += 1
        else:
            ids += torch.randint(8, VOCAB, (seg,), generator=g).tolist()
            types += [0] * seg
    return {
        "input_ids": torch.tensor(ids),
        "mm_token_type_ids": torch.tensor(types),
        "pixel_values": torch.randn(images, 3, 16, 16, generator=g, dtype=torch.float64),
    }


SAMPLES = (
    sample([3, "image", 9, "image", 2], 1),
    sample([11], 2),
    sample(["image", 4, "image", "image", 7], 3),
)


def two_layer_masks(batch: dict, window: int, *, bidirectional: bool = True, **rule) -> dict:
    """The sliding + full masks of ``batch``, float64 additive: each image's block where
    ``bidirectional``; ``rule``: :func:`~prealign.collate.vision.attention.layer_masks`'
    ``bidirectional_layers`` / ``block_over_window``."""
    index = TokenMaskIndex.of(
        batch["cu_seqlens_padded"], batch["cu_seqlens"], batch["mm_token_type_ids"]
    )
    return layer_masks(
        index,
        ["sliding_attention", "full_attention"],
        bidirectional=bidirectional,
        window=window,
        dtype=torch.float64,
        **rule,
    )


def blockless_masks(batch: dict, window: int) -> dict:
    """:func:`two_layer_masks` without image blocks (causal per sequence)."""
    return two_layer_masks(batch, window, bidirectional=False)


def alone(model, s: dict) -> torch.Tensor:
    kw = {
        "input_ids": s["input_ids"][None],
        "token_type_ids": s["mm_token_type_ids"][None],
        "use_cache": False,
    }
    if s["pixel_values"].shape[0]:
        kw["pixel_values"] = s["pixel_values"]
    with torch.no_grad():
        return model(**kw).logits[0]


def packed(attention="mask", window: int = WINDOW):
    batch = THDCollator(schema=SCHEMA, layout=LAYOUT)(
        [{k: v for k, v in s.items() if k != "pixel_values"} for s in SAMPLES]
    )
    kwargs = to_hf_kwargs(
        batch,
        attention=attention,
        model_config=tiny_config(window=window),
        mask_dtype=torch.float64,
        labels=False,
    )
    kwargs["pixel_values"] = torch.cat([s["pixel_values"] for s in SAMPLES])
    return batch, kwargs


def worst(batch: dict, kwargs: dict, attn: str = "sdpa", window: int = WINDOW) -> float:
    model = tiny_model(attn, window)
    with torch.no_grad():
        out = model(**kwargs).logits[0]
    diffs = [
        (out[slots] - alone(model, s)).abs().max()
        for slots, s in zip(real_slots(batch), SAMPLES, strict=True)
    ]
    return float(max(diffs))


def test_the_contract_declares_bidirectional_images_sliding_windows_and_1d_positions():
    c = model_contract(tiny_config())
    assert (c.position_kind, c.media_attention, c.local_attention, c.linear_attention) == (
        "1d",
        "bidirectional",
        "sliding",
        False,
    )
    assert c.fields() == ("position_ids", "cu_seqlens_padded", "attention_mask")
    fam = vision_family(tiny_config())
    assert (fam.image_token_id, fam.vision_start_token_id, fam.vision_end_token_id) == (
        IMAGE,
        BOI,
        EOI,
    )
    assert fam.tokens_per_image() == TOKENS and fam.spatial_merge_size == 2


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logits_equal_each_sample_alone(attn):
    batch, kwargs = packed()
    assert set(kwargs["attention_mask"]) == {"sliding_attention", "full_attention"}
    assert "mm_token_type_ids" not in kwargs and batch["cu_seqlens_padded"].shape[0] == 4
    assert worst(batch, kwargs, attn) < TOL


@pytest.mark.slow
def test_an_image_longer_than_the_window_packs_under_the_installed_rule():
    """Window 2, images of 4 tokens: transformers 5.6 / 5.10 OR each image's block over the
    windowed causal mask (an image token sees its whole image), 5.24 ANDs the window after the
    block; the masks follow the installed release (``ModelContract.media_over_window``)."""
    batch, kwargs = packed(window=SHORT_WINDOW)
    assert worst(batch, kwargs, window=SHORT_WINDOW) < TOL


@pytest.mark.slow
def test_the_other_releases_window_rule_is_caught():
    batch, kwargs = packed(window=SHORT_WINDOW)
    ours = model_contract(tiny_config(window=SHORT_WINDOW)).media_over_window
    kwargs["attention_mask"] = two_layer_masks(batch, SHORT_WINDOW, block_over_window=not ours)
    assert worst(batch, kwargs, window=SHORT_WINDOW) > CORRUPT


@pytest.mark.slow
def test_the_image_block_removed_is_caught():
    """Negative control: the same masks without the bidirectional image block (causal per
    sequence)."""
    batch, kwargs = packed()
    kwargs["attention_mask"] = blockless_masks(batch, WINDOW)
    assert worst(batch, kwargs) > CORRUPT


@pytest.mark.slow
def test_the_window_removed_or_counted_across_the_row_is_caught():
    batch, kwargs = packed()
    masks = dict(kwargs["attention_mask"])
    kwargs["attention_mask"] = {**masks, "sliding_attention": masks["full_attention"]}
    assert worst(batch, kwargs) > CORRUPT


def test_a_packed_row_without_its_masks_is_refused():
    for attention in ("positions", "varlen"):
        with pytest.raises(PackingUnsupportedError, match="attention='mask'"):
            packed(attention)


@pytest.mark.parametrize("window", [WINDOW, SHORT_WINDOW])
def test_the_flex_description_equals_the_dense_masks(window):
    assert_flex_equals_dense(packed(window=window)[0], tiny_config(window=window))


def test_the_mask_is_the_per_sequence_rule():
    """Golden case: two sequences (3 real + 1 pad, then 4 real), an image of 2 tokens at slots
    1-2."""
    index = TokenMaskIndex.of(
        torch.tensor([0, 4, 8]), torch.tensor([0, 3, 7]), torch.tensor([0, 1, 1, 0, 1, 1, 0, 0])
    )
    full = packed_token_mask(index, bidirectional=True)[0, 0].int().tolist()
    assert full == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],  # the pad sees its sequence (no NaN row), nothing sees it
        [0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 1, 1, 1, 1],
    ]
    sliding = packed_token_mask(index, bidirectional=True, window=2)[0, 0].int().tolist()
    assert sliding[6] == [0, 0, 0, 0, 0, 1, 1, 0] and sliding[4] == [0, 0, 0, 0, 1, 1, 0, 0]


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["mask", "positions"])
def test_a_text_gemma3_packs_with_its_window_per_sequence(attention):
    """Gemma 3 text (``gemma3_text``: sliding + full layers, no images): with ``attention="mask"``
    the per-layer masks (the window counted inside each sequence), with ``"positions"`` the model's
    own packing from ``position_ids``; both give each sample's logits."""
    cfg = tiny_config().text_config
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).to(torch.float64).eval()
    texts = [
        {"input_ids": s["input_ids"], "mm_token_type_ids": torch.zeros_like(s["input_ids"])}
        for s in SAMPLES
    ]
    batch = THDCollator(schema=SCHEMA, layout=LAYOUT)(texts)
    kwargs = to_hf_kwargs(
        batch, attention=attention, model_config=cfg, mask_dtype=torch.float64, labels=False
    )
    kwargs.pop("mm_token_type_ids", None)
    assert ("attention_mask" in kwargs) == (attention == "mask")
    with torch.no_grad():
        out = model(**kwargs).logits[0]
        diffs = [
            (out[slots] - model(input_ids=t["input_ids"][None], use_cache=False).logits[0])
            .abs()
            .max()
            for slots, t in zip(real_slots(batch), texts, strict=True)
        ]
    assert float(max(diffs)) < TOL
