"""Mutation test: deliberate faults patched into the collator in-process must each be caught.

The validator (``prealign.schemas``) computes what every slot must hold from the Megatron/TE
definition and imports nothing from ``prealign.collate``, so a fault in the collator's index
arithmetic cannot fool it. Each mutant names its killer: ``validate`` (``validate_batch`` reports a
violation on some rank of some case) or ``reference`` (the property test
``test_collate_thd.py::test_every_rank_matches_the_reference_and_unshards_to_the_input`` and its
BSHD twin: the batch differs from ``conftest.reference_thd`` / ``reference_bshd``; for faults that
keep every invariant a batch can show on its own, e.g. a sequence's first token read from the
previous one).
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

import prealign.collate.assemble as assemble
import prealign.collate.bshd as bshd
import prealign.collate.indices as indices
import prealign.collate.inverse as inverse
import prealign.collate.samples as samples_mod
import prealign.collate.thd as thd
from prealign.collate import BSHDCollator, THDCollator
from prealign.collate.indices import Chunks, GatherPlan
from prealign.schemas import CPLayout, ParallelLayout, validate_batch
from tests import ROOT
from tests.conftest import SCHEMA_TOPK, TOPK, make_samples, reference_bshd, reference_thd

LENGTHS = [5, 9, 2, 7]
LAYOUTS = [
    ParallelLayout(),
    ParallelLayout(tp=2, cp=2),
    ParallelLayout(cp=3),
    ParallelLayout(tp=2, cp=2, cp_layout="contiguous"),
    ParallelLayout(tp=4, fp8="mxfp8"),
    ParallelLayout(tp=2, cp=2, fp8="fp8"),
]


def outputs():
    """``(collator, layout, rank, samples, batch)`` for every case and rank (None: unsharded)."""
    samples = make_samples(LENGTHS, topk=TOPK)
    for cls in (THDCollator, BSHDCollator):
        for layout in LAYOUTS:
            for rank in (None, *range(layout.cp)):
                yield (
                    cls,
                    layout,
                    rank,
                    samples,
                    cls(schema=SCHEMA_TOPK, layout=layout, cp_rank=rank)(samples),
                )


def validate_kills(batch, layout) -> bool:
    return bool(validate_batch(batch, SCHEMA_TOPK, layout, raise_on_error=False))


def reference_kills(cls, layout, rank, samples, batch) -> bool:
    """The batch differs from the slow reference of the property tests (any field, any shape)."""
    if cls is THDCollator:
        padded = batch["cu_seqlens_padded"].diff().tolist()
        if padded != layout.padded_lengths(torch.tensor(LENGTHS)).tolist():
            return True
        want, lead = reference_thd(samples, padded, SCHEMA_TOPK, layout, rank), (1,)
    else:
        s = layout.bshd_length(max(LENGTHS), len(LENGTHS))
        want, lead = reference_bshd(samples, s, SCHEMA_TOPK, layout, rank), ()
    for name, w in want.items():
        got = batch[name]
        if got.shape != (*lead, *w.shape) or not torch.equal(got.reshape(w.shape), w.to(got.dtype)):
            return True
    return False


# ---- the mutants
# ------------------------------------------------------------------------------------
def _everywhere(mp, name: str, mutant) -> None:
    """Patch ``name`` where it is defined and wherever the collators imported it: a consistent bug,
    which a checker reusing the collator's arithmetic would share."""
    for module in (indices, thd, bshd, inverse):
        if hasattr(module, name):
            mp.setattr(module, name, mutant)


def swapped_zigzag_chunks(mp):
    """A rank keeps chunk 2cp-1-r before chunk r."""
    orig = indices.cp_chunks

    def mutant(padded, layout, cp_rank):
        c = orig(padded, layout, cp_rank)
        if cp_rank is None or layout.cp == 1 or layout.cp_layout is not CPLayout.ZIGZAG:
            return c
        return Chunks(c.seq, c.start.reshape(-1, 2)[:, ::-1].reshape(-1).copy(), c.length)

    _everywhere(mp, "cp_chunks", mutant)


def zigzag_wrong_chunk(mp):
    """Rank r keeps chunks r and 2cp-2-r (an off-by-one in the mirror chunk)."""
    orig = indices.cp_chunks

    def mutant(padded, layout, cp_rank):
        c = orig(padded, layout, cp_rank)
        if cp_rank is None or layout.cp == 1 or layout.cp_layout is not CPLayout.ZIGZAG:
            return c
        start = c.start.copy()
        start[1::2] -= c.length[1::2]
        return Chunks(c.seq, start, c.length)

    _everywhere(mp, "cp_chunks", mutant)


def contiguous_off_by_one(mp):
    """Contiguous CP: rank r > 0 starts one row early."""
    orig = indices.cp_chunks

    def mutant(padded, layout, cp_rank):
        if (
            cp_rank is None
            or cp_rank == 0
            or layout.cp == 1
            or layout.cp_layout is not CPLayout.CONTIGUOUS
        ):
            return orig(padded, layout, cp_rank)
        padded = indices.as_numpy(padded)
        cu = np.concatenate(([0], np.cumsum(padded)))
        local = int(cu[-1]) // layout.cp
        lo, hi = cp_rank * local - 1, (cp_rank + 1) * local - 1
        begin, end = np.clip(cu[:-1], lo, hi), np.clip(cu[1:], lo, hi)
        return Chunks(np.arange(padded.size), begin - cu[:-1], end - begin)

    _everywhere(mp, "cp_chunks", mutant)


def offsets_off_by_one(mp):
    """cu_seqlens_padded: every inner offset one too far."""
    orig = indices.lengths_to_cu_seqlens

    def mutant(lengths, dtype=torch.int32):
        cu = orig(lengths, dtype).clone()
        cu[1:-1] += 1
        return cu

    _everywhere(mp, "lengths_to_cu_seqlens", mutant)


def cu_seqlens_padded_not_padded(mp):
    """cu_seqlens_padded holds the true offsets."""
    orig = THDCollator.__call__

    def mutant(self, batch):
        out = orig(self, batch)
        out["cu_seqlens_padded"] = out["cu_seqlens"].clone()
        return out

    mp.setattr(THDCollator, "__call__", mutant)


def labels_not_shifted(mp):
    """labels[j] = token j instead of token j+1 (read from the rows, or copied from input_ids)."""
    orig = assemble.gather

    def mutant(source, index, plan, flat, check=None, shift=0):
        return orig(source, index, plan, flat, check, 0)

    mp.setattr(assemble, "gather", mutant)
    mp.setattr(
        assemble,
        "_next_of_gathered",
        lambda rows, gathered, plan, no_next: plan.next_rows(gathered.clone(), 0, no_next),
    )


def labels_of_a_chunk_end_from_the_next_slot(mp):
    """The last real slot of a chunk takes the next slot's token (a pad, or under CP the token of
    another chunk) instead of its own next row: consistent where a chunk ends a sequence, so the
    reference (the next token held by another CP rank) sees it."""

    def edit(plan):
        plan.run_ends = plan.run_ends[:0]
        return plan

    _plan_mutant(mp, edit)


def labels_on_pads_copied_from_the_next_slot(mp):
    """Pad slots of the labels hold the next slot's token instead of the ignore index."""

    def edit(plan):
        plan.pad_slots = plan.pad_slots[:0]
        return plan

    _plan_mutant(mp, edit)


def labels_cross_the_boundary(mp):
    """A sequence's last label is the next sequence's first token."""
    mp.setattr(GatherPlan, "next_rows", lambda self, gathered, dim, no_next: gathered)


def wrong_pad_value(mp):
    """Pads hold the pad value + 1."""
    orig = samples_mod._constant_pad_rows
    mp.setattr(
        samples_mod,
        "_constant_pad_rows",
        lambda shape, dtype, dim, pad, nxt: orig(shape, dtype, dim, pad + 1, nxt),
    )


def _plan_mutant(mp, edit):
    orig = indices.gather_plan

    def mutant(lengths, chunks, cu_seqlens=None):
        return edit(orig(lengths, chunks, cu_seqlens))

    _everywhere(mp, "gather_plan", mutant)


def positions_restart_in_pads(mp):
    """Pad positions restart at 0 instead of continuing L, L+1, ..."""

    def edit(plan):
        plan.positions = torch.where(plan.is_pad, 0, plan.positions)
        return plan

    _plan_mutant(mp, edit)


def first_token_from_the_previous_row(mp):
    """Every real slot reads the row before its own: the first token of a sequence is the previous
    sequence's last. Consistent in itself (labels are still the next slot's id): only the reference
    sees it."""

    def edit(plan):
        plan.src = torch.where(plan.is_pad, plan.src, (plan.src - 1).clamp(min=0))
        return plan

    _plan_mutant(mp, edit)


def padding_mask_off_by_one(mp):
    """is_pad shifted by one slot."""

    def edit(plan):
        plan.is_pad = plan.is_pad.roll(1)
        return plan

    _plan_mutant(mp, edit)


def topk_not_sharded(mp):
    """Teacher top-k rows gathered for the whole batch on every CP rank."""
    orig = assemble.token_fields

    def mutant(schema, flat, plan, unsharded_plan=None):
        fields = tuple(
            dataclasses.replace(f, cp_sharded=False) if f.name.startswith("teacher_") else f
            for f in schema.fields
        )
        return orig(dataclasses.replace(schema, fields=fields), flat, plan, unsharded_plan)

    mp.setattr(thd, "token_fields", mutant)
    mp.setattr(bshd, "token_fields", mutant)


def topk_rows_of_the_next_rank(mp):
    """Teacher top-k rows of CP rank r+1 shipped on rank r (same shape, wrong rows)."""
    orig = THDCollator.__call__

    def mutant(self, batch):
        out = orig(self, batch)
        if self.cp_rank is not None and self.layout.cp > 1:
            other = orig(
                dataclasses.replace(self, cp_rank=(self.cp_rank + 1) % self.layout.cp), batch
            )
            for name in ("teacher_topk_ids", "teacher_topk_log_probs"):
                out[name] = other[name]
        return out

    mp.setattr(THDCollator, "__call__", mutant)


def loss_mask_on_the_last_token(mp):
    """The loss mask is 1 on every real slot, the last of each sequence included."""
    mp.setattr(
        assemble,
        "_loss_mask",
        lambda spec, schema, flat, plan, labels, from_ids: (~plan.is_pad).to(spec.dtype),
    )


def max_seqlen_of_the_true_lengths(mp):
    orig = THDCollator.__call__

    def mutant(self, batch):
        out = orig(self, batch)
        out["max_seqlen"] = out["cu_seqlens"].diff().max().reshape(1).to(torch.int32)
        return out

    mp.setattr(THDCollator, "__call__", mutant)


def cp_rank_metadata_always_zero(mp):
    orig = assemble.non_token_fields

    def mutant(flat, schema, layout, cp_rank):
        return orig(flat, schema, layout, None if cp_rank is None else 0)

    mp.setattr(thd, "non_token_fields", mutant)
    mp.setattr(bshd, "non_token_fields", mutant)


def fp8_aligned_on_t_local_only(mp):
    """The rule before issue 8: T/cp a multiple of lcm(tp, fp8), not T/(cp*tp) of fp8."""
    mp.setattr(
        ParallelLayout,
        "local_multiple",
        property(lambda self: int(np.lcm(self.sp_size, self.fp8.value))),
    )
    mp.setattr(
        ParallelLayout,
        "bshd_multiple",
        lambda self, b: int(
            np.lcm.reduce(
                [
                    2 * self.cp if self.zigzag else 1,
                    self.cp * self.sp_size,
                    self.cp * self.fp8.value // int(np.gcd(b, self.fp8.value)),
                ]
            )
        ),
    )


def attention_mask_inverted(mp):
    orig = BSHDCollator.__call__

    def mutant(self, batch):
        out = orig(self, batch)
        out["attention_mask"] = ~out["attention_mask"]
        return out

    mp.setattr(BSHDCollator, "__call__", mutant)


MUTANTS = {
    swapped_zigzag_chunks: "validate",
    zigzag_wrong_chunk: "validate",
    contiguous_off_by_one: "validate",
    offsets_off_by_one: "validate",
    cu_seqlens_padded_not_padded: "validate",
    labels_not_shifted: "validate",
    labels_cross_the_boundary: "validate",
    labels_of_a_chunk_end_from_the_next_slot: "reference",
    labels_on_pads_copied_from_the_next_slot: "validate",
    wrong_pad_value: "validate",
    positions_restart_in_pads: "validate",
    padding_mask_off_by_one: "validate",
    topk_not_sharded: "validate",
    loss_mask_on_the_last_token: "validate",
    max_seqlen_of_the_true_lengths: "validate",
    cp_rank_metadata_always_zero: "validate",
    fp8_aligned_on_t_local_only: "validate",
    attention_mask_inverted: "validate",
    first_token_from_the_previous_row: "reference",
    topk_rows_of_the_next_rank: "reference",
}


def test_the_clean_collator_passes_both_killers():
    seen = 0
    for cls, layout, rank, samples, batch in outputs():
        assert not validate_kills(batch, layout), (cls.__name__, layout, rank)
        assert not reference_kills(cls, layout, rank, samples, batch), (cls.__name__, layout, rank)
        seen += 1
    assert seen == 2 * sum(1 + lay.cp for lay in LAYOUTS)


@pytest.mark.parametrize("mutant", list(MUTANTS), ids=lambda m: m.__name__)
def test_every_mutant_is_killed(mutant, monkeypatch):
    mutant(monkeypatch)
    killer = MUTANTS[mutant]
    kills = 0
    for cls, layout, rank, samples, batch in outputs():
        kills += (
            validate_kills(batch, layout)
            if killer == "validate"
            else reference_kills(cls, layout, rank, samples, batch)
        )
    assert kills > 0, f"mutant {mutant.__name__} survived ({killer})"


# ---- the validator stands alone
# -------------------------------------------------------------------------
def test_schemas_imports_nothing_from_collate_or_loaders():
    seen = 0
    for path in sorted((ROOT / "schemas").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                seen += 1
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                assert not any(
                    n.startswith(("prealign.collate", "prealign.loaders", "collate", "loaders"))
                    for n in names
                ), f"{path.name}:{node.lineno} imports {names}"
                assert not (isinstance(node, ast.ImportFrom) and node.level > 1), (
                    f"{path.name}:{node.lineno}"
                )
    assert seen > 10


@pytest.mark.slow
def test_validating_a_batch_loads_no_collate_module(subprocess_env):
    code = """
import sys, torch
from prealign.schemas import ParallelLayout, causal_lm_schema, validate_batch
i32 = torch.int32
b = {"input_ids": torch.tensor([[3, 4, 5, 0]]), "labels": torch.tensor([[4, 5, -100, -100]]),
     "loss_mask": torch.tensor([[1.0, 1.0, 0.0, 0.0]]),
     "position_ids": torch.tensor([[0, 1, 2, 3]]),
     "padding_mask": torch.tensor([[False, False, False, True]]),
     "cu_seqlens": torch.tensor([0, 3], dtype=i32),
     "cu_seqlens_padded": torch.tensor([0, 4], dtype=i32),
     "max_seqlen": torch.tensor([4], dtype=i32)}
assert validate_batch(b, causal_lm_schema(), ParallelLayout(cp=2)) == []
b["labels"][0, 0] = 5
found = validate_batch(b, causal_lm_schema(), ParallelLayout(cp=2), raise_on_error=False)
assert [v.path for v in found] == ["labels[slot 0]"]
loaded = sorted(m for m in sys.modules if m.startswith(("prealign.collate", "prealign.loaders")))
assert loaded == [], loaded
print("alone")
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "alone", out.stderr
