"""One SmolVLM / Idefics3 sample, raw -> model-ready (:class:`Idefics3SampleTransform`), as
transformers' ``SmolVLMProcessor`` / ``Idefics3Processor`` and their chat template write it
(:mod:`prealign.collate.vision. idefics3` holds the tiling rule).

    raw sample (as VLMSampleTransform's)           Idefics3SampleTransform(raw)
    json   {"messages": [...], "images": [...]}    input_ids          int64   [L]
    0.jpg  JPEG bytes                    ---->     loss_mask          float32 [L]  1 on replies (and
                                                                              <end_of_utterance>)
                                                   mm_token_type_ids  int64   [L]  1 on <image>
                                                   pixel_values       float32 [tiles, 3, S, S]
                                                   image_rows_cols    int64   [images, 2]

The chat template (rendered here, tokenized as its string is:
:func:`~.chat_tokenizer.encode_segments`): the tokenizer's bos (``<|im_start|>`` for SmolVLM,
``<|begin_of_text|>`` for Idefics3), then per turn the role capitalised, ``":"`` when the content
opens with an image else ``": "``, the content (an ``<image>`` there is the image's tiles and global
view, :mod:`prealign.collate.vision.idefics3`), ``<end_of_utterance>\\n``; assistant content and its
``<end_of_utterance>`` are trained. The length depends on the text and each image's size alone
(:meth:`Idefics3SampleTransform.header_ids`). Positions are 1-D (the collator's ``position_ids``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field

import torch

from prealign.collate.vision import Idefics3
from prealign.loaders.media.sized_images import SPLIT_IMAGES, SizedImagesTransform
from prealign.loaders.media.vlm import (
    IMAGE_PLACEHOLDER,
    MediaError,
    MediaProblem,
    refused_images,
)
from prealign.schemas.errors import ConfigError

IDEFICS3_TOKENS = {
    "im_start": "<fake_token_around_image>",
    "im_end": "<end_of_utterance>",
    "vision_start": "<fake_token_around_image>",
    "vision_end": "<fake_token_around_image>",
    "image_pad": "<image>",
}
""":class:`HFChatTokenizer` names of SmolVLM's tokens: ``<end_of_utterance>`` closes a turn
(``im_end``), ``<fake_token_around_image>`` wraps images (``vision_start``), ``<image>`` is the
image token. ``<row_r_col_c>`` and ``<global-img>`` are written as text (the tokenizer's added
tokens)."""


@functools.lru_cache(maxsize=4)
def idefics3_image_processor(model_type: str, longest_edge: int, tile: int):
    """transformers' SmolVLM / Idefics3 image processor (PIL backend where the installed
    transformers has one), ``longest_edge`` and ``tile``-px tiles. Built locally; cached per
    process."""
    return pil_image_processor_class(model_type)(
        size={"longest_edge": longest_edge}, max_image_size={"longest_edge": tile}
    )


def pil_image_processor_class(model_type: str):
    """transformers' PIL-backend image processor class of ``smolvlm`` / ``idefics3``, imported from
    its module (transformers 5.6 and 5.10 list ``SmolVLMImageProcessorPil`` as needing torchvision
    at the top level, though its module does not); the torchvision-free ``*ImageProcessor`` where no
    PIL module exists."""
    import importlib

    import transformers

    name, module = ("SmolVLM", "smolvlm") if model_type == "smolvlm" else ("Idefics3", "idefics3")
    try:
        pil = importlib.import_module(f"transformers.models.{module}.image_processing_pil_{module}")
        return getattr(pil, f"{name}ImageProcessorPil")
    except (ImportError, AttributeError):  # pragma: no cover - older transformers
        return getattr(transformers, f"{name}ImageProcessor")


def _longest(size) -> int | None:
    return (
        size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None)
    )


@dataclass(frozen=True, kw_only=True)
class Idefics3SampleTransform(SizedImagesTransform):
    """Raw multimodal sample -> SmolVLM / Idefics3 fields (module docstring). ``model_config``: the
    ``SmolVLMConfig`` / ``Idefics3Config`` (or its dict); ``tokenizer``: the model's HF tokenizer
    (wrapped with :data:`IDEFICS3_TOKENS`) or a
    :class:`~prealign.loaders.media.chat_tokenizer.ChatTokenizer` with those ids; ``processor``: the
    model's processor or image processor (default :func:`idefics3_image_processor`: longest edge ``4
    * S``, ``S`` the vision tower's ``image_size``). The other settings are
    :class:`~prealign.loaders.media.sized_images.SizedImagesTransform`'s. Picklable."""

    family: Idefics3 = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self):
        fam = self.checked_family(Idefics3, "smolvlm or idefics3")
        self._setup(fam, IDEFICS3_TOKENS, "<image>")
        ip = self.image_processor  # the splitting that runs decides the lengths
        tile, edge = _longest(ip.max_image_size), _longest(ip.size)
        if not tile or not edge:
            raise ConfigError(
                f"Idefics3SampleTransform: expected an image processor with size and "
                f"max_image_size longest_edge, got {ip.size}, {ip.max_image_size}"
            )
        if int(tile) != fam.tile_size:
            raise ConfigError(
                f"Idefics3SampleTransform: the image processor's {tile}-px tiles are not the "
                f"vision tower's image_size {fam.tile_size}"
            )
        object.__setattr__(
            self,
            "family",
            dataclasses.replace(fam, longest_edge=int(edge), split=bool(ip.do_image_splitting)),
        )

    def default_image_processor(self):
        fam = self.family
        return idefics3_image_processor(fam.model_type, fam.longest_edge, fam.tile_size)

    def image_segments(self, rows: int, cols: int) -> list[tuple]:
        """One image as :func:`encode_segments` parts: its tiles row by row, then its global
        view."""
        tok, n = self.tokenizer, self.family.image_seq_len
        fake, image = [tok.vision_start_token_id], [tok.image_token_id] * n
        parts: list[tuple] = []
        for r in range(rows):
            for c in range(cols):
                parts += [(fake, False), (f"<row_{r + 1}_col_{c + 1}>", False), (image, False)]
            parts.append(("\n", False))
        return parts + [
            ("\n" if rows else "", False),
            (fake, False),
            ("<global-img>", False),
            (image + fake, False),
        ]

    def segments(self, meta: dict, grids: list[tuple[int, int]], *, sample) -> list[tuple]:
        """The rendered chat as :func:`encode_segments` parts, one ``(rows, cols)`` tile grid per
        image."""
        tok = self.tokenizer
        turns = self.turns(meta, sample=sample)
        images = iter(grids)
        segments: list[tuple] = []
        seen = 0

        def content(text: str, trained: bool):
            nonlocal seen
            for part in SPLIT_IMAGES.split(text):
                if part != IMAGE_PLACEHOLDER:
                    segments.append((part, trained))
                    continue
                seen += 1
                grid = next(images, None)
                if grid is not None:
                    segments.extend(self.image_segments(*grid))

        if turns is None:
            content(meta["text"], True)
        else:
            bos = getattr(tok, "bos_token_id", None)
            if bos is not None:
                segments.append(([bos], False))
            for turn in turns:
                reply = turn["role"] == "assistant"
                opens_with_image = turn["content"].startswith(IMAGE_PLACEHOLDER)
                segments.append(
                    (turn["role"].capitalize() + (":" if opens_with_image else ": "), False)
                )
                content(turn["content"], reply)
                segments += [([tok.im_end_id], reply), ("\n", False)]
        self.check_placeholders(seen, len(grids), sample=sample)
        return segments

    def image_grid(self, width: int, height: int, *, sample, field: str) -> tuple[int, int]:
        """``(rows, cols)`` of one image's tiles (``(0, 0)``: its global view alone; a header's size
        is enough)."""
        return self.family.rows_cols(height, width, sample=sample, field=field)

    def index_key(self) -> str:
        """What a sample's length depends on (an index sidecar's key): the shared fields (the family
        with the splitting in use) and the token ids."""
        tok = self.tokenizer
        return json.dumps(
            {
                "idefics3": {
                    **self.key_fields(),
                    "ids": [tok.vision_start_token_id, tok.im_end_id, tok.image_token_id],
                }
            },
            sort_keys=True,
        )

    def __call__(self, raw: dict) -> dict:
        key, images, grids, ids, mask = self.render(raw)
        s = self.family.tile_size
        if images:
            try:
                out = self.image_processor(
                    images=[images], return_row_col_info=True, return_tensors="pt"
                )
            except ValueError as exc:
                raise refused_images(
                    "the SmolVLM / Idefics3 image processor", str(exc), sample=key
                ) from None
            pixels = out["pixel_values"][0].to(torch.float32)
            theirs = [[int(r), int(c)] for r, c in zip(out["rows"][0], out["cols"][0])]
            if theirs != [list(g) for g in grids]:
                raise MediaError(
                    MediaProblem.VISION_TOKEN_MISMATCH,
                    sample=key,
                    field="images",
                    expected=f"tile grids {grids}",
                    actual=f"the image processor's {theirs}",
                )
        else:
            pixels = torch.zeros(0, 3, s, s)
        return self.output(
            raw,
            key,
            ids,
            mask,
            {
                "pixel_values": pixels,
                "image_rows_cols": torch.tensor(grids, dtype=torch.int64).reshape(-1, 2),
            },
        )
