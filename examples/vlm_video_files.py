"""Video files (mp4) in webdataset shards, for Qwen3-VL: written, indexed from their headers, and
trained on.

    {"json": chat with <video>, "clip.mp4": {"frames": uint8 [T, H, W, 3], "fps": 24}}
        ──ShardWriter(transform=...)──► shards (H.264 mp4 members, PyAV)
                                        + sidecars (lengths from the mp4 headers: no frame decoded)
        ──PackedLoader(WebDatasetSource(...,
                       transform=VLMSampleTransform(model_config=Qwen3-VL)))──► batches
          (each clip sampled at 2 fps as Qwen3-VL's video processor samples it, only those frames
           decoded, `<t seconds>` text from their source timestamps, mRoPE positions)
        ──to_hf_kwargs──► a tiny Qwen3-VL (random weights) forward + backward: the loss is finite

Everything is built in memory (a word-level tokenizer with Qwen's special tokens, a 2-layer Qwen3-VL
config): no download. With a real checkpoint, pass its tokenizer
(``HFChatTokenizer(AutoTokenizer...)``), its config and its ``video_preprocessor_config.json`` as
``video_processor_config=``. Run:

    python examples/vlm_video_files.py
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
    "<|video_pad|>",
]
WORDS = [
    "user",
    "assistant",
    "\n",
    " ",
    "what",
    "happens",
    "?",
    "a",
    "ball",
    "rolls",
    "right",
    ".",
    "<",
    ">",
    "seconds",
    *[str(d) for d in range(10)],
]


def local_tokenizer():
    """A word-level tokenizer with Qwen's special tokens (stands in for
    AutoTokenizer.from_pretrained)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(SPECIALS + WORDS)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n|[.?<>]|\d| +"), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=SPECIALS[2:],
    )


def qwen3_vl_config(tokenizer):
    """A 2-layer Qwen3-VL config with the tokenizer's special ids (stands in for
    AutoConfig.from_pretrained)."""
    from transformers import Qwen3VLConfig

    ids = tokenizer.convert_tokens_to_ids
    return Qwen3VLConfig(
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
            "pad_token_id": ids("<pad>"),
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 32,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "deepstack_visual_indexes": [0],
            "num_position_embeddings": 64,
        },
    )


def clip(frames: int, w: int, h: int, seed: int) -> np.ndarray:
    """uint8 ``[frames, h, w, 3]``: a bright square moving right over a gradient."""
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // w, y * 255 // h, np.full_like(x, 40 * seed % 255)], -1).astype(
        np.uint8
    )
    out = np.repeat(base[None], frames, axis=0)
    for t in range(frames):
        x0 = (t * 3) % max(w - 12, 1)
        out[t, h // 3 : h // 3 + 12, x0 : x0 + 12] = 255
    return out


def main() -> dict:
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from prealign.collate import to_hf_kwargs
    from prealign.loaders.media import video_file

    hf_tokenizer = local_tokenizer()
    tokenizer = HFChatTokenizer(hf_tokenizer)
    config = qwen3_vl_config(hf_tokenizer)
    video_settings = {
        "size": {"shortest_edge": 4096, "longest_edge": 64 * 32 * 32},
        "fps": 2,
    }  # the checkpoint's
    transform = VLMSampleTransform(
        tokenizer=tokenizer, model_config=config, video_processor_config=video_settings
    )
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        decoded_before = video_file.DECODE_COUNT[0]
        with ShardWriter(
            os.path.join(folder, "clips-%04d.tar"), max_bytes=256 << 10, transform=transform
        ) as writer:
            for i in range(12):
                frames = int(rng.integers(10, 60))
                chat = {
                    "messages": [
                        {"role": "user", "content": "<video>\nwhat happens?"},
                        {"role": "assistant", "content": "a ball rolls right."},
                    ]
                }
                writer.write(
                    {
                        "__key__": f"clip{i:04d}",
                        "json": chat,
                        "clip.mp4": {"frames": clip(frames, 96, 64, i), "fps": 24.0},
                    }
                )
        assert (
            video_file.DECODE_COUNT[0] == decoded_before
        )  # the sidecars came from the mp4 headers alone
        layout = ParallelLayout(tp=1, cp=1)
        schema = vlm_schema(pad_token_id=tokenizer.pad_token_id, vocab_size=tokenizer.vocab_size)
        source = WebDatasetSource(writer.shards, transform=transform, image="bytes")
        loader = PackedLoader(
            source, schema=schema, layout=layout, token_budget=256, cp_rank=None, seed=0
        )
        torch.manual_seed(0)
        model = Qwen3VLForConditionalGeneration(config).train()
        videos = samples = 0
        losses = []
        for batch in loader:
            problems = validate_vlm_batch(batch, schema, layout, raise_on_error=False)
            assert not problems, problems
            videos += int(batch["video_grid_thw"].shape[0])
            samples += len(batch["sample_index"])
            loss = model(**to_hf_kwargs(batch, model_config=config)).loss
            loss.backward()
            losses.append(float(loss.detach()))
        first = batch
    assert samples == 12 and videos == 12 and all(np.isfinite(losses))
    return {
        "samples": samples,
        "videos": videos,
        "losses": [round(v, 3) for v in losses],
        "frames decoded": video_file.DECODE_COUNT[0] - decoded_before,
        "last batch": {k: tuple(v.shape) for k, v in first.items() if hasattr(v, "shape")},
    }


if __name__ == "__main__":
    for key, value in main().items():
        print(f"{key}: {value}")
