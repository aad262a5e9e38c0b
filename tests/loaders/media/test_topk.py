"""Teacher top-k distillation data: decoded from ``.npy`` members or dataset columns, validated per
sample, then padded, length-bucketed and CP-sharded with exactly the token indices (THD and BSHD),
round-tripping bit-exactly through the inverse maps (verl cannot bucket with top-k)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate import (
    BSHDCollator,
    THDCollator,
    unpack_bshd,
    unpack_thd,
    unshard_bshd,
    unshard_cp,
)
from prealign.loaders.cli.demo_data import synthetic_teacher
from prealign.loaders.media.teacher_topk import IDS, LOG_PROBS, encode_npy, teacher_topk
from prealign.schemas import (
    CPLayout,
    ParallelLayout,
    SampleError,
    causal_lm_schema,
    round_up,
    validate_batch,
)
from tests.conftest import examples

VOCAB, K = 264, 5
SCHEMA = causal_lm_schema(topk=K, vocab_size=VOCAB)


def raw_sample(n: int, seed: int) -> dict:
    """A raw webdataset-like sample: token ids plus teacher ``.npy`` members (bytes)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(8, VOCAB, size=n)
    lp, top = synthetic_teacher(ids, K, VOCAB, rng)
    return {
        "__key__": f"k{seed}",
        "input_ids": ids,
        f"{LOG_PROBS}.npy": encode_npy(lp),
        f"{IDS}.npy": encode_npy(top),
    }


def decoded(raw: dict, dtype: torch.dtype) -> dict:
    ids = torch.as_tensor(raw["input_ids"])
    return {
        "input_ids": ids,
        **teacher_topk(
            raw,
            sample=raw["__key__"],
            length=ids.numel(),
            topk=K,
            vocab_size=VOCAB,
            log_prob_dtype=dtype,
        ),
    }


cases = st.tuples(
    st.lists(st.integers(1, 300), min_size=1, max_size=5),
    st.sampled_from([(1, 1), (2, 1), (2, 2), (1, 4), (4, 2)]),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.sampled_from(list(CPLayout)),
    st.booleans(),
)


def layout_for(tp: int, cp: int, cp_layout: CPLayout, buckets: bool, need: int) -> ParallelLayout:
    lay = ParallelLayout(tp=tp, cp=cp, cp_layout=cp_layout)
    if not buckets:
        return lay
    m = lay.total_multiple
    return ParallelLayout(
        tp=tp, cp=cp, cp_layout=cp_layout, length_buckets=(m, round_up(need, m) + 4 * m, 1 << 14)
    )


@given(cases)
@examples(60)  # 60 here, a quarter under PREALIGN_EXAMPLES_SCALE=0.25 (verl, floor)
def test_thd_cp_shards_round_trip_exactly(case):
    lengths, (tp, cp), dtype, cp_layout, buckets = case
    samples = [decoded(raw_sample(n, i), dtype) for i, n in enumerate(lengths)]
    need = int(
        ParallelLayout(tp=tp, cp=cp, cp_layout=cp_layout)
        .padded_lengths(torch.tensor(lengths))
        .sum()
    )
    layout = layout_for(tp, cp, cp_layout, buckets, need)
    shards = [THDCollator(schema=SCHEMA, layout=layout, cp_rank=r)(samples) for r in range(cp)]
    for b in shards:
        validate_batch(b, SCHEMA, layout)
        t_local = b["input_ids"].shape[1]
        assert b[LOG_PROBS].shape == (1, t_local, K) and b[IDS].shape == (1, t_local, K)
        assert b[LOG_PROBS].dtype == dtype and t_local % tp == 0
        pad = b["padding_mask"][0]
        assert bool((b[LOG_PROBS][0, pad] == 0).all()) and bool((b[IDS][0, pad] == 0).all())
    if buckets:
        assert int(shards[0]["cu_seqlens_padded"][-1]) in layout.length_buckets
    cu, cup = shards[0]["cu_seqlens"], shards[0]["cu_seqlens_padded"]
    for name in ("input_ids", LOG_PROBS, IDS):
        whole = unshard_cp([b[name] for b in shards], cu_seqlens_padded=cup, cp_layout=cp_layout)
        for got, s in zip(unpack_thd(whole, cu_seqlens=cu, cu_seqlens_padded=cup), samples):
            assert torch.equal(got, s[name]), name  # bit-exact, bf16 included


@given(cases)
@examples(60)
def test_bshd_cp_shards_round_trip_exactly(case):
    lengths, (tp, cp), dtype, cp_layout, buckets = case
    samples = [decoded(raw_sample(n, i), dtype) for i, n in enumerate(lengths)]
    base = ParallelLayout(tp=tp, cp=cp, cp_layout=cp_layout)
    layout = base
    if buckets:
        m = base.bshd_multiple(len(lengths))
        layout = ParallelLayout(
            tp=tp,
            cp=cp,
            cp_layout=cp_layout,
            length_buckets=(
                round_up(base.bshd_length(max(lengths), len(lengths)) + m, m * base.total_multiple),
            ),
        )
    shards = [BSHDCollator(schema=SCHEMA, layout=layout, cp_rank=r)(samples) for r in range(cp)]
    for b in shards:
        validate_batch(b, SCHEMA, layout)
        assert b[LOG_PROBS].shape == (*b["input_ids"].shape, K)
        assert bool((b[IDS][~b["attention_mask"]] == 0).all())
    for name in ("input_ids", LOG_PROBS, IDS):
        whole = unshard_bshd([b[name] for b in shards], cp_layout=cp_layout)
        for got, s in zip(unpack_bshd(whole, cu_seqlens=shards[0]["cu_seqlens"]), samples):
            assert torch.equal(got, s[name]), name


def test_hf_dataset_column_gives_the_same_tensors():
    """An HF ``datasets`` row (nested lists) decodes to the same tensors as the ``.npy`` members."""
    datasets = pytest.importorskip("datasets")
    raw = raw_sample(17, 3)
    lp = np.load(io.BytesIO(raw[f"{LOG_PROBS}.npy"]), allow_pickle=False)
    top = np.load(io.BytesIO(raw[f"{IDS}.npy"]), allow_pickle=False)
    ds = datasets.Dataset.from_dict(
        {"input_ids": [raw["input_ids"].tolist()], LOG_PROBS: [lp.tolist()], IDS: [top.tolist()]}
    )
    row = {"__key__": "hf0", **ds[0]}
    a, b = decoded(raw, torch.float32), decoded(row, torch.float32)
    assert all(torch.equal(a[k], b[k]) for k in (LOG_PROBS, IDS))


# ---- validation
# -----------------------------------------------------------------------------------
def with_member(raw: dict, name: str, array) -> dict:
    return {**raw, f"{name}.npy": encode_npy(np.asarray(array))}


@pytest.mark.parametrize(
    "edit, field, needle",
    [
        (lambda lp, ids: (lp[:, :4], ids), LOG_PROBS, "K=5"),  # K differs from the declared K
        (lambda lp, ids: (lp, ids[:-1]), IDS, "L=12"),  # one row short
        (
            lambda lp, ids: (np.where(np.arange(5) == 2, np.nan, lp), ids),
            LOG_PROBS,
            "finite log-probs <= 0",
        ),
        (lambda lp, ids: (np.abs(lp), ids), LOG_PROBS, "finite log-probs <= 0"),
        (
            lambda lp, ids: (lp, np.where(np.arange(5) == 4, VOCAB, ids)),
            IDS,
            f"ids in [0, {VOCAB})",
        ),
        (lambda lp, ids: (lp, -ids), IDS, f"ids in [0, {VOCAB})"),
    ],
)
def test_bad_teacher_data_names_sample_and_field(edit, field, needle):
    raw = raw_sample(12, 1)
    lp = np.load(io.BytesIO(raw[f"{LOG_PROBS}.npy"]))
    ids = np.load(io.BytesIO(raw[f"{IDS}.npy"]))
    lp, ids = edit(lp, ids)
    bad = with_member(with_member(raw, LOG_PROBS, lp), IDS, ids)
    with pytest.raises(SampleError) as err:
        decoded(bad, torch.float32)
    assert err.value.sample == "k1" and err.value.field == field and needle in str(err.value)


def test_pickled_npy_is_refused_not_loaded():
    """An object array needs pickle to load: refused with a SampleError, never unpickled."""
    buf = io.BytesIO()
    np.save(buf, np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    raw = {**raw_sample(4, 2), f"{IDS}.npy": buf.getvalue()}
    with pytest.raises(SampleError, match="teacher_topk_ids"):
        decoded(raw, torch.float32)


def test_missing_member_and_ragged_rows_are_named():
    raw = raw_sample(6, 4)
    with pytest.raises(SampleError, match="teacher_topk_ids.npy"):
        decoded({k: v for k, v in raw.items() if not k.startswith(IDS)}, torch.float32)
    ragged = {**raw, f"{IDS}.npy": None, IDS: [[1, 2, 3, 4, 5]] * 5 + [[1, 2]]}
    del ragged[f"{IDS}.npy"]
    with pytest.raises(SampleError, match="K must be constant"):
        decoded(ragged, torch.float32)


def test_collator_rejects_a_batch_mixing_two_k():
    """``K`` declared by name: constant over the batch, checked by the collator too."""
    schema = causal_lm_schema(topk="K", vocab_size=VOCAB)
    a = decoded(raw_sample(5, 0), torch.float32)
    b = {
        k: (v[:, :3] if v.ndim == 2 else v)
        for k, v in decoded(raw_sample(4, 1), torch.float32).items()
    }
    with pytest.raises(SampleError) as err:
        THDCollator(schema=schema, layout=ParallelLayout(tp=2))([a, b])
    assert err.value.sample == 1
