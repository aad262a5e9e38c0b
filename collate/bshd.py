"""BSHD collation: one sequence per row, rows padded to a common aligned length ``S``.

>>> from prealign.schemas import ParallelLayout, causal_lm_schema
>>> coll = BSHDCollator(schema=causal_lm_schema(), layout=ParallelLayout(cp=2), cp_rank=0)
>>> b = coll([{"input_ids": torch.tensor([1, 2, 3, 4, 5])}, {"input_ids": torch.tensor([6, 7, 8])}])
>>> b["input_ids"].tolist(), b["attention_mask"].tolist()
([[1, 2, 0, 0], [6, 7, 0, 0]], [[True, True, False, False], [True, True, False, False]])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from prealign.schemas.errors import BucketOverflowError
from prealign.schemas.layout import CPLayout, ParallelLayout
from prealign.schemas.schema import BatchSchema
from prealign.schemas.validate import check_schema_layout

from .assemble import check_cp_rank, non_token_fields, token_fields
from .indices import Chunks, cp_chunks, gather_plan, once
from .samples import flatten


def bshd_chunks(
    batch_size: int, seq_len: int, layout: ParallelLayout, cp_rank: int | None
) -> Chunks:
    """Chunks of a ``[B, S]`` batch held by ``cp_rank``: zigzag per row as megatron-core's
    ``get_batch_on_this_cp_rank``; contiguous keeps columns ``[r*S/cp, (r+1)*S/cp)`` of every
    row."""
    padded = np.full(batch_size, seq_len, dtype=np.int64)
    if cp_rank is None or layout.cp == 1 or layout.cp_layout is CPLayout.ZIGZAG:
        return cp_chunks(padded, layout, cp_rank)
    local = seq_len // layout.cp
    return Chunks(
        np.arange(batch_size, dtype=np.int64),
        np.full_like(padded, cp_rank * local),
        np.full_like(padded, local),
    )


@dataclass(frozen=True, kw_only=True)
class BSHDCollator:
    """``collate_fn`` producing ``[B, S_out, *dense]`` rows (``S_out = S/cp`` for a CP rank).

    ``S`` is the longest sequence rounded up to :meth:`ParallelLayout.bshd_multiple` (then
    ``min_local_rows`` and length buckets). Fields as :class:`~prealign.collate.THDCollator`, plus
    ``attention_mask`` bool ``[B, S_out]`` (True on real tokens, the verl/HF convention) and
    ``cu_seqlens`` int32 ``[B+1]`` of the true lengths. Under ``layout.max_seqs`` a batch of more
    rows is a :class:`~prealign.schemas.errors.BucketOverflowError`, as in THD (the rows are not
    padded up to it).
    """

    schema: BatchSchema
    layout: ParallelLayout
    cp_rank: int | None = None
    check_values: bool = True

    def __post_init__(self):
        check_schema_layout(self.schema, self.layout)
        object.__setattr__(
            self, "cp_rank", check_cp_rank(self.cp_rank, self.layout)
        )  # np.int64(1) -> 1

    def __call__(self, batch) -> dict:
        flat = flatten(batch, self.schema, check_values=self.check_values)
        b = flat.lengths.numel()
        if self.layout.max_seqs is not None and b > self.layout.max_seqs:
            raise BucketOverflowError(
                f"a batch of {b} sequences exceeds the layout's max_seqs = "
                f"{self.layout.max_seqs}; plan with the same layout or raise max_seqs"
            )
        s = self.layout.bshd_length(int(flat.lengths.max()), b)
        plan = gather_plan(
            flat.lengths, bshd_chunks(b, s, self.layout, self.cp_rank), flat.cu_seqlens
        )
        whole = once(
            lambda: gather_plan(flat.lengths, bshd_chunks(b, s, self.layout, None), flat.cu_seqlens)
        )
        out = {}
        for name, v in token_fields(self.schema, flat, plan, whole).items():
            td = self.schema[name].token_dim
            out[name] = v.unflatten(td, (b, v.shape[td] // b))
        out["attention_mask"] = ~plan.is_pad.view(b, -1)
        out["cu_seqlens"] = flat.cu_seqlens.to(torch.int32)
        out.update(non_token_fields(flat, self.schema, self.layout, self.cp_rank))
        return out
