"""The interface every Qwen vision family implements: what the transform, the collator and the index
read from a model's Hugging Face config, and the few rules in which the families differ.

===================  =====  ==========  =====================================  =====================
family (model_type)  patch  video time  video runs in the text                 packing metadata
===================  =====  ==========  =====================================  =====================
qwen2_vl             14     step 1      one run per video                      cu_seq_lens
qwen2_5_vl           14     step tps*s  one run per video                      cu_seq_lens
qwen3_vl(_moe)       16     step 1      one run per frame group, each after    cu_seq_lens
                                        ``<t seconds>`` text
qwen3_5(_moe)        16     step 1      as qwen3_vl                            + seq_idx (GDN
                                                                               layers)
===================  =====  ==========  =====================================  =====================

(``tps`` = ``vision_config.tokens_per_second``, ``s`` = the video's ``second_per_grid_ts``.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from prealign.schemas.contract import ModelContract
from prealign.schemas.errors import ConfigError, SampleError

from .grids import VisionGeometry, check_positive_ints, image_grid, video_grid
from .positions import rope_positions

MAX_SECONDS_PER_GRID = 3600.0
"""The largest ``second_per_grid_ts`` accepted (an hour per temporal grid step): finite values in
``[0, MAX_SECONDS_PER_GRID]`` keep every temporal position far inside int64."""


def check_seconds(second_per_grid_ts, videos: int, *, sample=None) -> np.ndarray:
    """``second_per_grid_ts`` (one value per video) -> a float ``[videos]`` array (bf16 / fp16 read
    as float32), after checking its count and that every value is finite and in ``[0,
    MAX_SECONDS_PER_GRID]``; else a :class:`~prealign.schemas.SampleError` naming ``sample`` and the
    field.

    >>> check_seconds(torch.tensor([0.5, 1.0], dtype=torch.bfloat16), 2).tolist()
    [0.5, 1.0]
    """
    if isinstance(second_per_grid_ts, torch.Tensor):
        if second_per_grid_ts.dtype in (torch.bfloat16, torch.float16):
            second_per_grid_ts = second_per_grid_ts.to(torch.float32)
        second_per_grid_ts = second_per_grid_ts.detach().cpu().numpy()
    seconds = np.asarray(second_per_grid_ts).reshape(-1)
    if seconds.shape[0] != videos:
        raise SampleError(
            sample=sample,
            field="second_per_grid_ts",
            expected=f"one value per video ({videos})",
            actual=f"{seconds.shape[0]} values",
        )
    if not np.issubdtype(seconds.dtype, np.floating):
        seconds = seconds.astype(np.float32)
    bad = ~(np.isfinite(seconds) & (seconds >= 0) & (seconds <= MAX_SECONDS_PER_GRID))
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise SampleError(
            sample=sample,
            field=f"second_per_grid_ts[{k}]",
            actual=repr(float(seconds[k])),
            expected=f"finite seconds in [0, {MAX_SECONDS_PER_GRID:g}] (MAX_SECONDS_PER_GRID)",
        )
    return seconds


@dataclass(frozen=True, kw_only=True)
class VisionFamily:
    """One Qwen vision family's constants, read from the model config by :meth:`from_config`.
    Picklable."""

    model_types: ClassVar[tuple[str, ...]] = ()
    """The HF ``model_type`` values this family serves."""

    # ---- the data contract (:mod:`prealign.schemas.contract`): a new family sets what differs
    # ----------------
    position_kind: ClassVar[str] = "mrope"
    """``"1d"`` (``position_ids`` alone, restarting per sequence) or ``"mrope"``
    (``mrope_position_ids`` too)."""
    media_attention: ClassVar[str] = "causal"
    """``"causal"`` (image tokens attend like text) or ``"bidirectional"`` (each image's tokens see
    each other: packing needs a per-token mask, :mod:`prealign.collate.vision.attention`)."""
    transform: ClassVar[str | None] = None
    """The family's own sample transform where ``VLMSampleTransform`` does not write its samples
    (Gemma 3: ``prealign.loaders.media.gemma3.Gemma3SampleTransform``); ``None``:
    ``VLMSampleTransform``."""
    default_system: ClassVar[str | None] = None
    """The system turn the family's chat template writes before a conversation that has none
    (Qwen2-VL / Qwen2.5-VL: ``"You are a helpful assistant."``), which the transform writes too (a
    switch turns it off)."""
    local_attention: ClassVar[str | None] = None
    """``None``, ``"sliding"`` or ``"chunked"``: the text model's local layers (``None`` here: read
    from the config's ``layer_types`` by :meth:`contract`)."""
    volume_resize: ClassVar[bool] = False
    """Video resize bounds the clip's volume (Qwen3-VL) rather than each frame's area (Qwen2-VL)."""
    video_defaults: ClassVar[dict] = {
        "min_pixels": 128 * 28 * 28,
        "max_pixels": 28 * 28 * 768,
        "image_mean": (0.48145466, 0.4578275, 0.40821073),
        "image_std": (0.26862954, 0.26130258, 0.27577711),
    }
    """transformers' video processor defaults (``size`` and normalisation), used when no video
    processor is given (transformers' video processors need torchvision)."""

    model_type: str
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    linear_attention: bool = False
    """The text model has Gated DeltaNet / causal-conv layers (``layer_types`` with
    ``linear_attention``): packed sequences need ``cu_seq_lens_q`` and ``seq_idx`` honoured by the
    fast kernels."""

    @classmethod
    def from_config(cls, config: Any) -> "VisionFamily":
        """The family's constants from a transformers config (or its ``to_dict()``)."""
        get = config_getter(config)
        vision = config_getter(get("vision_config", {}) or {})
        values = dict(
            model_type=get("model_type"),
            image_token_id=get("image_token_id"),
            video_token_id=get("video_token_id"),
            vision_start_token_id=get("vision_start_token_id"),
            vision_end_token_id=get("vision_end_token_id"),
            patch_size=vision("patch_size"),
            spatial_merge_size=vision("spatial_merge_size"),
            temporal_patch_size=vision("temporal_patch_size"),
            linear_attention=has_linear_attention(config),
            **cls._extra(vision),
        )
        missing = [k for k, v in values.items() if v is None]
        if missing:
            raise ConfigError(
                f"{cls.__name__}.from_config: the {values['model_type']} config has no {missing}"
            )
        return cls(**values)

    @classmethod
    def _extra(cls, vision) -> dict:
        return {}

    def __post_init__(self):
        ids = (
            self.image_token_id,
            self.video_token_id,
            self.vision_start_token_id,
            self.vision_end_token_id,
        )
        if len(set(ids)) != 4 or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids
        ):
            raise ConfigError(
                f"{type(self).__name__}: expected four distinct non-negative token ids (image, "
                f"video, vision start, vision end), got {ids}"
            )
        check_positive_ints(self, ("patch_size", "spatial_merge_size", "temporal_patch_size"))

    def contract(self, config: Any = None) -> ModelContract:
        """This family's :class:`~prealign.schemas.contract.ModelContract`: the class declarations,
        the local attention of ``config``'s ``layer_types`` where the class declares none, and
        :attr:`linear_attention`."""
        local = (
            self.local_attention
            if config is None or self.local_attention
            else local_attention(config)
        )
        return ModelContract(
            model=self.model_type,
            position_kind=self.position_kind,
            media_attention=self.media_attention,
            local_attention=local,
            linear_attention=self.linear_attention,
        )

    # ---- grids
    # ------------------------------------------------------------------------------------
    def image_grid(
        self,
        height: int,
        width: int,
        geometry: VisionGeometry,
        *,
        sample=None,
        field: str = "image",
    ) -> tuple[int, int, int]:
        """``image_grid_thw`` row of a ``height x width`` image under the image processor's
        ``geometry``."""
        return image_grid(height, width, geometry, sample=sample, field=field)

    def video_grid(
        self,
        frames: int,
        height: int,
        width: int,
        geometry: VisionGeometry,
        *,
        sample=None,
        field: str = "video",
    ) -> tuple[int, int, int]:
        """``video_grid_thw`` row of ``frames`` frames of ``height x width`` under the video
        processor's ``geometry``."""
        return video_grid(
            frames, height, width, geometry, volume=self.volume_resize, sample=sample, field=field
        )

    # ---- video
    # --------------------------------------------------------------------------------------
    def video_runs(self, video_grid_thw: torch.Tensor) -> np.ndarray:
        """int64 ``[num_video_runs, 3]``: the grid of each run of video tokens, in order (one per
        video)."""
        return np.asarray(video_grid_thw, dtype=np.int64).reshape(-1, 3)

    def video_steps(
        self, video_grid_thw: torch.Tensor, second_per_grid_ts: torch.Tensor | None
    ) -> np.ndarray | None:
        """Float temporal step of each video run (``None``: 1 everywhere)."""
        return None

    def wraps_video(self) -> bool:
        """Whether a video's runs stay inside the chat template's outer ``<|vision_start|>`` ...
        ``<|vision_end|>`` (every Qwen2 processor; Qwen3-VL: depends on the installed transformers,
        :mod:`.qwen3_vl`)."""
        return True

    def frame_texts(self, frames: int, fps: float, frame_indices=None) -> list[str] | None:
        """The text written before each frame group's run of video tokens (``None``: no per-frame
        text)."""
        return None

    # ---- positions
    # ----------------------------------------------------------------------------------
    def positions(
        self,
        mm_token_type_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        *,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        grids_per_sample=None,
    ) -> torch.Tensor:
        """int64 ``[3, T]`` mRoPE positions of ``T`` packed tokens (``cu_seqlens`` int ``[N+1]``),
        equal to the family's transformers ``get_rope_index`` on each sequence
        (:mod:`.positions`)."""
        images = np.zeros((0, 3), np.int64) if image_grid_thw is None else _np(image_grid_thw)
        videos = np.zeros((0, 3), np.int64) if video_grid_thw is None else _np(video_grid_thw)
        out = rope_positions(
            _np(mm_token_type_ids),
            _np(cu_seqlens),
            images,
            self.video_runs(videos),
            self.video_steps(videos, second_per_grid_ts),
            self.spatial_merge_size,
            grids_per_sample=grids_per_sample,
        )
        return torch.from_numpy(out)


def has_linear_attention(model_config: Any) -> bool:
    """Whether a model has Gated DeltaNet / causal-conv layers: a :class:`VisionFamily`'s
    ``linear_attention``, or a transformers config (object or dict; a VLM's ``text_config`` looked
    in first) whose ``layer_types`` hold ``"linear_attention"`` (Qwen3.5, Qwen3.6, Qwen3-Next). The
    one test every caller uses.

    >>> layers = ["linear_attention", "full_attention"]
    >>> has_linear_attention({"text_config": {"layer_types": layers}})
    True
    """
    if isinstance(model_config, VisionFamily):
        return model_config.linear_attention
    get = config_getter(model_config)
    text = config_getter(get("text_config", None) or {})
    return "linear_attention" in (text("layer_types", None) or get("layer_types", None) or ())


def local_attention(model_config: Any) -> str | None:
    """``"chunked"`` / ``"sliding"`` / ``None``: the local layers a transformers config (object or
    dict; a VLM's ``text_config`` looked in first) declares in its ``layer_types`` (Llama 4's
    ``chunked_attention``, Gemma 3's ``sliding_attention``).

    >>> local_attention({"layer_types": ["sliding_attention", "full_attention"]})
    'sliding'
    """
    get = config_getter(model_config)
    text = config_getter(get("text_config", None) or {})
    kinds = set(text("layer_types", None) or get("layer_types", None) or ())
    return (
        "chunked"
        if "chunked_attention" in kinds
        else "sliding"
        if "sliding_attention" in kinds
        else None
    )


def _np(value) -> np.ndarray:
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def config_getter(obj):
    """``get(key, default=None)`` over a config object or its dict (H32b's families read theirs
    through it)."""
    if isinstance(obj, dict):
        return lambda key, default=None: obj.get(key, default)
    return lambda key, default=None: getattr(obj, key, default)
