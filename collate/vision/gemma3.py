"""Gemma 3 (``model_type`` ``gemma3``): a SigLIP tower whose patches are average-pooled to a fixed
``mm_tokens_per_image`` tokens per image (256 for the released checkpoints, whatever the image's
size: the processor resizes every image to ``image_size`` square, pan-and-scan crops off by
default), written by the processor as ``"\\n\\n<start_of_image>" + <image_soft_token> x
mm_tokens_per_image + "<end_of_image>\\n\\n"``.

The contract: 1-D positions; **image tokens attend bidirectionally within their image**
(transformers' ``create_masks_for_vision_model``), so a packed row needs a per-token mask per layer
type (:func:`.attention.layer_masks`, handed to the model by ``to_hf_kwargs(attention="mask")``):
``full_attention`` layers ``OR(causal, image block)``, ``sliding_attention`` layers that intersected
with the window (``text_config.sliding_window``), each inside its sequence, in transformers 5.17 and
newer; 5.6 to 5.16 OR the image block over the windowed causal mask instead (an image token sees
its whole image however long the window): ``ModelContract.media_over_window``, read from the
installed release. Flash attention drops
that mask (transformers sets ``_supports_flash_attn = False`` for the multimodal model): refused by
the contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prealign.schemas.errors import ConfigError

from .family import VisionFamily, config_getter, has_linear_attention


@dataclass(frozen=True, kw_only=True)
class Gemma3(VisionFamily):
    """``model_type`` ``gemma3``: ``image_token_id`` the ``<image_soft_token>``,
    ``vision_start_token_id`` / ``vision_end_token_id`` ``<start_of_image>`` / ``<end_of_image>``
    (``boi`` / ``eoi_token_index``); no video
    (``video_token_id`` -1); ``spatial_merge_size`` the pooling kernel (patches per token side)."""

    model_types = ("gemma3",)
    position_kind = "1d"
    media_attention = "bidirectional"
    local_attention = None  # from text_config.layer_types ("sliding" for every released Gemma 3)
    transform = "prealign.loaders.media.gemma3.Gemma3SampleTransform"
    mm_tokens_per_image: int
    image_size: int
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: Any) -> "Gemma3":
        get = config_getter(config)
        vision = config_getter(get("vision_config", {}) or {})
        text = config_getter(get("text_config", {}) or {})
        tokens = get("mm_tokens_per_image")
        image, patch = vision("image_size"), vision("patch_size")
        values = dict(
            model_type=get("model_type"),
            image_token_id=_first(get, "image_token_id", "image_token_index"),
            vision_start_token_id=_first(get, "boi_token_id", "boi_token_index"),
            vision_end_token_id=_first(get, "eoi_token_id", "eoi_token_index"),
            mm_tokens_per_image=tokens,
            image_size=image,
            patch_size=patch,
            sliding_window=text("sliding_window"),
            layer_types=tuple(text("layer_types") or ()),
        )
        missing = [k for k, v in values.items() if v is None and k != "sliding_window"]
        if missing:
            raise ConfigError(
                f"Gemma3.from_config: the {values['model_type']} config has no {missing}"
            )
        side = round(tokens**0.5)
        return cls(
            **values,
            video_token_id=-1,
            spatial_merge_size=max(1, image // patch // side),
            temporal_patch_size=1,
            linear_attention=has_linear_attention(config),
        )

    def __post_init__(self):
        ids = (self.image_token_id, self.vision_start_token_id, self.vision_end_token_id)
        if len(set(ids)) != 3 or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids
        ):
            raise ConfigError(
                f"Gemma3: expected three distinct non-negative token ids (image, start, end), got "
                f"{ids}"
            )
        if self.layer_types and "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ConfigError("Gemma3: sliding_attention layers need text_config.sliding_window")

    def contract(self, config: Any = None):
        """The class declarations, local attention from the text config's ``layer_types`` (kept at
        build), and how the installed transformers meets an image longer than the window
        (:func:`~.contract.block_over_window`)."""
        from dataclasses import replace

        from .contract import block_over_window

        declared = super().contract(
            {"layer_types": list(self.layer_types)} if config is None else config
        )
        return replace(declared, media_over_window=block_over_window(self.model_type))

    def tokens_per_image(self) -> int:
        return self.mm_tokens_per_image


def _first(get, *names):
    for name in names:
        value = get(name)
        if value is not None:
            return value
    return None
