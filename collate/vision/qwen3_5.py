"""Qwen3.5 (and its MoE, e.g. Qwen3.6-35B-A3B): Qwen3-VL's vision and video text; a text model
mixing Gated DeltaNet (``linear_attention``) layers with full attention, which see sequence
boundaries only through ``cu_seq_lens_q`` (the chunked delta rule) and ``seq_idx`` (the causal
conv)."""

from __future__ import annotations

from dataclasses import dataclass

from .qwen3_vl import Qwen3VL


@dataclass(frozen=True, kw_only=True)
class Qwen3_5(Qwen3VL):
    """``model_type`` ``qwen3_5`` / ``qwen3_5_moe``."""

    model_types = ("qwen3_5", "qwen3_5_moe")
