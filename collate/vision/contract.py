"""The :class:`~prealign.schemas.contract.ModelContract` of any transformers config: a vision family's own
declarations, or a text-only LM's read from its ``layer_types`` (Qwen3-Next / Qwen3.5 Gated DeltaNet
``linear_attention``, Llama 4 ``chunked_attention``, Gemma 3 ``sliding_attention``).

>>> model_contract({"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]}).to_dict()
{'model': 'qwen3_next', 'position_kind': '1d', 'media_attention': 'causal', 'local_attention': None, \
'linear_attention': True}
"""
from __future__ import annotations

from typing import Any

from prealign.schemas.contract import ModelContract

from .family import VisionFamily, has_linear_attention, local_attention


def model_contract(model_config: Any) -> ModelContract:
    """The contract of ``model_config`` (a transformers config, its dict, or a
    :class:`~prealign.collate.vision.VisionFamily`): a supported vision-language ``model_type`` gives its
    family's (:meth:`VisionFamily.contract`), any other a text LM's (1-D positions, causal)."""
    from . import FAMILIES, vision_family

    if isinstance(model_config, VisionFamily):
        return model_config.contract()
    model_type = model_config.get("model_type") if isinstance(model_config, dict) else \
        getattr(model_config, "model_type", None)
    if any(model_type in family.model_types for family in FAMILIES):
        return vision_family(model_config).contract(model_config)
    return ModelContract(model=str(model_type), local_attention=local_attention(model_config),
                         linear_attention=has_linear_attention(model_config))
