"""The :class:`~prealign.schemas.contract.ModelContract` of any transformers config: a vision
family's own declarations, or any other model's read from its config: ``layer_types`` (Qwen3-Next /
Qwen3.5 Gated DeltaNet ``linear_attention``, Llama 4 ``chunked_attention``, Gemma 3 / 4
``sliding_attention``) and Gemma 4's ``use_bidirectional_attention == "vision"`` (image and video
tokens attend bidirectionally within their block).

>>> cfg = {"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]}
>>> model_contract(cfg).to_dict()
{'model': 'qwen3_next', 'position_kind': '1d', 'media_attention': 'causal', \
'local_attention': None, 'linear_attention': True}
"""

from __future__ import annotations

from typing import Any

from prealign.schemas.contract import ModelContract

from .family import VisionFamily, config_getter, has_linear_attention, local_attention


def model_contract(model_config: Any) -> ModelContract:
    """The contract of ``model_config`` (a transformers config, its dict, or a
    :class:`~prealign.collate.vision.VisionFamily`): a supported vision-language ``model_type``
    gives its family's (:meth:`VisionFamily.contract`), any other a text LM's (1-D positions,
    causal)."""
    from . import FAMILIES, vision_family

    if isinstance(model_config, VisionFamily):
        return model_config.contract()
    model_type = (
        model_config.get("model_type")
        if isinstance(model_config, dict)
        else getattr(model_config, "model_type", None)
    )
    if any(model_type in family.model_types for family in FAMILIES):
        return vision_family(model_config).contract(model_config)
    get = config_getter(model_config)
    text = config_getter(get("text_config", None) or model_config)
    bidirectional = (
        text("use_bidirectional_attention", None) == "vision"
    )  # Gemma 4 (its larger models)
    return ModelContract(
        model=str(model_type),
        media_attention="bidirectional" if bidirectional else "causal",
        local_attention=local_attention(model_config),
        linear_attention=has_linear_attention(model_config),
        bidirectional_layers=gemma4_bidirectional_layers() if bidirectional else None,
        media_over_window=bidirectional and block_over_window("gemma4"),
    )


def gemma4_bidirectional_layers() -> tuple[str, ...] | None:
    """The layer types whose mask has Gemma 4's image / video blocks in the installed transformers,
    read from its ``modeling_gemma4``: only ``sliding_attention`` where it builds them with
    ``create_causal_mask_mapping`` (5.6) or ``create_masks_for_vision_model`` (5.17 and newer:
    "Gemma 4 explicitly disables bidirectional
    attention on global attention layers"); every layer otherwise (5.10 hands the blocks to both
    masks)."""
    try:
        from transformers.models.gemma4 import modeling_gemma4
    except ImportError:
        return None
    sliding_only = any(
        hasattr(modeling_gemma4, name)
        for name in ("create_masks_for_vision_model", "create_causal_mask_mapping")
    )
    return ("sliding_attention",) if sliding_only else None


def block_over_window(model_type: str) -> bool:
    """Whether the installed transformers ORs ``model_type``'s (``"gemma3"`` / ``"gemma4"``) image
    blocks over the sliding window (``OR(AND(window, causal), block)``: an image token sees its
    whole image however long; 5.6's ``create_causal_mask_mapping`` / ``or_mask_function`` and
    5.10's ``block_sequence_ids`` overlay, both added after the window in
    ``create_sliding_window_causal_mask``) rather than ANDing the window after them (5.17 and newer:
    its ``modeling_<model_type>`` builds the masks with ``create_masks_for_vision_model``,
    ``AND(sliding_window, OR(causal, blockwise))``)."""
    import importlib

    try:
        name = f"transformers.models.{model_type}.modeling_{model_type}"
        modeling = importlib.import_module(name)
    except ImportError:
        return False
    return not hasattr(modeling, "create_masks_for_vision_model")
