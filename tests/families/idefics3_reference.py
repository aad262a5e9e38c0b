"""transformers' own SmolVLM / Idefics3 pieces built offline: a byte-level BPE tokenizer with
SmolVLM's special tokens, the image processors (PIL backend), ``Idefics3Processor`` /
``SmolVLMProcessor`` with SmolVLM's chat
template, and tiny models."""

from __future__ import annotations

import functools

from tests.consumers.models import seeded_model, tiny_text_config, tiny_vit_config
from tests.families.bpe import byte_bpe_tokenizer

ROW_COL = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
SPECIALS = [
    "<unk>",
    "<|im_start|>",
    "<|endoftext|>",
    "<pad>",
    "<end_of_utterance>",
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    *ROW_COL,
]
TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if "
    "message['content'] is string %}"
    "{{': ' + message['content']}}{% else %}{% if message['content'][0]['type'] == 'image' "
    "%}{{':'}}{% else %}"
    "{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' "
    "%}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif "
    "%}<end_of_utterance>\n{% endfor %}"
)
"""SmolVLM's chat template (transformers' ``DEFAULT_CHAT_TEMPLATE`` of ``processing_smolvlm``)."""
TILE, PATCH, SCALE = 32, 4, 2


@functools.lru_cache(maxsize=None)
def hf_tokenizer():
    """A byte-level BPE tokenizer (:mod:`tests.families.bpe`) with SmolVLM's special tokens."""
    corpus = ["User: hello\n\n\nworld", "Assistant: a cat. \n\n", "a b\n\n c ? \n \n what is it"]
    return byte_bpe_tokenizer(
        SPECIALS,
        corpus,
        bos_token="<|im_start|>",
        eos_token="<end_of_utterance>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def tid(name: str) -> int:
    return hf_tokenizer().convert_tokens_to_ids(name)


def image_processor(
    model_type: str = "smolvlm", *, split: bool = True, longest_edge: int = 4 * TILE
):
    from prealign.loaders.media.idefics3 import pil_image_processor_class

    return pil_image_processor_class(model_type)(
        size={"longest_edge": longest_edge},
        max_image_size={"longest_edge": TILE},
        do_image_splitting=split,
    )


def hf_processor(model_type: str = "smolvlm", **kw):
    """``Idefics3Processor`` with the ``model_type``'s image processor. (``SmolVLMProcessor`` needs
    ``num2words``, which prealign does not declare, and a torchvision video processor; its image
    text is the module function ``get_image_prompt_string``, compared with Idefics3's
    separately.)"""
    import transformers

    seq = (TILE // PATCH // SCALE) ** 2
    return transformers.Idefics3Processor(
        image_processor=image_processor(model_type, **kw),
        tokenizer=hf_tokenizer(),
        image_seq_len=seq,
        chat_template=TEMPLATE,
    )


def tiny_config(model_type: str = "smolvlm", attn: str = "sdpa"):
    """A tiny SmolVLM / Idefics3 (1-layer vision tower of ``PATCH``-px patches on ``TILE``-px tiles,
    pixel shuffle ``SCALE``, 2-layer Llama LM, hidden 32) with :func:`hf_tokenizer`'s ids."""
    import transformers

    tok = hf_tokenizer()
    vision = tiny_vit_config(image_size=TILE, patch_size=PATCH)
    text = tiny_text_config(
        len(tok),
        model_type="llama",
        head_dim=8,
        max_position_embeddings=8192,
        bos_token_id=tid("<|im_start|>"),
        eos_token_id=tid("<end_of_utterance>"),
        pad_token_id=tid("<pad>"),
    )
    cls = transformers.SmolVLMConfig if model_type == "smolvlm" else transformers.Idefics3Config
    return cls(
        vision_config=vision,
        text_config=text,
        image_token_id=tid("<image>"),
        scale_factor=SCALE,
        attn_implementation=attn,
    )


@functools.lru_cache(maxsize=None)
def tiny_model(model_type: str = "smolvlm"):
    import transformers

    cls = (
        transformers.SmolVLMForConditionalGeneration
        if model_type == "smolvlm"
        else transformers.Idefics3ForConditionalGeneration
    )
    return seeded_model(cls, tiny_config(model_type))
