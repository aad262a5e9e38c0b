"""Gemma 4 (``use_bidirectional_attention="vision"``): image and video tokens attend bidirectionally
within their block, read from the config by ``model_contract``. A tiny model (float64) consumes
prealign's packed THD batch (tp=2, cp=2, unsharded) with the masks
``to_hf_kwargs(attention="mask")`` emits and gives every real token the logits of its sample alone
(the model building its masks from ``mm_token_type_ids``; the vision tower is not run: the blocks
are marked by type alone, which is all the mask reads). Without the blocks: caught. A Gemma 4
without bidirectional vision is plain causal and packs without masks."""

from __future__ import annotations

import functools

import pytest
import torch

from prealign.collate import THDCollator, to_hf_kwargs
from prealign.collate.vision import model_contract
from prealign.schemas import BatchSchema, FieldSpec, PadPolicy, ParallelLayout
from prealign.schemas.contract import Consumer, ConsumerUnsupportedError, check_consumer
from prealign.schemas.schema import core_token_fields
from tests.consumers.models import CORRUPT, real_slots, tiny_text_config
from tests.consumers.test_gemma3 import blockless_masks, two_layer_masks

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma4ForConditionalGeneration"):
    pytest.skip("platform: the installed transformers lacks Gemma 4", allow_module_level=True)
VOCAB, WINDOW = 64, 6
LAYOUT = ParallelLayout(tp=2, cp=2, pad_policy=PadPolicy.PER_SEQUENCE)
SCHEMA = BatchSchema(
    name="gemma4",
    ignore_index=-100,
    fields=(
        *core_token_fields(0, -100, VOCAB),
        FieldSpec(
            name="mm_token_type_ids", dtypes=("int64",), pad_value=0, min_value=0, max_value=3
        ),
    ),
)


def config(bidirectional: str | None = "vision"):
    text = tiny_text_config(
        VOCAB,
        head_dim=8,
        global_head_dim=8,
        max_position_embeddings=512,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        use_bidirectional_attention=bidirectional,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    return transformers.Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        boi_token_id=4,
        eoi_token_id=5,
        image_token_id=6,
        video_token_id=7,
        boa_token_id=8,
        eoa_token_index=9,
        audio_token_id=10,
        initializer_range=0.3,
        attn_implementation="sdpa",
    )


@functools.lru_cache(maxsize=None)
def model(bidirectional: str | None = "vision"):
    torch.manual_seed(0)
    return (
        transformers.Gemma4ForConditionalGeneration(config(bidirectional)).to(torch.float64).eval()
    )


def sample(lengths_and_types: list, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    types = torch.cat([torch.full((n,), k) for n, k in lengths_and_types])
    return {
        "input_ids": torch.randint(11, VOCAB, (types.numel(),), generator=g),
        "mm_token_type_ids": types,
    }


SAMPLES = (
    sample([(3, 0), (4, 1), (9, 0), (5, 2), (2, 0)], 1),
    sample([(11, 0)], 2),
    sample([(4, 1), (4, 0), (3, 1), (3, 1), (1, 0), (2, 3), (6, 0)], 3),
)  # type 3 (audio): no block


def worst(batch, kwargs, bidirectional="vision") -> float:
    m = model(bidirectional)
    with torch.no_grad():
        out = m(**kwargs).logits[0]
        diffs = [
            (
                out[slots]
                - m(
                    input_ids=s["input_ids"][None],
                    mm_token_type_ids=s["mm_token_type_ids"][None],
                    use_cache=False,
                ).logits[0]
            )
            .abs()
            .max()
            for slots, s in zip(real_slots(batch), SAMPLES, strict=True)
        ]
    return float(max(diffs))


def packed(bidirectional="vision", attention="mask"):
    batch = THDCollator(schema=SCHEMA, layout=LAYOUT)(list(SAMPLES))
    return batch, to_hf_kwargs(
        batch,
        attention=attention,
        model_config=config(bidirectional),
        mask_dtype=torch.float64,
        labels=False,
    )


def test_the_contract_reads_bidirectional_vision_from_the_config():
    assert model_contract(config()).media_attention == "bidirectional"
    assert model_contract(config()).local_attention == "sliding"
    assert model_contract(config(None)).media_attention == "causal"
    with pytest.raises(ConsumerUnsupportedError, match="gemma4"):
        check_consumer(model_contract(config()), Consumer.hf("flash_attention_2"))
    check_consumer(model_contract(config(None)), Consumer.hf("flash_attention_2"))


@pytest.mark.slow
def test_packed_logits_equal_each_sample_alone():
    batch, kwargs = packed()
    assert set(kwargs["attention_mask"]) == {"sliding_attention", "full_attention"}
    assert worst(batch, kwargs) < 1e-6


@pytest.mark.slow
def test_the_blocks_removed_are_caught():
    batch, kwargs = packed()
    kwargs["attention_mask"] = blockless_masks(batch, WINDOW)
    assert worst(batch, kwargs) > CORRUPT


@pytest.mark.slow
def test_a_causal_gemma4_packs_from_its_positions():
    batch, kwargs = packed(None, attention="positions")
    assert "attention_mask" not in kwargs
    assert worst(batch, kwargs, None) < 1e-6


@pytest.mark.slow
def test_the_other_releases_layer_rule_is_caught():
    """transformers releases differ in which layers get the blocks (5.6 and >= 5.17 sliding only,
    5.10 all): the rule of the other kind of release does not give the installed model's logits."""
    batch, kwargs = packed()
    ours = model_contract(config()).bidirectional_layers
    other = None if ours else ("sliding_attention",)
    kwargs["attention_mask"] = two_layer_masks(batch, WINDOW, bidirectional_layers=other)
    assert worst(batch, kwargs) > CORRUPT
