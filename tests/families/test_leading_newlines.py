"""Leading-newline turns, every family but GLM (issue 32): on random conversations whose turns start
and end with newlines and spaces (or are empty), with 0-2 images opening the first user turn,
prealign's ``input_ids`` equal transformers' processor on ``apply_chat_template``'s text. Each
family's tokenizer merges runs of newlines (Qwen's pre-tokenizer rule), so a content's leading
``"\\n"`` is one token with the role header's where the template's string has them side by side;
Gemma 3's and Gemma 4's templates trim instead.

Each family reuses its own test's reference builders (tokenizer, processor, chat template);
InternVL's own test tokenizes one character per token (merging nothing), so a merging tokenizer with
its special tokens is built here. GLM-4.1V / 4.5V is left out (its chat frame is being changed
elsewhere)."""

from __future__ import annotations

import functools
import io
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prealign.loaders.media.chat_tokenizer import HFChatTokenizer
from prealign.loaders.media.vlm import VLMSampleTransform
from tests.conftest import examples
from tests.families import gemma4_reference as g4_ref
from tests.families import internvl_reference as iv
from tests.families import llava_onevision_reference as lo_ref
from tests.families import test_llava_onevision_transform as lo
from tests.loaders.media import test_chat_rendering as cr
from tests.loaders.media import test_gemma3_transform as g

transformers = pytest.importorskip("transformers")

PIECES = st.sampled_from(["\n", "\n\n", " ", "  ", " \n", "\n ", "a", "hello", "?"])
TEXT = st.lists(PIECES, max_size=6).map("".join)


def pil(images: list[bytes]) -> list:
    from PIL import Image

    return [Image.open(io.BytesIO(b)).convert("RGB") for b in images]


def png(seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = (int(x) for x in rng.integers(20, 90, 2))
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def items(text: str) -> list[dict]:
    import re

    return [
        {"type": "image"} if p == "<image>" else {"type": "text", "text": p}
        for p in re.split("(<image>)", text)
        if p
    ]


def raw(messages: list[dict], images: list[bytes]) -> dict:
    return {
        "__key__": "n",
        "json": json.dumps({"messages": messages}).encode(),
        **{f"{i}.png": b for i, b in enumerate(images)},
    }


# ---- each family: (prealign's ids, the processor's ids) for messages whose "<image>"s open the
# first user turn
def qwen(family: str, messages, images):
    frame = (
        "qwen2_vl" if family in ("qwen2_vl", "qwen2_5_vl") else "qwen3_vl"
    )  # default system turn, or none
    cls = {
        "qwen2_vl": transformers.Qwen2VLConfig,
        "qwen2_5_vl": transformers.Qwen2_5_VLConfig,
        "qwen3_vl": transformers.Qwen3VLConfig,
        "qwen3_5": transformers.Qwen3_5Config,
    }[family]
    config = cls(
        **{
            name: cr.ids(f"<|{token}|>")
            for name, token in (
                ("image_token_id", "image_pad"),
                ("video_token_id", "video_pad"),
                ("vision_start_token_id", "vision_start"),
                ("vision_end_token_id", "vision_end"),
            )
        }
    )
    ours = VLMSampleTransform(
        tokenizer=HFChatTokenizer(cr.tokenizer()),
        model_config=config,
        mrope=False,
        processor=cr.image_processor(frame),
    )(raw(messages, images))
    return ours["input_ids"].tolist(), cr.reference(frame, messages, images)["input_ids"][
        0
    ].tolist()


def gemma3(messages, images):
    ours = g.transform()(raw(messages, images))
    return ours["input_ids"].tolist(), g.reference(messages, images)["input_ids"][0].tolist()


def gemma4(messages, images):
    ours = g4_ref.transform()(raw(messages, images))
    want = g4_ref.reference(messages, images, g4_ref.PATCH, g4_ref.POOL, g4_ref.BUDGET)
    return ours["input_ids"].tolist(), want["input_ids"][0].tolist()


@functools.lru_cache(maxsize=None)
def internvl_tokenizer():
    """A byte-level BPE with InternVL's special tokens, trained here on newline-heavy text with
    Qwen's pre-tokenizer rule (InternVL 3's LM is Qwen2.5's), so ``"\\n\\n"`` is one token."""
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
        "assistant\n a? \n\n",
        "system\n hello",
        "a \n\n \n \n",
    ] * 50
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=list(iv.SPECIALS),
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|im_end|>",
        extra_special_tokens={
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        },
    )


def internvl(messages, images):
    """The template writes an image item as ``<IMG_CONTEXT>\\n``: prealign's content as
    ``<image>\\n``."""
    processor = iv.hf_processor(
        tile=56, max_patches=2, image_seq_length=4, tokenizer=internvl_tokenizer()
    )
    config = transformers.InternVLConfig(
        vision_config={"image_size": [56, 56]},
        image_seq_length=4,
        image_token_id=internvl_tokenizer().convert_tokens_to_ids("<IMG_CONTEXT>"),
    )
    ours = VLMSampleTransform(processor=processor, model_config=config)(
        raw(
            [{**m, "content": m["content"].replace("<image>", "<image>\n")} for m in messages],
            images,
        )
    )
    chat = [{"role": m["role"], "content": items(m["content"])} for m in messages]
    text = processor.apply_chat_template(chat, tokenize=False)
    want = processor(text=text, images=pil(images) or None, return_tensors="pt")
    return ours["input_ids"].tolist(), want["input_ids"][0].tolist()


def llava_onevision(messages, images):
    processor = lo_ref.hf_processor(tile=56, pinpoints=lo.PINS)
    ours = lo.transform(processor, tile=56, pinpoints=lo.PINS)(raw(messages, images))
    text = processor.apply_chat_template(
        [{"role": m["role"], "content": items(m["content"])} for m in messages], tokenize=False
    )
    want = processor(text=text, images=[pil(images)] if images else None, return_tensors="pt")
    return ours["input_ids"].tolist(), want["input_ids"][0].tolist()


FAMILIES = {
    **{f: functools.partial(qwen, f) for f in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")},
    "gemma3": gemma3,
    "gemma4": gemma4,
    "internvl": internvl,
    "llava_onevision": llava_onevision,
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
@given(
    contents=st.lists(TEXT, min_size=1, max_size=4),
    system=st.one_of(st.none(), TEXT),
    images=st.integers(0, 2),
    seed=st.integers(0, 99),
)
@examples(40)
def test_input_ids_equal_the_chat_template(family, contents, system, images, seed):
    roles = ["user", "assistant"] * 2
    messages = ([] if system is None else [{"role": "system", "content": system}]) + [
        {"role": r, "content": c} for r, c in zip(roles, contents)
    ]
    first_user = 0 if system is None else 1
    messages[first_user]["content"] = "<image>" * images + messages[first_user]["content"]
    ours, want = FAMILIES[family](messages, [png(seed + i) for i in range(images)])
    assert ours == want


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_golden_leading_newline_reply(family):
    """The issue's case, one sample per family: a reply ``"\\nab"`` after a user turn ``"
    hi\\n"``."""
    ours, want = FAMILIES[family](
        [{"role": "user", "content": " hi\n"}, {"role": "assistant", "content": "\na"}], []
    )
    assert ours == want
