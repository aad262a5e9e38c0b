"""What the 1-D-position families (Idefics3, Mistral3, InternVL, LLaVA-OneVision, Gemma 4; GLM-4V's
config reader too) share, so that each family module says only what differs: the config readers, the
positive-int check of their constants, and :class:`OneDimFamily`, whose batch schema is the token
fields, ``mm_token_type_ids``, the family's own MEDIA fields (:meth:`OneDimFamily.media_fields`)
and teacher top-k.

>>> from prealign.collate.vision import Mistral3
>>> fam = Mistral3(model_type="mistral3", image_token_id=10, patch_size=14, spatial_merge_size=2,
...                temporal_patch_size=1)
>>> s = fam.batch_schema(topk=2)
>>> s.name, [f.name for f in s.fields][5:8]
('mistral3_topk', ['mm_token_type_ids', 'pixel_values', 'image_sizes'])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from .family import VisionFamily, config_getter


def config_readers(config: Any) -> tuple[Callable, Callable]:
    """``(get, vision)``: ``get(key, default=None)`` over a transformers config (object or dict) and
    over its ``vision_config`` (an empty one when absent)."""
    get = config_getter(config)
    return get, config_getter(get("vision_config", {}) or {})


def tiles_field(name: str, pixel_dtypes: tuple[str, ...], side: int):
    """A MEDIA field of square RGB pixels ``[n, 3, side, side]`` (tiles, frames or patches)."""
    from prealign.schemas.schema import FieldSpec, Role

    return FieldSpec(name=name, role=Role.MEDIA, dtypes=pixel_dtypes, dense_shape=(3, side, side))


def int64_field(name: str, *, pairs: bool = False):
    """A MEDIA int64 field: ``[n]`` counts, or (``pairs``) ``[n, 2]`` sizes."""
    from prealign.schemas.schema import FieldSpec, Role

    if pairs:
        return FieldSpec(name=name, role=Role.MEDIA, dtypes=("int64",), dense_shape=(2,))
    return FieldSpec(name=name, role=Role.MEDIA, dtypes=("int64",))


@dataclass(frozen=True, kw_only=True)
class OneDimFamily(VisionFamily):
    """A family of 1-D positions whose batch is the token fields and its own MEDIA fields:
    :meth:`batch_schema` from :meth:`media_fields`, :attr:`schema_name` and
    :attr:`max_token_type`."""

    schema_name: ClassVar[str | None] = None
    """The batch schema's name (``None``: the family's ``model_type``); ``+ "_topk"`` with top-k."""
    max_token_type: ClassVar[int] = 1
    """The largest ``mm_token_type_ids`` value: 1 (images) or 2 (images and video)."""

    def media_fields(self, pixel_dtypes: tuple[str, ...]) -> tuple:
        """The family's MEDIA :class:`~prealign.schemas.FieldSpec` s, pixels in ``pixel_dtypes``."""
        raise NotImplementedError

    def batch_schema(
        self,
        *,
        pad_token_id: int = 0,
        topk: int | str | None = None,
        vocab_size: int | None = None,
        pixel_dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    ):
        """The batch the family's transform's samples collate to: the token fields (1-D
        ``position_ids``, no ``mrope_position_ids``), ``mm_token_type_ids`` int ``[L]`` (0 text, 1
        image, 2 video up to :attr:`max_token_type`), :meth:`media_fields`, teacher top-k ``[L,
        topk]`` when ``topk`` is given."""
        from prealign.schemas.schema import (
            BatchSchema,
            core_token_fields,
            token_type_field,
            topk_fields,
        )

        fields = (
            *core_token_fields(pad_token_id, -100, vocab_size),
            token_type_field(self.max_token_type),
            *self.media_fields(pixel_dtypes),
        )
        if topk is not None:
            fields += topk_fields(topk, vocab_size)
        name = self.schema_name or self.model_type
        return BatchSchema(name=name if topk is None else f"{name}_topk", fields=fields)
