"""Differential tests against verl 0.9.1's ``preprocess_thd_engine`` / ``preprocess_bshd_engine``
(``verl/models/mcore/util.py``), loaded from its file with two tiny stub modules because the
``verl`` package itself needs ray. Our PadPolicy.PER_SEQUENCE (no FP8, no buckets) must give the
same rows, element for element, and the same padded offsets."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate import BSHDCollator, THDCollator
from prealign.schemas import CPLayout, PadPolicy, ParallelLayout
from tests.conftest import TOPK, TOPK_FIELDS, examples, make_samples, schema_for, to_nested

VERL_SPEC = importlib.util.find_spec(
    "verl"
)  # locates the package without importing it (that needs ray)
if VERL_SPEC is None:
    pytest.skip(
        "could not import 'verl': not installed (the README's test command installs it)",
        allow_module_level=True,
    )
pytest.importorskip("megatron.core")
from megatron.core import parallel_state  # noqa: E402


def _stub(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


@pytest.fixture(scope="module")
def verl_util():
    """verl's util module with stub ``verl``, ``verl.utils``, ``verl.utils.device`` and
    ``verl.utils.model``."""
    import transformers.utils.logging  # noqa: F401  (as in verl: gives logging.Logger.warning_once)
    from transformers.utils import ModelOutput

    @dataclass
    class CausalLMOutputForPPO(ModelOutput):
        log_probs: torch.Tensor | None = None

    path = os.path.join(VERL_SPEC.submodule_search_locations[0], "models", "mcore", "util.py")
    stubs = {
        "verl": _stub("verl", __path__=[]),
        "verl.utils": _stub("verl.utils", __path__=[]),
        "verl.utils.device": _stub("verl.utils.device", is_npu_available=False),
        "verl.utils.model": _stub("verl.utils.model", CausalLMOutputForPPO=CausalLMOutputForPPO),
    }
    with pytest.MonkeyPatch.context() as mp:
        for name, module in stubs.items():
            mp.setitem(sys.modules, name, module)
        spec = importlib.util.spec_from_file_location("verl_mcore_util_under_test", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def run_verl(util, name: str, *args, tp: int, cp: int, rank: int, **kwargs):
    """``util.name(*args, **kwargs)`` with megatron's parallel_state getters patched to (tp, cp,
    rank). megatron-core 0.16 has no ``PackedSeqParams.cp_partition_mode``, which verl requires for
    its contiguous layout; a namespace stands in for PackedSeqParams there (the rows do not depend
    on it)."""
    with pytest.MonkeyPatch.context() as mp:
        for getter, value in [
            ("get_tensor_model_parallel_world_size", tp),
            ("get_tensor_model_parallel_rank", 0),
            ("get_context_parallel_world_size", cp),
            ("get_context_parallel_rank", rank),
        ]:
            mp.setattr(parallel_state, getter, lambda value=value: value)
        if kwargs.get("cp_layout", "zigzag") != "zigzag":
            mp.setattr(util, "_PACKED_SEQ_PARAMS_HAS_CP_PARTITION_MODE", True)
            mp.setattr(util, "PackedSeqParams", lambda **kw: types.SimpleNamespace(**kw))
        return getattr(util, name)(*args, **kwargs)


@st.composite
def verl_case(draw, cp_layouts=tuple(CPLayout)):
    lengths = draw(
        st.lists(st.one_of(st.integers(1, 16), st.integers(1, 1500)), min_size=1, max_size=5)
    )
    return (
        lengths,
        draw(st.integers(1, 8)),
        draw(st.integers(1, 4)),
        draw(st.sampled_from(cp_layouts)),
    )


@given(case=verl_case())
@examples(60)
def test_thd_equals_preprocess_thd_engine(verl_util, case):
    lengths, tp, cp, cp_layout = case
    layout = ParallelLayout(tp=tp, cp=cp, pad_policy=PadPolicy.PER_SEQUENCE, cp_layout=cp_layout)
    samples = make_samples(lengths, topk=TOPK)
    nested = to_nested(samples)
    compared = 0
    for rank in range(cp):
        ours = THDCollator(schema=schema_for(TOPK), layout=layout, cp_rank=rank)(nested)
        real = ~ours["padding_mask"][0]
        for name in ("input_ids", *TOPK_FIELDS):
            theirs, params, positions = run_verl(
                verl_util,
                "preprocess_thd_engine",
                nested[name],
                tp=tp,
                cp=cp,
                rank=rank,
                cp_layout=cp_layout.value,
            )
            assert theirs.shape == ours[name].shape and theirs.dtype == ours[name].dtype
            assert torch.equal(theirs[0][real], ours[name][0][real]), (name, rank)
            assert torch.equal(theirs, ours[name]), (
                name,
                rank,
            )  # pads: verl's zeros are our pad values here
            compared += int(real.sum())
        assert torch.equal(positions[0][real], ours["position_ids"][0][real])
        for cu in (
            params.cu_seqlens_q,
            params.cu_seqlens_kv,
            params.cu_seqlens_q_padded,
            params.cu_seqlens_kv_padded,
        ):
            assert torch.equal(cu, ours["cu_seqlens_padded"])
        assert params.max_seqlen_q == int(ours["max_seqlen"])
    assert compared == 3 * sum(lengths)


@given(case=verl_case(cp_layouts=(CPLayout.ZIGZAG,)))
@examples(40)
def test_thd_labels_equal_verl_rolled_ids_inside_each_sequence(verl_util, case):
    """verl's ``need_roll`` ids are the next-token labels; they differ only on each sequence's last
    token (verl wraps to the sequence's first token, we give the ignore index)."""
    lengths, tp, cp, _ = case
    layout = ParallelLayout(tp=tp, cp=cp, pad_policy=PadPolicy.PER_SEQUENCE)
    nested = to_nested(make_samples(lengths))
    compared = 0
    for rank in range(cp):
        ours = THDCollator(schema=schema_for(None), layout=layout, cp_rank=rank)(nested)
        rolled, _, _ = run_verl(
            verl_util,
            "preprocess_thd_engine",
            nested["input_ids"],
            tp=tp,
            cp=cp,
            rank=rank,
            need_roll=True,
        )
        inner = ~ours["padding_mask"][0] & (ours["labels"][0] != -100)
        assert torch.equal(rolled[0][inner], ours["labels"][0][inner])
        compared += int(inner.sum())
    assert compared == sum(
        n - 1 for n in lengths
    )  # every label but each sequence's last was compared


@given(case=verl_case(cp_layouts=(CPLayout.ZIGZAG,)))
@examples(60)
def test_bshd_equals_preprocess_bshd_engine(verl_util, case):
    lengths, tp, cp, _ = case
    layout = ParallelLayout(tp=tp, cp=cp, pad_policy=PadPolicy.PER_SEQUENCE)
    samples = make_samples(lengths, topk=TOPK)
    nested = to_nested(samples)
    for rank in range(cp):
        ours = BSHDCollator(schema=schema_for(TOPK), layout=layout, cp_rank=rank)(nested)
        assert all(
            torch.equal(v, w) if torch.is_tensor(v) else v == w
            for v, w in zip(
                ours.values(),
                BSHDCollator(schema=schema_for(TOPK), layout=layout, cp_rank=rank)(
                    samples
                ).values(),
            )
        )
        for name in ("input_ids", *TOPK_FIELDS):
            theirs, mask, positions = run_verl(
                verl_util, "preprocess_bshd_engine", nested[name], tp=tp, cp=cp, rank=rank
            )
            assert torch.equal(theirs, ours[name]) and theirs.dtype == ours[name].dtype, (
                name,
                rank,
            )
            assert torch.equal(mask, ours["attention_mask"])
            assert torch.equal(positions, ours["position_ids"])
