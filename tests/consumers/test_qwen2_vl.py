"""A tiny ``Qwen2VLForConditionalGeneration`` consumes prealign's unsharded VLM THD batch: images
through the real Qwen2-VL image processor (built locally), several per sample, 3-D mRoPE ids from
the batch (``MRoPECollator``), fed as transformers' packed layout ``[text; t; h; w]`` by
``to_hf_kwargs``. The logits at every real token equal those of the sample run alone, where the
model computes its own mRoPE positions (``get_rope_index``). Corruptions (a wrong mRoPE block, text
positions that do not restart, mRoPE without the text row) are caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prealign.collate import HFAttention, MRoPECollator, THDCollator, to_hf_kwargs
from prealign.loaders import VLMSampleTransform
from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
from prealign.schemas import PadPolicy, ParallelLayout, validate_vlm_batch, vlm_schema
from tests.consumers.models import CORRUPT, TOL, qwen2_vl, real_slots

pytest.importorskip("transformers")
TOK = ByteTokenizer()
SCHEMA = vlm_schema(vocab_size=TOK.vocab_size)
IMAGE_SIZES = (
    ((56, 84), (112, 56)),
    (),
    ((84, 84),),
    ((56, 56), (70, 112), (56, 56)),
)  # (w, h) per sample


def raw_samples(sizes=IMAGE_SIZES) -> list[dict]:
    """HF-row chat samples, one ``<image>`` per image, random-noise PIL images."""
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for i, images in enumerate(sizes):
        placeholders = " ".join(["<image>"] * len(images))
        out.append(
            {
                "__key__": f"s{i}",
                "images": [
                    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
                    for w, h in images
                ],
                "messages": [
                    {"role": "user", "content": f"q{i} {placeholders} what is it?"},
                    {"role": "assistant", "content": "a cat" * (i + 1)},
                ],
            }
        )
    return out


def model_inputs(kwargs: dict) -> dict:
    return (
        {**kwargs, "pixel_values": kwargs["pixel_values"].to(torch.float64)}
        if "pixel_values" in kwargs
        else kwargs
    )


def logits(model, kwargs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**model_inputs(kwargs)).logits[0]


def alone(model, sample: dict) -> torch.Tensor:
    """The sample run by itself; the model computes its mRoPE positions from
    ``mm_token_type_ids``."""
    kwargs = {"input_ids": sample["input_ids"][None], "use_cache": False}
    if sample["image_grid_thw"].shape[0]:
        kwargs.update(
            pixel_values=sample["pixel_values"],
            image_grid_thw=sample["image_grid_thw"],
            mm_token_type_ids=sample["mm_token_type_ids"][None],
        )
    return logits(model, kwargs)


def mismatch(model, batch: dict, samples: list[dict], kwargs: dict) -> tuple[float, int]:
    packed = logits(model, kwargs)
    worst, seen = 0.0, 0
    for slots, sample in zip(real_slots(batch), samples, strict=True):
        worst = max(worst, float((packed[slots] - alone(model, sample)).abs().max()))
        seen += slots.numel()
    return worst, seen


def collate(layout: ParallelLayout, transform: VLMSampleTransform, samples: list[dict]) -> dict:
    coll = MRoPECollator(
        collator=THDCollator(schema=SCHEMA, layout=layout),
        spatial_merge_size=transform.spatial_merge_size,
    )
    batch = coll(samples)
    validate_vlm_batch(batch, SCHEMA, layout, spatial_merge_size=transform.spatial_merge_size)
    return batch


@pytest.fixture(scope="module")
def samples():
    """Transformed samples without mRoPE ids (the collator computes them for the whole batch)."""
    transform = VLMSampleTransform(tokenizer=TOK, mrope=False)
    out = [transform(r) for r in raw_samples()]
    assert [s["image_grid_thw"].shape[0] for s in out] == [len(x) for x in IMAGE_SIZES]
    return transform, out


LAYOUTS = {
    "tp2-cp2-per-sequence": ParallelLayout(tp=2, cp=2, pad_policy=PadPolicy.PER_SEQUENCE),
    "cp3-min-rows": ParallelLayout(cp=3, min_local_rows=150),
    "tp4-fp8-buckets": ParallelLayout(tp=4, fp8="fp8", length_buckets=(256, 512)),
}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_packed_vlm_logits_equal_each_sample_alone(samples, attn, name):
    transform, ss = samples
    batch = collate(LAYOUTS[name], transform, ss)
    assert bool(batch["padding_mask"].any()) and batch["image_grid_thw"].shape[0] == 6
    worst, seen = mismatch(
        qwen2_vl(attn), batch, ss, to_hf_kwargs(batch, attention=HFAttention.POSITIONS)
    )
    assert seen == sum(s["input_ids"].numel() for s in ss) and worst < TOL, worst


def test_block_causal_mask_path_and_the_transforms_own_mrope(samples):
    """The 4-D mask instead of the text row, and samples that carry the transform's own mRoPE
    ids."""
    transform, _ = samples
    with_mrope = VLMSampleTransform(tokenizer=TOK)
    ss = [with_mrope(r) for r in raw_samples()]
    batch = collate(LAYOUTS["tp2-cp2-per-sequence"], transform, ss)
    kwargs = to_hf_kwargs(batch, attention=HFAttention.MASK, mask_dtype=torch.float64)
    kwargs["position_ids"] = kwargs["position_ids"][
        1:
    ]  # mRoPE rows only: the mask carries the packing
    worst, seen = mismatch(qwen2_vl("eager"), batch, ss, kwargs)
    assert seen > 0 and worst < TOL


def test_the_merge_size_comes_from_the_image_processor():
    transform = VLMSampleTransform(tokenizer=TOK)
    assert transform.spatial_merge_size == transform.image_processor.merge_size == 2
    assert transform.vision.spatial_merge_size == 2
    wrong = VLMSampleTransform(tokenizer=ByteTokenizer(spatial_merge_size=4))
    from prealign.schemas import ConfigError

    with pytest.raises(ConfigError, match="spatial_merge_size=4"):
        wrong.vision


# ---- corruptions are caught
# ---------------------------------------------------------------------------
def _batch(samples):
    transform, ss = samples
    return ss, collate(LAYOUTS["tp2-cp2-per-sequence"], transform, ss)


def test_detects_a_wrong_mrope_block(samples):
    """One image's height and width rows swapped (a transposed grid): its tokens' rotary angles
    change."""
    ss, batch = _batch(samples)
    mrope = batch["mrope_position_ids"].clone()
    img = torch.nonzero(batch["mm_token_type_ids"][0]).flatten()[
        :6
    ]  # first image: grid (1, 6, 4) -> 6 tokens
    mrope[1, 0, img], mrope[2, 0, img] = mrope[2, 0, img].clone(), mrope[1, 0, img].clone()
    assert not torch.equal(mrope, batch["mrope_position_ids"])
    corrupted = {**batch, "mrope_position_ids": mrope}
    worst, _ = mismatch(
        qwen2_vl("sdpa"), batch, ss, to_hf_kwargs(corrupted, attention=HFAttention.POSITIONS)
    )
    assert worst > CORRUPT


def test_detects_an_image_block_shifted_by_one(samples):
    """The last sample's image tokens placed one position later relative to its text (an off-by-one
    image start; shifting a whole sequence would not count: rotary positions are relative)."""
    ss, batch = _batch(samples)
    mrope = batch["mrope_position_ids"].clone()
    start, end = batch["cu_seqlens_padded"][3:5].tolist()
    img = start + torch.nonzero(batch["mm_token_type_ids"][0, start:end]).flatten()
    assert img.numel() > 0
    mrope[:, 0, img] += 1
    corrupted = {**batch, "mrope_position_ids": mrope}
    worst, _ = mismatch(
        qwen2_vl("sdpa"), batch, ss, to_hf_kwargs(corrupted, attention=HFAttention.POSITIONS)
    )
    assert worst > CORRUPT


@pytest.mark.parametrize("corruption", ["text-row-counts-on", "no-text-row"])
def test_detects_positions_that_do_not_show_the_packing(samples, corruption):
    ss, batch = _batch(samples)
    kwargs = to_hf_kwargs(batch, attention=HFAttention.POSITIONS)
    if corruption == "text-row-counts-on":
        kwargs["position_ids"][0] = torch.arange(batch["input_ids"].shape[1])
    else:  # [3, 1, T]: transformers then builds a plain causal mask over the whole row
        kwargs["position_ids"] = kwargs["position_ids"][1:]
    worst, _ = mismatch(qwen2_vl("sdpa"), batch, ss, kwargs)
    assert worst > CORRUPT


def test_a_batch_without_images_sends_no_empty_pixel_values():
    transform = VLMSampleTransform(tokenizer=TOK, mrope=False)
    ss = [transform(r) for r in raw_samples(((), ()))]
    batch = collate(LAYOUTS["cp3-min-rows"], transform, ss)
    kwargs = to_hf_kwargs(batch, attention=HFAttention.POSITIONS)
    assert (
        "pixel_values" not in kwargs
        and "image_grid_thw" not in kwargs
        and "mm_token_type_ids" in kwargs
    )
    worst, seen = mismatch(qwen2_vl("sdpa"), batch, ss, kwargs)
    assert seen > 0 and worst < TOL


def test_the_chat_tokenizer_gives_pad_and_eos_ids():
    from prealign.loaders import HFChatTokenizer
    from tests.loaders.media.test_vlm import _tiny_hf_tokenizer

    hf = _tiny_hf_tokenizer()  # no pad, no eos: eos falls back to <|im_end|>, pad to eos
    tok = HFChatTokenizer(hf)
    assert (
        tok.eos_token_id == tok.im_end_id == hf.convert_tokens_to_ids("<|im_end|>")
        and tok.pad_token_id == tok.eos_token_id
    )
    hf.pad_token, hf.eos_token = "<unk>", "<|im_end|>"
    tok = HFChatTokenizer(hf)
    assert (tok.pad_token_id, tok.eos_token_id) == (
        hf.pad_token_id,
        hf.eos_token_id,
    ) and tok.pad_token_id != tok.eos_token_id
    assert (TOK.pad_token_id, TOK.eos_token_id) == (0, 1)  # the demo tokenizer has them too
