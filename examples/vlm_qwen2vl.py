"""A VLM (Qwen2-VL): chat + images to packed batches with pixel values, image grids and mRoPE
positions.

    {"json": chat with <image>, "0.png": image} ──ShardWriter(transform=...)──► shards + sidecars
        ──PackedLoader(WebDatasetSource(..., transform=VLMSampleTransform(tokenizer)),
                       vlm_schema)──► batches

The tokenizer is your Hugging Face tokenizer wrapped by ``HFChatTokenizer`` (Qwen2-VL's special
tokens); here a word-level one is built in memory so the example needs no download. The image
processor is transformers' Qwen2-VL one with its defaults (``processor_options={...}`` overrides
them). Run:

    python examples/vlm_qwen2vl.py
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from prealign.loaders import (
    HFChatTokenizer,
    PackedLoader,
    ShardWriter,
    VLMSampleTransform,
    WebDatasetSource,
)
from prealign.schemas import ParallelLayout, validate_vlm_batch, vlm_schema

SPECIALS = [
    "<pad>",
    "<unk>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
]
WORDS = [
    "user",
    "assistant",
    "\n",
    " ",
    "what",
    "is",
    "in",
    "the",
    "picture",
    "?",
    "a",
    "red",
    "square",
    ".",
]


def local_tokenizer():
    """A word-level tokenizer with Qwen2-VL's special tokens (stands in for
    AutoTokenizer.from_pretrained)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(SPECIALS + WORDS)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n|[.?]| +"), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=SPECIALS[2:],
    )


def main() -> dict:
    from PIL import Image

    tokenizer = HFChatTokenizer(local_tokenizer())
    transform = VLMSampleTransform(
        tokenizer=tokenizer, processor_options={"max_pixels": 128 * 28 * 28}
    )
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        with ShardWriter(
            os.path.join(folder, "vlm-%04d.tar"), max_bytes=256 << 10, transform=transform
        ) as writer:
            for i in range(24):
                images = {
                    f"{j}.png": Image.fromarray(
                        rng.integers(
                            0,
                            255,
                            (int(rng.integers(40, 200)), int(rng.integers(40, 200)), 3),
                            dtype=np.uint8,
                        )
                    )
                    for j in range(i % 3)
                }
                chat = {
                    "messages": [
                        {
                            "role": "user",
                            "content": "<image>\n" * len(images) + "what is in the picture?",
                        },
                        {"role": "assistant", "content": "a red square."},
                    ],
                    "images": sorted(images),
                }
                writer.write({"__key__": f"chat{i:04d}", "json": chat, **images})
        layout = ParallelLayout(tp=2, cp=2)
        schema = vlm_schema(pad_token_id=tokenizer.pad_token_id, vocab_size=tokenizer.vocab_size)
        source = WebDatasetSource(writer.shards, transform=transform, image="bytes")
        loaders = [
            PackedLoader(source, schema=schema, layout=layout, token_budget=2048, cp_rank=r, seed=0)
            for r in range(layout.cp)
        ]
        images = samples = 0
        first = None
        for per_rank in zip(*loaders):
            for batch in per_rank:
                problems = validate_vlm_batch(batch, schema, layout, raise_on_error=False)
                assert not problems, problems
            images += int(
                per_rank[0]["image_grid_thw"].shape[0]
            )  # media are never CP-sharded: each rank has all
            samples += len(per_rank[0]["sample_index"])
            first = per_rank[0] if first is None else first
    assert samples == 24 and images == sum(i % 3 for i in range(24))
    return {
        "samples": samples,
        "images": images,
        "CP rank 0, first batch": {
            k: tuple(v.shape) for k, v in first.items() if hasattr(v, "shape")
        },
    }


if __name__ == "__main__":
    for key, value in main().items():
        print(f"{key}: {value}")
