"""LLaVA-OneVision: prealign's transform equals transformers' ``LlavaOnevisionProcessor`` +
``apply_chat_template`` (input ids with the leading-newline merges, AnyRes pixel values per
image, ``image_sizes``, 1-D positions) on random samples; header-only ids equal the transform's;
and a tiny LLaVA-OneVision (float64) gives the same logits for a packed THD batch (cp=2, every
rank unsharded back) as for each sample alone, while positions that do not restart, or image
features handed to the wrong image, are caught; videos (frame lists) as the processor writes
them.

What is real here (:mod:`tests.families.llava_onevision_reference`): the tokenizer class, the
image processor, the processor's ``__call__`` and ``apply_chat_template``, the model; the video
slot holds a stand-in (``FramesVideoProcessor``)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate import HFAttention, THDCollator, to_hf_kwargs, unpack_thd, unshard_cp
from prealign.loaders.media.llava_onevision import LlavaOnevisionSampleTransform
from prealign.loaders.media.vlm import MediaError
from prealign.schemas import ConfigError, ParallelLayout
from tests.conftest import examples
from tests.consumers.models import CORRUPT, real_slots
from tests.families import llava_onevision_reference as ref
from tests.families.chat_samples import sized_png

transformers = pytest.importorskip("transformers")
TOL = 1e-6
PINS = ((56, 56), (56, 112), (112, 56), (112, 112), (56, 168), (168, 56), (168, 168))
"""Small tiles (56 px, 4 x 4 patches of 14) so random samples run in milliseconds; the rule is the
same."""


def items(text: str) -> list[dict]:
    """A content string as the other families' tests read it: ``<image>`` / ``<video>`` items and
    the text pieces between."""
    import re

    return [
        {"type": p[1:-1]} if p in ("<image>", "<video>") else {"type": "text", "text": p}
        for p in re.split("(<image>|<video>)", text)
        if p
    ]


def sample(key: str, contents: list[str], sizes: list, seed: int, frames: list[int] = ()) -> tuple:
    """(raw sample, typed chat messages, PIL images, PIL frames per video) of alternating user /
    assistant ``contents``; video ``v`` has ``frames[v]`` frames of one random size, listed in
    ``json["videos"]``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    members = {f"{i}.png": sized_png(rng, w, h) for i, (w, h) in enumerate(sizes)}
    roles = ["user", "assistant"] * len(contents)
    messages = [{"role": r, "content": c} for r, c in zip(roles, contents)]
    meta = {"messages": messages, "images": list(members), "videos": []}
    for v, n in enumerate(frames):
        w, h = (int(x) for x in rng.integers(10, 90, 2))
        names = [f"v{v}_{j}.png" for j in range(n)]
        members.update({name: sized_png(rng, w, h) for name in names})
        meta["videos"].append({"frames": names})
    raw = {"__key__": key, "json": json.dumps(meta), **members}
    chat = [{"role": m["role"], "content": items(m["content"])} for m in messages]
    load = [Image.open(io.BytesIO(members[f"{i}.png"])).convert("RGB") for i in range(len(sizes))]
    clips = [
        [Image.open(io.BytesIO(members[name])).convert("RGB") for name in video["frames"]]
        for video in meta["videos"]
    ]
    return raw, chat, load, clips


def transform(processor, **cfg) -> LlavaOnevisionSampleTransform:
    return LlavaOnevisionSampleTransform(
        model_config=ref.config(**cfg), tokenizer=ref.hf_tokenizer(), processor=processor
    )


PIECES = st.sampled_from(
    ["\n", "\n\n", " ", "a", "b", "hello", "world", ".", "?", " \n", "what cat"]
)
TEXT = st.lists(PIECES, max_size=5).map("".join)


def check_equal(processor, t, raw, chat, images, clips=()):
    """Every field against the processor's output on the template's text."""
    out = t(raw)
    text = processor.apply_chat_template(chat, tokenize=False)
    want = processor(
        text=text,
        images=[images] if images else None,
        videos=list(clips) or None,
        return_tensors="pt",
    )
    assert out["input_ids"].tolist() == want["input_ids"][0].tolist()
    assert t.header_ids(raw)[0].tolist() == out["input_ids"].tolist()
    assert out["batch_num_images"].tolist() == (
        [len(images)] if images else []
    )  # none without media
    if images:
        assert out["image_sizes"].tolist() == want["image_sizes"].tolist()
        pv = want["pixel_values"].to(
            torch.float32
        )  # [images, most tiles, 3, s, s], zero rows padding the batch
        tiles = [t.family.tiles(im.height, im.width, images_in_sample=len(images)) for im in images]
        assert torch.equal(out["pixel_values"], torch.cat([pv[i, :n] for i, n in enumerate(tiles)]))
        assert all(not pv[i, n:].any() for i, n in enumerate(tiles))
    else:
        assert out["pixel_values"].shape[0] == 0 and out["image_sizes"].shape == (0, 2)
    assert out["video_num_frames"].tolist() == [len(c) for c in clips]
    video = (out["input_ids"] == ref.token_id("<video>")).long() * 2
    assert torch.equal(
        out["mm_token_type_ids"], (out["input_ids"] == ref.token_id("<image>")).long() + video
    )
    if clips:  # (the stand-in's un-fused rescale + normalize: float32 rounding apart)
        got, theirs = out["pixel_values_videos"], want["pixel_values_videos"].flatten(0, 1)
        assert got.shape == theirs.shape and torch.allclose(got, theirs, atol=1e-5, rtol=0)
    return out


@pytest.mark.slow
@given(
    st.lists(st.tuples(st.integers(8, 400), st.integers(8, 400)), max_size=3),
    st.lists(TEXT, min_size=1, max_size=4),
    st.sampled_from(["full", "default"]),
    st.sampled_from(["anyres_max_9", "anyres_max_1"]),
    st.integers(0, 2**31),
    st.integers(0, 2),
    st.integers(1, 3),
    st.booleans(),
)
@examples(30)
def test_ids_pixels_sizes_and_positions_equal_the_processor(
    sizes, contents, strategy, aspect, seed, videos, frames, video_first
):
    """0-3 images and 0-2 videos (one frame count per sample: transformers 5.6 / 5.10 expand every
    ``<video>`` by the first video's), the placeholders in either order (the template writes a
    turn's images first)."""
    processor = ref.hf_processor(
        tile=56, pinpoints=PINS, strategy=strategy, aspect=aspect, video=True
    )
    t = transform(processor, tile=56, pinpoints=PINS, strategy=strategy, aspect=aspect)
    media = ["<image>"] * len(sizes) + ["<video>"] * videos
    contents = ["".join(media[::-1] if video_first else media) + contents[0], *contents[1:]]
    raw, chat, images, clips = sample("s", contents, sizes, seed, [frames] * videos)
    out = check_equal(processor, t, raw, chat, images, clips)
    schema = t.family.batch_schema(
        pad_token_id=0, vocab_size=len(ref.hf_tokenizer()), pixel_dtypes=("float32",)
    )
    batch = THDCollator(schema=schema, layout=ParallelLayout(tp=2))([out, out])
    for got in unpack_thd(
        batch["position_ids"],
        cu_seqlens=batch["cu_seqlens"],
        cu_seqlens_padded=batch["cu_seqlens_padded"],
    ):
        assert torch.equal(
            got, torch.arange(out["input_ids"].numel())
        )  # the model's own positions: 0..L-1
    assert batch["batch_num_images"].tolist() == ([len(sizes)] * 2 if sizes else [])


@pytest.mark.slow
def test_the_released_geometry():
    """384-px tiles, transformers' default 36 pinpoints, anyres_max_9: one image alone, then two in
    a sample."""
    processor = ref.hf_processor()
    for sizes in ([(700, 300)], [(300, 200), (90, 400)]):
        raw, chat, images, _ = sample(
            "r", ["<image>" * len(sizes) + "\nWhat is it?", "A cat."], sizes, 7
        )
        check_equal(processor, transform(processor), raw, chat, images)


@given(st.lists(TEXT, min_size=1, max_size=4))
@examples(40)
def test_leading_newline_turns_equal_the_chat_template(contents):
    """Text only (no pixels): ``"user "`` + ``"\\n" + text`` tokenized as the template's string, so
    a content that starts with a newline merges with the template's one (and the space before
    it)."""
    processor = ref.hf_processor(tile=56, pinpoints=PINS)
    raw, chat, _, _ = sample("n", contents, [], 0)
    text = processor.apply_chat_template(chat, tokenize=False)
    ours = transform(processor, tile=56, pinpoints=PINS)(raw)
    assert (
        ours["input_ids"].tolist()
        == ref.hf_tokenizer()(text, add_special_tokens=False)["input_ids"]
    )
    end = ref.token_id("<|im_end|>")
    trained_ends = int(((ours["input_ids"] == end) & (ours["loss_mask"] > 0)).sum())
    assert trained_ends == sum(m["role"] == "assistant" for m in chat)


def test_golden_leading_newline():
    """``"\\nab"`` from the assistant: ``" \\n\\n"`` is one piece of the template's string (one
    token here)."""
    processor = ref.hf_processor(tile=56, pinpoints=PINS)
    raw, chat, _, _ = sample("g", ["hi", "\nab"], [], 0)
    ours = transform(processor, tile=56, pinpoints=PINS)(raw)
    text = processor.apply_chat_template(chat, tokenize=False)
    assert text == "<|im_start|>user \nhi<|im_end|><|im_start|>assistant \n\nab<|im_end|>"
    assert (
        ours["input_ids"].tolist()
        == ref.hf_tokenizer()(text, add_special_tokens=False)["input_ids"]
    )
    trained = ours["input_ids"][ours["loss_mask"] > 0].tolist()
    assert ref.hf_tokenizer().decode(trained) == " \n\nab<|im_end|>"


def test_refusals():
    processor = ref.hf_processor(tile=56, pinpoints=PINS)
    with pytest.raises(
        ConfigError, match="pinpoints"
    ):  # the processor's tiling is not the config's
        transform(processor, tile=56)
    raw, _, _, _ = sample("v", ["<video>\nhi", "ok"], [], 0)  # no video listed
    with pytest.raises(MediaError, match="placeholder_mismatch"):
        transform(processor, tile=56, pinpoints=PINS)(raw)
    clip = {
        "__key__": "f",
        "json": json.dumps({"messages": [{"role": "user", "content": "<video>"}]}),
        "mp4": b"x",
    }
    with pytest.raises(MediaError, match="corrupt_video"):  # not a video container
        transform(processor, tile=56, pinpoints=PINS)(clip)
    raw, _, _, _ = sample("m", ["<image><image>hi", "ok"], [(20, 20)], 0)
    with pytest.raises(MediaError, match="placeholder_mismatch"):
        transform(processor, tile=56, pinpoints=PINS)(raw)


# ---- in-model
# ---------------------------------------------------------------------------------------
MODEL = dict(
    tile=42,
    pinpoints=((42, 42), (42, 84), (84, 42), (84, 84), (42, 126), (126, 42)),
    aspect="anyres_max_1",
)
"""A tiny tower on 42-px tiles (3 x 3 patches), ``anyres_max_1`` so a two-tile image is pooled
(interpolated)."""


def model_samples() -> list[dict]:
    processor = ref.hf_processor(tile=42, pinpoints=MODEL["pinpoints"], aspect=MODEL["aspect"])
    t = transform(processor, **MODEL)
    raws = [
        sample("a", ["<image>what?", "a cat."], [(80, 40)], 1)[0],  # alone: base + 2 tiles, pooled
        sample("b", ["hi", "\nhello there"], [], 2)[0],
        sample("c", ["<image>compare<image>", "same."], [(30, 60), (42, 42)], 3)[
            0
        ],  # two: base + newline
        sample("d", ["<video>what moves?<image>", "a dot."], [(42, 42)], 4, [2])[0],
    ]  # 2 frames, 2x2 each
    return [t(r) for r in raws]


def logits(kwargs: dict) -> torch.Tensor:
    with torch.no_grad():
        return ref.tiny_model(MODEL["tile"], MODEL["pinpoints"], MODEL["aspect"])(**kwargs).logits[
            0
        ]


def alone(s: dict) -> torch.Tensor:
    kwargs = {"input_ids": s["input_ids"][None], "use_cache": False}
    if s["pixel_values"].shape[0]:
        kwargs.update(
            pixel_values=s["pixel_values"].to(torch.float64),
            image_sizes=s["image_sizes"],
            batch_num_images=s["batch_num_images"],
        )
    if s["video_num_frames"].shape[0]:
        kwargs["pixel_values_videos"] = s["pixel_values_videos"].to(torch.float64)[None]
    return logits(kwargs)


def packed(samples: list[dict]) -> tuple[dict, dict]:
    """THD tp=2 cp=2: both CP ranks' shards unsharded back equal the whole batch; the model's kwargs
    from it."""
    schema = samples[0] and transform(
        ref.hf_processor(tile=42, pinpoints=MODEL["pinpoints"]), **MODEL
    ).family.batch_schema(
        pad_token_id=ref.hf_tokenizer().pad_token_id,
        vocab_size=len(ref.hf_tokenizer()),
        pixel_dtypes=("float32",),
    )
    layout = ParallelLayout(tp=2, cp=2)
    whole = THDCollator(schema=schema, layout=layout)(samples)
    shards = [THDCollator(schema=schema, layout=layout, cp_rank=r)(samples) for r in range(2)]
    for name in ("input_ids", "position_ids", "mm_token_type_ids"):
        back = unshard_cp([s[name] for s in shards], cu_seqlens_padded=whole["cu_seqlens_padded"])
        assert torch.equal(back, whole[name]), name
    for name in (
        "pixel_values",
        "image_sizes",
        "batch_num_images",
        "pixel_values_videos",
        "video_num_frames",
    ):
        assert all(torch.equal(s[name], whole[name]) for s in shards), name
    kwargs = to_hf_kwargs(whole, attention=HFAttention.POSITIONS, labels=False)
    assert sorted(kwargs) == [
        "batch_num_images",
        "image_sizes",
        "input_ids",
        "mm_token_type_ids",
        "pixel_values",
        "pixel_values_videos",
        "position_ids",
        "use_cache",
    ]
    kwargs.pop("mm_token_type_ids")  # (LLaVA-OneVision's forward takes none)
    kwargs["pixel_values"] = kwargs["pixel_values"].to(torch.float64)
    kwargs["pixel_values_videos"] = kwargs["pixel_values_videos"].to(
        torch.float64
    )  # [videos, frames, 3, s, s]
    return whole, kwargs


def worst(batch: dict, kwargs: dict, samples: list[dict]) -> float:
    out, bad = logits(kwargs), 0.0
    for slots, s in zip(real_slots(batch), samples, strict=True):
        bad = max(bad, float((out[slots] - alone(s)).abs().max()))
    return bad


@pytest.mark.slow
def test_packed_logits_equal_each_sample_alone():
    samples = model_samples()
    assert [s["pixel_values"].shape[0] for s in samples] == [3, 0, 2, 2]
    # a: 80x40 alone: base 3x3, its 1x2 tiles' 3x6 features pooled (anyres_max_1) to 2x4, a newline
    # per row; c: two images, each its base 3x3 + one newline; d: a 42-px image alone (base + one
    # 3x3 tile + 3 newlines)
    assert [int((s["mm_token_type_ids"] == 1).sum()) for s in samples] == [
        9 + 2 * 4 + 2,
        0,
        2 * (9 + 1),
        9 + 9 + 3,
    ]
    assert (
        int((samples[3]["mm_token_type_ids"] == 2).sum()) == 2 * 2 * 2 + 1
    )  # frames pooled to 2x2, a newline
    batch, kwargs = packed(samples)
    assert batch["batch_num_images"].tolist() == [1, 2, 1]  # per sample with images
    assert worst(batch, kwargs, samples) < TOL


@pytest.mark.slow
def test_positions_that_do_not_restart_are_caught():
    samples = model_samples()
    batch, kwargs = packed(samples)
    kwargs["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
    assert worst(batch, kwargs, samples) > CORRUPT


@pytest.mark.slow
def test_image_features_given_to_the_wrong_image_are_caught():
    """Sample c's two images swapped in the packed pixel values (sizes kept): each image's tokens
    get the other's features."""
    samples = model_samples()
    batch, kwargs = packed(samples)
    kwargs["pixel_values"] = kwargs["pixel_values"][[0, 1, 2, 4, 3, 5, 6]]
    assert worst(batch, kwargs, samples) > CORRUPT


# ---- the demo and the header-only index
# ----------------------------------------------------------------
@pytest.mark.slow
def test_demo_command_with_llava_onevision(tmp_path, capsys):
    """``prealign demo --model llava_onevision``: every batch on every CP rank valid against the
    family's batch schema; AnyRes tiles, image sizes and images per sample in the batches."""
    import re

    from tests.families.header_index import run_demo

    out = run_demo(tmp_path, capsys, "llava_onevision")
    assert "llava_onevision_topk" in out
    assert (
        re.search(r"pixel_values +float32 +\[\d+, 3, 384, 384\]", out) and "batch_num_images" in out
    )


def test_header_index_equals_the_full_pass(tmp_path):
    """``prealign demo --model llava_onevision`` data: the header-only index (each image's header
    size and the sample's image count give its AnyRes tokens; the chat rendered by the tokenizer
    alone) gives every sample the length and media flag the full transform gives; a corrupt image is
    found by both."""
    from prealign.loaders.index.header_pass import AnyResRule
    from tests.families.header_index import assert_header_index_equals_full_pass

    assert_header_index_equals_full_pass(tmp_path, "llava_onevision", 24, rule=AnyResRule)


def test_videos_of_different_frame_counts_cannot_share_a_forward():
    """LLaVA-OneVision's forward takes one ``[videos, frames, 3, s, s]`` tensor: packed frames are
    reshaped to it, and videos of different lengths are refused with the way out."""
    from prealign.collate.hf import onevision_videos
    from prealign.schemas import PackingUnsupportedError

    frames = torch.arange(5 * 3 * 2 * 2, dtype=torch.float32).reshape(5, 3, 2, 2)
    with pytest.raises(PackingUnsupportedError, match="same number of frames"):
        onevision_videos(frames, torch.tensor([2, 3]))
    four = onevision_videos(frames[:4], torch.tensor([2, 2]))
    assert four.shape == (2, 2, 3, 2, 2) and torch.equal(four[1, 0], frames[2])
