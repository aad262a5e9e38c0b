"""Qwen2-VL: patch 14, video as one run of ``<|video_pad|>`` tokens, temporal positions step 1."""

from __future__ import annotations

from dataclasses import dataclass

from .family import VisionFamily


@dataclass(frozen=True, kw_only=True)
class Qwen2VL(VisionFamily):
    """``model_type`` ``qwen2_vl``."""

    model_types = ("qwen2_vl",)
    default_system = "You are a helpful assistant."
