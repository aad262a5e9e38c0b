"""Unsharded THD batch -> the keyword arguments of a Hugging Face ``transformers`` model forward.

A prealign THD batch is one ``[1, T]`` row of sequences, each padded to ``P_i`` slots (its ``L_i``
tokens first, then pads). HF models see the packing in one of three ways (:class:`HFAttention`):

=============  ================================================================  ===================
attention      what tells the model where sequences start                        implementations
=============  ================================================================  ===================
``VARLEN``     ``cu_seq_lens_q/k`` (padded offsets) + ``max_length_q/k``         flash_attention_2/3
``POSITIONS``  ``position_ids`` restarting at 0 (transformers >= 4.5x finds the  eager, sdpa, flex
               packing itself when ``attention_mask=None``)
``MASK``       a 4-D block-diagonal causal mask (:func:`block_causal_mask`)      eager, sdpa
=============  ================================================================  ===================

Every mode passes ``position_ids`` (a VLM batch: ``[4, 1, T]``, the per-sequence text positions
stacked on the three mRoPE rows, as every transformers Qwen VL forward reads packed positions) and
``labels`` in the HF convention (aligned with the tokens, the model shifts them): the batch's own
next-token ``labels`` moved one slot right, ``-100`` where ``loss_mask`` is 0, so the model's own
shift gives back exactly the batch's labels and no label crosses a sequence boundary. HF losses are
unweighted: a token is trained where ``loss_mask > 0``.

>>> from prealign.collate import THDCollator
>>> from prealign.schemas import ParallelLayout, causal_lm_schema
>>> b = THDCollator(schema=causal_lm_schema(), layout=ParallelLayout(tp=4))(
...     [{"input_ids": torch.tensor([5, 6, 7])}, {"input_ids": torch.tensor([8, 9])}])
>>> kw = to_hf_kwargs(b)
>>> kw["input_ids"].tolist(), kw["position_ids"].tolist(), kw["labels"].tolist()
([[5, 6, 7, 8, 9, 0, 0, 0]], [[0, 1, 2, 0, 1, 2, 3, 4]], [[-100, 6, 7, -100, 9, -100, -100, -100]])
>>> kw["cu_seq_lens_q"].tolist(), kw["max_length_q"]
([0, 3, 8], 5)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from prealign.schemas.contract import GDN_MIN_TRANSFORMERS, hf_linear_attention_gap
from prealign.schemas.errors import ConfigError, PackingUnsupportedError, SampleError
from prealign.schemas.schema import IGNORE_INDEX

from .indices import num_sequences
from .vision.attention import TokenMaskIndex, layer_masks
from .vision.contract import model_contract
from .vision.family import VisionFamily, config_getter, has_linear_attention
from .vision.mistral3 import hf_pixel_values, is_pixtral


class HFAttention(enum.Enum):
    """How the HF model is told where the packed sequences start (module docstring)."""

    VARLEN = "varlen"
    POSITIONS = "positions"
    MASK = "mask"


def block_causal_mask(
    cu_seqlens_padded: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.bool,
) -> torch.Tensor:
    """Block-diagonal causal attention mask of a packed row, ``[1, 1, T, T]`` (``T =
    cu_seqlens_padded[-1]``).

    Query ``q`` may attend key ``k`` when both lie in the same padded sequence and ``k <= q``. With
    the true offsets ``cu_seqlens`` also given, pad keys are masked for every query but the pad
    itself (a row with no key at all would turn into NaN in sdpa and poison later layers through ``0
    * NaN``).

    ``dtype=torch.bool``: True where attention is allowed (sdpa's convention). A floating dtype
    gives the additive mask eager attention adds to its scores: 0 where allowed,
    ``finfo(dtype).min`` elsewhere. Vectorised: a fixed number of tensor ops, ``O(T^2)`` memory
    (meant for eager / sdpa on short rows).

    >>> block_causal_mask(torch.tensor([0, 2, 5]), torch.tensor([0, 2, 4]))[0, 0].int().tolist()
    [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    """
    padded = cu_seqlens_padded.to(torch.int64).reshape(-1)
    total = int(padded[-1])
    slots = torch.arange(total)
    seq = torch.searchsorted(padded, slots, right=True) - 1  # which sequence each slot belongs to
    allowed = (seq[:, None] == seq[None, :]) & (slots[None, :] <= slots[:, None])
    if cu_seqlens is not None:
        true = cu_seqlens.to(torch.int64).reshape(-1)
        if true.shape != padded.shape:
            raise ConfigError(
                f"block_causal_mask: cu_seqlens {tuple(true.shape)} and cu_seqlens_padded "
                f"{tuple(padded.shape)} must have the same shape [N+1]"
            )
        real = (slots - padded[seq]) < true.diff()[seq]
        allowed &= real[None, :] | torch.eye(total, dtype=torch.bool)
    allowed = allowed[None, None]
    if dtype == torch.bool:
        return allowed
    if not dtype.is_floating_point:
        raise ConfigError(
            f"block_causal_mask: dtype must be torch.bool or a floating dtype, got {dtype}"
        )
    return torch.zeros((), dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def hf_labels(batch: dict, *, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The batch's next-token ``labels`` ``[1, T]`` (Megatron convention, already shifted) -> HF's
    (aligned with the tokens; the model shifts): one slot right, ``ignore_index`` where
    ``loss_mask`` is 0 (when the batch has one) and at slot 0. int64 ``[1, T]``."""
    labels = batch["labels"]
    if "loss_mask" in batch:
        labels = labels.masked_fill(batch["loss_mask"] <= 0, ignore_index)
    return torch.cat((torch.full_like(labels[..., :1], ignore_index), labels[..., :-1]), dim=-1)


def packed_seq_idx(cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """int32 ``[1, T]``: the index of the padded sequence each slot of a THD row belongs to (its
    pads included), what ``causal_conv1d_fn(..., seq_idx=...)`` reads to restart the convolution at
    every sequence.

    >>> packed_seq_idx(torch.tensor([0, 2, 5])).tolist()
    [[0, 0, 1, 1, 1]]
    """
    padded = cu_seqlens_padded.to(torch.int64).reshape(-1)
    slots = torch.arange(int(padded[-1]), device=padded.device)
    return torch.searchsorted(padded[1:], slots, right=True).to(torch.int32)[None]


def check_gdn_packing(model_config: Any, sequences: int) -> None:
    """Refuse a packed row (``sequences > 1``) for a model with linear-attention layers unless
    transformers hands the packing on to the fast kernels and both are importable: else the torch
    fallback would let each sequence's recurrent and convolution state leak into the next, silently.
    Raises :class:`PackingUnsupportedError`."""
    if sequences <= 1 or not has_linear_attention(model_config):
        return
    import transformers

    why = hf_linear_attention_gap(transformers.__version__)
    if why:
        raise PackingUnsupportedError(
            f"to_hf_kwargs: the model has Gated DeltaNet (linear_attention) layers and the batch "
            f"packs {sequences} "
            f"sequences, but {why}: its pure-torch path would run each sequence's state into the "
            f"next. Install "
            "flash-linear-attention and causal-conv1d (GPU) with transformers >= "
            f"{'.'.join(map(str, GDN_MIN_TRANSFORMERS))}, or give one sequence per row."
        )


def to_hf_kwargs(
    batch: dict,
    *,
    attention: HFAttention | str = HFAttention.VARLEN,
    mask_dtype: torch.dtype = torch.float32,
    labels: bool = True,
    ignore_index: int = IGNORE_INDEX,
    model_config: Any = None,
) -> dict:
    """Keyword arguments for ``model(**kwargs)`` of a Hugging Face causal LM (or Qwen2-VL) from an
    unsharded :class:`~prealign.collate.THDCollator` batch (``cp_rank=None``).

    Returns ``input_ids`` int64 ``[1, T]``, ``position_ids`` int64 ``[1, T]`` (``[4, 1, T]`` when
    the batch has ``mrope_position_ids``), ``labels`` int64 ``[1, T]`` (HF convention, see
    :func:`hf_labels`; left out with ``labels=False``), ``use_cache=False``, the media fields
    (``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``) when present, and per
    ``attention``: ``VARLEN``: ``cu_seq_lens_q/k`` int32 ``[N+1]`` (padded offsets: each padded
    sequence is one varlen segment, its pads at its end, so no real token sees them) and
    ``max_length_q/k`` (int); ``POSITIONS``: nothing more (``attention_mask`` stays None); ``MASK``:
    ``attention_mask`` ``[1, 1, T, T]`` from :func:`block_causal_mask` in ``mask_dtype`` (floating
    for eager, bool or floating for sdpa).

    Video: ``pixel_values_videos``, ``video_grid_thw`` and ``second_per_grid_ts`` when the batch has
    videos. LLaVA-OneVision: ``pixel_values`` tiles with ``image_sizes`` and ``batch_num_images``
    (images per sample), ``pixel_values_videos`` ``[videos, frames, 3, s, s]``
    (:func:`onevision_videos`). Mistral3 / Pixtral (``model_config`` theirs): ``pixel_values``
    rebuilt from patches + ``image_sizes`` as the zero-padded ``[images, 3, H_max, W_max]`` the
    model takes, and ``image_sizes``; SmolVLM / Idefics3 (a batch with ``image_rows_cols``):
    ``pixel_values`` as ``[1, tiles, 3, S, S]``. ``model_config`` (the model's transformers config,
    its dict or a :class:`~prealign.collate.vision.VisionFamily`): for a model with linear-attention
    layers (:func:`~prealign.collate.vision.has_linear_attention`), ``seq_idx`` int32 ``[1, T]``
    (each slot's padded sequence) is added, and ``cu_seq_lens_q/k`` + ``max_length_q/k`` in
    **every** mode: transformers' Gated DeltaNet hands ``cu_seq_lens_q`` to the chunked kernel
    whatever the attention implementation (without it the whole row is one recurrence), while eager
    / sdpa attention ignore those keys and flash attention reads the same padded segments the
    positions give. A packed row is refused with :class:`PackingUnsupportedError` where the kernels
    that honour them are missing (:func:`check_gdn_packing`).
    """
    attention = HFAttention(attention)
    if batch.get("cp_rank", -1) != -1 or "cp_gather_index" in batch:
        raise ConfigError(
            "to_hf_kwargs: expected an unsharded THD batch (THDCollator(..., cp_rank=None)); "
            f"got CP rank {batch.get('cp_rank')} of {batch.get('cp_size')}: a Hugging Face forward "
            "needs whole sequences"
        )
    ids = batch["input_ids"]
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise SampleError(
            sample=None,
            field="input_ids",
            expected="a THD batch [1, T]",
            actual=f"shape {tuple(ids.shape)}",
        )
    padded = batch["cu_seqlens_padded"]
    out = {"input_ids": ids, "position_ids": batch["position_ids"], "use_cache": False}
    if "mrope_position_ids" in batch:  # [3, 1, T]: transformers' packed layout is [text; t; h; w]
        out["position_ids"] = torch.cat(
            (batch["position_ids"][None], batch["mrope_position_ids"]), dim=0
        )
    if labels:
        out["labels"] = hf_labels(batch, ignore_index=ignore_index)
    media = (
        ("pixel_values", "image_grid_thw")
        if batch.get("image_grid_thw", torch.zeros(1)).shape[0]
        else ()
    )
    if "image_grid_thw" not in batch and batch.get("image_num_patches", torch.zeros(0)).shape[0]:
        media = ("pixel_values",)  # InternVL: tiles [n, 3, s, s], no grids
    if (
        "image_sizes" in batch
    ):  # LLaVA-OneVision: tiles, sizes, images per sample (no image: none of them)
        media = (
            ("pixel_values", "image_sizes", "batch_num_images")
            if batch["image_sizes"].shape[0]
            else ()
        )
    if batch.get("image_position_ids", torch.zeros(0)).shape[0]:  # Gemma 4: padded patches
        media = ("pixel_values", "image_position_ids")
    if batch.get("video_grid_thw", torch.zeros(0)).shape[0]:
        media += ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
    for name in (*media, "mm_token_type_ids"):  # a batch without images sends no empty pixel_values
        if name in batch:
            out[name] = batch[name]
    frames = batch.get("video_num_frames")
    if frames is not None and frames.shape[0]:  # LLaVA-OneVision: [videos, frames, 3, s, s]
        out["pixel_values_videos"] = onevision_videos(batch["pixel_values_videos"], frames)
    if (
        model_config is not None
        and batch.get("image_sizes", torch.zeros(0)).shape[0]
        and is_pixtral(model_config)
    ):
        out["pixel_values"] = hf_pixel_values(batch["pixel_values"], batch["image_sizes"])
        out["image_sizes"] = batch["image_sizes"]
    if batch.get("image_rows_cols", torch.zeros(0)).shape[
        0
    ]:  # SmolVLM / Idefics3: tiles [1, n, 3, S, S]
        out["pixel_values"] = batch["pixel_values"][None]
    linear = model_config is not None and has_linear_attention(model_config)
    if linear:
        check_gdn_packing(
            model_config, num_sequences(padded)
        )  # (static shapes repeat the total past them)
        out["seq_idx"] = packed_seq_idx(padded)
    if (
        attention is HFAttention.VARLEN or linear
    ):  # GDN layers read cu_seq_lens_q whatever the attention mode
        cu = padded.to(torch.int32)
        out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = cu
        out["max_length_q"] = out["max_length_k"] = int(batch["max_seqlen"].reshape(-1)[0])
    contract = None if model_config is None else model_contract(model_config)
    if (
        contract is not None
        and (contract.needs_token_mask or contract.local_attention)
        and (attention is HFAttention.MASK or num_sequences(padded) > 1)
    ):
        masks = model_layer_masks(batch, model_config, attention=attention, dtype=mask_dtype)
        if masks is not None:  # they replace what the model would build from the token types
            out.pop("mm_token_type_ids", None)
            out["attention_mask"] = masks
    elif attention is HFAttention.MASK:
        out["attention_mask"] = block_causal_mask(padded, batch["cu_seqlens"], dtype=mask_dtype)
    return out


def onevision_videos(
    pixel_values_videos: torch.Tensor, video_num_frames: torch.Tensor
) -> torch.Tensor:
    """LLaVA-OneVision's packed frames ``[sum frames, 3, s, s]`` -> ``[videos, frames, 3, s, s]``,
    the one layout its forward takes (it pools every video of a forward as one block): the videos
    must share a frame count, else a :class:`PackingUnsupportedError` naming the way out."""
    counts = video_num_frames.reshape(-1)
    if bool((counts != counts[0]).any()):
        raise PackingUnsupportedError(
            f"to_hf_kwargs: LLaVA-OneVision's forward takes its videos as one [videos, frames, 3, "
            f"s, s] tensor, but "
            f"the batch's videos have {sorted(set(counts.tolist()))} frames: sample the same "
            f"number of frames per "
            "video (the video processor's num_frames), or put one video per forward"
        )
    return pixel_values_videos.reshape(
        counts.shape[0], int(counts[0]), *pixel_values_videos.shape[1:]
    )


def model_layer_masks(
    batch: dict,
    model_config: Any,
    *,
    attention: HFAttention | str = HFAttention.MASK,
    dtype: torch.dtype = torch.bool,
    flex: bool = False,
) -> dict:
    """``{layer type: mask}`` of an unsharded THD batch for a model whose contract
    (:func:`~prealign.collate.vision.model_contract`) has bidirectional image blocks or local
    layers: each ``[1, 1, T, T]`` in ``dtype``
    (:func:`~prealign.collate.vision.attention.packed_token_mask`; eager, sdpa) or, with
    ``flex=True``, a ``mask_mod`` for flex attention's ``create_block_mask`` (``flex_attention``).
    Image blocks are the runs of ``mm_token_type_ids > 0``; windows and chunks from the text config.

    Only ``attention="mask"`` can carry them: a packed row (``N > 1``) of a model with bidirectional
    image blocks or chunked local attention (Llama 4: chunks counted from each sequence's start) in
    any other mode is a :class:`PackingUnsupportedError`, and so is a packed Llama 4 row too long
    for its attention temperature (:func:`check_temperature_tuning`)."""
    attention = HFAttention(attention)
    contract = model_contract(model_config)
    padded = batch["cu_seqlens_padded"]
    sequences = num_sequences(padded)
    text = _text_config(model_config)
    if contract.local_attention == "chunked" and sequences > 1:
        if attention is not HFAttention.MASK:
            raise PackingUnsupportedError(
                f"to_hf_kwargs: {contract.model} has chunked local-attention layers and the batch "
                f"packs "
                f"{sequences} sequences: their chunks restart at each sequence's start, which "
                f"only the "
                f"per-sequence chunked masks carry: attention='mask' with attn_implementation "
                f"'sdpa' or 'eager' "
                f"(or model_layer_masks(flex=True) for 'flex_attention'), not {attention.value!r}"
            )
        check_temperature_tuning(text, contract.model, int(padded[-1]))
    if (
        contract.media_attention == "bidirectional"
        and attention is not HFAttention.MASK
        and sequences > 1
    ):
        raise PackingUnsupportedError(
            f"to_hf_kwargs: {contract.model}'s image tokens attend bidirectionally within their "
            f"image; a packed row "
            f"({sequences} sequences) needs its per-token masks: attention='mask' with "
            f"attn_implementation 'sdpa' "
            f"or 'eager' (or model_layer_masks(flex=True) for 'flex_attention'), not "
            f"{attention.value!r}"
        )
    if contract.local_attention and attention is not HFAttention.MASK:
        # sliding windows: the model finds the packing from position_ids / cu_seq_lens itself
        return None
    types = batch.get("mm_token_type_ids") if contract.media_attention == "bidirectional" else None
    index = TokenMaskIndex.of(padded, batch["cu_seqlens"], types)
    return layer_masks(
        index,
        text("layer_types", None),
        bidirectional=contract.media_attention == "bidirectional",
        window=text("sliding_window", None),
        chunk=text("attention_chunk_size", None),
        dtype=dtype,
        flex=flex,
        bidirectional_layers=contract.bidirectional_layers,
        block_over_window=contract.media_over_window,
    )


def check_temperature_tuning(text, model: str, total: int) -> None:
    """Refuse a packed row of ``total`` slots that Llama 4's attention temperature tuning would see
    differently from its sequences alone: its NoPE layers scale queries by ``log1p(floor((i + 1) /
    floor_scale))``, ``i`` the slot's index in the **row** (transformers 5.6 to 5.24), so a row
    longer than ``floor_scale - 1`` slots scales tokens of later sequences as if they sat deeper in
    one sequence. ``text``: the text config getter."""
    floor_scale = text("floor_scale", None)
    if text("attn_temperature_tuning", False) and floor_scale and total >= floor_scale:
        raise PackingUnsupportedError(
            f"to_hf_kwargs: {model} tunes its NoPE layers' attention temperature by the slot's "
            f"index in the row "
            f"(floor_scale={floor_scale}); a packed row of {total} slots would scale later "
            f"sequences' tokens as "
            f"if deeper in one sequence. Way out: a token budget (row) under {floor_scale} slots, "
            f"or one sequence "
            "per row (ParallelLayout(max_seqs=1))."
        )


def _text_config(model_config: Any):
    if isinstance(model_config, VisionFamily):  # a family keeps what the masks read
        return lambda key, default=None: getattr(model_config, key, default)
    get = config_getter(model_config)
    return config_getter(get("text_config", None) or model_config)


@dataclass(frozen=True, kw_only=True)
class HFCollator:
    """``data_collator`` for a Hugging Face ``Trainer``: samples -> prealign batch ->
    :func:`to_hf_kwargs`. Picklable (DataLoader workers).

    >>> from prealign.collate import THDCollator
    >>> from prealign.schemas import ParallelLayout, causal_lm_schema
    >>> thd = THDCollator(schema=causal_lm_schema(), layout=ParallelLayout(tp=2))
    >>> coll = HFCollator(collator=thd, attention=HFAttention.POSITIONS)
    >>> sorted(coll([{"input_ids": torch.tensor([5, 6, 7])}]))
    ['input_ids', 'labels', 'position_ids', 'use_cache']
    """

    collator: Callable[[Sequence[dict]], dict]
    """An unsharded prealign collator: ``THDCollator(..., cp_rank=None)``, or an ``MRoPECollator``
    around one."""
    attention: HFAttention | str = HFAttention.VARLEN
    mask_dtype: torch.dtype = torch.float32
    labels: bool = True
    ignore_index: int = IGNORE_INDEX
    model_config: Any = None
    """The model's transformers config: ``seq_idx`` and the Gated DeltaNet packing check
    (:func:`to_hf_kwargs`)."""

    def __call__(self, samples: Sequence[dict]) -> dict:
        return to_hf_kwargs(
            self.collator(samples),
            attention=self.attention,
            mask_dtype=self.mask_dtype,
            labels=self.labels,
            ignore_index=self.ignore_index,
            model_config=self.model_config,
        )
