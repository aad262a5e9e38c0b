"""transformers' own LLaVA-OneVision pieces built offline: a byte-level BPE tokenizer with
LLaVA-OneVision's special tokens (Qwen's pre-tokenizer rule, so ``" \\n"`` and ``"\\n\\n"``
merge), its real image processor, ``LlavaOnevisionProcessor`` with the LLaVA-OneVision chat
template, and a tiny model.

What is real: the tokenizer class, the image processor, the processor's ``__call__`` (its
placeholder expansion and ``_get_number_of_features``, its ``<video>`` expansion),
``apply_chat_template`` and the model. What is not: the video processor slot (transformers'
video processors need torchvision, which does not import beside CPU torch here): ``None``, or
:class:`FramesVideoProcessor`, a stand-in written here; only the processor's class check of that
one argument is skipped."""

from __future__ import annotations

import functools

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% for c in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>' }}{% "
    "endfor %}"
    "{% for c in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>' }}{% "
    "endfor %}{% for c in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ '\n' + c['text'] }}{% "
    "endgeneration %}"
    "{% else %}{{ '\n' + c['text'] }}{% endif %}{% endfor %}{{ '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""The LLaVA-OneVision (Qwen2) template's shape: ``<|im_start|>role `` + the turn's images, then its
videos, then ``"\\n" + text`` per text item, ``<|im_end|>``; no newline between turns."""
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]


@functools.lru_cache(maxsize=None)
def hf_tokenizer():
    """A byte-level BPE trained here on newline-heavy text with Qwen's pre-tokenizer rule (a run of
    newlines and the spaces before it is one piece), so the template's ``"user "`` + ``"\\n..."``
    merge as Qwen2's tokenizer merges them."""
    import transformers
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
        "user \n\nhello\n\n\nworld",
        "assistant \n ab. \n\n",
        "system \nYou are a helpful assistant.",
        "a b\n\n c ? \n \n what cat",
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


def token_id(name: str) -> int:
    return hf_tokenizer().convert_tokens_to_ids(name)


def image_processor(tile: int = 384, pinpoints=None):
    try:
        from transformers import LlavaOnevisionImageProcessorPil as cls
    except ImportError:  # pragma: no cover
        from transformers import LlavaOnevisionImageProcessor as cls
    kwargs = {} if pinpoints is None else {"image_grid_pinpoints": [list(p) for p in pinpoints]}
    return cls(size={"height": tile, "width": tile}, **kwargs)


class FramesVideoProcessor:
    """The stand-in for the video slot (transformers' LLaVA-OneVision video processor needs
    torchvision): its steps written here with torch alone: each video's frames (one size per video)
    resized to ``tile`` square by bicubic interpolation with antialias on uint8, rescaled by 1/255
    and normalized with CLIP's mean and std.
    The processor's own ``__call__`` turns its ``pixel_values_videos`` into the ``<video>`` text."""

    def __init__(self, tile: int):
        from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

        self.size = {"height": tile, "width": tile}
        self.image_mean, self.image_std, self.rescale_factor = (
            OPENAI_CLIP_MEAN,
            OPENAI_CLIP_STD,
            1 / 255,
        )

    def __call__(self, videos, **kwargs):
        import numpy as np
        from transformers import BatchFeature

        mean = torch.tensor(self.image_mean)[:, None, None]
        std = torch.tensor(self.image_std)[:, None, None]
        out = []
        for video in videos:
            x = torch.stack([torch.from_numpy(np.array(f)).permute(2, 0, 1) for f in video])
            x = torch.nn.functional.interpolate(
                x,
                size=(self.size["height"], self.size["width"]),
                mode="bicubic",
                align_corners=False,
                antialias=True,
            )
            out.append((x.to(torch.float32) * self.rescale_factor - mean) / std)
        return BatchFeature({"pixel_values_videos": torch.stack(out)})


def hf_processor(
    tile: int = 384,
    patch: int = 14,
    pinpoints=None,
    strategy: str = "full",
    aspect: str = "anyres_max_9",
    video: bool = False,
):
    """``LlavaOnevisionProcessor`` around the real image processor and :func:`hf_tokenizer`, its
    video slot ``None`` or (``video``) :class:`FramesVideoProcessor` (the class check of that one
    argument skipped)."""
    from transformers import LlavaOnevisionProcessor

    from tests.families.offline import any_video_processor

    with any_video_processor():
        return LlavaOnevisionProcessor(
            image_processor=image_processor(tile, pinpoints),
            tokenizer=hf_tokenizer(),
            video_processor=FramesVideoProcessor(tile) if video else None,
            num_image_tokens=(tile // patch) ** 2,
            vision_feature_select_strategy=strategy,
            chat_template=CHAT_TEMPLATE,
            vision_aspect_ratio=aspect,
        )


def config(
    *,
    tile: int = 384,
    patch: int = 14,
    pinpoints=None,
    strategy: str = "full",
    aspect: str = "anyres_max_9",
    tiny: bool = False,
):
    """A ``LlavaOnevisionConfig`` with :func:`hf_tokenizer`'s ids; ``tiny``: a 1-layer SigLIP tower
    and a 2-layer Qwen2 LM of hidden size 32 (float64 logits in a second on CPU)."""
    import transformers

    tok = hf_tokenizer()
    kw = {} if pinpoints is None else {"image_grid_pinpoints": [list(p) for p in pinpoints]}
    from tests.consumers.models import tiny_text_config, tiny_vit_config

    vision = dict(model_type="siglip_vision_model", image_size=tile, patch_size=patch)
    text = dict(model_type="qwen2", vocab_size=len(tok))
    if tiny:
        vision = tiny_vit_config(**vision, num_hidden_layers=2)
        text = tiny_text_config(
            len(tok),
            model_type="qwen2",
            max_position_embeddings=8192,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    return transformers.LlavaOnevisionConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=token_id("<image>"),
        video_token_index=token_id("<video>"),
        vision_feature_select_strategy=strategy,
        vision_feature_layer=-1,
        vision_aspect_ratio=aspect,
        attn_implementation="sdpa",
        **kw,
    )


@functools.lru_cache(maxsize=None)
def tiny_model(tile: int, pinpoints: tuple, aspect: str):
    import transformers

    torch.manual_seed(0)
    cfg = config(tile=tile, pinpoints=pinpoints, aspect=aspect, tiny=True)
    return transformers.LlavaOnevisionForConditionalGeneration(cfg).to(torch.float64).eval()
