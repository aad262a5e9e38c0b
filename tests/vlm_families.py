"""Tiny configs and models of every Qwen vision family (random weights, fixed seed, no downloads),
whose special ids are the demo byte tokenizer's, and builders of token sequences with images and
video."""

from __future__ import annotations

import functools

import torch

from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
from tests.consumers.models import (
    INIT,
    seeded_model,
    tiny_qwen_vision_config,
    tiny_text_config,
)

TOK = ByteTokenizer()
FAMILY_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
TIMESTAMPED = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


def tiny_config(model_type: str, *, attn: str = "sdpa", tokens_per_second: int = 2):
    """A 2-layer, hidden-32 config of ``model_type`` (Qwen3.5: full attention on every layer, so
    that the pure-torch path can pack), the demo tokenizer's special ids."""
    import transformers

    text = tiny_text_config(
        TOK.vocab_size,
        head_dim=8,
        bos_token_id=TOK.eos_token_id,
        eos_token_id=TOK.eos_token_id,
        pad_token_id=TOK.pad_token_id,
    )
    vision = tiny_qwen_vision_config(in_channels=3)
    ids = dict(
        image_token_id=TOK.image_token_id,
        video_token_id=TOK.video_token_id,
        vision_start_token_id=TOK.vision_start_token_id,
        vision_end_token_id=TOK.vision_end_token_id,
    )
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    if model_type == "qwen2_vl":
        cls = transformers.Qwen2VLConfig
        text["rope_parameters"] = rope
        vision = {**vision, "embed_dim": 32, "mlp_ratio": 2, "patch_size": 14}
    elif model_type == "qwen2_5_vl":
        cls = transformers.Qwen2_5_VLConfig
        text["rope_parameters"] = rope
        vision = {
            **vision,
            "intermediate_size": 32,
            "out_hidden_size": 32,
            "patch_size": 14,
            "window_size": 56,
            "fullatt_block_indexes": [0],
            "tokens_per_second": tokens_per_second,
        }
    else:
        cls = {
            "qwen3_vl": transformers.Qwen3VLConfig,
            "qwen3_vl_moe": transformers.Qwen3VLMoeConfig,
            "qwen3_5": transformers.Qwen3_5Config,
            "qwen3_5_moe": transformers.Qwen3_5MoeConfig,
        }[model_type]
        text["rope_parameters"] = {**rope, "mrope_interleaved": True}
        vision = {
            **vision,
            "intermediate_size": 32,
            "out_hidden_size": 32,
            "patch_size": 16,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0] if "qwen3_vl" in model_type else [],
        }
        if "moe" in model_type:
            text.update(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=16,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
        if model_type.startswith("qwen3_5"):
            text.update(
                layer_types=["full_attention"] * 2,
                linear_num_value_heads=2,
                linear_num_key_heads=2,
                linear_key_head_dim=8,
                linear_value_head_dim=8,
                linear_conv_kernel_dim=4,
            )
            text["rope_parameters"] = {**text["rope_parameters"], "partial_rotary_factor": 0.5}
    return cls(
        text_config=text,
        vision_config=vision,
        initializer_range=INIT,
        attn_implementation=attn,
        **ids,
    )


@functools.lru_cache(maxsize=None)
def tiny_model(model_type: str, *, attn: str = "sdpa", dtype: torch.dtype = torch.float64):
    """``*ForConditionalGeneration`` of :func:`tiny_config`, seed 0, eval mode."""
    import transformers

    name = {
        "qwen2_vl": "Qwen2VL",
        "qwen2_5_vl": "Qwen2_5_VL",
        "qwen3_vl": "Qwen3VL",
        "qwen3_vl_moe": "Qwen3VLMoe",
        "qwen3_5": "Qwen3_5",
        "qwen3_5_moe": "Qwen3_5Moe",
    }[model_type]
    cls = getattr(transformers, f"{name}ForConditionalGeneration")
    return seeded_model(cls, tiny_config(model_type, attn=attn), dtype)


def vision_sample(model_type: str, segments: list, *, text_id: int = 9) -> dict:
    """Token fields of one sample: ``segments`` are ints (runs of text), ``("image", h, w)`` grids
    and ``("video", t, h, w, seconds)`` grids, written as the family's processor writes them
    (Qwen3-VL / 3.5: each frame group after a 5-token timestamp, inside its own vision
    start/end)."""
    merge = 2
    ids, types, images, videos, seconds = [], [], [], [], []

    def add(tokens, kind=0):
        ids.extend(tokens)
        types.extend([kind] * len(tokens))

    for seg in segments:
        if isinstance(seg, int):
            add([text_id + (k % 200) for k in range(seg)])
        elif seg[0] == "image":
            _, h, w = seg
            add([TOK.vision_start_token_id])
            add([TOK.image_token_id] * (h * w // merge**2), 1)
            add([TOK.vision_end_token_id])
            images.append([1, h, w])
        else:
            _, t, h, w, sec = seg
            add([TOK.vision_start_token_id])
            if model_type in TIMESTAMPED:
                for f in range(t):
                    add([text_id + 20 + f % 7] * 5)  # "<x.y seconds>"
                    add([TOK.vision_start_token_id])
                    add([TOK.video_token_id] * (h * w // merge**2), 2)
                    add([TOK.vision_end_token_id])
            else:
                add([TOK.video_token_id] * (t * h * w // merge**2), 2)
            add([TOK.vision_end_token_id])
            videos.append([t, h, w])
            seconds.append(sec)
    patch = 14 if model_type in ("qwen2_vl", "qwen2_5_vl") else 16
    dim = 3 * 2 * patch * patch
    n_img = sum(t * h * w for t, h, w in images)
    n_vid = sum(t * h * w for t, h, w in videos)
    return {
        "input_ids": torch.tensor(ids, dtype=torch.int64),
        "mm_token_type_ids": torch.tensor(types, dtype=torch.int64),
        "image_grid_thw": torch.tensor(images, dtype=torch.int64).reshape(-1, 3),
        "video_grid_thw": torch.tensor(videos, dtype=torch.int64).reshape(-1, 3),
        "second_per_grid_ts": torch.tensor(seconds, dtype=torch.float32),
        "pixel_values": torch.zeros(n_img, dim),
        "pixel_values_videos": torch.zeros(n_vid, dim),
    }
