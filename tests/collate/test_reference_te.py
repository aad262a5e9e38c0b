"""Differential test against TransformerEngine's THD CP partition (``thd_get_partitioned_indices``),
implemented here token by token from its documented formula (TE itself needs CUDA)."""

from __future__ import annotations

import torch
from hypothesis import given

from prealign.collate import THDCollator, unshard_cp
from prealign.schemas import CPLayout
from tests.conftest import collate_case, collate_case_batches, examples, te_thd_partition_index


@given(case=collate_case(cp_layout=CPLayout.ZIGZAG))
@examples(120)
def test_every_rank_holds_the_rows_te_assigns_it(case):
    _, layout, _, _, whole, shards = collate_case_batches(THDCollator, case)
    cu_padded = whole["cu_seqlens_padded"].tolist()
    fields = [k for k, v in whole.items() if torch.is_tensor(v) and v.ndim >= 2]
    assert len(fields) >= 5
    indices = []
    for rank, shard in enumerate(shards):
        idx = te_thd_partition_index(cu_padded, layout.cp, rank)
        assert idx.numel() == shard["input_ids"].shape[1]
        for name in fields:
            assert torch.equal(shard[name], whole[name].index_select(1, idx)), (name, rank)
        indices.append(idx)
    # TE's index sets tile the batch exactly once, and our inverse undoes them
    assert torch.equal(torch.cat(indices).sort().values, torch.arange(cu_padded[-1]))
    rows = torch.arange(cu_padded[-1])[None]
    assert torch.equal(
        unshard_cp([rows[:, i] for i in indices], cu_seqlens_padded=whole["cu_seqlens_padded"]),
        rows,
    )


def test_te_formula_on_the_worked_example():
    """L=[5,3], cp=2, P=[8,4]: rank 0 rows 0 1 6 7 | 8 11, rank 1 rows 2 3 4 5 | 9 10."""
    assert te_thd_partition_index([0, 8, 12], 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert te_thd_partition_index([0, 8, 12], 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
