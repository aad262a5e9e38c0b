"""What the family transforms share. :class:`FamilyTransform`, under every family's own transform
(Gemma 3, LLaVA-OneVision and the ones below): the settings, the family's check, the tokenizer's
wrapping and the sample dict. :class:`SizedImagesTransform`, under the families whose sample length
follows from its text and each image's size (Mistral3 / Pixtral, SmolVLM / Idefics3, Gemma 4): the
image token's check, the conversation's turns, header-only ids. A family's transform adds its chat
rendering (``segments``), its image grid (``image_grid``) and its pixels (``__call__``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from prealign.collate.vision import vision_family
from prealign.loaders.media.chat_tokenizer import HFChatTokenizer, encode_segments
from prealign.loaders.media.teacher_topk import with_teacher_topk
from prealign.loaders.media.vlm import (
    IMAGE_PLACEHOLDER,
    MediaError,
    MediaProblem,
    chat_turns,
    check_float_dtypes,
    decode_images,
    image_members,
    sample_metadata,
)
from prealign.loaders.sources.tar_decode import DEFAULT_LIMITS, DecodeLimits
from prealign.schemas.errors import ConfigError

SPLIT_IMAGES = re.compile("(" + re.escape(IMAGE_PLACEHOLDER) + ")")
"""``re.split`` pattern keeping each ``<image>`` placeholder as its own part."""


@dataclass(frozen=True, kw_only=True)
class FamilyTransform:
    """What every family's own sample transform shares (Gemma 3, LLaVA-OneVision and each
    :class:`SizedImagesTransform`): the settings, ``model_config`` (the model's transformers
    config, its dict or its family), ``tokenizer`` (the model's HF tokenizer, wrapped with the
    family's token names, or a :class:`~prealign.loaders.media.chat_tokenizer.ChatTokenizer`),
    ``processor`` (the model's processor or image processor; unset: the family's default), teacher
    ``topk``, output dtypes, the JSON member and decode limits (a family's transform adds its own
    settings after these); the family's check, the tokenizer's wrapping and the sample dict."""

    model_config: Any
    tokenizer: Any
    processor: Any = None
    topk: int | None = None
    """Expect teacher top-k members with this K (as
    :class:`~prealign.loaders.media.vlm.VLMSampleTransform`)."""
    log_prob_dtype: str = "float32"
    pixel_dtype: str = "float32"
    text_key: str = "json"
    limits: DecodeLimits = DEFAULT_LIMITS

    def checked_family(self, kind: type, names: str):
        """``model_config``'s family (:func:`~prealign.collate.vision.vision_family`) when it is a
        ``kind``, else a :class:`~prealign.schemas.errors.ConfigError` naming this transform,
        ``names`` (the configs it takes) and the config's model type."""
        fam = vision_family(self.model_config)
        if not isinstance(fam, kind):
            raise ConfigError(
                f"{type(self).__name__}: expected a {names} config, got {fam.model_type!r}"
            )
        return fam

    def set_family(self, family, token_names: dict) -> None:
        """Keep ``family``; the tokenizer must have ``encode`` (else a
        :class:`~prealign.schemas.errors.ConfigError` naming this transform), a plain HF one is
        wrapped with ``token_names``
        (:class:`~prealign.loaders.media.chat_tokenizer.HFChatTokenizer`)."""
        object.__setattr__(self, "family", family)
        if not hasattr(self.tokenizer, "encode"):
            raise ConfigError(
                f"{type(self).__name__}: tokenizer must be a ChatTokenizer or an HF tokenizer"
            )
        if not hasattr(self.tokenizer, "im_start_id"):  # a plain HF tokenizer
            object.__setattr__(self, "tokenizer", HFChatTokenizer(self.tokenizer, **token_names))

    def output(self, raw: dict, key, ids: np.ndarray, mask: np.ndarray, media: dict) -> dict:
        """The sample dict: ids, loss mask, ``mm_token_type_ids`` (1 on the image token), ``media``
        (pixels cast to ``pixel_dtype``) and teacher top-k when ``topk`` is set."""
        input_ids = torch.from_numpy(ids)
        out = {
            "__key__": key,
            "input_ids": input_ids,
            "loss_mask": torch.from_numpy(mask),
            "mm_token_type_ids": (input_ids == self.family.image_token_id).to(torch.int64),
            **{
                k: v.to(getattr(torch, self.pixel_dtype)) if k == "pixel_values" else v
                for k, v in media.items()
            },
        }
        return with_teacher_topk(out, raw, self)


@dataclass(frozen=True, kw_only=True)
class SizedImagesTransform(FamilyTransform):
    """What the transforms of families whose sample length follows from the text and each image's
    size share (the module docstring), over :class:`FamilyTransform`."""

    def _setup(self, family, token_names: dict, image_token: str) -> None:
        """Keep ``family``, wrap a plain HF tokenizer with ``token_names``
        (:meth:`~FamilyTransform.set_family`) and check its image token and the dtypes."""
        self.set_family(family, token_names)
        if self.tokenizer.image_token_id != family.image_token_id:
            raise ConfigError(
                f"{type(self).__name__}: the config's image_token_id {family.image_token_id} is "
                f"not the tokenizer's {image_token} {self.tokenizer.image_token_id}"
            )
        check_float_dtypes(self)

    @property
    def image_processor(self):
        """``processor``'s image processor (or ``processor`` itself), else the family's default."""
        if self.processor is not None:
            return getattr(self.processor, "image_processor", self.processor)
        return self.default_image_processor()

    def default_image_processor(self):  # pragma: no cover - every family defines it
        raise NotImplementedError

    def image_grid(
        self, width: int, height: int, *, sample, field: str
    ) -> tuple[int, int]:  # pragma: no cover
        """The ``(rows, cols)`` of one image (a header's size is enough)."""
        raise NotImplementedError

    def segments(self, meta: dict, grids: list, *, sample) -> list[tuple]:  # pragma: no cover
        """The rendered chat as :func:`encode_segments` parts, one grid per image."""
        raise NotImplementedError

    def turns(
        self, meta: dict, *, sample, roles: tuple[str, ...] | None = None
    ) -> list[dict] | None:
        """The sample's messages, each checked to be ``{'role': str, 'content': str}`` (a role among
        ``roles`` when given); ``None`` for a plain ``text`` sample."""
        turns = chat_turns(meta, sample)
        if turns is None:
            return None
        for i, turn in enumerate(turns):
            if (
                not isinstance(turn, dict)
                or not isinstance(turn.get("content"), str)
                or not isinstance(turn.get("role"), str)
                or (roles and turn["role"] not in roles)
            ):
                raise MediaError(
                    MediaProblem.BAD_TEXT,
                    sample=sample,
                    field=f"json.messages[{i}]",
                    expected=f"{{'role': {' | '.join(map(repr, roles)) if roles else 'str'}, "
                    "'content': str}",
                    actual=repr(turn)[:80],
                )
        return turns

    @staticmethod
    def check_placeholders(seen: int, images: int, *, sample) -> None:
        """A :class:`MediaError` (``placeholder_mismatch``) naming ``sample`` unless the text's
        ``seen`` ``<image>`` placeholders are one per image."""
        if seen != images:
            raise MediaError(
                MediaProblem.PLACEHOLDER_MISMATCH,
                sample=sample,
                field="json",
                expected=f"{images} '{IMAGE_PLACEHOLDER}' placeholders (one per image)",
                actual=f"{seen}",
            )

    def header_ids(self, raw: dict, size_of=None) -> tuple[np.ndarray, np.ndarray]:
        """(``input_ids``, ``loss_mask``) without decoding an image: each image's ``(width,
        height)`` from ``size_of(name, value)`` (default: its header) is all the length depends on
        (what an index pass needs)."""
        from prealign.loaders.sources.header_lengths import image_header_size

        key = raw.get("__key__", "?")
        meta = sample_metadata(raw, self.text_key, key)
        size_of = size_of or (lambda name, value: image_header_size(value, field=name, sample=key))
        grids = [
            self.image_grid(*size_of(n, v), sample=key, field=n)
            for n, v in image_members(raw, meta, key)
        ]
        return encode_segments(self.tokenizer, self.segments(meta, grids, sample=key))

    def render(self, raw: dict) -> tuple:
        """``(key, images, grids, ids, mask)`` of a raw sample: its images decoded (RGB PIL), their
        grids, and the chat's ``input_ids`` / ``loss_mask``."""
        key = raw.get("__key__", "?")
        meta = sample_metadata(raw, self.text_key, key)
        images = decode_images(raw, meta, key, self.limits)
        grids = [
            self.image_grid(im.width, im.height, sample=key, field=f"images[{i}]")
            for i, im in enumerate(images)
        ]
        ids, mask = encode_segments(self.tokenizer, self.segments(meta, grids, sample=key))
        return key, images, grids, ids, mask

    def key_fields(self) -> dict:
        """What every such transform's length depends on, for its ``index_key``: the tokenizer
        (class, vocabulary, a probe encoding, bos), the family, teacher K and the JSON member."""
        tok = self.tokenizer
        probe = np.asarray(
            tok.encode("prealign probe:\n\n <image> <row_1_col_1> Hello, world!")
        ).tolist()
        return {
            "tokenizer": f"{type(tok).__module__}.{type(tok).__qualname__}",
            "vocab_size": int(tok.vocab_size),
            "probe": probe,
            "bos": getattr(tok, "bos_token_id", None),
            "family": repr(self.family),
            "topk": self.topk,
            "text_key": self.text_key,
        }
