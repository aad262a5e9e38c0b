"""Today's Megatron / TE batch contract: the identity rule, static shapes (one length bucket,
max_seqs), the MXFP8 / NVFP4 / token_multiple recipes and the newer PackedSeqParams fields; each
rule also checked by the validator on its own (a batch or PackedSeqParams broken in exactly that
rule is named)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate import THDCollator, to_packed_seq_params, unpack_thd, unshard_cp
from prealign.collate.indices import num_sequences
from prealign.loaders import plan_microbatches
from prealign.schemas import ParallelLayout, validate_batch, validate_packed_seq_params
from prealign.schemas.errors import BatchValidationError, BucketOverflowError, LayoutError
from tests.conftest import SCHEMA, examples, make_samples

megatron_psp = pytest.importorskip("megatron.core.packed_seq_params")


def collate(lengths, layout, rank=0):
    return THDCollator(schema=SCHEMA, layout=layout, cp_rank=rank)(make_samples(lengths))


# ---- the identity rule
# ----------------------------------------------------------------------------------
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=6),
    cp=st.sampled_from([1, 2, 4]),
    tp=st.sampled_from([1, 2]),
    convention=st.sampled_from(["padded", "unpadded"]),
    data=st.data(),
)
@examples(60)
def test_identity_rule_on_random_batches(lengths, cp, tp, convention, data):
    layout = ParallelLayout(cp=cp, tp=tp)
    batch = collate(lengths, layout, data.draw(st.integers(0, cp - 1)))
    params = to_packed_seq_params(batch, convention=convention)
    no_padding = torch.equal(batch["cu_seqlens"], batch["cu_seqlens_padded"])
    assert (params.cu_seqlens_q is params.cu_seqlens_q_padded) == (
        no_padding or convention == "padded"
    )
    assert (
        params.cu_seqlens_kv is params.cu_seqlens_q
        and params.cu_seqlens_kv_padded is params.cu_seqlens_q_padded
    )
    assert validate_packed_seq_params(params, layout) == []


def test_identity_rule_golden_and_the_validator_names_a_copy():
    layout = ParallelLayout()
    batch = collate([5, 3], layout)
    assert batch["cu_seqlens"] is not batch["cu_seqlens_padded"]  # two tensors in the batch ...
    params = to_packed_seq_params(batch, convention="unpadded")
    assert params.cu_seqlens_q is params.cu_seqlens_q_padded  # ... one object for TE
    params.cu_seqlens_q = params.cu_seqlens_q.clone()  # what a copy of equal offsets looks like
    with pytest.raises(
        BatchValidationError, match="cu_seqlens_q_padded: expected the same tensor object"
    ):
        validate_packed_seq_params(params, layout)
    padded = to_packed_seq_params(collate([5, 3], ParallelLayout(cp=2)), convention="unpadded")
    assert padded.cu_seqlens_q.tolist() == [0, 5, 8] and padded.cu_seqlens_q_padded.tolist() == [
        0,
        8,
        12,
    ]
    assert validate_packed_seq_params(padded, ParallelLayout(cp=2)) == []


# ---- static shapes
# --------------------------------------------------------------------------------------
@pytest.mark.slow
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    cp=st.sampled_from([1, 2]),
    max_seqs=st.integers(5, 8),
    data=st.data(),
)
@examples(60)
def test_static_shapes_on_random_batches(lengths, cp, max_seqs, data):
    layout = ParallelLayout(cp=cp, length_buckets=(256,), max_seqs=max_seqs)
    rank = data.draw(st.integers(0, cp - 1))
    batch = collate(lengths, layout, rank)
    assert batch["input_ids"].shape == (1, 256 // cp)  # exactly T rows, whatever the lengths
    n = len(lengths)
    for key in ("cu_seqlens", "cu_seqlens_padded"):
        cu = batch[key]
        assert cu.shape == (max_seqs + 1,) and cu.dtype == torch.int32
        assert bool((cu[n:] == cu[n]).all()), "the trailing entries repeat the total"
    assert batch["cu_seqlens"][n] == sum(lengths) and batch["cu_seqlens_padded"][n] == 256
    validate_batch(batch, SCHEMA, layout)
    assert batch["max_seqlen"].tolist() == [
        256
    ]  # fixed for CUDA graphs: T, whatever the longest sequence
    params = to_packed_seq_params(batch, convention="unpadded")
    assert params.cu_seqlens_q.shape == params.cu_seqlens_q_padded.shape == (max_seqs + 1,)
    assert params.max_seqlen_q == params.max_seqlen_kv == 256
    assert validate_packed_seq_params(params, layout) == []


def test_static_shapes_golden_and_refusals():
    layout = ParallelLayout(cp=2, length_buckets=(64,), max_seqs=4)
    batch = collate([5, 3], layout, rank=1)
    assert batch["cu_seqlens"].tolist() == [0, 5, 8, 8, 8]
    assert batch["cu_seqlens_padded"].tolist() == [0, 8, 64, 64, 64]
    assert batch["input_ids"].shape == (1, 32) and batch["max_seqlen"].tolist() == [64]
    # the validator checks max_seqlen == T on its own, in the batch and in PackedSeqParams
    longest = dict(batch, max_seqlen=torch.tensor([56], dtype=torch.int32))
    assert [v.path for v in validate_batch(longest, SCHEMA, layout, raise_on_error=False)] == [
        "max_seqlen"
    ]
    params = to_packed_seq_params(batch)
    assert [
        v.path
        for v in validate_packed_seq_params(
            dataclasses.replace(params, max_seqlen_q=56), layout, raise_on_error=False
        )
    ] == ["max_seqlen_q"]
    unpadded_pad = dataclasses.replace(params, cu_seqlens_kv_padded=params.cu_seqlens_kv_padded[:3])
    assert "cu_seqlens_kv_padded" in [
        v.path for v in validate_packed_seq_params(unpadded_pad, layout, raise_on_error=False)
    ]
    assert collate([5, 3], ParallelLayout(cp=2, length_buckets=(64,)))["max_seqlen"].tolist() == [
        56
    ]  # not static
    with pytest.raises(BucketOverflowError, match="5 sequences exceeds the layout's max_seqs = 4"):
        collate([1] * 5, layout)
    with pytest.raises(LayoutError, match="max_seqs"):
        ParallelLayout(max_seqs=0)
    # the validator checks the shape rule on its own: a batch of 3 entries under max_seqs=4 ...
    short = dict(
        batch, cu_seqlens=batch["cu_seqlens"][:3], cu_seqlens_padded=batch["cu_seqlens_padded"][:3]
    )
    paths = {v.path for v in validate_batch(short, SCHEMA, layout, raise_on_error=False)}
    assert paths == {"cu_seqlens", "cu_seqlens_padded"}
    # ... and a zero-length sequence in the middle is not a trailing repeat
    hole = dict(batch, cu_seqlens=torch.tensor([0, 5, 5, 8, 8], dtype=torch.int32))
    assert [v.path for v in validate_batch(hole, SCHEMA, layout, raise_on_error=False)] == [
        "cu_seqlens"
    ]


@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    cp=st.sampled_from([1, 2]),
    max_seqs=st.integers(5, 8),
)
@examples(40)
def test_static_batches_invert_to_their_real_sequences_only(lengths, cp, max_seqs):
    """The trailing repeated offsets are no sequences: the inverse gives back exactly the
    samples."""
    layout = ParallelLayout(cp=cp, length_buckets=(256,), max_seqs=max_seqs)
    shards = [collate(lengths, layout, r) for r in range(cp)]
    cu, cup = shards[0]["cu_seqlens"], shards[0]["cu_seqlens_padded"]
    whole = (
        unshard_cp([b["input_ids"] for b in shards], cu_seqlens_padded=cup)
        if cp > 1
        else shards[0]["input_ids"]
    )
    rows = unpack_thd(whole, cu_seqlens=cu, cu_seqlens_padded=cup)
    assert num_sequences(cup) == len(rows) == len(lengths)
    assert [r.tolist() for r in rows] == [s["input_ids"].tolist() for s in make_samples(lengths)]


@given(
    lengths=st.lists(st.integers(1, 50), min_size=0, max_size=120),
    max_seqs=st.integers(1, 6),
    dp=st.integers(1, 3),
    strategy=st.sampled_from(["bfd", "first_fit", "in_order"]),
    chunk=st.sampled_from([9, 16384]),
)
@examples(80)
def test_planner_respects_max_seqs(lengths, max_seqs, dp, strategy, chunk):
    layout = ParallelLayout(length_buckets=(128,), max_seqs=max_seqs)
    plan = plan_microbatches(
        lengths,
        layout=layout,
        token_budget=128,
        dp_size=dp,
        strategy=strategy,
        buffer_size=16,
        chunk_size=chunk,
    )
    placed = [i for rank in plan.microbatches for mb in rank for i in mb]
    assert sorted(placed) == list(range(len(lengths)))
    assert all(len(mb) <= max_seqs for rank in plan.microbatches for mb in rank)
    assert len({len(rank) for rank in plan.microbatches}) == 1
    for rank in plan.microbatches:  # and every micro-batch collates to the static shape
        for mb in rank:
            if mb:
                assert collate([lengths[i] for i in mb], layout)["cu_seqlens"].shape == (
                    max_seqs + 1,
                )


def test_planner_max_seqs_golden():
    plan = plan_microbatches([1] * 10, layout=ParallelLayout(max_seqs=3), token_budget=100)
    assert [len(mb) for mb in plan.microbatches[0]] == [3, 3, 3, 1]
    assert plan_microbatches([1] * 10, layout=ParallelLayout(), token_budget=100).microbatches == (
        (tuple(range(10)),),
    )


# ---- FP8 / FP4 recipes and the dispatcher's token multiple
# -------------------------------------------------
@pytest.mark.parametrize(
    "layout,block",
    [
        (ParallelLayout(tp=4, fp8="mxfp8"), 32),
        (ParallelLayout(tp=4, fp8="nvfp4"), 32),
        (ParallelLayout(tp=2, cp=2, token_multiple=128), 128),
        (ParallelLayout(tp=2, fp8="nvfp4", token_multiple=48), 96),
    ],
)
def test_recipes_rows_per_sp_rank(layout, block):
    rng = np.random.default_rng(0)
    for _ in range(30):
        lengths = rng.integers(1, 300, rng.integers(1, 6)).tolist()
        batch = collate(lengths, layout)
        t = int(batch["cu_seqlens_padded"][-1])
        assert (t // (layout.cp * layout.sp_size)) % block == 0 and t % (
            layout.cp * layout.sp_size
        ) == 0
        # and never more than one block of rows per SP rank beyond what the alignment alone needs
        bare = dataclasses.replace(layout, fp8="none", token_multiple=1)
        assert (
            t - int(collate(lengths, bare)["cu_seqlens_padded"][-1])
            < layout.cp * layout.sp_size * block
        )
        validate_batch(batch, SCHEMA, layout)


def test_recipes_golden_and_the_validator_checks_each():
    assert int(collate([32], ParallelLayout(tp=4, fp8="mxfp8"))["cu_seqlens_padded"][-1]) == 128
    assert (
        int(collate([32], ParallelLayout(tp=4, fp8="nvfp4"))["cu_seqlens_padded"][-1]) == 128
    )  # 32 per SP rank
    assert int(collate([5], ParallelLayout(token_multiple=128))["cu_seqlens_padded"][-1]) == 128
    # megatron-core's FP4 alignment (32), which is also what "nvfp4" meant before it was named: the
    # states saved then ({"fp8": 32}) keep their fingerprint
    assert (
        ParallelLayout(fp8="nvfp4").to_dict()
        == ParallelLayout.from_dict(dict(ParallelLayout().to_dict(), fp8=32)).to_dict()
    )
    assert ParallelLayout(fp8="nvfp4").to_dict()["fp8"] == 32
    assert ParallelLayout.from_dict(
        ParallelLayout(fp8="nvfp4", token_multiple=128).to_dict()
    ) == ParallelLayout(fp8="nvfp4", token_multiple=128)
    assert set(ParallelLayout().to_dict()) == {
        "tp",
        "cp",
        "sp",
        "fp8",
        "pad_policy",
        "cp_layout",
        "length_buckets",
        "min_local_rows",
    }  # fingerprints of layouts of before unchanged
    batch = collate(
        [32], ParallelLayout(tp=4, fp8="nvfp4")
    )  # 32 rows per SP rank: not HybridEP's 128
    bad = validate_batch(
        batch, SCHEMA, ParallelLayout(tp=4, fp8="nvfp4", token_multiple=128), raise_on_error=False
    )
    assert bad and all("token_multiple" in v.expected for v in bad[-1:])
    fp8 = collate([32], ParallelLayout(tp=4, fp8="fp8"))  # 16 rows per SP rank: not MXFP8's 32
    bad = validate_batch(fp8, SCHEMA, ParallelLayout(tp=4, fp8="mxfp8"), raise_on_error=False)
    assert bad and "MXFP8" in bad[-1].expected and "token_multiple=1" in bad[-1].expected


def test_recipe_multiples_agree_with_megatron_core():
    """megatron-core's own token alignments: FP8 16, MXFP8 32; FP4's is 128 for MoE grouped kernels,
    a multiple of the 32 the FP4 GEMM needs (its docstring), which is NVFP4's rows per SP rank."""
    fp8_utils = pytest.importorskip("megatron.core.fp8_utils")
    from megatron.core.enums import Fp8Recipe

    from prealign.schemas import FP8Recipe

    assert fp8_utils.get_fp8_align_size(Fp8Recipe.mxfp8) == FP8Recipe.MXFP8.multiple == 32
    assert fp8_utils.get_fp8_align_size(Fp8Recipe.tensorwise) == FP8Recipe.FP8.multiple == 16
    try:
        from megatron.core.enums import Fp4Recipe
        from megatron.core.fp4_utils import get_fp4_align_size
    except ImportError:  # megatron-core 0.14: no FP4
        return
    assert (
        get_fp4_align_size(Fp4Recipe.nvfp4) % FP8Recipe.NVFP4.multiple == 0
        and FP8Recipe.NVFP4.multiple == 32
    )


# ---- newer PackedSeqParams fields
# ---------------------------------------------------------------------------
@dataclasses.dataclass
class NewerPackedSeqParams(megatron_psp.PackedSeqParams):
    """The fields megatron-core >= 0.17 adds (same names and meaning), over the installed class."""

    total_tokens: int = None
    seq_idx: torch.Tensor = None
    tokens_per_sample: int = None
    pad_between_seqs: bool = None


def test_newer_fields_filled_when_present(monkeypatch):
    installed = to_packed_seq_params(collate([5, 3], ParallelLayout(cp=2)))
    assert not hasattr(installed, "total_tokens")  # 0.16.1: nothing it does not know
    monkeypatch.setattr(megatron_psp, "PackedSeqParams", NewerPackedSeqParams)
    layout = ParallelLayout(cp=2)
    batch = collate([5, 3], layout)
    unpadded = to_packed_seq_params(batch, convention="unpadded")
    # tokens_per_sample in Megatron-LM's unit (pretrain_gpt.py: args.seq_length, global tokens of
    # one sample)
    assert (unpadded.total_tokens, unpadded.tokens_per_sample, unpadded.pad_between_seqs) == (
        12,
        12,
        True,
    )
    assert unpadded.seq_idx.tolist() == [[0] * 8 + [1] * 4]
    assert validate_packed_seq_params(unpadded, layout) == []
    same = to_packed_seq_params(collate([4, 8], layout), convention="unpadded")
    assert same.pad_between_seqs is False and same.cu_seqlens_q is same.cu_seqlens_q_padded
    same.pad_between_seqs = True
    assert [v.path for v in validate_packed_seq_params(same, layout, raise_on_error=False)] == [
        "pad_between_seqs"
    ]


NEWER_FIELDS = {"total_tokens", "seq_idx", "tokens_per_sample", "pad_between_seqs"}


@pytest.mark.skipif(
    not NEWER_FIELDS <= {f.name for f in dataclasses.fields(megatron_psp.PackedSeqParams)},
    reason="platform: the installed megatron-core's PackedSeqParams has no total_tokens / seq_idx "
    "/ tokens_per_sample / pad_between_seqs (Megatron-LM main after 0.16)",
)
def test_newer_fields_against_the_installed_class():
    """The real class (its own __post_init__ derives seq_idx from total_tokens): ours agrees with
    it."""
    layout = ParallelLayout(cp=2, length_buckets=(64,), max_seqs=4)
    params = to_packed_seq_params(collate([5, 3], layout), convention="unpadded")
    assert type(params) is megatron_psp.PackedSeqParams
    assert (params.total_tokens, params.tokens_per_sample, params.pad_between_seqs) == (
        64,
        64,
        True,
    )
    assert params.seq_idx.tolist() == [[0] * 8 + [1] * 56]
    assert validate_packed_seq_params(params, layout) == []


def test_the_cli_report_counts_real_sequences_of_a_static_batch():
    from prealign.loaders.cli.report import batch_stats

    layout = ParallelLayout(length_buckets=(64,), max_seqs=6)
    batch = collate([5, 3], layout)
    assert batch["cu_seqlens_padded"].numel() == 7  # trailing entries repeat the total ...
    stats = batch_stats(0, [batch], 0)
    assert stats.sequences == 2 and stats.padded_tokens == 64  # ... and are not sequences
