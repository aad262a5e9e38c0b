"""Top-k distillation on a packed batch: KL(teacher || student) on the teacher's top-k, read from
the batch's ``teacher_topk_log_probs`` / ``teacher_topk_ids`` (aligned with the logits at each
position) and weighted by its ``loss_mask``, equals the same loss of every sample run alone, token
by token and in total. A teacher shifted by one slot is caught."""

from __future__ import annotations

import pytest
import torch

from prealign.collate import THDCollator
from prealign.schemas import FP8Recipe, PadPolicy, ParallelLayout, causal_lm_schema, validate_batch
from tests.consumers.models import (
    CORRUPT,
    TOL,
    VOCAB,
    causal_lm,
    random_samples,
    real_slots,
    sample_next_token_targets,
    topk_kl,
)

pytest.importorskip("transformers")
K = 8
SCHEMA = causal_lm_schema(topk=K, vocab_size=VOCAB)
LENGTHS = (9, 2, 31, 14, 1)
LAYOUTS = {
    "tp2-cp2-per-sequence": ParallelLayout(tp=2, cp=2, pad_policy=PadPolicy.PER_SEQUENCE),
    "cp3-fp8": ParallelLayout(cp=3, fp8=FP8Recipe.FP8),
    "tp2-cp2-buckets-min-rows": ParallelLayout(
        tp=2, cp=2, length_buckets=(128, 256), min_local_rows=40
    ),
}


def packed_kl(model, batch: dict) -> torch.Tensor:
    """Per-slot distillation loss ``[T]`` of the packed batch, ``loss_mask`` applied."""
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits[0]
    kl = topk_kl(logits, batch["teacher_topk_log_probs"][0], batch["teacher_topk_ids"][0])
    return kl * batch["loss_mask"][0]


def compare(model, batch: dict, samples: list[dict]) -> tuple[float, float, int]:
    """(largest per-token difference, difference of the mean losses, real tokens compared)."""
    packed = packed_kl(model, batch)
    worst, total, weight, seen = 0.0, 0.0, 0.0, 0
    for slots, s in zip(real_slots(batch), samples, strict=True):
        with torch.no_grad():
            logits = model(input_ids=s["input_ids"][None], use_cache=False).logits[0]
        _, trained = sample_next_token_targets(s)
        want = topk_kl(logits, s["teacher_topk_log_probs"], s["teacher_topk_ids"]) * trained
        worst = max(worst, float((packed[slots] - want).abs().max()))
        total, weight, seen = (
            total + float(want.sum()),
            weight + float(trained.sum()),
            seen + slots.numel(),
        )
    mean_gap = abs(float(packed.sum() / batch["loss_mask"].sum()) - total / weight)
    return worst, mean_gap, seen


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_packed_topk_kl_equals_each_sample_alone(name):
    layout = LAYOUTS[name]
    samples = random_samples(LENGTHS, seed=1, topk=K, loss_mask=True)
    batch = THDCollator(schema=SCHEMA, layout=layout)(samples)
    validate_batch(batch, SCHEMA, layout)
    worst, mean_gap, seen = compare(causal_lm("sdpa"), batch, samples)
    assert seen == sum(LENGTHS) and worst < TOL and mean_gap < TOL, (worst, mean_gap)
    pads = batch["padding_mask"][0]
    assert bool(pads.any()) and bool(torch.isfinite(packed_kl(causal_lm("sdpa"), batch)).all())


@pytest.mark.parametrize("shift", [1, -1])
def test_detects_a_teacher_shifted_by_one_slot(shift):
    samples = random_samples(LENGTHS, seed=1, topk=K, loss_mask=True)
    batch = THDCollator(schema=SCHEMA, layout=LAYOUTS["tp2-cp2-per-sequence"])(samples)
    corrupted = {
        **batch,
        **{
            k: torch.roll(batch[k], shift, dims=1)
            for k in ("teacher_topk_log_probs", "teacher_topk_ids")
        },
    }
    worst, mean_gap, _ = compare(causal_lm("sdpa"), corrupted, samples)
    assert worst > CORRUPT and mean_gap > 0
