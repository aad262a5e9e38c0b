"""Tokenizers the VLM transform can use: the :class:`ChatTokenizer` protocol, and
:class:`HFChatTokenizer`, which adapts a Hugging Face tokenizer with Qwen2-VL's special tokens.

The transform only needs: ``encode(text) -> int64 [n]`` (no special tokens added), the ids of
``<|im_start|>`` / ``<|im_end|>`` (chat turns) and of ``<|vision_start|>`` / ``<|image_pad|>`` /
``<|vision_end|>`` (images), the vocabulary size (to bound teacher ids) and the vision-token config.
``pad_token_id`` (what ``vlm_schema(pad_token_id=...)`` pads ``input_ids`` with) and
``eos_token_id`` complete it for the model side. The merge size comes from the image processor the
transform owns (``VLMSampleTransform.spatial_merge_size``), not from the tokenizer.
The demo's :class:`~prealign.loaders.cli.demo_tokenizer.ByteTokenizer` is one; a real tokenizer is
wrapped::

    from transformers import AutoTokenizer tok =
    HFChatTokenizer(AutoTokenizer.from_pretrained("Qwen/Qwen2-VL-2B-Instruct")) transform =
    VLMSampleTransform(tokenizer=tok, topk=64)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from prealign.schemas.errors import ConfigError
from prealign.schemas.vlm import VisionTokens


class ChatTokenizer(Protocol):
    im_start_id: int
    im_end_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    image_token_id: int
    vocab_size: int
    pad_token_id: int
    eos_token_id: int

    @property
    def vision(self) -> VisionTokens: ...

    def encode(self, text: str) -> np.ndarray: ...


@dataclass(frozen=True)
class HFChatTokenizer:
    """A Hugging Face (fast or slow) tokenizer as a :class:`ChatTokenizer`. Picklable when the
    wrapped tokenizer is (HF tokenizers are). Special-token names default to Qwen2-VL's.

    ``pad_token_id``: the tokenizer's pad token, else its eos; ``eos_token_id``: its eos, else
    ``<|im_end|>``.
    """

    tokenizer: Any
    spatial_merge_size: int | None = None
    """Leave unset: :class:`~prealign.loaders.media.vlm.VLMSampleTransform` takes it from its image
    processor (``vision`` alone falls back to Qwen2-VL's 2)."""
    im_start: str | None = "<|im_start|>"
    im_end: str | None = "<|im_end|>"
    """``None`` (both): a family whose chat frame writes its own role tags (GLM's); then
    ``im_start_id`` / ``im_end_id`` are absent and the tokenizer must have an eos token."""
    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"
    image_pad: str = "<|image_pad|>"
    video_pad: str = "<|video_pad|>"
    """Looked up when the tokenizer has it (``video_token_id``); a tokenizer without video tokens is
    fine."""
    _ids: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        names = {
            "im_start_id": self.im_start,
            "im_end_id": self.im_end,
            "vision_start_token_id": self.vision_start,
            "vision_end_token_id": self.vision_end,
            "image_token_id": self.image_pad,
        }
        names = {
            attr: token for attr, token in names.items() if token is not None or attr[:3] != "im_"
        }
        unk = getattr(self.tokenizer, "unk_token_id", None)
        ids = {}
        for attr, token in names.items():
            tid = self.tokenizer.convert_tokens_to_ids(token)
            if tid is None or (tid == unk and token != getattr(self.tokenizer, "unk_token", None)):
                raise ConfigError(
                    f"HFChatTokenizer: the tokenizer has no {token!r} token ({attr}); pass the "
                    f"name this model uses, e.g. HFChatTokenizer(tok, "
                    f"{attr.removesuffix('_id').removesuffix('_token')}=...)"
                )
            ids[attr] = int(tid)
        video = self.tokenizer.convert_tokens_to_ids(self.video_pad)
        if video is not None and video != unk:
            ids["video_token_id"] = int(video)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if bos is not None:  # what a template that opens with bos_token writes first (Gemma 3)
            ids["bos_token_id"] = int(bos)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None and "im_end_id" not in ids:
            raise ConfigError("HFChatTokenizer: the tokenizer has no eos token and im_end=None")
        ids["eos_token_id"] = ids["im_end_id"] if eos is None else int(eos)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        ids["pad_token_id"] = ids["eos_token_id"] if pad is None else int(pad)
        object.__setattr__(self, "_ids", ids)

    def __getattr__(self, name: str):
        ids = self.__dict__.get("_ids", {})
        if name in ids:
            return ids[name]
        raise AttributeError(name)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def vision(self) -> VisionTokens:
        return VisionTokens(
            image_token_id=self.image_token_id,
            vision_start_token_id=self.vision_start_token_id,
            vision_end_token_id=self.vision_end_token_id,
            spatial_merge_size=2 if self.spatial_merge_size is None else self.spatial_merge_size,
        )

    def encode(self, text: str) -> np.ndarray:
        """str -> int64 ``[n]``, without the special tokens a tokenizer may add around a text."""
        return np.asarray(
            self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64
        )


def encode_segments(tokenizer: ChatTokenizer, segments) -> tuple[np.ndarray, np.ndarray]:
    """Chat segments -> (``input_ids`` int64 ``[L]``, ``loss_mask`` float32 ``[L]``), tokenized as a
    chat template's rendered string is: ``segments`` is a sequence of ``(part, trained)``, ``part``
    either text or special-token ids (a list / array, never merged with anything). Consecutive texts
    are joined and encoded together, as the tokenizer sees the text between two special tokens of
    the template's output (so a role header's ``"\\n"`` and a content's leading ``"\\n"`` merge into
    ``"\\n\\n"`` where the tokenizer has it). A token that straddles two texts belongs to the later
    one (its ``trained`` flag): the boundary is where the encoding of the text before it stops being
    a prefix of the joined encoding.

    >>> from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    >>> segments = [([2], False), ("ab", False), ("c", True), ([3], True)]
    >>> ids, mask = encode_segments(ByteTokenizer(), segments)
    >>> ids.tolist()[:1] + ids.tolist()[-1:], mask.tolist()
    ([2, 3], [0.0, 0.0, 0.0, 1.0, 1.0])
    """
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    run: list[tuple[str, bool]] = []

    def flush():
        if not run:
            return
        text = "".join(t for t, _ in run)
        joined = np.asarray(tokenizer.encode(text), dtype=np.int64).reshape(-1)
        mask = np.zeros(joined.shape, dtype=np.float32)
        start, offset = 0, 0
        for part, trained in run:
            offset += len(part)
            end = (
                joined.size
                if offset == len(text)
                else _common_prefix(tokenizer.encode(text[:offset]), joined)
            )
            end = max(end, start)
            mask[start:end] = trained
            start = end
        ids.append(joined)
        masks.append(mask)
        run.clear()

    for part, trained in segments:
        if isinstance(part, str):
            if part:
                run.append((part, bool(trained)))
            continue
        flush()
        special = np.asarray(part, dtype=np.int64).reshape(-1)
        ids.append(special)
        masks.append(np.full(special.shape, bool(trained), dtype=np.float32))
    flush()
    if not ids:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    return np.concatenate(ids), np.concatenate(masks)


def _common_prefix(a, b: np.ndarray) -> int:
    """How many leading ids ``a`` and ``b`` share (a fixed number of NumPy ops)."""
    a = np.asarray(a, dtype=np.int64).reshape(-1)
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
