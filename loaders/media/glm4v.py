"""GLM-4.1V / 4.5V samples (:mod:`prealign.collate.vision.glm4v` holds the rules): the token names its tokenizer
uses and transformers' GLM-4.1V image processor, for the transform's Qwen-style path (grids, mRoPE)."""
from __future__ import annotations

import functools

TOKEN_NAMES = {"vision_start": "<|begin_of_image|>", "vision_end": "<|end_of_image|>", "image_pad": "<|image|>",
               "video_pad": "<|video|>"}
""":class:`~prealign.loaders.media.chat_tokenizer.HFChatTokenizer` names of GLM-4.1V's media tokens."""


@functools.lru_cache(maxsize=4)
def _processor(options: tuple):
    try:  # transformers >= 5 without torchvision: the PIL backend
        from transformers import Glm4vImageProcessorPil as cls
    except ImportError:  # pragma: no cover - older transformers
        from transformers import Glm4vImageProcessor as cls
    return cls(**dict(options))


def glm4v_image_processor(**options):
    """transformers' GLM-4.1V image processor with its defaults, overridden by ``options``; cached per process."""
    return _processor(tuple(sorted(options.items())))
