"""A tiny Hugging Face causal LM consumes prealign's unsharded THD batch as it is: for every layout,
each real token's next-token loss, read from the batch's own ``labels`` and ``loss_mask``, equals
the loss of its sample run alone, and pads contribute nothing. transformers (5.x) sees the packing
from ``position_ids`` restarting at 0 with ``attention_mask=None``
(``find_packed_sequence_indices``); the 4-D mask of :func:`prealign.collate.hf.block_causal_mask` is
checked as the alternative.

Each check is also shown to catch a corrupted batch (a shifted label, positions that do not restart,
a mask built from the wrong offsets)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate import THDCollator
from prealign.collate.hf import HFAttention, block_causal_mask, to_hf_kwargs
from prealign.schemas import FP8Recipe, PadPolicy, ParallelLayout, causal_lm_schema, validate_batch
from tests.conftest import examples
from tests.consumers.models import (
    CORRUPT,
    TOL,
    VOCAB,
    causal_lm,
    random_samples,
    real_slots,
    sample_next_token_targets,
    token_ce,
)

pytest.importorskip("transformers")
SCHEMA = causal_lm_schema(vocab_size=VOCAB)
LENGTHS = (7, 1, 23, 12, 40, 3)
LAYOUTS = {
    "none": ParallelLayout(),
    "tp4": ParallelLayout(tp=4),
    "tp2-cp2-per-sequence": ParallelLayout(tp=2, cp=2, pad_policy=PadPolicy.PER_SEQUENCE),
    "cp3": ParallelLayout(cp=3),
    "tp2-fp8": ParallelLayout(tp=2, fp8=FP8Recipe.FP8),
    "tp2-cp2-mxfp8-per-sequence": ParallelLayout(
        tp=2, cp=2, fp8=FP8Recipe.MXFP8, pad_policy=PadPolicy.PER_SEQUENCE
    ),
    "cp2-min-local-rows": ParallelLayout(cp=2, min_local_rows=120),
    "tp2-cp2-buckets": ParallelLayout(tp=2, cp=2, length_buckets=(64, 160, 512)),
}


def packed_logits(model, kwargs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**kwargs).logits[0]


def raw_kwargs(batch: dict) -> dict:
    """The batch fed as it is: ids, positions, no mask, no cache."""
    return {
        "input_ids": batch["input_ids"],
        "position_ids": batch["position_ids"],
        "attention_mask": None,
        "use_cache": False,
    }


def per_token_mismatch(model, batch: dict, samples: list[dict], kwargs: dict) -> tuple[float, int]:
    """Largest difference, over every real token, between the packed run (logits and the next-token
    loss read from the batch's ``labels`` and ``loss_mask``) and each sample run alone; and how many
    real tokens were compared."""
    logits = packed_logits(model, kwargs)
    loss = token_ce(logits, batch["labels"][0]) * batch["loss_mask"][0]
    worst, seen = 0.0, 0
    for slots, sample in zip(real_slots(batch), samples, strict=True):
        alone = packed_logits(model, {"input_ids": sample["input_ids"][None], "use_cache": False})
        labels, trained = sample_next_token_targets(sample)
        want = token_ce(alone, labels) * trained
        worst = max(
            worst,
            float((logits[slots] - alone).abs().max()),
            float((loss[slots] - want).abs().max()),
        )
        seen += slots.numel()
    pads = batch["padding_mask"][0]
    assert float(loss[pads].abs().sum()) == 0.0 and not bool(batch["loss_mask"][0][pads].any())
    return worst, seen


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_packed_loss_equals_each_sample_alone(attn, name):
    layout = LAYOUTS[name]
    samples = random_samples(LENGTHS, seed=len(name), loss_mask=name.startswith("tp2"))
    batch = THDCollator(schema=SCHEMA, layout=layout)(samples)
    validate_batch(batch, SCHEMA, layout)
    model = causal_lm(attn)
    worst, seen = per_token_mismatch(model, batch, samples, raw_kwargs(batch))
    assert seen == sum(LENGTHS) and worst < TOL, (name, worst)
    if name != "none":
        assert bool(batch["padding_mask"].any())  # the layout really padded


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_llama_model_too(attn):
    layout = LAYOUTS["tp2-cp2-buckets"]
    samples = random_samples(LENGTHS, seed=2, loss_mask=True)
    batch = THDCollator(schema=SCHEMA, layout=layout)(samples)
    worst, seen = per_token_mismatch(causal_lm(attn, "llama"), batch, samples, raw_kwargs(batch))
    assert seen == sum(LENGTHS) and worst < TOL


@pytest.mark.parametrize(
    "attn,mask_dtype", [("sdpa", torch.bool), ("eager", torch.float64), ("sdpa", torch.float64)]
)
def test_block_causal_mask_gives_the_same_losses(attn, mask_dtype):
    layout = LAYOUTS["tp2-cp2-per-sequence"]
    samples = random_samples(LENGTHS, seed=3)
    batch = THDCollator(schema=SCHEMA, layout=layout)(samples)
    kwargs = to_hf_kwargs(batch, attention=HFAttention.MASK, mask_dtype=mask_dtype, labels=False)
    worst, seen = per_token_mismatch(causal_lm(attn), batch, samples, kwargs)
    assert seen == sum(LENGTHS) and worst < TOL


def test_the_models_own_loss_on_hf_kwargs_is_the_mean_of_the_per_sample_losses():
    """``to_hf_kwargs`` labels (HF convention, the model shifts) give the model's own loss = the
    mean next-token loss over every trained token of every sample run alone."""
    layout = LAYOUTS["cp2-min-local-rows"]
    samples = random_samples(LENGTHS, seed=5, loss_mask=True)
    batch = THDCollator(schema=SCHEMA, layout=layout)(samples)
    model = causal_lm("sdpa")
    total, count = torch.zeros((), dtype=torch.float64), 0
    for s in samples:
        labels, trained = sample_next_token_targets(s)
        with torch.no_grad():
            total += (
                token_ce(model(input_ids=s["input_ids"][None]).logits[0], labels) * trained
            ).sum()
        count += int(trained.sum())
    for attention in HFAttention:
        with torch.no_grad():
            out = model(**to_hf_kwargs(batch, attention=attention, mask_dtype=torch.float64))
        assert abs(float(out.loss) - float(total / count)) < TOL, attention


def test_pad_tokens_change_nothing():
    """Whatever the pads hold, the real tokens' logits stay the same (they never attend to a
    pad)."""
    layout = LAYOUTS["tp2-cp2-per-sequence"]
    batch = THDCollator(schema=SCHEMA, layout=layout)(random_samples(LENGTHS, seed=9))
    pads = batch["padding_mask"]
    noisy = batch["input_ids"].masked_scatter(pads, torch.randint(1, VOCAB, (int(pads.sum()),)))
    model = causal_lm("eager")
    a = packed_logits(model, raw_kwargs(batch))
    b = packed_logits(model, {**raw_kwargs(batch), "input_ids": noisy})
    real = ~pads[0]
    assert int(pads.sum()) > 10 and float((a[real] - b[real]).abs().max()) < 1e-12


@pytest.mark.slow
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=5),
    tp=st.integers(1, 4),
    cp=st.integers(1, 3),
    policy=st.sampled_from(list(PadPolicy)),
    fp8=st.sampled_from([FP8Recipe.NONE, FP8Recipe.FP8]),
    rows=st.sampled_from([0, 0, 40]),
)
@examples(6)
def test_any_layout_property(lengths, tp, cp, policy, fp8, rows):
    layout = ParallelLayout(tp=tp, cp=cp, pad_policy=policy, fp8=fp8, min_local_rows=rows)
    samples = random_samples(lengths, seed=sum(lengths))
    batch = THDCollator(schema=SCHEMA, layout=layout)(samples)
    worst, seen = per_token_mismatch(causal_lm("sdpa"), batch, samples, raw_kwargs(batch))
    assert seen == sum(lengths) and worst < TOL


# ---- the same checks catch a corrupted batch
# ------------------------------------------------------
CORRUPTED = LAYOUTS["tp2-cp2-per-sequence"]


def _corrupt_case():
    samples = random_samples(LENGTHS, seed=11)
    return samples, THDCollator(schema=SCHEMA, layout=CORRUPTED)(samples)


def test_detects_a_label_shifted_by_one():
    samples, batch = _corrupt_case()
    shifted = {**batch, "labels": torch.roll(batch["labels"], 1, dims=-1)}
    worst, _ = per_token_mismatch(causal_lm("sdpa"), shifted, samples, raw_kwargs(shifted))
    assert worst > CORRUPT


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_detects_positions_that_do_not_restart(attn):
    """Positions counting on across sequences: transformers sees one long sequence, every later
    sample attends to the earlier ones."""
    samples, batch = _corrupt_case()
    flat = {**batch, "position_ids": torch.arange(batch["input_ids"].shape[1])[None]}
    worst, _ = per_token_mismatch(causal_lm(attn), flat, samples, raw_kwargs(flat))
    assert worst > CORRUPT


def test_detects_one_sequence_whose_positions_do_not_restart():
    samples, batch = _corrupt_case()
    pos = batch["position_ids"].clone()
    start, end = batch["cu_seqlens_padded"][2:4].tolist()  # sample 2 continues sample 1's count
    pos[0, start:end] += int(batch["cu_seqlens_padded"][2] - batch["cu_seqlens_padded"][1])
    corrupted = {**batch, "position_ids": pos}
    worst, _ = per_token_mismatch(causal_lm("sdpa"), corrupted, samples, raw_kwargs(corrupted))
    assert worst > CORRUPT


def test_detects_a_mask_built_from_the_true_offsets_of_a_padded_batch():
    """The padded buffer's blocks are ``cu_seqlens_padded``; the true offsets misplace every block
    after the first padded sequence (TE's padded-THD trap, here on the mask)."""
    samples, batch = _corrupt_case()
    assert not torch.equal(batch["cu_seqlens"], batch["cu_seqlens_padded"])
    total = int(batch["cu_seqlens_padded"][-1])
    wrong = torch.cat((batch["cu_seqlens"][:-1], torch.tensor([total], dtype=torch.int32)))
    kwargs = {**raw_kwargs(batch), "attention_mask": block_causal_mask(wrong, dtype=torch.float64)}
    worst, _ = per_token_mismatch(causal_lm("eager"), batch, samples, kwargs)
    assert worst > CORRUPT
