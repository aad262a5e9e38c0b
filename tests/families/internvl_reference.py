"""transformers' own InternVL pieces built offline: a character-level tokenizer with InternVL's
special tokens, the GotOcr2 image processor, ``InternVLProcessor`` with InternVL 3's chat template,
and a tiny model."""

from __future__ import annotations

import functools
import re

from tests.consumers.models import seeded_model, tiny_text_config, tiny_vit_config
from tests.families.offline import any_video_processor, char_tokenizer, image_processor_class

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}{% if "
    "message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if "
    "content['type'] == 'image' %}"
    "{{ '<IMG_CONTEXT>\n' }}{% elif content['type'] == 'video' %}{{ '<video>\n' }}{% elif "
    "content['type'] == 'text' %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)
"""InternVL 3's template shape (``<|im_start|>role\\n ... <|im_end|>\\n``, an image item as
``<IMG_CONTEXT>\\n``)."""
SPECIALS = (
    "<unk>",
    "<|im_start|>",
    "<|im_end|>",
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
    "<video>",
    "<pad>",
)


@functools.lru_cache(maxsize=None)
def hf_tokenizer():
    """A ``PreTrainedTokenizerFast`` of one token per character (so any split of a text encodes the
    same) with InternVL's special tokens as its processor reads them (``start_image_token``,
    ...)."""
    return char_tokenizer(
        SPECIALS,
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


def image_processor(tile: int = 448, max_patches: int = 12):
    return image_processor_class("GotOcr2")(
        size={"height": tile, "width": tile},
        crop_to_patches=True,
        min_patches=1,
        max_patches=max_patches,
    )


def hf_processor(
    tile: int = 448, max_patches: int = 12, image_seq_length: int = 256, tokenizer=None
):
    """``InternVLProcessor`` without a video processor (transformers' needs torchvision, absent
    here): its class check of that one argument is skipped for ``None``; images and text run through
    the processor itself. ``tokenizer``: another with InternVL's special tokens (default
    :func:`hf_tokenizer`)."""
    from transformers import InternVLProcessor

    with any_video_processor():
        return InternVLProcessor(
            image_processor=image_processor(tile, max_patches),
            tokenizer=tokenizer or hf_tokenizer(),
            chat_template=CHAT_TEMPLATE,
            image_seq_length=image_seq_length,
        )


def expand_video_text(processor, text: str, frames: list[int]) -> str:
    """The processor's own text for each ``<video>`` of ``text`` (``frames[i]`` frames, one tile
    each): ``_insert_media_placeholders`` (transformers 5.6, 5.10) or else ``replace_video_token``
    (5.24)."""
    import numpy as np

    if not hasattr(processor, "_insert_media_placeholders"):
        clips = iter(frames)
        return re.sub(
            re.escape(processor.video_token),
            lambda m: processor.replace_video_token(
                {"pixel_values_videos": [np.zeros(next(clips))]}, 0
            ),
            text,
        )
    per_frame = [1] * sum(frames)
    out, *_ = processor._insert_media_placeholders(
        [text],
        None,
        np.zeros(sum(frames)),
        [],
        per_frame,
        np.array([0]),
        np.arange(sum(frames) + 1),
        np.concatenate(([0], np.cumsum(frames))),
    )
    return out[0]


def tiny_config(*, tile: int = 56):
    """A tiny InternVL (1-layer ViT of 14-px patches on ``tile``-px tiles, 2-layer Qwen2 LM, hidden
    32): ``(tile / 14)**2 / 4`` image tokens per tile; ids of :func:`hf_tokenizer`."""
    import transformers

    tok = hf_tokenizer()
    vision = tiny_vit_config(image_size=[tile, tile], patch_size=[14, 14])
    text = tiny_text_config(
        len(tok),
        model_type="qwen2",
        max_position_embeddings=8192,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return transformers.InternVLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tok.context_image_token_id,
        image_seq_length=(tile // 14) ** 2 // 4,
        attn_implementation="sdpa",
    )


@functools.lru_cache(maxsize=None)
def tiny_model():
    import transformers

    return seeded_model(transformers.InternVLForConditionalGeneration, tiny_config())
