"""A tiny deterministic byte-level chat tokenizer for the demo and the tests (no hub download).

Ids ``0..7`` are special tokens laid out like Qwen2-VL's (names below), ids ``8..263`` are the 256
UTF-8 bytes (``id = byte + 8``), so ``vocab_size = 264`` and every string round-trips exactly. A
chat message renders as ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` (the Qwen chat template's
shape); an image renders as ``<|vision_start|>`` + ``n`` x ``<|image_pad|>`` + ``<|vision_end|>``.

It is *not* meant for training: it only has to be small, fast, reversible and deterministic so
that token counts in tests and in ``prealign demo`` are reproducible.

>>> tok = ByteTokenizer()
>>> tok.encode("hi").tolist(), tok.decode(tok.encode("héllo"))
([112, 113], 'héllo')
>>> tok.decode([tok.im_start_id, 8 + ord("a"), tok.image_token_id, tok.image_token_id])
'<|im_start|>a<|image_pad|>*2'
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prealign.schemas.vlm import VisionTokens

SPECIAL_TOKENS = (
    "<|pad|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
BYTE_OFFSET = len(SPECIAL_TOKENS)


@dataclass(frozen=True)
class ByteTokenizer:
    """Byte-level tokenizer with Qwen2-VL-like special ids. Picklable, stateless."""

    spatial_merge_size: int = 2

    pad_token_id = 0
    eos_token_id = 1
    im_start_id = 2
    im_end_id = 3
    vision_start_token_id = 4
    vision_end_token_id = 5
    image_token_id = 6
    video_token_id = 7
    vocab_size = BYTE_OFFSET + 256

    @property
    def vision(self) -> VisionTokens:
        return VisionTokens(
            image_token_id=self.image_token_id,
            vision_start_token_id=self.vision_start_token_id,
            vision_end_token_id=self.vision_end_token_id,
            spatial_merge_size=self.spatial_merge_size,
        )

    def encode(self, text: str) -> np.ndarray:
        """str -> int64 ``[num_utf8_bytes]`` (one token per byte, no special tokens)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + BYTE_OFFSET

    def decode(self, ids) -> str:
        """Ids -> text; special tokens by name, runs of ``<|image_pad|>`` shortened to
        ``<|image_pad|>*n``."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out: list[str] = []
        raw = bytearray()
        i = 0
        while i < ids.size:
            t = int(ids[i])
            if t >= BYTE_OFFSET:
                raw.append(t - BYTE_OFFSET)
                i += 1
                continue
            out.append(raw.decode("utf-8", errors="replace"))
            raw.clear()
            j = i
            while j < ids.size and ids[j] == t:
                j += 1
            n = j - i if t in (self.image_token_id, self.video_token_id) else 1
            out.append(SPECIAL_TOKENS[t] + (f"*{n}" if n > 1 else ""))
            i += n
        out.append(raw.decode("utf-8", errors="replace"))
        return "".join(out)
