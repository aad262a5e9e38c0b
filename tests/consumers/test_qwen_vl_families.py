"""Tiny Qwen2.5-VL, Qwen3-VL and Qwen3.5 (float64, random weights, fixed seed) consume prealign's
packed THD batch with images and video: the logits at every real token equal those of each sample
run alone, where the model computes its own positions (``get_rope_index``) from
``mm_token_type_ids``. Qwen3.5 runs with full-attention ``layer_types`` (the pure-torch Gated
DeltaNet cannot pack; ``to_hf_kwargs`` refuses that).
A corrupted batch (a video frame's positions shifted, the text row not restarting) is caught."""

from __future__ import annotations

import functools

import pytest
import torch

from prealign.collate import HFAttention, MRoPECollator, THDCollator, to_hf_kwargs
from prealign.schemas import PadPolicy, ParallelLayout, validate_vlm_batch, vlm_schema
from prealign.schemas.errors import PackingUnsupportedError
from tests.consumers.models import CORRUPT, TOL, real_slots
from tests.families.test_vlm_families import fractional_seconds
from tests.vlm_families import TOK, tiny_config, tiny_model, vision_sample

transformers = pytest.importorskip("transformers")
SCHEMA = vlm_schema(vocab_size=TOK.vocab_size)
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")
LAYOUT = ParallelLayout(tp=2, cp=2, pad_policy=PadPolicy.PER_SEQUENCE)


def segments() -> tuple[list, ...]:
    """Fractional seconds per grid where the installed transformers keeps them (5.10 truncates to an
    int)."""
    a, b = (0.75, 1.5) if fractional_seconds() else (1.0, 2.0)
    return (
        [3, ("image", 4, 6), 2, ("video", 3, 4, 4, a), 2],
        [5],
        [("video", 2, 2, 4, b), 1, ("image", 2, 2), 3, ("image", 4, 2), 1],
    )


@functools.lru_cache(maxsize=None)
def samples(model_type: str) -> tuple[dict, ...]:
    """The three samples with random pixels (the processors' path is the transform's test)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for segs in segments():
        s = vision_sample(model_type, segs)
        for key in ("pixel_values", "pixel_values_videos"):
            s[key] = torch.randn(s[key].shape, generator=g)
        out.append(s)
    return tuple(out)


def logits(model, kwargs: dict) -> torch.Tensor:
    kwargs = {
        k: v.to(torch.float64) if k.startswith("pixel_values") else v for k, v in kwargs.items()
    }
    with torch.no_grad():
        return model(**kwargs).logits[0]


def alone(model_type: str, model, sample: dict) -> torch.Tensor:
    kwargs = {
        "input_ids": sample["input_ids"][None],
        "mm_token_type_ids": sample["mm_token_type_ids"][None],
        "use_cache": False,
    }
    if sample["image_grid_thw"].shape[0]:
        kwargs.update(pixel_values=sample["pixel_values"], image_grid_thw=sample["image_grid_thw"])
    if sample["video_grid_thw"].shape[0]:
        kwargs.update(
            pixel_values_videos=sample["pixel_values_videos"],
            video_grid_thw=sample["video_grid_thw"],
        )
        if model_type == "qwen2_5_vl":
            kwargs["second_per_grid_ts"] = sample["second_per_grid_ts"]
    return logits(model, kwargs)


def packed(model_type: str) -> tuple[dict, dict]:
    cfg = tiny_config(model_type)
    batch = MRoPECollator(collator=THDCollator(schema=SCHEMA, layout=LAYOUT), model_config=cfg)(
        list(samples(model_type))
    )
    validate_vlm_batch(batch, SCHEMA, LAYOUT)
    return batch, to_hf_kwargs(batch, attention=HFAttention.POSITIONS, model_config=cfg)


def mismatch(model_type: str, batch: dict, kwargs: dict) -> tuple[float, int]:
    model = tiny_model(model_type)
    out = logits(model, kwargs)
    worst, seen = 0.0, 0
    for slots, sample in zip(real_slots(batch), samples(model_type), strict=True):
        worst = max(worst, float((out[slots] - alone(model_type, model, sample)).abs().max()))
        seen += slots.numel()
    return worst, seen


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILIES)
def test_packed_logits_equal_each_sample_alone(model_type):
    batch, kwargs = packed(model_type)
    assert batch["video_grid_thw"].shape[0] == 2 and batch["image_grid_thw"].shape[0] == 3
    assert kwargs["position_ids"].shape == (4, 1, batch["input_ids"].shape[1])
    worst, seen = mismatch(model_type, batch, kwargs)
    assert seen == sum(s["input_ids"].numel() for s in samples(model_type)) and worst < TOL, worst


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_video_frame_shifted_by_one_is_caught(model_type):
    """The first sample's video tokens one temporal step later (rotary positions are relative: only
    a block moved against its text shows)."""
    batch, kwargs = packed(model_type)
    video = torch.nonzero(batch["mm_token_type_ids"][0] == 2).flatten()
    video = video[video < int(batch["cu_seqlens_padded"][1])]
    kwargs["position_ids"] = kwargs["position_ids"].clone()
    kwargs["position_ids"][1, 0, video] += 1
    worst, _ = mismatch(model_type, batch, kwargs)
    assert worst > CORRUPT


@pytest.mark.slow
def test_a_text_row_that_does_not_restart_is_caught():
    batch, kwargs = packed("qwen3_5")
    kwargs["position_ids"] = kwargs["position_ids"].clone()
    kwargs["position_ids"][0] = torch.arange(batch["input_ids"].shape[1])
    worst, _ = mismatch("qwen3_5", batch, kwargs)
    assert worst > CORRUPT


def test_gdn_packing_without_the_kernels_is_refused():
    """Qwen3.5's default layers mix linear attention in: a packed row needs fla + causal-conv1d
    (absent here); one sequence per row needs neither; seq_idx names each slot's padded sequence."""
    cfg = transformers.Qwen3_5Config()
    batch, _ = packed("qwen3_5")
    with pytest.raises(PackingUnsupportedError, match="fla, causal_conv1d not importable"):
        to_hf_kwargs(batch, model_config=cfg)
    one = MRoPECollator(
        collator=THDCollator(schema=SCHEMA, layout=LAYOUT), model_config=tiny_config("qwen3_5")
    )([samples("qwen3_5")[0]])
    kw = to_hf_kwargs(one, model_config=cfg)
    assert kw["seq_idx"].dtype == torch.int32 and kw["seq_idx"].shape == one["input_ids"].shape
    assert bool((kw["seq_idx"] == 0).all())
    assert "seq_idx" not in to_hf_kwargs(
        batch, model_config=tiny_config("qwen3_5")
    )  # all full attention


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_5"])
def test_transformed_samples_pack_exactly(model_type):
    """Samples from the transform itself (the family's image processor, video frames, the timestamp
    text): packed logits equal each sample alone."""
    from prealign.loaders.media.vlm import VLMSampleTransform
    from tests.loaders.media.test_vlm_video import video_raw

    cfg = tiny_config(model_type)
    transform = VLMSampleTransform(tokenizer=TOK, model_config=cfg, mrope=False)
    fps = 4.0 if fractional_seconds() else 2.0
    raws = [video_raw("a", 3, 64, 48, fps), video_raw("b", 4, 40, 72, fps, image=False)]
    ss = [transform(r) for r in raws]
    batch = MRoPECollator(collator=THDCollator(schema=SCHEMA, layout=LAYOUT), model_config=cfg)(ss)
    kwargs = to_hf_kwargs(batch, attention=HFAttention.POSITIONS, model_config=cfg)
    model = tiny_model(model_type)
    out, worst = logits(model, kwargs), 0.0
    for slots, sample in zip(real_slots(batch), ss, strict=True):
        worst = max(worst, float((out[slots] - alone(model_type, model, sample)).abs().max()))
    assert worst < TOL, worst


@pytest.mark.slow
def test_gdn_packing_keys_leave_full_attention_layers_exact():
    """What ``to_hf_kwargs`` adds for a Gated DeltaNet model in every mode (``cu_seq_lens_q/k``,
    ``max_length_q/k``, ``seq_idx``) is read by the GDN layers only: the full-attention (sdpa)
    layers, in this test's POSITIONS mode, give the same exact per-sample logits with them."""
    batch, kwargs = packed("qwen3_5")
    padded = batch["cu_seqlens_padded"].to(torch.int32)
    extra = to_hf_kwargs(batch, attention=HFAttention.VARLEN)
    kwargs = {
        **kwargs,
        **{k: extra[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")},
    }
    from prealign.collate.hf import packed_seq_idx

    worst, _ = mismatch("qwen3_5", batch, {**kwargs, "seq_idx": packed_seq_idx(padded)})
    assert worst < TOL, worst
