"""GLM-4.1V / GLM-4.5V: prealign's transform equals transformers' ``Glm4vProcessor`` (input ids,
pixel values, image and video grids, token types: video frames use the image token) and its
positions equal the tiny model's own ``get_rope_index``, per sample and packed (THD cp=2, both ranks
unsharded back); a tiny model (float64) gives the
same logits packed as alone for image batches and for video batches; images and video in one forward
are refused."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate import HFAttention, MRoPECollator, THDCollator, to_hf_kwargs, unshard_cp
from prealign.collate.vision import Glm4V, VisionGeometry, vision_family
from prealign.collate.vision.glm4v import glm4v_frame_indices, glm4v_resize
from prealign.loaders.media.vlm import MediaError, VLMSampleTransform
from prealign.schemas import ParallelLayout, vlm_schema
from prealign.schemas.errors import PackingUnsupportedError
from tests.conftest import examples
from tests.consumers.models import CORRUPT, real_slots
from tests.families import glm4v_reference as ref
from tests.families.chat_samples import media_sample

transformers = pytest.importorskip("transformers")
TOL = 1e-6
SCHEMA = vlm_schema(
    vocab_size=len(ref.hf_tokenizer()), pad_token_id=ref.hf_tokenizer().pad_token_id
)
words = st.text(alphabet=" abcdefgh?.\n", min_size=0, max_size=10)


def raw_sample(key, sizes, videos, question, reply, seed):
    """(raw sample, chat messages, PIL images, PIL frame lists); ``videos``: ``(frames, w, h,
    fps)``."""
    return media_sample(key, sizes, question, reply, seed, videos=videos)


def hf_positions(model_type, out) -> torch.Tensor:
    kw = {k: out[k] for k in ("image_grid_thw", "video_grid_thw") if k in out and out[k].shape[0]}
    with torch.no_grad():
        pos, _ = ref.tiny_model(model_type).model.get_rope_index(
            out["input_ids"][None], out["mm_token_type_ids"][None], **kw
        )
    return pos[:, 0]


media = st.one_of(
    st.tuples(
        st.lists(st.tuples(st.integers(8, 400), st.integers(8, 400)), min_size=0, max_size=2),
        st.just([]),
    ),
    st.tuples(
        st.just([]),
        st.lists(
            st.tuples(
                st.integers(1, 5),
                st.integers(20, 200),
                st.integers(20, 200),
                st.sampled_from([1.0, 2.0, 3.0, 0.5]),
            ),
            min_size=1,
            max_size=2,
        ),
    ),
)


@pytest.mark.slow
@given(media, words, words, st.integers(0, 2**31), st.sampled_from(["glm4v", "glm4v_moe"]))
@examples(12)
def test_ids_pixels_grids_types_and_positions_equal_transformers(
    case, question, reply, seed, model_type
):
    sizes, videos = case
    processor = ref.hf_processor([fps for *_, fps in videos], thinking=model_type == "glm4v_moe")
    raw, messages, images, clips = raw_sample("g", sizes, videos, question, reply, seed)
    out = VLMSampleTransform(processor=processor, model_config=ref.tiny_config(model_type))(raw)
    text = processor.apply_chat_template(messages, tokenize=False)
    want = processor(
        text=text,
        images=images or None,
        videos=clips or None,
        return_tensors="pt",
        return_mm_token_type_ids=True,
    )
    assert out["input_ids"].tolist() == want["input_ids"][0].tolist()
    if images:
        assert torch.equal(out["pixel_values"], want["pixel_values"].to(torch.float32))
        assert torch.equal(out["image_grid_thw"], want["image_grid_thw"])
    if clips:
        assert torch.equal(out["video_grid_thw"], want["video_grid_thw"])
    assert out["mm_token_type_ids"].tolist() == want["mm_token_type_ids"][0].tolist()
    assert torch.equal(out["mrope_position_ids"], hf_positions(model_type, out))
    t = VLMSampleTransform(processor=processor, model_config=ref.tiny_config(model_type))
    tokens = (want["image_grid_thw"].prod(-1) // 4).tolist() if images else []
    assert [t.header_image_tokens(w, h, sample="g", field="i") for w, h in sizes] == tokens
    # packed with itself, THD cp=2: both ranks unsharded back equal the whole batch, whose rows
    # equal transformers'
    layout = ParallelLayout(tp=2, cp=2)
    cfg = ref.tiny_config(model_type)
    whole = MRoPECollator(collator=THDCollator(schema=SCHEMA, layout=layout), model_config=cfg)(
        [out, out]
    )
    shards = [
        MRoPECollator(
            collator=THDCollator(schema=SCHEMA, layout=layout, cp_rank=r), model_config=cfg
        )([out, out])
        for r in range(2)
    ]
    back = unshard_cp(
        [s["mrope_position_ids"] for s in shards],
        cu_seqlens_padded=whole["cu_seqlens_padded"],
        dim=2,
    )
    assert torch.equal(back, whole["mrope_position_ids"])
    for slots in real_slots(whole):
        assert torch.equal(whole["mrope_position_ids"][:, 0, slots], out["mrope_position_ids"])


# ---- GLM's own chat frame
# ------------------------------------------------------------------------------
texts = st.text(alphabet=" ab?\n", min_size=0, max_size=6)
replies = st.one_of(
    texts, st.builds(lambda a, b, c: f"{a}<think>{b}</think>{c}", texts, texts, texts)
)


def conversation(sizes, videos, system, turns, seed):
    """(raw sample, HF messages, images, clips): an optional system turn, then ``turns`` (user,
    reply) pairs; the media lead the first user turn."""
    raw, _, images, clips = raw_sample("c", sizes, videos, "", "", seed)
    media = "<video>" * len(videos) + "<image>" * len(sizes)
    items = [{"type": "video"}] * len(videos) + [{"type": "image"}] * len(sizes)
    ours, hf = [], []
    if system is not None:
        ours.append({"role": "system", "content": system})
        hf.append({"role": "system", "content": system})
    for k, (question, reply) in enumerate(turns):
        ours += [
            {"role": "user", "content": (media if k == 0 else "") + question},
            {"role": "assistant", "content": reply},
        ]
        hf += [
            {
                "role": "user",
                "content": (items if k == 0 else []) + [{"type": "text", "text": question}],
            },
            {"role": "assistant", "content": reply},
        ]
    meta = json.loads(raw["json"])
    meta["messages"] = ours
    return {**raw, "json": json.dumps(meta)}, hf, images, clips


@pytest.mark.slow
@given(
    media,
    st.one_of(st.none(), texts),
    st.lists(st.tuples(texts, replies), min_size=1, max_size=3),
    st.integers(0, 2**31),
    st.sampled_from([("glm4v", None), ("glm4v_moe", None), ("glm4v", "glm4.5v")]),
)
@examples(40)
def test_glm_chat_frame_equals_apply_chat_template(case, system, turns, seed, frame):
    """Random conversations (system turn or not, several turns, leading newlines, think blocks,
    images or video): input_ids equal transformers' processor over the chat template's rendering."""
    sizes, videos = case
    model_type, name = frame
    thinking = model_type == "glm4v_moe" or name == "glm4.5v"
    processor = ref.hf_processor([fps for *_, fps in videos], thinking=thinking)
    raw, messages, images, clips = conversation(sizes, videos, system, turns, seed)
    t = VLMSampleTransform(
        processor=processor, model_config=ref.tiny_config(model_type), chat_frame=name
    )
    out = t(raw)
    text = processor.apply_chat_template(messages, tokenize=False)
    want = processor(text=text, images=images or None, videos=clips or None, return_tensors="pt")
    assert out["input_ids"].tolist() == want["input_ids"][0].tolist()
    assert text.startswith("[gMASK]<sop>") and "<|im_start|>" not in text


def test_glm_chat_frame_golden_ids_and_loss():
    """GLM-4.1V: ``[gMASK]<sop><|user|>\\n\\nq<|assistant|>\\na<|user|>\\nb<|assistant|>\\nc``; the
    user's leading newline merges into one ``\\n\\n`` token; loss on each reply and on the role tag
    after it."""
    tok = ref.hf_tokenizer()
    raw = {
        "__key__": "g",
        "json": json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "\nq"},
                    {"role": "assistant", "content": "a"},
                    {"role": "user", "content": "b"},
                    {"role": "assistant", "content": "c"},
                ]
            }
        ),
    }
    out = VLMSampleTransform(processor=ref.hf_processor(), model_config=ref.tiny_config())(raw)
    names = tok.convert_ids_to_tokens(out["input_ids"].tolist())
    assert names == [
        "[gMASK]",
        "<sop>",
        "<|user|>",
        "\n\n",
        "q",
        "<|assistant|>",
        "\n",
        "a",
        "<|user|>",
        "\n",
        "b",
        "<|assistant|>",
        "\n",
        "c",
    ]
    trained = [n for n, m in zip(names, out["loss_mask"].tolist(), strict=True) if m]
    assert trained == ["a", "<|user|>", "c"]
    thinking = VLMSampleTransform(
        processor=ref.hf_processor(), model_config=ref.tiny_config("glm4v_moe")
    )(raw)
    names = tok.convert_ids_to_tokens(thinking["input_ids"].tolist())
    assert names[5:10] == ["<|assistant|>", "\n", "<think>", "</think>", "\n"]
    assert [n for n, m in zip(names, thinking["loss_mask"].tolist(), strict=True) if m][:6] == [
        "\n",
        "<think>",
        "</think>",
        "\n",
        "a",
        "<|user|>",
    ]


def test_the_frame_switch_is_checked():
    from prealign.schemas.errors import ConfigError

    for name, match in (("chatml", "no such tokens"), ("glm5", "expected one of")):
        with pytest.raises(ConfigError, match=match):
            VLMSampleTransform(
                processor=ref.hf_processor(), model_config=ref.tiny_config(), chat_frame=name
            )


def test_glm_chat_frame_refuses_other_roles():
    raw = {"__key__": "t", "json": json.dumps({"messages": [{"role": "tool", "content": "x"}]})}
    with pytest.raises(MediaError, match="roles this model's chat template writes"):
        VLMSampleTransform(processor=ref.hf_processor(), model_config=ref.tiny_config())(raw)


@given(
    st.integers(1, 6000),
    st.integers(1, 6000),
    st.integers(2, 64),
    st.sampled_from([112 * 112, 3136]),
    st.sampled_from([28 * 28 * 15000, 28 * 28 * 2 * 30000, 200_000]),
)
@examples(300)
def test_resize_equals_transformers(h, w, frames, lo, hi):
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize

    try:
        want = smart_resize(frames, h, w, 2, 28, lo, hi)
    except ValueError:
        want = None
    try:
        got = glm4v_resize(frames, h, w, VisionGeometry(min_pixels=lo, max_pixels=hi))
    except Exception:
        got = None
    assert got == want


@given(st.integers(1, 20000), st.floats(1.0, 60.0), st.sampled_from([1.0, 2.0, 4.0]))
@examples(200)
def test_frame_sampler_equals_transformers(total, video_fps, fps):
    try:
        from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
    except ImportError:
        pytest.skip(
            "platform: the installed transformers lacks a torchvision-free GLM-4.1V video "
            "processor module (it imports torchvision)"
        )
    import types

    from transformers.video_utils import VideoMetadata

    meta = VideoMetadata(total_num_frames=total, fps=video_fps, duration=total / video_fps)
    want = Glm4vVideoProcessor.sample_frames(types.SimpleNamespace(fps=fps, max_duration=300), meta)
    assert glm4v_frame_indices(
        total, video_fps, duration=total / video_fps, fps=fps
    ).tolist() == list(want)


def test_golden_video_text_and_types():
    fam = vision_family(ref.tiny_config())
    assert isinstance(fam, Glm4V) and fam.position_kind == "mrope" and fam.one_media_kind
    # 5 frames at 2 fps: groups start at frames 0, 2, 4 -> 0 s, 1 s, 2 s (truncated), the last group
    # padded
    assert fam.frame_texts(5, 2.0) == ["0", "1", "2"]
    i = ref.ids()
    s, e, vs, ve, img = (
        i["image_start_token_id"],
        i["image_end_token_id"],
        i["video_start_token_id"],
        i["video_end_token_id"],
        i["image_token_id"],
    )
    ids = [20, s, img, img, e, vs, s, img, e, 21, ve, 22]
    assert fam.token_types(ids).tolist() == [0, 0, 1, 1, 0, 0, 0, 2, 0, 0, 0, 0]


def test_images_and_video_in_one_forward_are_refused():
    processor = ref.hf_processor([2.0])
    t = VLMSampleTransform(processor=processor, model_config=ref.tiny_config())
    with pytest.raises(MediaError, match="images or video, not both"):
        t(raw_sample("both", [(60, 60)], [(2, 40, 40, 2.0)], "q", "a", 0)[0])
    image = t(raw_sample("i", [(60, 60)], [], "q", "a", 0)[0])
    video = t(raw_sample("v", [], [(2, 40, 40, 2.0)], "q", "a", 0)[0])
    coll = MRoPECollator(
        collator=THDCollator(schema=SCHEMA, layout=ParallelLayout(tp=2)),
        model_config=ref.tiny_config(),
    )
    with pytest.raises(
        PackingUnsupportedError, match="Glm4vModel.forward counts video tokens as image tokens"
    ):
        coll([image, video])
    coll([image, image]), coll([video, video])  # one kind per batch is fine


# ---- in-model
# ---------------------------------------------------------------------------------------
def model_batch(model_type: str, kind: str) -> list[dict]:
    processor = ref.hf_processor([2.0, 1.0])
    t = VLMSampleTransform(processor=processor, model_config=ref.tiny_config(model_type))
    if kind == "image":
        raws = [
            raw_sample("a", [(90, 60)], [], "what?", "a cat.", 1),
            raw_sample("b", [], [], "hi", "hello", 2),
            raw_sample("c", [(40, 90), (84, 84)], [], "compare", "same.", 3),
        ]
    else:
        raws = [
            raw_sample("a", [], [(3, 70, 50, 2.0)], "what?", "moving.", 1),
            raw_sample("b", [], [(4, 60, 60, 2.0), (2, 40, 80, 1.0)], "hi", "two", 2),
        ]
    return [t(r[0]) for r in raws]


def logits(model, kwargs):
    kwargs = {
        k: v.to(torch.float64) if k.startswith("pixel_values") else v for k, v in kwargs.items()
    }
    with torch.no_grad():
        return model(**kwargs).logits[0]


def alone(model, s):
    kw = {
        "input_ids": s["input_ids"][None],
        "mm_token_type_ids": s["mm_token_type_ids"][None],
        "use_cache": False,
    }
    if s["image_grid_thw"].shape[0]:
        kw.update(pixel_values=s["pixel_values"], image_grid_thw=s["image_grid_thw"])
    if s.get("video_grid_thw") is not None and s["video_grid_thw"].shape[0]:
        kw.update(pixel_values_videos=s["pixel_values_videos"], video_grid_thw=s["video_grid_thw"])
    return logits(model, kw)


def worst(model_type, kind, shift: bool = False) -> float:
    samples = model_batch(model_type, kind)
    cfg = ref.tiny_config(model_type)
    layout = ParallelLayout(tp=2, cp=2)
    batch = MRoPECollator(collator=THDCollator(schema=SCHEMA, layout=layout), model_config=cfg)(
        samples
    )
    kwargs = to_hf_kwargs(batch, attention=HFAttention.POSITIONS, model_config=cfg)
    if shift:  # the first sample's vision tokens one row lower
        vis = torch.nonzero(batch["mm_token_type_ids"][0] > 0).flatten()
        vis = vis[vis < int(batch["cu_seqlens_padded"][1])]
        kwargs["position_ids"] = kwargs["position_ids"].clone()
        kwargs["position_ids"][2, 0, vis] += 1
    model = ref.tiny_model(model_type)
    out, bad = logits(model, kwargs), 0.0
    for slots, s in zip(real_slots(batch), samples, strict=True):
        bad = max(bad, float((out[slots] - alone(model, s)).abs().max()))
    return bad


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["glm4v", "glm4v_moe"])
@pytest.mark.parametrize("kind", ["image", "video"])
def test_packed_logits_equal_each_sample_alone(model_type, kind):
    assert worst(model_type, kind) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["image", "video"])
def test_a_vision_block_shifted_by_one_row_is_caught(kind):
    assert worst("glm4v", kind, shift=True) > CORRUPT
