"""Differential test against Hugging Face's DataCollatorWithFlattening (no alignment, no CP): with
tp = cp = 1 our THD batch is its packed batch, with labels already shifted (Megatron convention)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate import THDCollator
from prealign.schemas import ParallelLayout, causal_lm_schema
from tests.conftest import examples

transformers = pytest.importorskip("transformers")


@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=12), with_labels=st.booleans())
@examples(60)
def test_thd_equals_hf_flattening_collator_when_unaligned(lengths, with_labels):
    g = torch.Generator().manual_seed(sum(lengths))
    samples = []
    for n in lengths:
        ids = torch.randint(1, 1000, (n,), generator=g)
        s = {"input_ids": ids}
        if with_labels:  # HF convention: labels aligned with the tokens, -100 on the prompt
            labels = ids.clone()
            labels[: n // 3] = -100
            s["labels"] = labels
        samples.append(s)
    hf = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{k: v.tolist() for k, v in s.items()} for s in samples], return_tensors="pt"
    )
    ours = THDCollator(schema=causal_lm_schema(), layout=ParallelLayout())(samples)

    assert torch.equal(ours["input_ids"], hf["input_ids"])
    assert torch.equal(ours["position_ids"], hf["position_ids"])
    assert ours["cu_seqlens"].tolist() == hf["cu_seq_lens_q"].tolist()
    assert int(ours["max_seqlen"]) == int(hf["max_length_q"])
    # HF marks each sequence's first label -100 and lets the model shift; ours is that stream
    # shifted left by one, so each sequence's last label is -100 and no label crosses a boundary
    shifted = torch.cat((hf["labels"][0, 1:], torch.tensor([-100])))
    assert torch.equal(ours["labels"][0], shifted)
    assert torch.equal(ours["loss_mask"][0], (shifted != -100).float())
    assert int((ours["labels"] == -100).sum()) >= len(lengths)
