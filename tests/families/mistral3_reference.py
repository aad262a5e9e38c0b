"""transformers' own Mistral3 / Pixtral pieces built offline: a byte-level BPE tokenizer with
Mistral's control tokens, the Pixtral image processor (PIL backend), ``PixtralProcessor`` with a
chat template written after Mistral Small 3.1's (without its dated default system prompt), and a
tiny ``Mistral3ForConditionalGeneration``."""

from __future__ import annotations

import functools
import importlib
import sys
import types

from tests.consumers.models import seeded_model, tiny_text_config, tiny_vit_config
from tests.families.bpe import byte_bpe_tokenizer
from tests.families.offline import image_processor_class

SPECIALS = [
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "[INST]",
    "[/INST]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
]
TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ '[SYSTEM_PROMPT]' + messages[0]['content'] + '[/SYSTEM_PROMPT]' }}{% set turns = "
    "messages[1:] %}{% else %}{% set turns = messages %}{% endif %}{% for message in turns %}"
    "{% if message['role'] == 'user' %}{% if message['content'] is string %}"
    "{{ '[INST]' + message['content'] + '[/INST]' }}{% else %}{{ '[INST]' }}{% for block in "
    "message['content'] %}"
    "{% if block['type'] == 'text' %}{{ block['text'] }}{% elif block['type'] == 'image' %}{{ "
    "'[IMG]' }}{% endif %}"
    "{% endfor %}{{ '[/INST]' }}{% endif %}{% elif message['role'] == 'system' %}"
    "{{ '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}{% elif message['role'] == "
    "'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
"""Mistral Small 3.1's template shape:
``<s>[SYSTEM_PROMPT]..[/SYSTEM_PROMPT][INST]..[/INST]reply</s>``, an image block written ``[IMG]``
(the processor expands it)."""


@functools.lru_cache(maxsize=None)
def hf_tokenizer():
    """A byte-level BPE ``PreTrainedTokenizerFast`` (merges of newlines and spaces, so how a text is
    split matters) with Mistral's control tokens."""
    corpus = ["user\n\nhello\n\n\nworld", "a cat. \n\n", "a b\n\n c ? \n \n what is it"]
    return byte_bpe_tokenizer(
        SPECIALS, corpus, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def tid(name: str) -> int:
    return hf_tokenizer().convert_tokens_to_ids(name)


def image_processor(longest_edge: int, patch: int):
    return image_processor_class("Pixtral")(
        size={"longest_edge": longest_edge}, patch_size={"height": patch, "width": patch}
    )


@functools.lru_cache(maxsize=None)
def processor_class():
    """transformers' ``PixtralProcessor`` class. Its module imports ``get_resize_output_image_size``
    from the torchvision image processor module, absent here: that module is stood in for, during
    the import only, by the PIL backend's module, which defines the same function (the processor's
    own code runs unchanged)."""
    name = "transformers.models.pixtral.image_processing_pixtral"
    try:
        importlib.import_module(name)
    except ImportError:
        from transformers.models.pixtral import image_processing_pil_pixtral as pil

        stub = types.ModuleType(name)
        stub.get_resize_output_image_size = pil.get_resize_output_image_size
        sys.modules[name] = stub
        try:
            sys.modules.pop("transformers.models.pixtral.processing_pixtral", None)
            return importlib.import_module(
                "transformers.models.pixtral.processing_pixtral"
            ).PixtralProcessor
        finally:
            sys.modules.pop(name, None)
    return importlib.import_module(
        "transformers.models.pixtral.processing_pixtral"
    ).PixtralProcessor


def hf_processor(longest_edge: int = 64, patch: int = 4, merge: int = 2):
    return processor_class()(
        image_processor=image_processor(longest_edge, patch),
        tokenizer=hf_tokenizer(),
        patch_size=patch,
        spatial_merge_size=merge,
        chat_template=TEMPLATE,
    )


def tiny_config(*, longest_edge: int = 64, patch: int = 4, merge: int = 2, attn: str = "sdpa"):
    """A tiny Mistral3 (1-layer Pixtral tower of ``patch``-px patches up to ``longest_edge`` px,
    patch merger ``merge``, 2-layer Mistral LM, hidden 32) with :func:`hf_tokenizer`'s ids."""
    import transformers

    tok = hf_tokenizer()
    vision = tiny_vit_config(model_type="pixtral", image_size=longest_edge, patch_size=patch)
    text = tiny_text_config(
        len(tok),
        model_type="mistral",
        head_dim=8,
        bos_token_id=tid("<s>"),
        eos_token_id=tid("</s>"),
        pad_token_id=tid("<pad>"),
    )
    return transformers.Mistral3Config(
        vision_config=vision,
        text_config=text,
        image_token_id=tid("[IMG]"),
        spatial_merge_size=merge,
        attn_implementation=attn,
    )


@functools.lru_cache(maxsize=None)
def tiny_model():
    import transformers

    return seeded_model(transformers.Mistral3ForConditionalGeneration, tiny_config())


def tiny_pixtral_config():
    """Pixtral as transformers builds it: a ``llava`` config with the same tiny Pixtral tower (no
    patch merger, ``vision_feature_select_strategy="full"``) and Mistral LM."""
    import transformers

    cfg = tiny_config()
    return transformers.LlavaConfig(
        vision_config=cfg.vision_config.to_dict(),
        text_config=cfg.text_config.to_dict(),
        image_token_id=tid("[IMG]"),
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        attn_implementation="sdpa",
    )


@functools.lru_cache(maxsize=None)
def tiny_pixtral_model():
    import transformers

    return seeded_model(transformers.LlavaForConditionalGeneration, tiny_pixtral_config())
