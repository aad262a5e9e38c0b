"""Per-token attention masks of a packed row, for models whose packing ``cu_seqlens`` alone cannot
describe: image tokens attending bidirectionally within their image (Gemma 3 / 4), a sliding window
or chunks counted inside each sequence.

Query ``q`` may attend key ``k`` (slots of one ``[1, T]`` row of padded sequences) when

    same padded sequence  and  (k <= q  or  both in the same media block)  and  local(q, k)

where a media block is one run of image or video tokens (``token_types`` 1 or 2), ``local`` is
``pos(k) > pos(q) - window`` for a sliding window (``pos``: the slot's index inside its sequence) or
``pos(k) // chunk == pos(q) // chunk`` for chunks, and a pad key is seen by no query but itself. For
Gemma 3 this is transformers' own rule per layer type (``create_masks_for_vision_model``: full
``OR(causal, block)``, sliding ``AND(window, OR(causal, block))``) applied to each sequence alone.

:func:`packed_token_mask` materialises it (``[1, 1, T, T]``, bool or additive, for eager / sdpa);
:func:`flex_mask_mod` describes it as a ``mask_mod`` for
``torch.nn.attention.flex_attention.create_block_mask`` (the same predicate on ``[T]`` index
tensors, never ``T x T`` memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prealign.schemas.errors import ConfigError


@dataclass(frozen=True)
class TokenMaskIndex:
    """The per-slot tensors the mask reads, all int64 ``[T]``: ``seq`` (padded sequence), ``pos``
    (index in it), ``block`` (media block id, -1 on text), ``real`` (1 on real tokens, 0 on
    pads)."""

    seq: torch.Tensor
    pos: torch.Tensor
    block: torch.Tensor
    real: torch.Tensor

    @classmethod
    def of(
        cls,
        cu_seqlens_padded: torch.Tensor,
        cu_seqlens: torch.Tensor,
        token_types: torch.Tensor | None,
    ) -> "TokenMaskIndex":
        """From the row's padded and true offsets (int ``[N+1]``) and its token types (int ``[T]``
        or ``[1, T]``: 1 image, 2 video tokens form blocks; 0 text and any other type, e.g. audio,
        do not; ``None``: all text). A fixed number of tensor ops."""
        padded = cu_seqlens_padded.to(torch.int64).reshape(-1)
        true = cu_seqlens.to(torch.int64).reshape(-1)
        if true.shape != padded.shape:
            raise ConfigError(
                f"TokenMaskIndex: cu_seqlens {tuple(true.shape)} and cu_seqlens_padded "
                f"{tuple(padded.shape)} must have the same shape [N+1]"
            )
        total = int(padded[-1])
        slots = torch.arange(total)
        seq = torch.searchsorted(padded, slots, right=True) - 1
        pos = slots - padded[seq]
        real = pos < true.diff()[seq]
        if token_types is None:
            media = torch.zeros(total, dtype=torch.bool)
        else:
            types = token_types.reshape(-1).to(torch.int64)
            media = (types == 1) | (types == 2)
            if media.numel() != total:
                raise ConfigError(
                    f"TokenMaskIndex: {media.numel()} token types for a row of {total} slots"
                )
        media &= real
        starts = media & ~torch.cat((torch.zeros(1, dtype=torch.bool), media[:-1]))
        starts |= media & (pos == 0)  # a block never continues across a sequence boundary
        block = torch.where(
            media, torch.cumsum(starts.to(torch.int64), 0) - 1, torch.full_like(pos, -1)
        )
        return cls(seq=seq, pos=pos, block=block, real=real.to(torch.int64))

    def allowed(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        bidirectional: bool,
        window: int | None = None,
        chunk: int | None = None,
        block_over_window: bool = False,
    ) -> torch.Tensor:
        """The mask predicate on broadcastable slot indices ``q``, ``k`` (what both builders
        evaluate). ``block_over_window``: the media block is ORed after the window
        (``OR(AND(window, causal), block)``, Gemma 3 / 4 in transformers 5.6 to 5.16) instead of the
        window ANDed after the block."""
        ok = (self.seq[q] == self.seq[k]) & (k <= q)
        if window is not None and block_over_window:
            ok = ok & (self.pos[k] > self.pos[q] - window)
        if bidirectional:  # block ids are unique in the row: the same block is the same sequence
            ok = ok | (self.block[q] == self.block[k]) & (self.block[q] >= 0)
        ok = ok & ((self.real[k] == 1) | (k == q))
        if window is not None and not block_over_window:
            ok = ok & (self.pos[k] > self.pos[q] - window)
        if chunk is not None:
            ok = ok & (
                torch.div(self.pos[k], chunk, rounding_mode="floor")
                == torch.div(self.pos[q], chunk, rounding_mode="floor")
            )
        return ok


def packed_token_mask(
    index: TokenMaskIndex,
    *,
    bidirectional: bool,
    window: int | None = None,
    chunk: int | None = None,
    dtype: torch.dtype = torch.bool,
    block_over_window: bool = False,
) -> torch.Tensor:
    """``[1, 1, T, T]``: True (bool) or 0 (floating, else ``finfo(dtype).min``) where query row
    ``q`` may attend key column ``k`` (module docstring). ``O(T^2)`` memory: for eager / sdpa on
    short rows."""
    slots = torch.arange(index.seq.numel())
    allowed = index.allowed(
        slots[:, None],
        slots[None, :],
        bidirectional=bidirectional,
        window=window,
        chunk=chunk,
        block_over_window=block_over_window,
    )[None, None]
    if dtype == torch.bool:
        return allowed
    if not dtype.is_floating_point:
        raise ConfigError(
            f"packed_token_mask: dtype must be torch.bool or a floating dtype, got {dtype}"
        )
    return torch.zeros((), dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def flex_mask_mod(
    index: TokenMaskIndex,
    *,
    bidirectional: bool,
    window: int | None = None,
    chunk: int | None = None,
    block_over_window: bool = False,
):
    """``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` for flex attention's
    ``create_block_mask(mask_mod, 1, None, T, T)``: the predicate of :func:`packed_token_mask` on
    index tensors."""

    def mask_mod(b, h, q_idx, kv_idx):
        return index.allowed(
            q_idx,
            kv_idx,
            bidirectional=bidirectional,
            window=window,
            chunk=chunk,
            block_over_window=block_over_window,
        )

    return mask_mod


def layer_masks(
    index: TokenMaskIndex,
    layer_types,
    *,
    bidirectional: bool,
    window: int | None = None,
    chunk: int | None = None,
    dtype: torch.dtype = torch.bool,
    flex: bool = False,
    bidirectional_layers=None,
    block_over_window: bool = False,
) -> dict:
    """``{layer type: mask}`` for the distinct ``layer_types`` of a transformers text config: what a
    model with per-layer-type masks (Gemma 3, Llama 4, ...) takes as ``attention_mask`` in place of
    the masks it would build. ``sliding_attention`` layers get ``window``, ``chunked_attention``
    layers ``chunk``, others neither; each a :func:`packed_token_mask` (``flex=False``) or a
    :func:`flex_mask_mod` (``flex=True``). ``bidirectional``
    applies to the layer types in ``bidirectional_layers`` (``None``: all); ``block_over_window``:
    see :meth:`TokenMaskIndex.allowed`."""
    out = {}
    for kind in dict.fromkeys(layer_types or ("full_attention",)):
        local = {
            "window": window if kind == "sliding_attention" else None,
            "chunk": chunk if kind == "chunked_attention" else None,
            "bidirectional": bidirectional
            and (bidirectional_layers is None or kind in bidirectional_layers),
            "block_over_window": block_over_window,
        }
        out[kind] = (
            flex_mask_mod(index, **local)
            if flex
            else packed_token_mask(index, dtype=dtype, **local)
        )
    return out
