"""``to_hf_kwargs`` against transformers' own
``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``, ``block_causal_mask`` against a mask
written out per pair, and the HF ``Trainer`` example running in the
suite with a prealign collator."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate import HFAttention, HFCollator, THDCollator, block_causal_mask, to_hf_kwargs
from prealign.schemas import ConfigError, PadPolicy, ParallelLayout, causal_lm_schema
from tests.conftest import examples

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


def _samples(lengths, with_labels: bool, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        s = {"input_ids": torch.randint(1, 1000, (n,), generator=g)}
        if with_labels:  # HF convention: aligned with the tokens, -100 on a prompt
            s["labels"] = s["input_ids"].masked_fill(torch.arange(n) < n // 3, -100)
        out.append(s)
    return out


@given(lengths=st.lists(st.integers(1, 200), min_size=1, max_size=10), with_labels=st.booleans())
@examples(30)
def test_to_hf_kwargs_equals_data_collator_with_flattening(lengths, with_labels):
    samples = _samples(lengths, with_labels, seed=sum(lengths))
    hf = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{k: v.tolist() for k, v in s.items()} for s in samples], return_tensors="pt"
    )
    ours = to_hf_kwargs(THDCollator(schema=causal_lm_schema(), layout=ParallelLayout())(samples))
    assert set(hf) <= set(ours)
    for key, want in hf.items():
        got = ours[key]
        if torch.is_tensor(want):
            assert got.dtype == want.dtype and torch.equal(got, want), key
        else:
            assert type(got) is type(want) and got == want, key
    assert int((ours["labels"] == -100).sum()) >= len(lengths)


def test_padded_layout_keeps_each_padded_sequence_one_varlen_segment():
    samples = _samples([5, 3, 9], False)
    batch = THDCollator(
        schema=causal_lm_schema(),
        layout=ParallelLayout(tp=2, cp=2, pad_policy=PadPolicy.PER_SEQUENCE),
    )(samples)
    kw = to_hf_kwargs(batch)
    assert kw["cu_seq_lens_q"].tolist() == [0, 8, 16, 32] and kw["max_length_q"] == 16
    assert kw["cu_seq_lens_q"].dtype == torch.int32 and kw["input_ids"].shape == (1, 32)
    # HF labels shifted back by the model's own shift are exactly the batch's labels
    shifted = torch.cat((kw["labels"][0, 1:], torch.tensor([-100])))
    assert torch.equal(shifted, batch["labels"][0])
    with pytest.raises(ConfigError, match="unsharded"):
        to_hf_kwargs(
            THDCollator(schema=causal_lm_schema(), layout=ParallelLayout(cp=2), cp_rank=0)(samples)
        )


def _mask_by_pairs(padded: list[int], true: list[int]) -> torch.Tensor:
    """The mask's definition, one (query, key) pair at a time."""
    total = padded[-1]
    seq = [
        next(i for i in range(len(padded) - 1) if padded[i] <= t < padded[i + 1])
        for t in range(total)
    ]
    real = [t - padded[seq[t]] < true[seq[t] + 1] - true[seq[t]] for t in range(total)]
    return torch.tensor(
        [
            [seq[q] == seq[k] and k <= q and (real[k] or k == q) for k in range(total)]
            for q in range(total)
        ]
    )


@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=5),
    tp=st.integers(1, 4),
    cp=st.integers(1, 3),
)
@examples(25)
def test_block_causal_mask_matches_its_definition(lengths, tp, cp):
    batch = THDCollator(
        schema=causal_lm_schema(),
        layout=ParallelLayout(tp=tp, cp=cp, pad_policy=PadPolicy.PER_SEQUENCE),
    )(_samples(lengths, False))
    padded, true = batch["cu_seqlens_padded"], batch["cu_seqlens"]
    mask = block_causal_mask(padded, true)
    assert mask.shape == (1, 1, int(padded[-1]), int(padded[-1])) and mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], _mask_by_pairs(padded.tolist(), true.tolist()))
    assert bool(mask[0, 0].any(-1).all())  # no row without a key (sdpa would give NaN)
    additive = block_causal_mask(padded, true, dtype=torch.float32)
    assert torch.equal(additive == 0, mask)
    assert bool((additive[~mask] == torch.finfo(torch.float32).min).all())


def test_block_causal_mask_golden():
    assert block_causal_mask(torch.tensor([0, 3, 5]))[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    with pytest.raises(ConfigError):
        block_causal_mask(torch.tensor([0, 3]), dtype=torch.int64)


def test_hf_trainer_example_trains_three_steps_with_a_prealign_collator(tmp_path):
    pytest.importorskip("accelerate")  # the Trainer's own requirement
    spec = importlib.util.spec_from_file_location(
        "hf_trainer_example", ROOT / "examples" / "hf_trainer.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    history = example.train(str(tmp_path))
    losses = [row["loss"] for row in history if "loss" in row]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert history[-1]["step"] == 3


def test_hf_collator_is_picklable_and_passes_options():
    import pickle

    coll = pickle.loads(
        pickle.dumps(
            HFCollator(
                collator=THDCollator(schema=causal_lm_schema(), layout=ParallelLayout(tp=2)),
                attention=HFAttention.MASK,
            )
        )
    )
    out = coll(_samples([3, 4], False))
    assert out["attention_mask"].shape == (1, 1, 8, 8) and "cu_seq_lens_q" not in out
