"""THD (packed) collation: every sequence padded per the layout and packed into ``[1, T]``.

>>> from prealign.schemas import ParallelLayout, causal_lm_schema
>>> coll = THDCollator(schema=causal_lm_schema(), layout=ParallelLayout(cp=2), cp_rank=1)
>>> b = coll([{"input_ids": torch.tensor([1, 2, 3, 4, 5])}, {"input_ids": torch.tensor([6, 7, 8])}])
>>> b["input_ids"].tolist(), b["cu_seqlens_padded"].tolist()
([[3, 4, 5, 0, 7, 8]], [0, 8, 12])
>>> b["position_ids"].tolist(), b["labels"].tolist()
([[2, 3, 4, 5, 1, 2]], [[4, 5, -100, -100, 8, -100]])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from prealign.schemas.layout import ParallelLayout
from prealign.schemas.schema import BatchSchema
from prealign.schemas.validate import check_schema_layout

from .assemble import check_cp_rank, non_token_fields, token_dims, token_fields
from .indices import (
    cp_chunks,
    gather_plan,
    global_slots,
    lengths_to_cu_seqlens,
    once,
    padded_lengths,
    static_offsets,
)
from .samples import flatten


@dataclass(frozen=True, kw_only=True)
class THDCollator:
    """``collate_fn`` producing a Megatron-ready packed batch (picklable, stateless).

    Input: a list of sample dicts (``input_ids`` int64 ``[L]``, optional ``labels`` ``[L]`` aligned
    with the tokens, ``loss_mask`` ``[L]``, any TOKEN field of the schema ``[L, *dense]``) or verl's
    dict of jagged nested tensors. Output (``T_out = T/cp`` for a CP rank, ``T`` for
    ``cp_rank=None``):

    - every TOKEN field: ``[1, T_out, *dense]`` (``[*leading, 1, T_out]`` for leading dims), pads
      holding the field's pad value; ``labels[j]`` is the next token of the same sequence,
      ``ignore_index`` on each sequence's last token and on pads; ``position_ids`` the global
      position of the slot inside its padded sequence (pads continue ``L, L+1, ...``);
      ``padding_mask`` bool, True on pads.
    - ``cu_seqlens`` (true) and ``cu_seqlens_padded`` (global), int32 ``[N+1]`` (``[max_seqs+1]``
      under ``layout.max_seqs``, the trailing entries repeating each one's total); ``max_seqlen``
      int32 ``[1]`` (the longest padded sequence; ``T`` under static shapes); ``cp_rank`` /
      ``cp_size`` ints (``cp_rank`` -1 when unsharded).
    - SEQUENCE fields stacked ``[N, ...]``; MEDIA fields concatenated on dim 0.
    """

    schema: BatchSchema
    layout: ParallelLayout
    cp_rank: int | None = None
    check_values: bool = True
    defer_cp_shard: bool = False
    """VLM path: with a ``cp_rank``, emit the whole aligned batch ``[1, T]`` plus
    ``cp_gather_index`` int64 ``[T/cp]``, the rows this rank keeps, for one ``index_select`` in the
    forward after the vision embeddings are merged into the sequence."""

    def __post_init__(self):
        check_schema_layout(self.schema, self.layout)
        object.__setattr__(
            self, "cp_rank", check_cp_rank(self.cp_rank, self.layout)
        )  # np.int64(1) -> 1

    def __call__(self, batch) -> dict:
        flat = flatten(batch, self.schema, check_values=self.check_values)
        lengths, cu = flat.np_lengths, flat.np_cu_seqlens  # int64
        padded = padded_lengths(self.layout, lengths)
        cu_padded = lengths_to_cu_seqlens(
            padded
        )  # int32; refuses T >= 2**31 before anything of size T exists
        shard_rank = None if self.defer_cp_shard else self.cp_rank
        plan = gather_plan(lengths, cp_chunks(padded, self.layout, shard_rank), cu)
        whole = once(lambda: gather_plan(lengths, cp_chunks(padded, self.layout, None), cu))
        dims = token_dims(self.schema)
        out = {
            name: v.unsqueeze(dims[name])  # the batch dim, before the token dim
            for name, v in token_fields(self.schema, flat, plan, whole).items()
        }
        # (int32 casts and the one-element max_seqlen in numpy: each torch call costs µs)
        cu32 = torch.from_numpy(cu.astype(np.int32))
        out["cu_seqlens"] = static_offsets(cu32, self.layout.max_seqs)
        out["cu_seqlens_padded"] = static_offsets(cu_padded, self.layout.max_seqs)
        out["max_seqlen"] = torch.from_numpy(
            np.array([self.layout.static_length or np.maximum.reduce(padded)], dtype=np.int32)
        )
        if self.defer_cp_shard and self.cp_rank is not None:
            out["cp_gather_index"] = global_slots(
                cp_chunks(padded, self.layout, self.cp_rank), out["cu_seqlens_padded"]
            )
        out.update(non_token_fields(flat, self.schema, self.layout, shard_rank))
        return out
