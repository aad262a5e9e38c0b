"""One Gemma 4 sample, raw -> model-ready (:class:`Gemma4SampleTransform`), as transformers'
``Gemma4Processor`` and the Gemma 4 chat template write it: every image resized at its aspect
ratio to fit the image processor's soft-token budget (:func:`~prealign.collate.vision.gemma4.
resized_size`), cut into ``p``-px patches, written as ``<|image>`` + ``<|image|>`` x tokens +
``<image|>``.

    raw sample (as VLMSampleTransform's)        Gemma4SampleTransform(raw)
    json   {"messages": [...], "images": [...]} input_ids          int64   [L]
    0.jpg  JPEG bytes                    ---->  loss_mask          float32 [L]  1 on model replies
                                                                                + <turn|>
                                                mm_token_type_ids  int64   [L]  1 on <|image|>
                                                pixel_values       float32 [images, P, 3 p^2]
                                                image_position_ids int64   [images, P, 2]

``P = max_soft_tokens * k^2`` (the budget in patches, ``k`` the pooling kernel): each image's
patches in raster order, zero-padded to ``P``, their ``(x, y)`` in ``image_position_ids`` and -1 on
the padding, exactly the image processor's output.

The chat template (rendered here, tokenized as its string is:
:func:`~.chat_tokenizer.encode_segments`): ``<bos>``; a first ``system`` (or ``developer``) turn
as ``<|turn>system\\n`` + its text trimmed + ``<turn|>\\n``; then per turn ``<|turn>{role}\\n``
(``assistant`` written ``model``; a model turn right after a model turn continues it, no header),
each text piece around an image trimmed (a leading newline disappears), an image written
``<|image|>`` with no newline around it, ``<turn|>\\n``. A model turn's text drops thinking
(``<|channel>...<channel|>``) as the template does. Loss on the model's replies and their
``<turn|>``. The length depends on the text and each image's size alone
(:meth:`Gemma4SampleTransform.header_ids`). Positions are 1-D (the collator's ``position_ids``);
a model with bidirectional vision needs the per-token masks ``to_hf_kwargs(attention="mask",
model_config=...)`` emits for packed rows.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

import numpy as np
import torch

from prealign.collate.vision import Gemma4
from prealign.loaders.media.sized_images import SPLIT_IMAGES, SizedImagesTransform
from prealign.loaders.media.vlm import (
    IMAGE_PLACEHOLDER,
    MediaError,
    MediaProblem,
    refuse_videos,
    sample_metadata,
)
from prealign.schemas.errors import ConfigError

GEMMA4_TOKENS = {
    "im_start": "<|turn>",
    "im_end": "<turn|>",
    "vision_start": "<|image>",
    "vision_end": "<image|>",
    "image_pad": "<|image|>",
    "video_pad": "<|video|>",
}
""":class:`~.chat_tokenizer.HFChatTokenizer` names of Gemma 4's special tokens:
``HFChatTokenizer(tok, **GEMMA4_TOKENS)``."""
DEFAULT_MAX_SOFT_TOKENS = 280
"""transformers' ``Gemma4ImageProcessor`` default budget of soft tokens per image."""
_THOUGHT_OPEN, _THOUGHT_CLOSE = "<|channel>", "<channel|>"


@functools.lru_cache(maxsize=4)
def gemma4_image_processor(patch_size: int, pooling_kernel_size: int, max_soft_tokens: int):
    """transformers' Gemma 4 image processor (its PIL backend) with the vision tower's patch and
    pooling sizes. Built locally; cached per process."""
    from transformers import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(
        patch_size=patch_size,
        pooling_kernel_size=pooling_kernel_size,
        max_soft_tokens=max_soft_tokens,
    )


def strip_thinking(text: str) -> str:
    """A model turn's text as the template writes it: each ``<|channel>...<channel|>`` span
    dropped, the rest trimmed.

    >>> strip_thinking(" <|channel>thought\\nhm<channel|>Yes. ")
    'Yes.'
    """
    parts = text.split(_THOUGHT_CLOSE)
    return "".join(p.split(_THOUGHT_OPEN)[0] if _THOUGHT_OPEN in p else p for p in parts).strip()


@dataclass(frozen=True, kw_only=True)
class Gemma4SampleTransform(SizedImagesTransform):
    """Raw multimodal sample -> Gemma 4 fields (module docstring). ``model_config``: the
    ``Gemma4Config`` (its dict, or a :class:`~prealign.collate.vision.Gemma4`); ``tokenizer``: the
    model's HF tokenizer (wrapped with :data:`GEMMA4_TOKENS`) or a
    :class:`~prealign.loaders.media.chat_tokenizer.ChatTokenizer` with those ids; ``processor``:
    the model's processor or image processor (default :func:`gemma4_image_processor` with the
    vision tower's sizes and a budget of :data:`DEFAULT_MAX_SOFT_TOKENS`). The other settings are
    :class:`~prealign.loaders.media.sized_images.SizedImagesTransform`'s. Picklable. No video
    (a sample with one is a ``MediaError`` ``unprocessed_video``)."""

    family: Gemma4 = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self):
        fam = self.checked_family(Gemma4, "gemma4")
        self._setup(fam, GEMMA4_TOKENS, "<|image|>")
        tok = self.tokenizer
        ours = (fam.vision_start_token_id, fam.vision_end_token_id)
        theirs = (tok.vision_start_token_id, tok.vision_end_token_id)
        if ours != theirs:
            raise ConfigError(
                f"Gemma4SampleTransform: the config's (boi, eoi) ids {ours} differ from the "
                f"tokenizer's {theirs}"
            )
        proc = self.image_processor
        sizes = (getattr(proc, "patch_size", None), getattr(proc, "pooling_kernel_size", None))
        if sizes != (fam.patch_size, fam.spatial_merge_size):
            raise ConfigError(
                f"Gemma4SampleTransform: the image processor's (patch_size, pooling_kernel_size) "
                f"{sizes} differ from the vision config's "
                f"{(fam.patch_size, fam.spatial_merge_size)}"
            )

    def default_image_processor(self):
        fam = self.family
        return gemma4_image_processor(
            fam.patch_size, fam.spatial_merge_size, DEFAULT_MAX_SOFT_TOKENS
        )

    @property
    def max_soft_tokens(self) -> int:
        """The image processor's budget of soft tokens per image."""
        return int(self.image_processor.max_soft_tokens)

    def image_grid(self, width: int, height: int, *, sample, field: str) -> tuple[int, int]:
        """``(rows, cols)`` of soft tokens of a ``width x height`` image (its header is enough)."""
        return self.family.token_grid(
            height, width, max_soft_tokens=self.max_soft_tokens, sample=sample, field=field
        )

    def segments(self, meta: dict, grids: list[tuple[int, int]], *, sample) -> list[tuple]:
        """The rendered chat as :func:`encode_segments` parts, one ``(rows, cols)`` token grid per
        image."""
        tok, fam = self.tokenizer, self.family
        turns = self.turns(meta, sample=sample)
        images = iter(grids)
        segments: list[tuple] = []
        seen = 0

        def content(text: str, trained: bool, clean):
            nonlocal seen
            for part in SPLIT_IMAGES.split(text):
                if part != IMAGE_PLACEHOLDER:
                    segments.append((clean(part), trained))
                    continue
                seen += 1
                rows, cols = next(images, (0, 0))
                block = [fam.vision_start_token_id, *[fam.image_token_id] * (rows * cols)]
                segments.append(([*block, fam.vision_end_token_id], False))

        if turns is None:
            content(meta["text"], True, lambda part: part)
        else:
            bos = getattr(tok, "bos_token_id", None)
            if bos is not None:
                segments.append(([bos], False))
            if turns and turns[0]["role"] in ("system", "developer"):
                self._system(turns[0]["content"], segments, sample)
                turns = turns[1:]
            previous = None
            for i, turn in enumerate(turns):
                role = turn["role"]
                if role == "tool":  # the template writes tool turns only after a tool call
                    raise MediaError(
                        MediaProblem.BAD_TEXT,
                        sample=sample,
                        field=f"json.messages[{i}]",
                        expected="system, user and assistant turns (Gemma 4's template drops a "
                        "'tool' turn that follows no tool call)",
                        actual="a 'tool' turn",
                    )
                reply = role == "assistant"
                if not (reply and previous == "assistant"):  # a reply continues the one before
                    header = ("model" if reply else role) + "\n"
                    segments += [([tok.im_start_id], False), (header, False)]
                content(turn["content"], reply, strip_thinking if reply else str.strip)
                segments += [([tok.im_end_id], reply), ("\n", False)]
                previous = role
        self.check_placeholders(seen, len(grids), sample=sample)
        return segments

    def _system(self, text: str, segments: list, sample) -> None:
        if IMAGE_PLACEHOLDER in text:
            raise MediaError(
                MediaProblem.PLACEHOLDER_MISMATCH,
                sample=sample,
                field="json.messages[0]",
                expected="no image in the system turn (Gemma 4's template writes its text alone)",
                actual="an '<image>'",
            )
        tok = self.tokenizer
        segments += [
            ([tok.im_start_id], False),
            ("system\n" + text.strip(), False),
            ([tok.im_end_id], False),
            ("\n", False),
        ]

    def header_ids(self, raw: dict, size_of=None) -> tuple[np.ndarray, np.ndarray]:
        key = raw.get("__key__", "?")
        self._refuse_videos(raw, key)
        return super().header_ids(raw, size_of)

    def _refuse_videos(self, raw: dict, key) -> None:
        try:
            refuse_videos(raw, sample_metadata(raw, self.text_key, key), key)
        except MediaError as exc:
            raise MediaError(
                MediaProblem.UNPROCESSED_VIDEO,
                sample=key,
                field=exc.field,
                expected="images only: Gemma4SampleTransform has no video rules (transformers' "
                "Gemma 4 video processor needs torchvision)",
                actual=exc.actual,
            ) from None

    def index_key(self) -> str:
        """What a sample's length depends on (an index sidecar's key): the shared fields, the
        soft-token budget and the token ids."""
        tok = self.tokenizer
        return json.dumps(
            {
                "gemma4": {
                    **self.key_fields(),
                    "max_soft_tokens": self.max_soft_tokens,
                    "ids": [
                        tok.im_start_id,
                        tok.im_end_id,
                        tok.vision_start_token_id,
                        tok.vision_end_token_id,
                    ],
                }
            },
            sort_keys=True,
        )

    def __call__(self, raw: dict) -> dict:
        self._refuse_videos(raw, raw.get("__key__", "?"))
        key, images, grids, ids, mask = self.render(raw)
        fam, budget = self.family, self.max_soft_tokens
        patches = budget * fam.spatial_merge_size**2
        if images:
            out = self.image_processor(images=images, return_tensors="pt")
            pixels, positions = out["pixel_values"], out["image_position_ids"].to(torch.int64)
            made = [int(n) for n in out["num_soft_tokens_per_image"]]
        else:
            pixels = torch.zeros(0, patches, 3 * fam.patch_size**2)
            positions, made = torch.zeros(0, patches, 2, dtype=torch.int64), []
        if made != [r * c for r, c in grids]:
            raise MediaError(
                MediaProblem.VISION_TOKEN_MISMATCH,
                sample=key,
                field="images",
                expected=f"soft tokens per image {[r * c for r, c in grids]}",
                actual=f"the image processor's {made}",
            )
        media = {"pixel_values": pixels.to(torch.float32), "image_position_ids": positions}
        return self.output(raw, key, ids, mask, media)
