"""ParallelLayout: the padding arithmetic against brute force, and its validation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.schemas import (
    BucketOverflowError,
    CPLayout,
    FP8Recipe,
    LayoutError,
    PadPolicy,
    ParallelLayout,
    PrealignError,
    round_up,
)
from prealign.schemas.layout import round_up_array
from tests.conftest import (
    brute_force_bshd_length,
    brute_force_total,
    examples,
    layout_st,
    lengths_st,
    local_ok,
    naive_round_up,
    required_seq_multiple,
)


# ---- round_up
# ---------------------------------------------------------------------------------------
@given(n=st.integers(0, 10**6), m=st.integers(1, 5000))
@examples(300)
def test_round_up_is_the_smallest_multiple_not_below_n(n, m):
    r = round_up(n, m)
    assert r % m == 0 and n <= r < n + m
    assert round_up(r, m) == r  # never adds a block when already aligned
    assert round_up(n * m, m) == n * m
    assert round_up_array([n, r, n * m], m).tolist() == [r, r, n * m]


@pytest.mark.parametrize("m", [0, -4])
def test_round_up_rejects_a_non_positive_multiple(m):
    with pytest.raises(LayoutError, match="multiple"):
        round_up(3, m)


# ---- THD padded lengths
# -----------------------------------------------------------------------------
@st.composite
def lengths_and_layout(draw, **kw):
    lengths = draw(lengths_st)
    return lengths, draw(layout_st(lengths, **kw))


@pytest.mark.slow
@given(case=lengths_and_layout())
@examples(400)
def test_thd_padding_meets_every_constraint_and_minimal_is_the_minimum(case):
    lengths, layout = case
    padded = layout.padded_lengths(torch.tensor(lengths))
    p, t = padded.tolist(), int(padded.sum())
    m = required_seq_multiple(layout)
    assert padded.dtype == torch.int64 and len(p) == len(lengths)
    assert all(
        pi % m == 0 and pi % layout.seq_multiple == 0 and pi >= li for pi, li in zip(p, lengths)
    )
    # only the last sequence grows beyond its own alignment
    assert p[:-1] == [naive_round_up(li, m) for li in lengths[:-1]]
    assert t % layout.cp == 0 and local_ok(layout, t // layout.cp)
    assert t % layout.total_multiple == 0
    assert t >= layout.cp * layout.min_local_rows
    assert layout.length_buckets is None or t in layout.length_buckets
    assert (
        t
        == brute_force_total(lengths, layout)
        == layout.total_length(sum(naive_round_up(n, m) for n in lengths))
    )
    if layout.pad_policy is PadPolicy.MINIMAL:
        per = dataclasses.replace(layout, pad_policy=PadPolicy.PER_SEQUENCE)
        assert t <= int(per.padded_lengths(torch.tensor(lengths)).sum())


@pytest.mark.slow
@given(case=lengths_and_layout(bshd=True))
@examples(300)
def test_bshd_row_length_is_the_brute_force_minimum(case):
    lengths, layout = case
    s = layout.bshd_length(max(lengths), len(lengths))
    assert s == brute_force_bshd_length(lengths, layout)
    assert s % layout.bshd_multiple(len(lengths)) == 0
    if layout.pad_policy is PadPolicy.MINIMAL:
        per = dataclasses.replace(layout, pad_policy=PadPolicy.PER_SEQUENCE)
        assert s <= per.bshd_length(max(lengths), len(lengths))


def test_verl_per_sequence_alignment_is_tp_cp_2():
    """PER_SEQUENCE reproduces verl's ``align = tp*cp*2 if cp > 1 else tp`` (contiguous: tp*cp)."""
    for tp, cp in [(1, 1), (2, 1), (3, 1), (2, 2), (4, 3), (8, 8)]:
        zig = ParallelLayout(tp=tp, cp=cp, pad_policy="per_sequence")
        assert zig.seq_multiple == zig.bshd_multiple(5) == (tp * cp * 2 if cp > 1 else tp)
        con = ParallelLayout(tp=tp, cp=cp, pad_policy="per_sequence", cp_layout="contiguous")
        assert con.seq_multiple == con.bshd_multiple(5) == tp * cp


def test_the_seed_case_4026_tokens_tp2():
    """verl #7702: B=1, 4026 tokens, TP=2 (+SP) crashed the SP scatter; every T_local here is
    even."""
    expected = {
        (1, PadPolicy.MINIMAL): 4026,
        (1, PadPolicy.PER_SEQUENCE): 4026,
        (2, PadPolicy.MINIMAL): 4028,
        (2, PadPolicy.PER_SEQUENCE): 4032,
    }
    for (cp, policy), total in expected.items():
        layout = ParallelLayout(tp=2, cp=cp, pad_policy=policy)
        assert layout.padded_lengths(torch.tensor([4026])).tolist() == [total]
        assert (total // cp) % 2 == 0
    assert ParallelLayout(tp=2).padded_lengths(torch.tensor([4027])).tolist() == [4028]


def test_padded_lengths_does_not_mutate_its_input():
    lengths = torch.tensor([5, 3])
    out = ParallelLayout(tp=4, cp=2, min_local_rows=64).padded_lengths(lengths)
    assert lengths.tolist() == [5, 3] and out.tolist() == [8, 120]


# ---- buckets and validation
# ---------------------------------------------------------------------------
def test_bucket_picks_the_smallest_that_fits_and_overflow_is_typed():
    layout = ParallelLayout(tp=2, cp=2, length_buckets=(64, 16, 32))
    assert layout.length_buckets == (16, 32, 64)
    assert int(layout.padded_lengths(torch.tensor([5, 3])).sum()) == 16
    assert int(layout.padded_lengths(torch.tensor([20, 3])).sum()) == 32
    with pytest.raises(BucketOverflowError, match="exceeds the largest length bucket 64"):
        layout.padded_lengths(torch.tensor([61, 4]))
    with pytest.raises(BucketOverflowError):
        layout.bshd_length(65, 2)
    assert issubclass(BucketOverflowError, PrealignError) and issubclass(
        BucketOverflowError, ValueError
    )
    assert not issubclass(
        PrealignError, ValueError
    )  # system errors (I/O, timeouts, workers) are not


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tp=0), "tp: expected a positive int, got 0"),
        (dict(cp=-2), "cp: expected a positive int, got -2"),
        (dict(tp=True), "tp: expected a positive int"),
        (dict(cp=1.5), "cp: expected a positive int"),
        (dict(fp8="fp7"), "fp8: expected one of"),
        (dict(fp8=24), "fp8: expected one of"),
        (dict(pad_policy="maximal"), "maximal"),
        (dict(cp_layout="spiral"), "spiral"),
        (dict(min_local_rows=-1), "min_local_rows"),
        (dict(length_buckets=()), "at least one bucket"),
        (dict(length_buckets=(0, 8)), "length_buckets"),
        (
            dict(tp=2, cp=2, pad_policy="per_sequence", length_buckets=(8, 12, 10)),
            r"multiple of the total multiple 8 .*got \[10, 12\]; use e.g. \[16, 16\]",
        ),
        (dict(cp=2, fp8="fp8", length_buckets=(32, 48)), r"got \[48\]"),
    ],
)
def test_invalid_layouts_raise_layout_error(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        ParallelLayout(**kwargs)


def test_coercions_and_defaults():
    assert ParallelLayout(tp=2).sp is True and ParallelLayout(tp=2, sp=False).sp is False
    assert ParallelLayout().sp is False
    assert [
        FP8Recipe.coerce(v) for v in (None, False, "FP8", "mxfp8", "nvfp4", 128, 1, "nvfp4", 16)
    ] == [
        FP8Recipe.NONE,
        FP8Recipe.NONE,
        FP8Recipe.FP8,
        FP8Recipe.MXFP8,
        FP8Recipe.NVFP4,
        FP8Recipe.BLOCKWISE,
        FP8Recipe.NONE,
        FP8Recipe.NVFP4,
        FP8Recipe.FP8,
    ]
    lay = ParallelLayout(pad_policy="per_sequence", cp_layout="contiguous", fp8="blockwise")
    assert (lay.pad_policy, lay.cp_layout, lay.fp8) == (
        PadPolicy.PER_SEQUENCE,
        CPLayout.CONTIGUOUS,
        FP8Recipe.BLOCKWISE,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.tp = 4


@pytest.mark.slow
@given(case=lengths_and_layout())
def test_layout_dict_round_trip(case):
    _, layout = case
    again = ParallelLayout.from_dict(layout.to_dict())
    assert again == layout and again.to_dict() == layout.to_dict()


# ---- FP8 under SP: the rows of one SP rank are a multiple of the recipe's block
# ---------------------------
def sp_share(layout: ParallelLayout, total: int) -> int:
    """Rows one TP rank holds after the SP scatter: T / cp / tp under SP, T / cp without."""
    return total // layout.cp // (layout.tp if layout.sp else 1)


@pytest.mark.slow
@given(case=lengths_and_layout())
@examples(300)
def test_every_sp_rank_holds_a_multiple_of_the_fp8_block(case):
    lengths, layout = case
    t = int(layout.padded_lengths(torch.tensor(lengths)).sum())
    assert (t // layout.cp) % (layout.tp if layout.sp else 1) == 0
    assert sp_share(layout, t) % layout.fp8.multiple == 0


@given(case=lengths_and_layout(bshd=True))
@examples(200)
def test_every_sp_rank_holds_a_multiple_of_the_fp8_block_bshd(case):
    lengths, layout = case
    s = layout.bshd_length(max(lengths), len(lengths))
    assert sp_share(layout, len(lengths) * s) % layout.fp8.multiple == 0


def test_fp8_under_sp_golden():
    """The issue's case: tp=4 (SP on), MXFP8, one 32-token sample gave T=32, 8 rows per SP rank."""
    lay = ParallelLayout(tp=4, fp8="mxfp8")
    t = int(lay.padded_lengths(torch.tensor([32])).sum())
    assert t == 128 and sp_share(lay, t) == 32
    assert (
        lay.bshd_length(32, 1) == 128 and lay.bshd_length(32, 4) == 32
    )  # B*S/tp = 32 rows per SP rank
    assert (
        int(ParallelLayout(tp=4, sp=False, fp8="mxfp8").padded_lengths(torch.tensor([32])).sum())
        == 32
    )
    assert (
        int(ParallelLayout(tp=2, cp=2, fp8="blockwise").padded_lengths(torch.tensor([5, 3])).sum())
        == 512
    )


# ---- differential: NeMo-RL's padding rule, written from its documented behaviour
# --------------------------
FP8_DIVISOR = {
    FP8Recipe.NONE: 1,
    FP8Recipe.FP8: 16,
    FP8Recipe.MXFP8: 32,
    FP8Recipe.BLOCKWISE: 128,
}  # NVFP4 is MXFP8


def nemo_rl_padded_total(lengths: list[int], layout: ParallelLayout) -> tuple[list[int], int]:
    """NeMo-RL (Megatron policy, sequence packing): every sequence padded to a multiple of
    ``(2cp if cp>1) * (tp if sp and tp>1)``; with FP8 the packed length to a multiple of that times
    16 (FP8), 32 (MXFP8) or 128 (blockwise), the last sequence taking the extension."""
    split = (2 * layout.cp if layout.cp > 1 else 1) * (
        layout.tp if layout.sp and layout.tp > 1 else 1
    )
    per_seq = [naive_round_up(n, split) for n in lengths]
    pack = split * FP8_DIVISOR[layout.fp8] if layout.fp8 is not FP8Recipe.NONE else 1
    return per_seq, naive_round_up(sum(per_seq), pack)


@pytest.mark.slow
@given(
    lengths=lengths_st,
    tp=st.sampled_from([1, 2, 3, 4, 8]),
    cp=st.sampled_from([1, 2, 3, 4]),
    sp=st.booleans(),
    fp8=st.sampled_from(list(FP8Recipe)),
)
@examples(400)
def test_fp8_sp_rule_against_nemo_rl(lengths, tp, cp, sp, fp8):
    layout = ParallelLayout(tp=tp, cp=cp, sp=sp, fp8=fp8)
    per_seq, nemo_total = nemo_rl_padded_total(lengths, layout)
    ours = int(layout.padded_lengths(torch.tensor(lengths)).sum())
    # NeMo-RL's batches are valid under our rule (what validate_batch checks) ...
    assert (
        all(p % layout.seq_multiple == 0 for p in per_seq)
        and nemo_total % layout.total_multiple == 0
    )
    # ... both give every SP rank a multiple of the FP8 block, and we never pad more
    assert (
        sp_share(layout, nemo_total) % layout.fp8.multiple == 0
        and sp_share(layout, ours) % layout.fp8.multiple == 0
    )
    assert ours <= nemo_total


def test_fp8_sp_rule_against_nemo_rl_golden():
    """Where the two agree, and where NeMo-RL's extra factor 2 (it multiplies the FP8 block by the
    whole per-sequence split ``2cp*tp``) pads more."""
    one = ParallelLayout(tp=4, fp8="mxfp8")
    assert (
        nemo_rl_padded_total([32], one)[1]
        == int(one.padded_lengths(torch.tensor([32])).sum())
        == 128
    )
    two = ParallelLayout(tp=4, cp=2, fp8="mxfp8")
    assert nemo_rl_padded_total([32], two)[1] == 512
    assert (
        int(two.padded_lengths(torch.tensor([32])).sum()) == 256
    )  # 32 rows on each of cp*tp = 8 ranks
