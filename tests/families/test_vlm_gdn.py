"""Gated DeltaNet packing metadata in every ``to_hf_kwargs`` mode, and one "has linear attention"
test for every way a model is named (a transformers config, its dict, a :class:`VisionFamily`). The
fast kernels are stood in for by empty ``fla`` / ``causal_conv1d`` packages on ``sys.path``:
``check_gdn_packing`` only asks whether they import."""

from __future__ import annotations

import importlib

import pytest
import torch

from prealign.collate import HFAttention, MRoPECollator, THDCollator, to_hf_kwargs
from prealign.collate.hf import GDN_MIN_TRANSFORMERS
from prealign.collate.vision import has_linear_attention, vision_family
from prealign.schemas import ParallelLayout, vlm_schema
from prealign.schemas.errors import PackingUnsupportedError
from tests.vlm_families import tiny_config, vision_sample

transformers = pytest.importorskip("transformers")
VERSION = tuple(int(p) for p in transformers.__version__.split(".")[:2])


def gdn_config():
    cfg = tiny_config("qwen3_5")
    cfg.text_config.layer_types = ["linear_attention", "full_attention"]
    return cfg


def packed_batch() -> dict:
    samples = [vision_sample("qwen3_5", [5, ("image", 2, 2), 3]), vision_sample("qwen3_5", [7])]
    return MRoPECollator(
        collator=THDCollator(schema=vlm_schema(), layout=ParallelLayout(tp=2)),
        model_config=gdn_config(),
    )(samples)


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    """Importable (empty) ``fla`` and ``causal_conv1d`` packages for this test only."""
    for name in ("fla", "causal_conv1d"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()


@pytest.mark.parametrize("as_family", [False, True])
@pytest.mark.parametrize("mode", list(HFAttention))
def test_gdn_models_get_cu_seq_lens_and_seq_idx_in_every_mode(kernels, mode, as_family):
    """transformers' Gated DeltaNet reads ``cu_seq_lens_q`` whatever the attention mode; a family
    names the model as well as its config."""
    batch = packed_batch()
    cfg = vision_family(gdn_config()) if as_family else gdn_config()
    if VERSION < GDN_MIN_TRANSFORMERS:  # the floor's GDN does not pass cu_seq_lens_q on: refused
        with pytest.raises(PackingUnsupportedError, match="does not pass cu_seq_lens_q"):
            to_hf_kwargs(batch, attention=mode, model_config=cfg)
        return
    kw = to_hf_kwargs(batch, attention=mode, model_config=cfg)
    padded = batch["cu_seqlens_padded"]
    assert (
        kw["cu_seq_lens_q"].dtype == torch.int32 and kw["cu_seq_lens_q"].tolist() == padded.tolist()
    )
    assert kw["cu_seq_lens_k"].tolist() == padded.tolist()
    assert kw["max_length_q"] == kw["max_length_k"] == int(padded.diff().max())
    assert kw["seq_idx"].tolist() == [[0] * int(padded[1]) + [1] * int(padded[2] - padded[1])]
    assert ("attention_mask" in kw) == (mode is HFAttention.MASK)


@pytest.mark.parametrize("mode", [HFAttention.POSITIONS, HFAttention.MASK])
def test_full_attention_models_get_no_varlen_keys_outside_varlen(kernels, mode):
    kw = to_hf_kwargs(packed_batch(), attention=mode, model_config=tiny_config("qwen3_5"))
    assert not {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "seq_idx"} & set(kw)


def test_a_family_is_checked_like_its_config():
    """Without the kernels, a packed row is refused for the family as for the config (the family's
    ``linear_attention`` is the same test)."""
    cfg = gdn_config()
    for named in (cfg, cfg.to_dict(), vision_family(cfg)):
        assert has_linear_attention(named)
        with pytest.raises(PackingUnsupportedError):
            to_hf_kwargs(packed_batch(), model_config=named)
    for named in (
        tiny_config("qwen3_5"),
        vision_family(tiny_config("qwen3_vl")),
        {"layer_types": ["full_attention"]},
    ):
        assert not has_linear_attention(named)
    assert has_linear_attention({"layer_types": ["linear_attention"]})


def test_one_sequence_of_a_static_batch_is_not_packing():
    """Under ``max_seqs`` the offsets repeat the total past the real sequences: one sequence is no
    packing, so a GDN model without the kernels takes it."""
    layout = ParallelLayout(length_buckets=(64,), max_seqs=4)
    batch = MRoPECollator(
        collator=THDCollator(schema=vlm_schema(), layout=layout), model_config=gdn_config()
    )([vision_sample("qwen3_5", [5, ("image", 2, 2), 3])])
    assert batch["cu_seqlens_padded"].numel() == 5
    kw = to_hf_kwargs(
        batch, model_config=gdn_config()
    )  # no PackingUnsupportedError: one real sequence
    assert kw["seq_idx"].shape[-1] == 64
