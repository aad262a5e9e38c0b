"""Hybrid CP through PackedLoader (``PlannerConfig(hybrid_cp=True)``) over webdataset shards: for
every micro-batch the CP ranks' batches together hold exactly the micro-batch's sequences (unsharded
block by block and compared with an unsharded collate of the same plan), each rank's block is the
one ``hybrid_cp_plan`` gives, the batches validate and fill ``PackedSeqParams.local_cp_size``,
resume is exact, and the setting is part of the state."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from prealign.collate import THDCollator, to_packed_seq_params, unpack_thd, unshard_cp
from prealign.loaders import (
    BadDataPolicy,
    BadSampleWarning,
    BatchShare,
    CostModel,
    IndexOptions,
    PackedLoader,
    PlanError,
    PlannerConfig,
    ResumeError,
    StreamingPackedLoader,
    WebDatasetSource,
    assert_resumes_elastically,
    assert_resumes_exactly,
    build_index,
)
from prealign.loaders.plan.hybrid_cp import assign_cp_blocks, hybrid_cp_plan
from prealign.schemas import ParallelLayout, causal_lm_schema, validate_batch
from prealign.schemas.errors import (
    ArgumentError,
    BackendVersionError,
    BatchValidationError,
    ConfigError,
    SampleError,
)
from prealign.schemas.schema import Role
from tests.conftest import examples
from tests.loader_helpers import _npy, add_member, sample_lengths, token_ids, write_shards

SCHEMA = causal_lm_schema()
COST = CostModel(linear=24576, quadratic=1)
HYBRID = PlannerConfig(
    cost=COST, hybrid_cp=True, microbatches_per_step=2, oversize="truncate"
)  # cut at cp=2
LOADER_KEYS = ("sample_index", "is_filler", "epoch", "microbatch")
CAUGHT = (AssertionError, BatchValidationError)


def budget_of(cp: int) -> int:
    return 512 * cp  # per-rank share 512: a sequence longer than that spans two ranks or more


@pytest.fixture(scope="module")
def wds(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_shards")
    lengths = sample_lengths(120, seed=5, low=8, high=700) + [
        1500,
        1900,
        1100,
    ]  # some span 4 ranks at cp=4
    src = WebDatasetSource(write_shards(str(root), lengths, num_shards=3))
    return src, build_index(src, SCHEMA)


def make(wds, cp: int, *, planner=HYBRID, cp_rank=None, dp_rank=0, dp_size=2, **kw):
    src, idx = wds
    return PackedLoader(
        src,
        schema=SCHEMA,
        layout=ParallelLayout(cp=cp),
        token_budget=budget_of(cp),
        dp_rank=dp_rank,
        dp_size=dp_size,
        cp_rank=cp_rank,
        planner=planner,
        indexing=IndexOptions(prebuilt=idx),
        **kw,
    )


def sequences(
    batch: dict, shards: list[dict] | None = None, schema=SCHEMA
) -> dict[str, list[torch.Tensor]]:
    """Each token field's per-sequence tensors (true rows only) of ``batch``, unsharding ``shards``
    (the batches of every rank of its CP group, in rank order) first when given."""
    out = {}
    for name in (spec.name for spec in schema.of_role(Role.TOKEN)):
        whole = (
            batch[name]
            if shards is None
            else unshard_cp(
                [s[name] for s in shards],
                cu_seqlens_padded=batch["cu_seqlens_padded"],
                cp_size=batch["cp_size"],
            )
        )
        out[name] = unpack_thd(
            whole, cu_seqlens=batch["cu_seqlens"], cu_seqlens_padded=batch["cu_seqlens_padded"]
        )
    return out


def check_microbatch(ref: dict, got: list[dict], blocks, schema=SCHEMA) -> None:
    """``got`` (one batch per CP rank) against ``ref`` (the unsharded collate of the same
    micro-batch) and the micro-batch's ``blocks`` from :func:`hybrid_cp_plan`: raises AssertionError
    on any difference."""
    ids, want = ref["sample_index"].tolist(), sequences(ref, schema=schema)
    held = []
    for block in blocks:
        group = got[block.first : block.first + block.size]
        for r, b in enumerate(group):
            assert b["local_cp_size"] == b["cp_size"] == block.size, (
                f"rank {block.first + r}: local_cp_size"
            )
            assert b["cp_rank"] == r, f"rank {block.first + r}: rank in its block"
            assert b["hybrid_cp_members"] == block.members, f"rank {block.first + r}: members"
            assert b["sample_index"].tolist() == [ids[i] for i in block.members], (
                "sample_index: the block's samples"
            )
            assert torch.equal(b["cu_seqlens_padded"], group[0]["cu_seqlens_padded"])
            validate_batch(
                {k: v for k, v in b.items() if k not in LOADER_KEYS},
                schema,
                ParallelLayout(cp=len(got)),
            )
            refused_without_its_group(b, block.size)  # (filled with a real group of that size:
            # tests/loaders/plan/test_hybrid_cp.py, on gloo ranks)
        mine = sequences(group[0], group, schema)
        for name in mine:
            for j, i in enumerate(block.members):
                assert torch.equal(mine[name][j], want[name][i]), (
                    f"{name} of sequence {i} (block at {block.first})"
                )
        held.extend(block.members)
    assert sorted(held) == list(range(len(ids))), (
        "the blocks hold every sequence of the micro-batch once"
    )


def served(
    wds, cp: int, epoch: int, dp_rank: int, **kw
) -> tuple[list[dict], list[list[dict]], dict]:
    """(unsharded reference batches, per micro-batch the batch of every CP rank, blocks by
    micro-batch ids)."""
    ref = make(wds, cp, planner=dataclasses.replace(HYBRID, hybrid_cp=False), dp_rank=dp_rank)
    ref.set_epoch(epoch)
    ranks = []
    for c in range(cp):
        loader = make(wds, cp, cp_rank=c, dp_rank=dp_rank, **kw)
        loader.set_epoch(epoch)
        ranks.append(list(loader))
    order, plan = loader._schedule.plan(epoch)
    lengths = wds[1].lengths[order]
    blocks = hybrid_cp_plan(
        plan, lengths, layout=ParallelLayout(cp=cp), token_budget=budget_of(cp), cost=COST
    )
    by_ids = {
        tuple(order[list(mb)].tolist()): bl
        for mb, bl in zip(plan.microbatches[dp_rank], blocks[dp_rank])
    }
    return list(ref), [list(bs) for bs in zip(*ranks)], by_ids


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_ranks_together_hold_each_microbatch_as_planned(wds, cp):
    sizes = set()
    for dp_rank in (0, 1):
        ref, got, by_ids = served(wds, cp, 1, dp_rank, num_workers=2 if dp_rank else 0)
        assert len(ref) == len(got) > 4
        for r, g in zip(ref, got):
            blocks = by_ids[tuple(r["sample_index"].tolist())]
            check_microbatch(r, g, blocks)
            sizes.update(b.size for b in blocks)
    assert 1 in sizes and cp in sizes, (
        f"both one-rank and whole-group blocks were exercised, got sizes {sizes}"
    )


def test_planted_bugs_fail_the_check(wds):
    ref, got, by_ids = served(wds, 4, 0, 0)
    r, g = next(
        (r, g)
        for r, g in zip(ref, got)
        if any(b.size == 2 for b in by_ids[tuple(r["sample_index"].tolist())])
    )
    blocks = by_ids[tuple(r["sample_index"].tolist())]
    check_microbatch(r, g, blocks)
    two = next(b for b in blocks if b.size == 2)
    swapped = list(g)
    swapped[two.first], swapped[two.first + 1] = (
        g[two.first + 1],
        g[two.first],
    )  # wrong rank in the block
    with pytest.raises(CAUGHT):
        check_microbatch(r, swapped, blocks)
    fixed = [dict(b, cp_rank=i - two.first) if two.holds(i) else b for i, b in enumerate(swapped)]
    with pytest.raises(CAUGHT):  # right rank labels, wrong shards (validate_batch names the rows)
        check_microbatch(r, fixed, blocks)
    wrong = [
        dataclasses.replace(b, members=b.members[::-1]) if len(b.members) > 1 else b for b in blocks
    ]
    if wrong != list(blocks):
        with pytest.raises(CAUGHT):
            check_microbatch(r, g, tuple(wrong))
    with pytest.raises(CAUGHT):
        check_microbatch(r, [dict(b, local_cp_size=4) for b in g], blocks)


@pytest.mark.parametrize("cp", [2, 4])
def test_resume_mid_epoch_is_exact(wds, cp):
    out = assert_resumes_exactly(lambda: make(wds, cp, cp_rank=cp - 1, dp_rank=1))
    assert min(out["epoch_lengths"]) > 2 and out["midpoint"] > 0


def test_the_setting_is_part_of_the_state_and_the_default_is_unchanged(wds):
    assert PlannerConfig().to_dict() == {
        "strategy": "bfd",
        "buffer_size": 2048,
        "oversize": "error",
        "microbatches_per_step": 1,
        "max_age": 4,
        "step_pool": 8,
        "chunk_size": 16384,
    }, "the default keeps the fingerprints of before"
    assert (
        HYBRID.to_dict()["hybrid_cp"] is True
        and PlannerConfig.from_dict(HYBRID.to_dict()) == HYBRID
    )
    off = dataclasses.replace(HYBRID, hybrid_cp=False)
    assert "hybrid_cp" not in off.to_dict()
    on, plain = make(wds, 2, cp_rank=0), make(wds, 2, cp_rank=0, planner=off)
    next(iter(on))
    with pytest.raises(ResumeError, match="planner"):
        plain.load_state_dict(on.state_dict())
    with pytest.raises(ResumeError, match="planner"):
        make(wds, 2, cp_rank=0).load_state_dict(plain.state_dict())
    other = make(wds, 2, cp_rank=0, planner=dataclasses.replace(HYBRID, cp_comm_ratio=0.5))
    with pytest.raises(ResumeError, match="planner"):
        other.load_state_dict(on.state_dict())
    assert [b["sample_index"].tolist() for b in plain] != [], (
        "the plan itself does not depend on the setting"
    )
    assert plain.plan(0).microbatches == on.plan(0).microbatches


def test_refusals(wds, tmp_path):
    with pytest.raises(PlanError, match="needs cost"):
        PlannerConfig(hybrid_cp=True)
    with pytest.raises(PlanError, match="cp_comm_ratio"):
        PlannerConfig(hybrid_cp=True, cost=COST, cp_comm_ratio=-1.0)
    with pytest.raises(PlanError, match="hybrid_cp"):
        PlannerConfig(hybrid_cp=1, cost=COST)
    with pytest.raises(PlanError, match="power of two"):
        make(wds, 3, cp_rank=0)
    with pytest.raises(ConfigError, match="cp_rank"):
        make(wds, 2)
    with pytest.raises(ConfigError, match="BatchShare"):
        make(wds, 2, cp_rank=0, share=BatchShare(run="hybrid", cache_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="THDCollator"):
        make(wds, 2, cp_rank=0, collator=lambda samples: samples)
    with pytest.raises(
        PlanError, match="does not apply to StreamingPackedLoader"
    ):  # (nor does its cost)
        StreamingPackedLoader(
            wds[0],
            schema=SCHEMA,
            layout=ParallelLayout(cp=2),
            token_budget=1024,
            cp_rank=0,
            planner=PlannerConfig(cost=COST, hybrid_cp=True),
        )


def refused_without_its_group(batch: dict, size: int) -> None:
    """``to_packed_seq_params`` of a hybrid batch asks for its ``cp_group`` of ``size`` ranks (a
    megatron-core without ``local_cp_size``, 0.14, refuses the batch by version instead)."""
    with pytest.raises((ArgumentError, BackendVersionError)) as refused:
        to_packed_seq_params(batch)
    said = str(refused.value)
    assert (
        f"size {size}" in said
        if isinstance(refused.value, ArgumentError)
        else f"local_cp_size={size}" in said
    )


def test_without_cp_every_batch_is_one_block(wds):
    loader = make(wds, 1, dp_size=1)
    for batch in loader:
        assert batch["local_cp_size"] == 1 and batch["hybrid_cp_members"] == tuple(
            range(len(batch["sample_index"]))
        )
        refused_without_its_group(batch, 1)


class CPGroup:
    """The loaders of every CP rank of one DP rank as one component: each merged batch holds the
    sample ids and padded tokens of the micro-batch's blocks, each block counted once (at its first
    rank)."""

    def __init__(self, loaders):
        self.loaders = loaders

    def __iter__(self):
        for batches in zip(*self.loaders):
            firsts = [b for b in batches if b["cp_rank"] == 0]
            yield {
                "sample_index": torch.cat([b["sample_index"] for b in firsts]),
                "padded": sum(int(b["cu_seqlens_padded"][-1]) for b in firsts),
            }

    def __len__(self):
        return len(self.loaders[0])

    def set_epoch(self, epoch):
        for loader in self.loaders:
            loader.set_epoch(epoch)

    def state_dict(self):
        states = [loader.state_dict() for loader in self.loaders]
        assert all(st == states[0] for st in states), "every CP rank takes the same state"
        return states[0]

    def load_state_dict(self, state):
        for loader in self.loaders:
            loader.load_state_dict(state)


def test_elastic_resume_keeps_every_sample_once_across_the_cp_groups(wds):
    cp = 4

    def build(config, dp_rank):
        planner = dataclasses.replace(HYBRID, microbatches_per_step=config.get("k", 2))
        return CPGroup(
            [
                make(
                    wds, cp, cp_rank=c, dp_rank=dp_rank, dp_size=config["dp_size"], planner=planner
                )
                for c in range(cp)
            ]
        )

    segments = [({"dp_size": 2}, 3), ({"dp_size": 3, "k": 1}, 2), ({"dp_size": 1}, None)]
    out = assert_resumes_elastically(
        build, segments, budget=budget_of(cp), padded_length=lambda b: b["padded"]
    )
    assert out["samples"] == len(wds[1]) and out["counts"][:2] == [3, 2]


def test_deferred_cp_shard_keeps_whole_rows_and_the_gather_index(wds):
    cp = 4
    for c in range(cp):
        deferred = make(
            wds,
            cp,
            cp_rank=c,
            collator=THDCollator(
                schema=SCHEMA, layout=ParallelLayout(cp=cp), cp_rank=c, defer_cp_shard=True
            ),
        )
        for d, b in zip(deferred, make(wds, cp, cp_rank=c)):
            assert (
                d["local_cp_size"] == b["local_cp_size"]
                and d["hybrid_cp_members"] == b["hybrid_cp_members"]
            )
            assert d["input_ids"].shape[1] == int(d["cu_seqlens_padded"][-1])
            assert torch.equal(d["input_ids"].index_select(1, d["cp_gather_index"]), b["input_ids"])


def test_a_sample_bad_only_at_load_time_fails_alike_on_every_cp_rank(tmp_path):
    """A positive teacher log-prob in sample 7, which the header-only index does not read (its ids
    it bounds), is found on every CP rank whatever block it would have gone to: under the skip
    policy all ranks leave it out and assign the rest alike (each micro-batch still reconstructs,
    its blocks those of the samples left); under the default policy every rank raises naming it."""
    from prealign.loaders.index.header_pass import write_sidecars

    lengths = sample_lengths(40, seed=2, low=8, high=120)

    def extra(i, tf):
        ids = token_ids(i, lengths[i]) % 1000
        top = np.stack([ids, ids + 1], axis=1).astype(np.int64)
        logp = np.tile(np.float32([-0.5, -2.0]), (lengths[i], 1))
        if i == 7:
            logp[3, 1] = 0.5
        add_member(tf, f"{i:06d}.input_ids.npy", _npy(ids))
        add_member(tf, f"{i:06d}.teacher_topk_ids.npy", _npy(top))
        add_member(tf, f"{i:06d}.teacher_topk_log_probs.npy", _npy(logp))
        return True

    schema, cp, budget = causal_lm_schema(topk=2, vocab_size=1001), 4, 1024
    paths = write_shards(str(tmp_path), lengths, num_shards=2, extra=extra)
    write_sidecars(WebDatasetSource(paths), schema)
    skip = BadDataPolicy(on_error="skip", max_consecutive=50)
    planner = dataclasses.replace(HYBRID, oversize="error")

    def loader(**kw):
        return PackedLoader(
            WebDatasetSource(paths),
            schema=schema,
            layout=ParallelLayout(cp=cp),
            token_budget=budget,
            **kw,
        )

    with pytest.warns(BadSampleWarning, match="index row 7. at load time"):
        ref = list(loader(planner=dataclasses.replace(planner, hybrid_cp=False), bad_data=skip))
        got = [list(loader(planner=planner, cp_rank=c, bad_data=skip)) for c in range(cp)]
    assert sorted(i for b in ref for i in b["sample_index"].tolist()) == [
        i for i in range(40) if i != 7
    ]
    probe = loader(planner=planner, cp_rank=0)
    order, plan = probe.prepare()._schedule.plan(0)
    blocks7 = next(
        bl
        for mb, bl in zip(
            plan.microbatches[0],
            hybrid_cp_plan(
                plan,
                probe.index.lengths[order],
                layout=ParallelLayout(cp=cp),
                token_budget=budget,
                cost=COST,
            )[0],
        )
        if 7 in order[list(mb)]
    )
    assert len(blocks7) == cp, (
        "sample 7's micro-batch splits: three of the four ranks would not hold it"
    )
    split = 0
    for r, g in zip(ref, zip(*got)):
        blocks = assign_cp_blocks(
            [lengths[i] for i in r["sample_index"].tolist()],
            layout=ParallelLayout(cp=cp),
            token_budget=budget,
            cost=COST,
        )
        check_microbatch(r, list(g), blocks, schema)
        split += len(blocks) > 1
    assert split, "some micro-batches split into sub-groups"
    for c in range(cp):
        with pytest.raises(SampleError, match="index row 7"):
            list(loader(planner=planner, cp_rank=c))


def test_vlm_microbatch_each_block_holds_its_images_and_transformers_positions():
    """A VLM micro-batch through HybridCPCollator(MRoPECollator(THDCollator)) at cp=4: each block's
    ranks hold exactly their sequences' images (pixel_values, image_grid_thw) and, unsharded, their
    tokens and transformers' own Qwen2-VL mRoPE positions."""
    from prealign.collate.mrope import MRoPECollator
    from prealign.loaders.plan.hybrid_cp import HybridCPCollator
    from prealign.schemas import vlm_schema
    from tests.collate.test_mrope import hf_positions, vlm_sample

    schema, layout, cp = vlm_schema(), ParallelLayout(cp=4), 4
    samples = [
        vlm_sample(segs)
        for segs in (
            [30, (1, 12, 12), 20],
            [5, (1, 4, 4)],
            [(2, 8, 8), 3],
            [40],
            [(1, 6, 10), 7, (1, 4, 2)],
            [12],
        )
    ]
    lengths = [len(s["input_ids"]) for s in samples]
    blocks = assign_cp_blocks(lengths, layout=layout, token_budget=1024, cost=COST)
    assert len(blocks) > 1
    got = [
        HybridCPCollator(
            collator=MRoPECollator(collator=THDCollator(schema=schema, layout=layout, cp_rank=c)),
            token_budget=1024,
            cost=COST,
        )(samples)
        for c in range(cp)
    ]
    want = hf_positions(samples)
    for block in blocks:
        group = got[block.first : block.first + block.size]
        b = group[0]
        assert all(
            g["hybrid_cp_members"] == block.members and g["local_cp_size"] == block.size
            for g in group
        )
        for g in group:
            validate_batch(g, schema, layout)
            assert torch.equal(
                g["pixel_values"], torch.cat([samples[i]["pixel_values"] for i in block.members])
            )
            assert torch.equal(
                g["image_grid_thw"],
                torch.cat([samples[i]["image_grid_thw"] for i in block.members]),
            )
        pos = unshard_cp(
            [g["mrope_position_ids"] for g in group],
            cu_seqlens_padded=b["cu_seqlens_padded"],
            dim=2,
        )
        ids = unshard_cp([g["input_ids"] for g in group], cu_seqlens_padded=b["cu_seqlens_padded"])
        cu = dict(cu_seqlens=b["cu_seqlens"], cu_seqlens_padded=b["cu_seqlens_padded"])
        for j, (p, t) in enumerate(zip(unpack_thd(pos, dim=2, **cu), unpack_thd(ids, **cu))):
            i = block.members[j]
            assert torch.equal(p, want[i]) and torch.equal(t, samples[i]["input_ids"])


@pytest.mark.slow
@given(
    lengths=st.lists(st.integers(1, 700), min_size=1, max_size=10),
    cp=st.sampled_from([1, 2, 4]),
    tp=st.sampled_from([1, 2]),
    comm=st.sampled_from([0.0, 0.05, 0.5]),
)
@examples(60)
def test_hybrid_collator_ranks_reconstruct_any_microbatch(lengths, cp, tp, comm):
    """Property: for any micro-batch that fits the budget, the HybridCPCollator batches of all CP
    ranks hold its sequences exactly once, block by block, as assign_cp_blocks says."""
    from prealign.loaders.plan.hybrid_cp import HybridCPCollator

    layout, budget = ParallelLayout(cp=cp, tp=tp), 1024 * cp
    assume(layout.total_length(sum(layout.aligned_length(n) for n in lengths)) <= budget)
    samples = [{"input_ids": torch.as_tensor(token_ids(i, n))} for i, n in enumerate(lengths)]
    ref = dict(
        THDCollator(schema=SCHEMA, layout=layout)(samples), sample_index=torch.arange(len(lengths))
    )
    got = []
    for c in range(cp):
        b = HybridCPCollator(
            collator=THDCollator(schema=SCHEMA, layout=layout, cp_rank=c if cp > 1 else None),
            token_budget=budget,
            cost=COST,
            comm_ratio=comm,
        )(samples)
        got.append(dict(b, sample_index=torch.tensor(b["hybrid_cp_members"])))
    blocks = assign_cp_blocks(
        lengths, layout=layout, token_budget=budget, cost=COST, comm_ratio=comm
    )
    if cp == 1:
        got = [dict(got[0], cp_rank=0)]  # (an unsharded batch says -1)
    check_microbatch(ref, got, blocks)
