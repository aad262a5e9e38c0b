"""transformers' side of the Gemma 4 tests: a byte-level BPE tokenizer with Gemma 4's special
tokens, a chat template written here from Gemma 4's documented rules (none ships with
transformers): ``bos``; a first system / developer turn as ``<|turn>system\\n`` + its text trimmed
+ ``<turn|>\\n``; per turn ``<|turn>{role}\\n`` (``assistant`` written ``model``, no header for a
model turn right after one), text items trimmed, an image item ``<|image|>``, ``<turn|>\\n``; and
``Gemma4Processor`` on its output. transformers 5.10.4's processor module needs torchvision (its
image processor import); there the reference expands ``<|image|>`` exactly as the processor's
``replace_image_token`` does, from the installed image processor's soft-token counts."""

from __future__ import annotations

import functools
import io
import re

import transformers

from prealign.loaders.media.gemma4 import Gemma4SampleTransform
from tests.consumers.models import tiny_text_config
from tests.families.bpe import byte_bpe_tokenizer
from tests.families.offline import any_video_processor

PATCH, POOL, BUDGET, WINDOW = 4, 2, 70, 6
"""The tests' vision tower (4-px patches pooled 2 x 2), soft-token budget and sliding window."""

SPECIALS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<|turn>",
    "<turn|>",
    "<|image>",
    "<image|>",
    "<|image|>",
    "<|video|>",
    "<|audio>",
    "<audio|>",
    "<|audio|>",
    "<|channel>",
    "<channel|>",
]
NL = "{{ '\\n' }}"
TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(turns=messages, prev=None) %}"
    "{% if messages[0]['role'] in ['system', 'developer'] %}"
    "<|turn>system"
    + NL
    + "{{ messages[0]['content'] | trim }}<turn|>"
    + NL
    + "{% set ns.turns = messages[1:] %}{% endif %}"
    "{% for message in ns.turns %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{% if not (role == 'model' and ns.prev == 'assistant') %}<|turn>{{ role }}"
    + NL
    + "{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|image|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<turn|>" + NL + "{% set ns.prev = message['role'] %}{% endfor %}"
)


@functools.lru_cache(maxsize=None)
def tokenizer():
    return byte_bpe_tokenizer(
        SPECIALS,
        ["user\n\nhello\n\n\nworld", "model\n ab. \n\n", "a b\n\n c ? \n \n", "system\n hi"],
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        extra_special_tokens={
            "boi_token": "<|image>",
            "eoi_token": "<image|>",
            "image_token": "<|image|>",
            "audio_token": "<|audio|>",
            "boa_token": "<|audio>",
            "eoa_token": "<audio|>",
        },
    )


def tid(name: str) -> int:
    return tokenizer().convert_tokens_to_ids(name)


def image_processor(patch: int, pooling: int, budget: int):
    return transformers.Gemma4ImageProcessorPil(
        patch_size=patch, pooling_kernel_size=pooling, max_soft_tokens=budget
    )


def hf_processor(patch: int, pooling: int, budget: int):
    """``Gemma4Processor`` with no video processor (transformers' needs torchvision), or ``None``
    where the installed processor module cannot be imported (5.10.4 without torchvision)."""
    try:
        base = transformers.Gemma4Processor
    except (ImportError, ModuleNotFoundError):
        return None

    with any_video_processor():
        return base(
            feature_extractor=transformers.Gemma4AudioFeatureExtractor(),
            image_processor=image_processor(patch, pooling, budget),
            tokenizer=tokenizer(),
            video_processor=None,
            chat_template=TEMPLATE,
        )


def config(bidirectional: str | None = "vision"):
    """A tiny ``Gemma4Config`` on :func:`tokenizer`'s ids (bidirectional vision unless
    ``bidirectional`` is ``None``), sdpa attention."""
    text = tiny_text_config(
        len(tokenizer()),
        head_dim=8,
        global_head_dim=8,
        max_position_embeddings=1024,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        use_bidirectional_attention=bidirectional,
        vocab_size_per_layer_input=len(tokenizer()),
        hidden_size_per_layer_input=8,
        pad_token_id=tid("<pad>"),
        bos_token_id=tid("<bos>"),
        eos_token_id=tid("<eos>"),
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=PATCH,
        pooling_kernel_size=POOL,
        position_embedding_size=64,
    )
    return transformers.Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        boi_token_id=tid("<|image>"),
        eoi_token_id=tid("<image|>"),
        image_token_id=tid("<|image|>"),
        video_token_id=tid("<|video|>"),
        boa_token_id=tid("<|audio>"),
        eoa_token_index=tid("<audio|>"),
        audio_token_id=tid("<|audio|>"),
        initializer_range=0.3,
        attn_implementation="sdpa",
    )


def transform(budget: int = BUDGET) -> Gemma4SampleTransform:
    """prealign's transform on :func:`config` with the image processor of ``budget``."""
    return Gemma4SampleTransform(
        model_config=config(),
        tokenizer=tokenizer(),
        processor=image_processor(PATCH, POOL, budget),
    )


def items(text: str) -> list[dict]:
    return [
        {"type": "image"} if p == "<image>" else {"type": "text", "text": p}
        for p in re.split("(<image>)", text)
        if p
    ]


def reference(messages: list[dict], images: list[bytes], patch: int, pooling: int, budget: int):
    """transformers' ``input_ids`` / ``mm_token_type_ids`` ``[1, L]`` and ``pixel_values`` /
    ``image_position_ids`` for a conversation whose ``<image>`` placeholders are ``images``."""
    import torch
    from PIL import Image

    chat = [
        m if m["role"] in ("system", "developer") else {**m, "content": items(m["content"])}
        for m in messages
    ]
    text = tokenizer().apply_chat_template(chat, tokenize=False, chat_template=TEMPLATE)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    processor = hf_processor(patch, pooling, budget)
    if processor is not None:
        return processor(
            text=[text],
            images=[pil] if pil else None,
            return_tensors="pt",
            add_special_tokens=False,
        )
    out = dict(image_processor(patch, pooling, budget)(pil, return_tensors="pt")) if pil else {}
    counts = iter(out.pop("num_soft_tokens_per_image", []))
    text = re.sub(
        re.escape("<|image|>"),
        lambda _: "<|image>" + "<|image|>" * int(next(counts)) + "<image|>",
        text,
    )
    ids = torch.tensor([tokenizer()(text, add_special_tokens=False)["input_ids"]])
    out.update(input_ids=ids, mm_token_type_ids=(ids == tid("<|image|>")).long())
    return out
