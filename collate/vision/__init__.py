"""The Qwen vision-language families, one module each behind :class:`VisionFamily`, chosen by the
model config's ``model_type`` (:func:`vision_family`): token ids, patch / merge / temporal sizes,
grid arithmetic, video runs and timestamps, and mRoPE positions, all read from the Hugging Face
config, never configured twice.

>>> from transformers import Qwen3VLConfig
>>> fam = vision_family(Qwen3VLConfig())
>>> type(fam).__name__, fam.patch_size, fam.video_runs([[3, 4, 6]]).tolist()
('Qwen3VL', 16, [[1, 4, 6], [1, 4, 6], [1, 4, 6]])
"""

from __future__ import annotations

from typing import Any

from prealign.schemas.errors import ConfigError

from .contract import model_contract
from .family import VisionFamily, has_linear_attention, local_attention
from .gemma3 import Gemma3
from .gemma4 import Gemma4
from .glm4v import Glm4V
from .grids import VisionGeometry, image_grid, video_grid
from .idefics3 import Idefics3
from .internvl import InternVL
from .llava_onevision import LlavaOneVision
from .mistral3 import Mistral3
from .positions import IMAGE, TEXT, VIDEO, rope_positions
from .qwen2_5_vl import Qwen2_5VL
from .qwen2_vl import Qwen2VL
from .qwen3_5 import Qwen3_5
from .qwen3_vl import Qwen3VL, frame_timestamps

FAMILIES: tuple[type[VisionFamily], ...] = (
    Qwen2VL,
    Qwen2_5VL,
    Qwen3VL,
    Qwen3_5,
    Gemma3,
    Gemma4,
    InternVL,
    Glm4V,
    LlavaOneVision,
    Mistral3,
    Idefics3,
)
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(t for f in FAMILIES for t in f.model_types)


def vision_family(model_config: Any) -> VisionFamily:
    """The :class:`VisionFamily` of a transformers config (object or dict), by its ``model_type``; a
    family instance is returned as is. Anything else is a :class:`~prealign.schemas.ConfigError`
    naming the supported model types."""
    if isinstance(model_config, VisionFamily):
        return model_config
    model_type = (
        model_config.get("model_type")
        if isinstance(model_config, dict)
        else getattr(model_config, "model_type", None)
    )
    for family in FAMILIES:
        if model_type in family.model_types:
            return family.from_config(model_config)
    raise ConfigError(
        f"unsupported vision-language model_type {model_type!r} ({type(model_config).__name__}); "
        f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


__all__ = [
    "model_contract",
    "local_attention",
    "VisionFamily",
    "has_linear_attention",
    "VisionGeometry",
    "vision_family",
    "FAMILIES",
    "SUPPORTED_MODEL_TYPES",
    "Qwen2VL",
    "Qwen2_5VL",
    "Qwen3VL",
    "Qwen3_5",
    "Gemma3",
    "Gemma4",
    "InternVL",
    "Glm4V",
    "LlavaOneVision",
    "image_grid",
    "video_grid",
    "rope_positions",
    "frame_timestamps",
    "Mistral3",
    "Idefics3",
    "TEXT",
    "IMAGE",
    "VIDEO",
]
