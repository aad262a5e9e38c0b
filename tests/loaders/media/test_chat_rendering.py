"""Chat rendering as the chat template renders it (issue 32 item 3), against transformers' own
``apply_chat_template`` and Qwen2-VL processor on a byte-level BPE tokenizer built here (it merges
runs of newlines, as Qwen's does), with chat templates written after the Qwen2-VL (default system
turn) and Qwen3-VL (none) templates: ``input_ids``, pixels and grids equal on random conversations
whose turns start and end with newlines and spaces. Also: transparent images as the installed
transformers converts them, and frame members of
a video never taken as images by the implicit rule."""

from __future__ import annotations

import functools
import io
import json
import re

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from prealign.loaders.media.chat_tokenizer import HFChatTokenizer, encode_segments
from prealign.loaders.media.vlm import MediaError, VLMSampleTransform, decode_image
from tests.conftest import examples

transformers = pytest.importorskip("transformers")
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
TURNS = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is "
    "string %}"
    "{{ message['content'] }}{% else %}{% for c in message['content'] %}{% if c['type'] == "
    "'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor "
    "%}{% endif %}<|im_end|>\n{% endfor %}"
)
# the Qwen2-VL / Qwen2.5-VL template writes a default system turn; Qwen3-VL's does not
TEMPLATES = {
    "qwen2_vl": TURNS.replace(
        "{% for message in messages %}",
        "{% for message in messages %}{% if loop.first and "
        "message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant."
        "<|im_end|>\n{% endif %}",
        1,
    ),
    "qwen3_vl": TURNS,
}
PATCH = {"qwen2_vl": 14, "qwen3_vl": 16}


@functools.lru_cache(maxsize=None)
def tokenizer():
    """A byte-level BPE trained here on newline-heavy text; Qwen's pre-tokenizer rule (a run of
    newlines and the spaces before it is one piece), so ``"\\n" + "\\n"`` tokenizes apart but
    ``"\\n\\n"`` as one token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\s*[\r\n]+|\s+(?!\S)|\s+|[^\s]+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "user\n\nhello\n\n\nworld",
        "assistant\n ab. \n\n",
        "system\nYou are a helpful assistant.",
        "a b\n\n c ? \n \n",
    ] * 50
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=SPECIALS,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
    )


def ids(name: str) -> int:
    return tokenizer().convert_tokens_to_ids(name)


@functools.lru_cache(maxsize=None)
def image_processor(family: str):
    # the pixel range as ``size`` (a dict of its own): transformers 5.10 writes ``min_pixels=``
    # / ``max_pixels=`` into the class's default ``size``, which later processors start from
    return transformers.Qwen2VLImageProcessorPil(
        patch_size=PATCH[family], size={"shortest_edge": 56 * 56, "longest_edge": 64 * 64 * 4}
    )


def processor(family: str):
    """transformers' Qwen2-VL processor around the tokenizer (built without its video processor,
    which needs torchvision): its ``__call__`` expands each ``<|image_pad|>`` by the image's
    grid."""
    proc = object.__new__(transformers.Qwen2VLProcessor)
    proc.tokenizer, proc.image_processor, proc.video_processor = (
        tokenizer(),
        image_processor(family),
        None,
    )
    proc.chat_template = TEMPLATES[family]
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.image_token_id, proc.video_token_id = ids("<|image_pad|>"), ids("<|video_pad|>")
    proc.image_ids, proc.video_ids, proc.audio_ids = (
        [proc.image_token_id],
        [proc.video_token_id],
        [None],
    )  # 5.6
    return proc


def config(family: str):
    cls = transformers.Qwen2VLConfig if family == "qwen2_vl" else transformers.Qwen3VLConfig
    return cls(
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )


def transform(family: str, **kw) -> VLMSampleTransform:
    return VLMSampleTransform(
        tokenizer=HFChatTokenizer(tokenizer()),
        model_config=config(family),
        mrope=False,
        processor=image_processor(family),
        **kw,
    )


def png(seed: int, mode: str = "RGB") -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = int(rng.integers(20, 90)), int(rng.integers(20, 90))
    if mode == "P":  # a palette image with a transparency index
        img = Image.fromarray(rng.integers(0, 4, (h, w), np.uint8), mode="L").convert("P")
        img.info["transparency"] = 2
    else:
        img = Image.fromarray(rng.integers(0, 256, (h, w, len(mode)), np.uint8), mode=mode)
    buf = io.BytesIO()
    img.save(buf, format="PNG", **({"transparency": 2} if mode == "P" else {}))
    return buf.getvalue()


def reference(family: str, messages: list[dict], images: list[bytes]) -> dict:
    """The processor's output on the template's text, ``<image>`` written as image content items."""
    from PIL import Image

    def items(text):
        parts = re.split("(<image>)", text)
        return [
            {"type": "image"} if p == "<image>" else {"type": "text", "text": p} for p in parts if p
        ]

    chat = [{"role": m["role"], "content": items(m["content"])} for m in messages]
    text = tokenizer().apply_chat_template(chat, tokenize=False, chat_template=TEMPLATES[family])
    pil = [Image.open(io.BytesIO(b)) for b in images]
    return processor(family)(text=[text], images=pil or None, return_tensors="pt")


PIECES = st.sampled_from(
    ["\n", "\n\n", " ", "  ", "a", "b", "hello", "world", ".", "?", " \n", "<image>"]
)
TEXT = st.lists(PIECES, max_size=7).map("".join)


@pytest.mark.slow
@given(
    contents=st.lists(TEXT, min_size=1, max_size=4),
    system=st.booleans(),
    seed=st.integers(0, 99),
    family=st.sampled_from(sorted(TEMPLATES)),
)
@examples(120)
def test_input_ids_and_pixels_equal_the_chat_template_and_processor(contents, system, seed, family):
    roles = (["system"] if system else []) + ["user", "assistant"] * 3
    messages = [{"role": r, "content": c} for r, c in zip(roles, contents)]
    n = sum(c.count("<image>") for c in contents)
    assume(n <= 3)
    images = [png(seed + i) for i in range(n)]
    raw = {
        "__key__": "s",
        "json": json.dumps({"messages": messages}).encode(),
        **{f"{i}.png": b for i, b in enumerate(images)},
    }
    ours = transform(family)(raw)
    want = reference(family, messages, images)
    assert ours["input_ids"].tolist() == want["input_ids"][0].tolist()
    if n:
        assert torch.equal(ours["image_grid_thw"], want["image_grid_thw"])
        assert torch.allclose(
            ours["pixel_values"], want["pixel_values"].to(torch.float32), atol=1e-6, rtol=0
        )
    end = ids("<|im_end|>")
    trained_ends = int(((ours["input_ids"] == end) & (ours["loss_mask"] > 0)).sum())
    assert trained_ends == sum(m["role"] == "assistant" for m in messages)


def test_a_leading_newline_merges_with_the_role_header():
    """The issue's case, golden: ``"\\n\\n"`` is one token after the header; the content is trained
    from it."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\nab"}]
    raw = {"__key__": "s", "json": json.dumps({"messages": messages}).encode()}
    ours = transform("qwen3_vl")(raw)
    assert (
        ours["input_ids"].tolist() == reference("qwen3_vl", messages, [])["input_ids"][0].tolist()
    )
    nn = tokenizer()("\n\n", add_special_tokens=False)["input_ids"]
    assert len(nn) == 1 and nn[0] in ours["input_ids"].tolist()
    trained = ours["input_ids"][ours["loss_mask"] > 0].tolist()
    assert trained[0] == nn[0] and trained[-1] == ids("<|im_end|>")


def test_straddling_tokens_belong_to_the_later_segment():
    tok = HFChatTokenizer(tokenizer())
    got, mask = encode_segments(
        tok, [("assistant\n", False), ("\nab", True), ([ids("<|im_end|>")], True)]
    )
    assert (
        got.tolist()
        == tokenizer()("assistant\n\nab<|im_end|>", add_special_tokens=False)["input_ids"]
    )
    assert mask.tolist()[0] == 0 and mask.tolist()[1:] == [1.0] * (len(got) - 1)


def test_the_default_system_turn_and_its_switch():
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "a"}]
    raw = {"__key__": "s", "json": json.dumps({"messages": messages}).encode()}
    want = reference("qwen2_vl", messages, [])["input_ids"][0].tolist()
    assert transform("qwen2_vl")(raw)["input_ids"].tolist() == want
    plain = transform("qwen2_vl", default_system=False)(raw)["input_ids"].tolist()
    assert plain == reference("qwen3_vl", messages, [])["input_ids"][0].tolist() and len(
        plain
    ) < len(want)
    assert (
        transform("qwen2_vl").index_key() != transform("qwen2_vl", default_system=False).index_key()
    )
    assert transform("qwen3_vl").system_prompt is None


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparent_images_convert_as_the_installed_transformers_does(mode):
    from PIL import Image

    data = png(3, mode)
    messages = [{"role": "user", "content": "<image>a"}]
    raw = {"__key__": "s", "json": json.dumps({"messages": messages}).encode(), "0.png": data}
    ours = transform("qwen2_vl")(raw)
    want = reference("qwen2_vl", messages, [data])
    assert torch.allclose(
        ours["pixel_values"], want["pixel_values"].to(torch.float32), atol=1e-6, rtol=0
    )
    assert decode_image(data, sample="s", name="0.png").mode == "RGB"
    clear = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    buf = io.BytesIO()
    clear.save(buf, format="PNG")
    from transformers.image_transforms import convert_to_rgb

    theirs = np.asarray(convert_to_rgb(clear)).reshape(-1, 3)[0].tolist()
    assert (
        np.asarray(decode_image(buf.getvalue(), sample="s", name="x")).reshape(-1, 3)[0].tolist()
        == theirs
    )


def test_frames_named_by_videos_are_not_images():
    """``0.png``, ``1.png`` are the video's frames and there is no ``images`` list: no image is
    taken."""
    from tests.loaders.media.test_vlm_video import png as frame
    from tests.vlm_families import TOK, tiny_config

    meta = {
        "messages": [
            {"role": "user", "content": "<video> what?"},
            {"role": "assistant", "content": "ok"},
        ],
        "videos": [{"frames": ["0.png", "1.png"], "fps": 2.0}],
    }
    raw = {
        "__key__": "v",
        "json": json.dumps(meta).encode(),
        "0.png": frame(56, 56, 0),
        "1.png": frame(56, 56, 1),
    }
    out = VLMSampleTransform(
        tokenizer=TOK,
        model_config=tiny_config("qwen2_vl"),
        video_processor_config={"min_pixels": 56 * 56, "max_pixels": 112 * 112},
    )(raw)
    assert out["image_grid_thw"].shape == (0, 3) and out["video_grid_thw"].shape == (1, 3)
    meta["messages"][0]["content"] = (
        "<image> <video>"  # an image too: named by the implicit rule, 2.png
    )
    raw = {**raw, "json": json.dumps(meta).encode(), "2.png": frame(56, 56, 2)}
    out = VLMSampleTransform(
        tokenizer=TOK,
        model_config=tiny_config("qwen2_vl"),
        video_processor_config={"min_pixels": 56 * 56, "max_pixels": 112 * 112},
    )(raw)
    assert out["image_grid_thw"].shape == (1, 3)
    with pytest.raises(MediaError, match="placeholder"):
        meta["messages"][0]["content"] = "<video>"
        VLMSampleTransform(
            tokenizer=TOK,
            model_config=tiny_config("qwen2_vl"),
            video_processor_config={"min_pixels": 56 * 56, "max_pixels": 112 * 112},
        )({**raw, "json": json.dumps(meta).encode()})
