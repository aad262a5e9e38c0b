"""One Mistral3 / Pixtral sample, raw -> model-ready (:class:`Mistral3SampleTransform`), as
transformers' ``PixtralProcessor`` and Mistral Small 3.1's chat template write it
(:mod:`prealign.collate.vision.mistral3` holds the image rules).

    raw sample (as VLMSampleTransform's)           Mistral3SampleTransform(raw)
    json   {"messages": [...], "images": [...]}    input_ids          int64   [L]
    0.jpg  JPEG bytes                    ---->     loss_mask          float32 [L]  1: replies, </s>
                                                   mm_token_type_ids  int64   [L]  1 on [IMG]
                                                   pixel_values       float32 [sum h*w, 3, p, p]
                                                   image_sizes        int64   [images, 2]  (H, W)

The chat template (rendered here, tokenized as its string is:
:func:`~.chat_tokenizer.encode_segments`): ``<s>``, a first ``system`` turn as
``[SYSTEM_PROMPT]{text}[/SYSTEM_PROMPT]``, each user turn ``[INST]{content}[/INST]`` (an ``<image>``
there becomes the image's rows of ``[IMG]``, each row closed by ``[IMG_BREAK]``, the last by
``[IMG_END]``), each assistant turn ``{content}</s>`` (trained, ``</s>`` too). The content is
written as given (no trimming). Mistral Small 3.1's own template writes a default system prompt
holding today's date when the conversation has none; the transform writes none unless ``system=`` is
given (a dated prompt would make the data depend on the day it was tokenized). The length depends on
the text and the images' sizes alone (:meth:`Mistral3SampleTransform.header_ids`). Positions are 1-D
(the collator's ``position_ids``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

import torch

from prealign.collate.vision import Mistral3, vision_family
from prealign.collate.vision.mistral3 import image_patches
from prealign.loaders.media.sized_images import SPLIT_IMAGES, SizedImagesTransform
from prealign.loaders.media.vlm import (
    IMAGE_PLACEHOLDER,
    MediaError,
    MediaProblem,
)
from prealign.schemas.errors import ConfigError

MISTRAL3_TOKENS = {
    "im_start": "[INST]",
    "im_end": "[/INST]",
    "vision_start": "[IMG_BREAK]",
    "vision_end": "[IMG_END]",
    "image_pad": "[IMG]",
}
""":class:`HFChatTokenizer` names of Mistral3's tokens (a user turn's ``[INST]`` / ``[/INST]`` in
the turn slots, ``[IMG_BREAK]`` / ``[IMG_END]`` in the vision start / end slots):
``HFChatTokenizer(tok, **MISTRAL3_TOKENS)``."""
SYSTEM_TOKENS = ("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")


@functools.lru_cache(maxsize=4)
def mistral3_image_processor(longest_edge: int, patch_size: int):
    """transformers' Pixtral image processor (its PIL backend where the installed transformers has
    one) with ``longest_edge`` and ``patch_size``. Built locally; cached per process."""
    try:
        from transformers import PixtralImageProcessorPil as cls
    except (
        ImportError
    ):  # pragma: no cover - older transformers: the PIL / NumPy one is PixtralImageProcessor
        from transformers import PixtralImageProcessor as cls
    return cls(
        size={"longest_edge": longest_edge}, patch_size={"height": patch_size, "width": patch_size}
    )


@dataclass(frozen=True, kw_only=True)
class Mistral3SampleTransform(SizedImagesTransform):
    """Raw multimodal sample -> Mistral3 fields (module docstring). ``model_config``: the
    ``Mistral3Config`` (a Pixtral ``LlavaConfig``, their dicts, or a
    :class:`~prealign.collate.vision.Mistral3`); ``tokenizer``: the model's HF tokenizer (wrapped
    with :data:`MISTRAL3_TOKENS`) or a :class:`~prealign.loaders.media.chat_tokenizer.ChatTokenizer`
    with those ids; ``processor``: the model's processor or image processor (default
    :func:`mistral3_image_processor` with the vision tower's ``image_size`` as longest edge);
    ``system``: a system prompt written when the messages have none. The other
    settings are :class:`~prealign.loaders.media.sized_images.SizedImagesTransform`'s. Picklable."""

    system: str | None = None
    family: Mistral3 = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self):
        config = self.model_config
        fam = (
            config
            if isinstance(config, Mistral3)
            else Mistral3.from_config(config)
            if _model_type(config) == "llava"
            else vision_family(config)
        )
        if not isinstance(fam, Mistral3):
            raise ConfigError(
                f"Mistral3SampleTransform: expected a mistral3 (or Pixtral llava) config, got "
                f"{fam.model_type!r}"
            )
        self._setup(fam, MISTRAL3_TOKENS, "[IMG]")
        if fam.token_step > self.longest_edge:  # each side >= a step: past the edge, always
            raise ConfigError(
                f"Mistral3SampleTransform: expected patch_size * spatial_merge_size <= the image "
                f"processor's longest_edge (each side of a resized image is at least one token "
                f"step), got {fam.patch_size} * {fam.spatial_merge_size} = {fam.token_step} > "
                f"longest_edge {self.longest_edge}"
            )

    def default_image_processor(self):
        return mistral3_image_processor(self.family.longest_edge, self.family.patch_size)

    @property
    def longest_edge(self) -> int:
        """The longest edge images are fitted to: the image processor's ``size["longest_edge"]``."""
        size = self.image_processor.size
        edge = (
            size.get("longest_edge")
            if isinstance(size, dict)
            else getattr(size, "longest_edge", None)
        )
        if not edge:
            raise ConfigError(
                f"Mistral3SampleTransform: expected an image processor size with longest_edge, "
                f"got {size}"
            )
        return int(edge)

    def _system_ids(self) -> tuple[int, int]:
        hf = getattr(self.tokenizer, "tokenizer", None)
        ids = (
            tuple(hf.convert_tokens_to_ids(t) for t in SYSTEM_TOKENS)
            if hf is not None
            else (None, None)
        )
        if None in ids or getattr(hf, "unk_token_id", -1) in ids:
            raise ConfigError(
                f"Mistral3SampleTransform: the tokenizer has no {SYSTEM_TOKENS} tokens for a "
                f"system turn"
            )
        return ids

    def segments(self, meta: dict, grids: list[tuple[int, int]], *, sample) -> list[tuple]:
        """The rendered chat as :func:`encode_segments` parts, one ``(rows, cols)`` token grid per
        image."""
        tok, fam = self.tokenizer, self.family
        turns = self.turns(meta, sample=sample, roles=("system", "user", "assistant"))
        images = iter(grids)
        segments: list[tuple] = []
        seen = 0

        def content(text: str, trained: bool, where: str, images_allowed: bool):
            nonlocal seen
            for part in SPLIT_IMAGES.split(text):
                if part != IMAGE_PLACEHOLDER:
                    segments.append((part, trained))
                    continue
                if not images_allowed:
                    raise MediaError(
                        MediaProblem.PLACEHOLDER_MISMATCH,
                        sample=sample,
                        field=where,
                        expected="images in user turns only (Mistral3's template writes them "
                        "there)",
                        actual="an '<image>'",
                    )
                seen += 1
                grid = next(images, None)
                if grid is not None:
                    segments.append(
                        (
                            fam.image_ids(
                                *grid, tok.vision_start_token_id, tok.vision_end_token_id
                            ),
                            False,
                        )
                    )

        if turns is None:
            content(meta["text"], True, "json.text", True)
        else:
            bos = getattr(tok, "bos_token_id", None)
            if bos is not None:
                segments.append(([bos], False))
            if self.system is not None and not (turns and turns[0]["role"] == "system"):
                turns = [{"role": "system", "content": self.system}, *turns]
            for i, turn in enumerate(turns):
                role, where = turn["role"], f"json.messages[{i}]"
                if role == "user":
                    segments.append(([tok.im_start_id], False))
                    content(turn["content"], False, where, True)
                    segments.append(([tok.im_end_id], False))
                elif role == "assistant":
                    content(turn["content"], True, where, False)
                    segments.append(([tok.eos_token_id], True))
                else:
                    start, end = self._system_ids()
                    segments.append(([start], False))
                    content(turn["content"], False, where, False)
                    segments.append(([end], False))
        self.check_placeholders(seen, len(grids), sample=sample)
        return segments

    def image_grid(self, width: int, height: int, *, sample, field: str) -> tuple[int, int]:
        """``(rows, cols)`` of ``[IMG]`` tokens of a ``width x height`` image (its header is
        enough)."""
        return self.family.token_grid(
            height, width, longest_edge=self.longest_edge, sample=sample, field=field
        )

    def index_key(self) -> str:
        """What a sample's length depends on (an index sidecar's key): the shared fields, the
        longest edge, the token ids and the system prompt."""
        tok = self.tokenizer
        return json.dumps(
            {
                "mistral3": {
                    **self.key_fields(),
                    "longest_edge": self.longest_edge,
                    "system": self.system,
                    "ids": [
                        tok.im_start_id,
                        tok.im_end_id,
                        tok.vision_start_token_id,
                        tok.vision_end_token_id,
                        tok.eos_token_id,
                    ],
                }
            },
            sort_keys=True,
        )

    def __call__(self, raw: dict) -> dict:
        key, images, grids, ids, mask = self.render(raw)
        p, step = self.family.patch_size, self.family.token_step
        if images:
            out = self.image_processor(
                images=images, patch_size={"height": step, "width": step}, return_tensors="pt"
            )
            sizes = out["image_sizes"].to(torch.int64).reshape(-1, 2)
            pixels = torch.cat(
                [
                    image_patches(img[:, :h, :w].to(torch.float32), p)
                    for img, (h, w) in zip(out["pixel_values"], sizes.tolist())
                ]
            )
        else:
            sizes, pixels = torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 3, p, p)
        if sizes.tolist() != [[r * step, c * step] for r, c in grids]:
            raise MediaError(
                MediaProblem.VISION_TOKEN_MISMATCH,
                sample=key,
                field="images",
                expected=f"resized sizes {[[r * step, c * step] for r, c in grids]}",
                actual=f"the image processor's {sizes.tolist()}",
            )
        return self.output(raw, key, ids, mask, {"pixel_values": pixels, "image_sizes": sizes})


def _model_type(config) -> str | None:
    return (
        config.get("model_type")
        if isinstance(config, dict)
        else getattr(config, "model_type", None)
    )
