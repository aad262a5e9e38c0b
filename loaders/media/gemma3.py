"""One Gemma 3 sample, raw -> model-ready (:class:`Gemma3SampleTransform`), as transformers'
``Gemma3Processor`` and the Gemma 3 chat template write it: every image resized to the vision
tower's square (pan-and-scan off), written as ``"\\n\\n<start_of_image>" + <image_soft_token> x
mm_tokens_per_image + "<end_of_image>\\n\\n"``.

    raw sample (as VLMSampleTransform's)        Gemma3SampleTransform(raw)
    json   {"messages": [...], "images": [...]} input_ids          int64   [L]
    0.jpg  JPEG bytes                    ---->  loss_mask          float32 [L]  1 on model replies
                                                                                + <end_of_turn>
                                                mm_token_type_ids  int64   [L]  1 on image tokens
                                                pixel_values       float32 [num_images, 3, S, S]

The chat template (rendered here, tokenized as its string is:
:func:`~.chat_tokenizer.encode_segments`): ``<bos>``, then per turn ``<start_of_turn>{role}\\n``
(``assistant`` written ``model``), the content trimmed (each text piece around an image trimmed, an
image written ``<start_of_image>``), ``<end_of_turn>\\n``; a first ``system`` turn is no turn of its
own but its text + ``"\\n\\n"`` opens the first user turn. The length depends on the text and the
number of images alone (:meth:`Gemma3SampleTransform.header_ids`), never on image sizes. Positions
are 1-D (the collator's ``position_ids``); packed rows need the per-token masks
``to_hf_kwargs(attention="mask", model_config=...)`` emits (:mod:`prealign.collate.vision.gemma3`).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from prealign.collate.vision import Gemma3
from prealign.loaders.media.chat_tokenizer import encode_segments
from prealign.loaders.media.sized_images import FamilyTransform, SizedImagesTransform
from prealign.loaders.media.vlm import (
    IMAGE_PLACEHOLDER,
    MediaError,
    MediaProblem,
    chat_turns,
    check_float_dtypes,
    check_turn,
    decode_images,
    image_members,
    sample_metadata,
)
from prealign.schemas.errors import ConfigError

GEMMA3_TOKENS = {
    "im_start": "<start_of_turn>",
    "im_end": "<end_of_turn>",
    "vision_start": "<start_of_image>",
    "vision_end": "<end_of_image>",
    "image_pad": "<image_soft_token>",
}
""":class:`HFChatTokenizer` names of Gemma 3's special tokens: ``HFChatTokenizer(tok,
**GEMMA3_TOKENS)``."""
_SPLIT = re.compile("(" + re.escape(IMAGE_PLACEHOLDER) + ")")


@functools.lru_cache(maxsize=4)
def gemma3_image_processor(image_size: int):
    """transformers' Gemma 3 image processor (PIL backend where the installed transformers has one),
    resizing to ``image_size`` square, pan-and-scan off. Built locally; cached per process."""
    try:
        from transformers import Gemma3ImageProcessorPil as cls
    except ImportError:  # older transformers: the PIL / NumPy one is Gemma3ImageProcessor
        from transformers import Gemma3ImageProcessor as cls
    return cls(size={"height": image_size, "width": image_size}, do_pan_and_scan=False)


@dataclass(frozen=True, kw_only=True)
class Gemma3SampleTransform(FamilyTransform):
    """Raw multimodal sample -> Gemma 3 fields (module docstring). ``model_config``: the
    ``Gemma3Config`` (or its dict); ``tokenizer``: the model's HF tokenizer (wrapped with
    :data:`GEMMA3_TOKENS`) or a :class:`~prealign.loaders.media.chat_tokenizer.ChatTokenizer` with
    those ids; ``processor``: the model's processor or image processor (default
    :func:`gemma3_image_processor`). The other settings are
    :class:`~prealign.loaders.media.sized_images.FamilyTransform`'. Picklable."""

    family: Gemma3 = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self):
        fam = self.checked_family(Gemma3, "gemma3")
        self.set_family(fam, GEMMA3_TOKENS)
        tok = self.tokenizer
        ours = (fam.image_token_id, fam.vision_start_token_id, fam.vision_end_token_id)
        theirs = (tok.image_token_id, tok.vision_start_token_id, tok.vision_end_token_id)
        if ours != theirs:
            raise ConfigError(
                f"Gemma3SampleTransform: the config's (image, start, end) ids {ours} differ from "
                f"the tokenizer's {theirs}"
            )
        if getattr(self.image_processor, "do_pan_and_scan", None):
            raise ConfigError(
                "Gemma3SampleTransform: pan-and-scan crops are not supported "
                "(do_pan_and_scan=True); turn it off"
            )
        check_float_dtypes(self)

    @property
    def image_processor(self):
        if self.processor is not None:
            return getattr(self.processor, "image_processor", self.processor)
        return gemma3_image_processor(self.family.image_size)

    def segments(self, meta: dict, images: int, *, sample) -> list[tuple]:
        """The rendered chat as :func:`encode_segments` parts, ``images`` images expected in the
        text."""
        tok, fam = self.tokenizer, self.family
        turns = chat_turns(meta, sample)
        block = [
            fam.vision_start_token_id,
            *[fam.image_token_id] * fam.mm_tokens_per_image,
            fam.vision_end_token_id,
        ]
        segments: list[tuple] = []
        seen = 0

        def content(text: str, trained: bool, trim: bool):
            nonlocal seen
            for part in _SPLIT.split(text):
                if part == IMAGE_PLACEHOLDER:
                    seen += 1
                    segments.extend((("\n\n", False), (block, False), ("\n\n", False)))
                elif part.strip() if trim else part:
                    segments.append((part.strip() if trim else part, trained))

        bos = getattr(tok, "bos_token_id", None)
        if bos is not None and turns is not None:
            segments.append(([bos], False))
        if turns is None:
            content(meta["text"], True, trim=False)
        else:
            prefix = ""
            for i, turn in enumerate(turns):
                check_turn(turn, i, sample)
                if i == 0 and turn["role"] == "system":
                    prefix = turn["content"] + "\n\n"
                    if IMAGE_PLACEHOLDER in prefix:
                        raise MediaError(
                            MediaProblem.PLACEHOLDER_MISMATCH,
                            sample=sample,
                            field="json.messages[0]",
                            expected="no image in the system turn (Gemma 3's template writes its "
                            "text)",
                            actual="an '<image>'",
                        )
                    continue
                reply = turn["role"] == "assistant"
                segments += [
                    ([tok.im_start_id], False),
                    (("model" if reply else turn["role"]) + "\n", False),
                ]
                if prefix:
                    segments.append((prefix, False))
                    prefix = ""
                content(turn["content"], reply, trim=True)
                segments += [([tok.im_end_id], reply), ("\n", False)]
        SizedImagesTransform.check_placeholders(seen, images, sample=sample)
        return segments

    def index_key(self) -> str:
        """What a sample's length depends on (an index sidecar's key): the tokenizer (ids and a
        probe encoding), the family's image block, teacher K."""
        tok, fam = self.tokenizer, self.family
        probe = np.asarray(tok.encode("prealign probe:\n\n <image> Hello, world!")).tolist()
        return json.dumps(
            {
                "gemma3": {
                    "tokenizer": f"{type(tok).__module__}.{type(tok).__qualname__}",
                    "vocab_size": int(tok.vocab_size),
                    "probe": probe,
                    "family": repr(fam),
                    "bos": getattr(tok, "bos_token_id", None),
                    "turn": [tok.im_start_id, tok.im_end_id],
                    "topk": self.topk,
                    "text_key": self.text_key,
                }
            },
            sort_keys=True,
        )

    def header_ids(self, raw: dict) -> tuple[np.ndarray, np.ndarray]:
        """(``input_ids``, ``loss_mask``) without decoding an image: the number of images is all the
        length depends on (what an index pass needs)."""
        key = raw.get("__key__", "?")
        meta = sample_metadata(raw, self.text_key, key)
        return encode_segments(
            self.tokenizer, self.segments(meta, len(image_members(raw, meta, key)), sample=key)
        )

    def __call__(self, raw: dict) -> dict:
        key = raw.get("__key__", "?")
        meta = sample_metadata(raw, self.text_key, key)
        images = decode_images(raw, meta, key, self.limits)
        ids, mask = encode_segments(self.tokenizer, self.segments(meta, len(images), sample=key))
        size = self.family.image_size
        if images:
            pixels = self.image_processor(images=images, return_tensors="pt")["pixel_values"].to(
                torch.float32
            )
        else:
            pixels = torch.zeros(0, 3, size, size)
        return self.output(raw, key, ids, mask, {"pixel_values": pixels})
