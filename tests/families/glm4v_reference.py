"""transformers' own GLM-4.1V pieces built offline: a character-level tokenizer with GLM's media
tokens, its image processor, ``Glm4vProcessor``, and a tiny model. transformers' GLM video processor
needs torchvision (absent here): :class:`FrameGrids` stands in for it with transformers' own GLM
video ``smart_resize`` and class defaults,
so the processor's own ``__call__`` writes the video text (frame groups, timestamps) on every
version."""

from __future__ import annotations

import functools
import types

import torch

from tests.consumers.models import seeded_model, tiny_qwen_vision_config, tiny_text_config
from tests.families.offline import any_video_processor, char_tokenizer, image_processor_class

_USER = (
    "{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
    "{% if c.type == 'video' %}<|begin_of_video|><|video|><|end_of_video|>"
    "{% elif c.type == 'image' %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}"
)
CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}{% if m.role == 'system' %}<|system|>{{ '\\n' }}{{ "
    "m.content }}{% elif m.role == 'user' %}<|user|>{{ '\\n' }}"
    + _USER
    + "{% elif m.role == 'assistant' %}<|assistant|>{{ '\\n' }}{{ m.content }}{% endif %}{% "
    "endfor %}"
)
"""GLM-4.1V's chat frame as its released template renders a conversation (no generation prompt),
written here from its rules (the released template text is not in transformers): ``[gMASK]<sop>``,
each turn its role tag, ``"\\n"`` and the content, no end-of-turn token."""
THINKING_TEMPLATE = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "[gMASK]<sop>{% for m in messages %}{% if m.role == 'system' %}<|system|>{{ '\\n' }}{{ "
    "m.content }}{% elif m.role == 'user' %}<|user|>{{ '\\n' }}"
    + _USER
    + "{% elif m.role == 'assistant' %}<|assistant|>{% set text = m.content %}{% set why = '' %}"
    "{% if m.reasoning_content is string %}{% set why = m.reasoning_content %}"
    "{% elif '</think>' in text %}"
    "{% set why = text.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{% set text = text.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{{ '\\n<think>' }}{% if loop.index0 > ns.last and why %}{{ why.strip() }}{% endif %}{{ "
    "'</think>' }}{% if text.strip() %}{{ '\\n' + text.strip() }}{% endif %}{% endif %}{% endfor %}"
)
"""GLM-4.5V's frame, the same written from its template's rules: an assistant turn is
``<|assistant|>``, a think block (its reasoning only after the last user turn), then ``"\\n"`` + the
content stripped, when not empty."""
SPECIALS = (
    "<unk>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|video|>",
    "<pad>",
)


@functools.lru_cache(maxsize=None)
def hf_tokenizer():
    """One token per character, ``"\n\n"`` one token too (the leading-newline case)."""
    return char_tokenizer(
        SPECIALS,
        ("\n\n",),
        split=r"\n\n|[\s\S]",
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|endoftext|>",
    )


def ids() -> dict:
    tok = hf_tokenizer()
    get = tok.convert_tokens_to_ids
    return dict(
        image_token_id=get("<|image|>"),
        video_token_id=get("<|video|>"),
        image_start_token_id=get("<|begin_of_image|>"),
        image_end_token_id=get("<|end_of_image|>"),
        video_start_token_id=get("<|begin_of_video|>"),
        video_end_token_id=get("<|end_of_video|>"),
    )


class FrameGrids:
    """A stand-in for ``Glm4vVideoProcessor`` (torchvision) over frames already sampled:
    ``video_grid_thw`` from transformers' GLM video ``smart_resize`` with the class defaults,
    ``video_metadata`` with the frames at ``index / fps``; pixels are zeros (the test compares text
    and grids)."""

    def __init__(self, fps: list[float]):
        try:
            from transformers.models.glm4v.video_processing_glm4v import (
                Glm4vVideoProcessor,
                smart_resize,
            )
        except (
            ImportError
        ):  # 5.6: the module imports torchvision; the same resize, the class defaults of its source
            from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize

            Glm4vVideoProcessor = types.SimpleNamespace(
                patch_size=14,
                temporal_patch_size=2,
                merge_size=2,
                size={"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 2 * 30000},
            )
        self.cls, self.resize, self.fps = Glm4vVideoProcessor, smart_resize, fps
        c = self.cls  # the settings prealign's transform reads from a video processor
        self.patch_size, self.merge_size, self.temporal_patch_size, self.size = (
            c.patch_size,
            c.merge_size,
            c.temporal_patch_size,
            c.size,
        )
        self.image_mean, self.image_std, self.rescale_factor = (
            (0.48145466, 0.4578275, 0.40821073),
            (0.26862954, 0.26130258, 0.27577711),
            1 / 255,
        )

    def __call__(self, videos, **kwargs):
        from transformers.video_utils import VideoMetadata

        c = self.cls
        grids, metas = [], []
        for frames, fps in zip(videos, self.fps, strict=True):
            n, (w, h) = len(frames), frames[0].size
            hh, ww = self.resize(
                num_frames=max(n, c.temporal_patch_size),
                height=h,
                width=w,
                temporal_factor=c.temporal_patch_size,
                factor=c.patch_size * c.merge_size,
                min_pixels=c.size["shortest_edge"],
                max_pixels=c.size["longest_edge"],
            )
            grids.append([-(-n // c.temporal_patch_size), hh // c.patch_size, ww // c.patch_size])
            metas.append(VideoMetadata(total_num_frames=n, fps=fps, frames_indices=list(range(n))))
        grid = torch.tensor(grids)
        dim = 3 * c.temporal_patch_size * c.patch_size**2
        return {
            "pixel_values_videos": torch.zeros(int(grid.prod(-1).sum()), dim),
            "video_grid_thw": grid,
            "video_metadata": metas,
        }


def hf_processor(video_fps: list[float] = (), thinking: bool = False):
    """``Glm4vProcessor`` with transformers' GLM image processor and :class:`FrameGrids` for video
    (its class check of that argument skipped)."""
    from transformers import Glm4vProcessor

    with any_video_processor():
        return Glm4vProcessor(
            image_processor=image_processor_class("Glm4v")(),
            tokenizer=hf_tokenizer(),
            video_processor=FrameGrids(list(video_fps)),
            chat_template=THINKING_TEMPLATE if thinking else CHAT_TEMPLATE,
        )


def tiny_config(model_type: str = "glm4v"):
    """A 2-layer, hidden-32 GLM-4.1V (or GLM-4.5V MoE) with a 1-block vision tower; ids of
    :func:`hf_tokenizer`."""
    import transformers

    tok = hf_tokenizer()
    text = tiny_text_config(
        len(tok),
        head_dim=8,
        max_position_embeddings=8192,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [1, 1, 2],
            "partial_rotary_factor": 1.0,
        },
    )
    if model_type == "glm4v_moe":
        text.update(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        )
    vision = tiny_qwen_vision_config(
        intermediate_size=32, out_hidden_size=32, patch_size=14, image_size=112
    )
    cls = transformers.Glm4vConfig if model_type == "glm4v" else transformers.Glm4vMoeConfig
    cfg = cls(text_config=text, vision_config=vision, attn_implementation="sdpa", **ids())
    if model_type == "glm4v_moe":  # float64: the per-expert loop (grouped_mm takes no double)
        cfg.text_config._experts_implementation = "eager"
    return cfg


@functools.lru_cache(maxsize=None)
def tiny_model(model_type: str = "glm4v"):
    import transformers

    cls = (
        transformers.Glm4vForConditionalGeneration
        if model_type == "glm4v"
        else transformers.Glm4vMoeForConditionalGeneration
    )
    return seeded_model(cls, tiny_config(model_type))
