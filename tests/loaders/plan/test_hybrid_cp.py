"""Hybrid CP planned in the loader: the blocks (hypothesis invariants, golden cases), each rank's
batch (validated, local_cp_size in PackedSeqParams), and a differential test against megatron-core
0.16.1's own hybrid-CP path on 4 gloo processes: its sub-groups hold the ranks of our blocks, and
its ``get_batch_on_this_cp_rank`` over them cuts the same shards from the same samples."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from megatron.core.packed_seq_params import PackedSeqParams

from prealign.collate import to_packed_seq_params
from prealign.loaders import CostModel, PlanError, plan_microbatches
from prealign.loaders.plan.hybrid_cp import (
    assign_cp_blocks,
    block_of,
    hybrid_cp_batch,
    hybrid_cp_plan,
    hybrid_cp_samples,
    predicted_time,
)
from prealign.schemas import (
    ArgumentError,
    BackendVersionError,
    ParallelLayout,
    validate_batch,
    validate_packed_seq_params,
)
from tests.conftest import SCHEMA, examples, make_samples, spawn_ranks

COST = CostModel(linear=24576, quadratic=1)
HYBRID_FIELDS = {"local_cp_size", "cp_group"} <= {
    f.name for f in dataclasses.fields(PackedSeqParams)
}


def fixed_cp_time(lengths, cp, comm_ratio=0.05):
    n = np.asarray(lengths, dtype=np.float64)
    return float((COST.of(n) / cp + comm_ratio * COST.linear * n * (cp - 1) / cp).sum())


@given(
    lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=12),
    cp=st.sampled_from([1, 2, 4, 8]),
    tp=st.sampled_from([1, 2]),
    comm=st.sampled_from([0.0, 0.05, 0.5]),
    data=st.data(),
)
@examples(150)
def test_blocks_invariants(lengths, cp, tp, comm, data):
    layout = ParallelLayout(cp=cp, tp=tp)
    budget = data.draw(st.sampled_from([8192, 16384]))
    plan = plan_microbatches(lengths, layout=layout, token_budget=budget, oversize="skip")
    for mb in plan.microbatches[0]:
        if not mb:
            continue
        mb_lengths = [lengths[i] for i in mb]
        blocks = assign_cp_blocks(
            mb_lengths, layout=layout, token_budget=budget, cost=COST, comm_ratio=comm
        )
        assert blocks == assign_cp_blocks(
            mb_lengths, layout=layout, token_budget=budget, cost=COST, comm_ratio=comm
        )
        covered = [r for b in blocks for r in range(b.first, b.first + b.size)]
        assert covered == list(range(cp)), "every CP rank in exactly one block, in order"
        assert all(b.size & (b.size - 1) == 0 and b.first % b.size == 0 for b in blocks), (
            "megatron's aligned groups"
        )
        assert sorted(i for b in blocks for i in b.members) == list(range(len(mb))), (
            "every sequence once"
        )
        assert all(b.members for b in blocks), "no idle rank"
        for b in blocks:  # no rank holds more rows than its fixed-CP share
            sub = dataclasses.replace(layout, cp=b.size)
            rows = (
                sub.total_length(sum(sub.aligned_length(mb_lengths[i]) for i in b.members))
                // b.size
            )
            assert rows <= budget // cp
        assert predicted_time(mb_lengths, blocks, COST, comm) <= fixed_cp_time(
            mb_lengths, cp, comm
        ) * (1 + 1e-12)


def test_blocks_of_a_whole_plan():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(1024), 1.0, 400), 16, 9000).astype(np.int64)
    layout = ParallelLayout(cp=4)
    plan = plan_microbatches(
        lengths, layout=layout, token_budget=8192, dp_size=2, oversize="truncate", cost=COST
    )
    blocks = hybrid_cp_plan(plan, lengths, layout=layout, token_budget=8192, cost=COST)
    assert [len(rank) for rank in blocks] == [len(rank) for rank in plan.microbatches]
    for rank_blocks, rank in zip(blocks, plan.microbatches):
        for bl, mb in zip(rank_blocks, rank):
            assert bl == assign_cp_blocks(
                [min(int(lengths[i]), 8192) for i in mb],
                layout=layout,
                token_budget=8192,
                cost=COST,
            )
    assert any(len(bl) > 1 for rank in blocks for bl in rank), (
        "some micro-batches run on sub-groups"
    )


def test_blocks_golden_and_refusals():
    layout = ParallelLayout(cp=4)
    blocks = assign_cp_blocks(
        [2000, 500, 500, 500, 500], layout=layout, token_budget=8192, cost=COST
    )
    assert [(b.first, b.size, b.members) for b in blocks] == [
        (0, 2, (0,)),
        (2, 1, (1, 3)),
        (3, 1, (2, 4)),
    ]
    assert block_of(blocks, 1) == blocks[0] and block_of(blocks, 3) == blocks[2]
    # a sequence longer than two ranks' share spans the group; without communication cost nothing
    # splits
    assert [
        b.size for b in assign_cp_blocks([5000, 100], layout=layout, token_budget=8192, cost=COST)
    ] == [4]
    assert [
        b.size
        for b in assign_cp_blocks(
            [500] * 4, layout=layout, token_budget=8192, cost=COST, comm_ratio=0
        )
    ] == [4]
    with pytest.raises(PlanError, match="power of two"):
        assign_cp_blocks([5], layout=ParallelLayout(cp=3), token_budget=96, cost=COST)
    with pytest.raises(PlanError, match="does not fit"):
        assign_cp_blocks([9000], layout=layout, token_budget=8192, cost=COST)
    # numpy numbers are numbers; a bool or a negative ratio is not; the blocks are zigzag, never
    # contiguous
    for ratio in (np.float64(0.05), np.float32(0.05), np.int64(0)):
        assert assign_cp_blocks(
            [2000, 500], layout=layout, token_budget=8192, cost=COST, comm_ratio=ratio
        )
    for ratio in (True, np.bool_(True), -0.1, "0.05"):
        with pytest.raises(PlanError, match="comm_ratio"):
            assign_cp_blocks(
                [2000, 500], layout=layout, token_budget=8192, cost=COST, comm_ratio=ratio
            )
    with pytest.raises(PlanError, match="zigzag"):
        assign_cp_blocks(
            [2000, 500],
            layout=ParallelLayout(cp=4, cp_layout="contiguous"),
            token_budget=8192,
            cost=COST,
        )


@pytest.mark.parametrize(
    "lengths", [[2000, 500, 500, 500, 500], [700, 600, 300, 90, 40, 1000], [5000, 100]]
)
def test_each_rank_batch_is_valid_and_says_its_local_cp_size(lengths):
    layout = ParallelLayout(cp=4)
    blocks = assign_cp_blocks(lengths, layout=layout, token_budget=8192, cost=COST)
    samples = make_samples(lengths)
    for rank in range(4):
        batch = hybrid_cp_batch(samples, blocks, schema=SCHEMA, layout=layout, cp_rank=rank)
        block = block_of(blocks, rank)
        assert (
            batch["local_cp_size"] == batch["cp_size"] == block.size
            and batch["cp_rank"] == rank - block.first
        )
        assert batch["hybrid_cp_members"] == block.members
        validate_batch(
            batch, SCHEMA, layout
        )  # checked as the batch of a CP group of local_cp_size ranks
        validate_batch(batch, SCHEMA, dataclasses.replace(layout, cp=block.size))
        bad = validate_batch(dict(batch, local_cp_size=3), SCHEMA, layout, raise_on_error=False)
        assert [v.path for v in bad] == ["local_cp_size"]
        if block.size > 1:  # the shards of another rank of the block are named
            other = hybrid_cp_batch(
                samples,
                blocks,
                schema=SCHEMA,
                layout=layout,
                cp_rank=block.first + (rank - block.first + 1) % block.size,
            )
            assert validate_batch(
                dict(batch, input_ids=other["input_ids"]), SCHEMA, layout, raise_on_error=False
            )
        # no cp_group: refused (megatron-core and TE need the block's group, a singleton one
        # included), or, where PackedSeqParams has no hybrid-CP fields (megatron-core 0.14), refused
        # naming the version
        with pytest.raises(
            ArgumentError if HYBRID_FIELDS else BackendVersionError,
            match="hybrid-CP rank" if HYBRID_FIELDS else "megatron-core 0.1",
        ):
            to_packed_seq_params(batch)


def test_per_sample_form_is_one_batch_per_member_and_sbhd_needs_one_sequence():
    layout = ParallelLayout(cp=4)
    lengths = [2000, 500, 500, 500, 500]
    blocks = assign_cp_blocks(lengths, layout=layout, token_budget=8192, cost=COST)
    samples = make_samples(lengths)
    for rank in range(4):
        block, per = (
            block_of(blocks, rank),
            hybrid_cp_samples(samples, blocks, schema=SCHEMA, layout=layout, cp_rank=rank),
        )
        assert [b["hybrid_cp_members"] for b in per] == [(i,) for i in block.members]
        for b, i in zip(per, block.members, strict=True):
            validate_batch(b, SCHEMA, layout)
            assert b["local_cp_size"] == block.size and int(b["cu_seqlens"][-1]) == lengths[i]
    whole = hybrid_cp_batch(
        samples, blocks, schema=SCHEMA, layout=layout, cp_rank=3
    )  # two sequences
    with pytest.raises(ArgumentError, match="one sequence"):
        to_packed_seq_params(whole, qkv_format="sbhd")
    with pytest.raises(ArgumentError, match="qkv_format"):
        to_packed_seq_params(whole, qkv_format="bshd")


def test_no_hybrid_fields_is_a_typed_error_naming_the_version(monkeypatch):
    """An older PackedSeqParams (megatron-core 0.14's seven fields) takes plain batches, refuses
    hybrid ones."""
    import megatron.core.packed_seq_params as psp

    old = dataclasses.make_dataclass(
        "PackedSeqParams",
        [
            (f.name, object, None)
            for f in dataclasses.fields(psp.PackedSeqParams)
            if f.name
            in (
                "qkv_format",
                "cu_seqlens_q",
                "cu_seqlens_kv",
                "cu_seqlens_q_padded",
                "cu_seqlens_kv_padded",
                "max_seqlen_q",
                "max_seqlen_kv",
            )
        ],
    )
    monkeypatch.setattr(psp, "PackedSeqParams", old)
    layout = ParallelLayout(cp=4)
    lengths = [2000, 500, 500, 500, 500]
    blocks = assign_cp_blocks(lengths, layout=layout, token_budget=8192, cost=COST)
    batch = hybrid_cp_batch(make_samples(lengths), blocks, schema=SCHEMA, layout=layout, cp_rank=3)
    with pytest.raises(
        BackendVersionError, match=r"\['cp_group', 'local_cp_size'\].*megatron-core "
    ):
        to_packed_seq_params(batch)
    plain = to_packed_seq_params({k: v for k, v in batch.items() if k != "local_cp_size"})
    assert not hasattr(plain, "local_cp_size")


# ---- differential: megatron-core's hybrid-CP path on gloo
# ------------------------------------------------
CASES = [
    [2000, 500, 500, 500, 500],
    [700, 600, 300, 90, 40, 1000],
    [5000, 100],
    [1200, 1100, 1000, 900],
]


def _megatron_worker(rank: int, world: int, port: int, results) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=60)
    )
    try:
        ps.initialize_model_parallel(context_parallel_size=world, hybrid_context_parallel=True)
        hdp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
        singletons = [
            dist.new_group([r]) for r in range(world)
        ]  # megatron-core builds no size-1 groups
        layout = ParallelLayout(cp=world)
        out = []
        for lengths in CASES:
            blocks = assign_cp_blocks(lengths, layout=layout, token_budget=8192, cost=COST)
            block = block_of(blocks, hdp_rank)
            group = (
                ps.get_hybrid_data_context_parallel_groups(group_size=block.size)
                if block.size > 1
                else None
            )
            # the docs' recipe: the block's group, a singleton one for local_cp_size 1
            params = to_packed_seq_params(
                hybrid_cp_batch(
                    make_samples(lengths), blocks, schema=SCHEMA, layout=layout, cp_rank=hdp_rank
                ),
                cp_group=group or singletons[dist.get_rank()],
            )
            assert params.cp_group.size() == params.local_cp_size == block.size
            assert validate_packed_seq_params(params, layout) == []
            assert (
                validate_packed_seq_params(
                    dataclasses.replace(
                        params, cp_group=singletons[(rank + 1) % world] if block.size > 1 else group
                    ),
                    layout,
                    raise_on_error=False,
                )[0].path
                == "cp_group"
            )
            group_ranks = dist.get_process_group_ranks(group) if group is not None else [hdp_rank]
            # megatron-core's path: every sub-sample on its own, padded to 2 * local_cp_size, cut
            # over the group
            mine_ids, mine_pos, per_sample = [], [], []
            ours_per_sample = hybrid_cp_samples(
                make_samples(lengths), blocks, schema=SCHEMA, layout=layout, cp_rank=hdp_rank
            )
            for i, single in zip(block.members, ours_per_sample, strict=True):
                padded = -(-lengths[i] // (2 * block.size)) * (2 * block.size)
                ids = torch.zeros(1, padded, dtype=torch.int64)
                ids[0, : lengths[i]] = make_samples(lengths)[i]["input_ids"]
                sample = {"tokens": ids, "position_ids": torch.arange(padded)[None]}
                if group is not None:
                    sample = get_batch_on_this_cp_rank(sample, cp_group=group)
                mine_ids.append(sample["tokens"][0])
                mine_pos.append(sample["position_ids"][0])
                # the per-sample form: megatron's shard, and the sbhd params
                # get_batch_on_this_hybrid_cp_rank builds (every offsets field [0, S], max_seqlen S:
                # S the sub-sample's padded length)
                p = to_packed_seq_params(
                    single, qkv_format="sbhd", cp_group=group or singletons[dist.get_rank()]
                )
                per_sample.append(
                    (
                        single["input_ids"][0].tolist() == sample["tokens"][0].tolist(),
                        [
                            p.qkv_format,
                            p.cu_seqlens_q.tolist(),
                            p.cu_seqlens_kv_padded.tolist(),
                            p.max_seqlen_q,
                            p.local_cp_size,
                            p.cp_group.size(),
                        ],
                        ["sbhd", [0, padded], [0, padded], padded, block.size, block.size],
                    )
                )
            ours = hybrid_cp_batch(
                make_samples(lengths), blocks, schema=SCHEMA, layout=layout, cp_rank=hdp_rank
            )
            out.append(
                (
                    group_ranks,
                    block.first,
                    block.size,
                    torch.cat(mine_ids).tolist(),
                    torch.cat(mine_pos).tolist(),
                    ours["input_ids"][0].tolist(),
                    ours["position_ids"][0].tolist(),
                    list(block.members),
                    per_sample,
                )
            )
        results[rank] = out
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(
    not HYBRID_FIELDS,
    reason="platform: this megatron-core has no hybrid CP (PackedSeqParams."
    "local_cp_size, parallel_state's hybrid DPxCP groups: 0.16 and later)",
)
def test_shards_match_megatron_core_hybrid_cp_path():
    world = 4
    got = spawn_ranks(_megatron_worker, world)
    assert sorted(got) == list(range(world))
    for case in range(len(CASES)):
        members = {}
        for rank in range(world):
            group_ranks, first, size, meg_ids, meg_pos, ids, pos, held, per_sample = got[rank][case]
            assert group_ranks == list(range(first, first + size)), (
                "our block is megatron's sub-group"
            )
            assert ids == meg_ids and pos == meg_pos, f"case {case} rank {rank}: shards differ"
            assert len(per_sample) == len(held)
            for same_shard, fields, megatron_fields in per_sample:
                assert same_shard and fields == megatron_fields, (
                    f"case {case} rank {rank}: per-sample form differs"
                )
            for i in held:
                members.setdefault(i, []).append(rank)
        # megatron-core's local_cp_size of a sub-sample: how many ranks hold it
        # (hybrid_cp_schedule.py)
        for i, ranks in members.items():
            assert len(ranks) == next(got[r][case][2] for r in ranks)
        assert sorted(members) == list(range(len(CASES[case])))


def test_a_bad_sample_is_named_by_its_position_in_the_microbatch():
    from prealign.schemas.errors import SampleError

    lengths = [2000, 500, 500, 500, 500]  # blocks (0, 2): [0], (2, 1): [1, 3], (3, 1): [2, 4]
    layout = ParallelLayout(cp=4)
    blocks = assign_cp_blocks(lengths, layout=layout, token_budget=8192, cost=COST)
    samples = make_samples(lengths)
    samples[3] = dict(
        samples[3], input_ids=samples[3]["input_ids"].clone().fill_(-1)
    )  # second of its block
    with pytest.raises(SampleError, match="sample 3") as info:
        hybrid_cp_batch(samples, blocks, schema=SCHEMA, layout=layout, cp_rank=2)
    assert info.value.sample == 3
    hybrid_cp_batch(
        samples, blocks, schema=SCHEMA, layout=layout, cp_rank=3
    )  # another block does not hold it
