"""A tiny Llama 4 text model (float64, random weights, fixed seed) consumes prealign's packed THD
batch (tp=2, cp=2 layout, every rank unsharded): with the per-layer-type masks
``to_hf_kwargs(attention="mask")`` emits (``chunked_attention`` layers: chunks counted from each
sequence's start; ``full_attention``: causal per sequence) the logits at every real token equal
those of each sequence alone, where the model builds its own chunked mask. Sequences are not
multiples of the chunk, so the chunks counted from the row's start (what the model itself would do
with a packed row) are caught. The flex-attention description equals the 4-D masks; the contract
lets eager / sdpa / flex pack and refuses flash; a row longer than the attention-temperature floor
is refused (the control shows why)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from prealign.collate import THDCollator, to_hf_kwargs
from prealign.collate.vision import model_contract
from prealign.collate.vision.attention import TokenMaskIndex, layer_masks, packed_token_mask
from prealign.schemas import ParallelLayout, causal_lm_schema
from prealign.schemas.contract import Consumer, ConsumerUnsupportedError, check_consumer
from prealign.schemas.errors import PackingUnsupportedError
from tests.consumers.models import CORRUPT, assert_flex_equals_dense, real_slots

transformers = pytest.importorskip("transformers")
VOCAB, CHUNK, TOL = 64, 5, 1e-6  # 5: no multiple of the padding (2 * tp * cp = 8)
LAYOUT = ParallelLayout(tp=2, cp=2)
SCHEMA = causal_lm_schema(vocab_size=VOCAB)
LENGTHS = (
    11,
    7,
    13,
    6,
)  # none a multiple of CHUNK; padded starts 0, 16, 24, 40: mid-chunk of the row


def tiny_config(attn: str = "sdpa", floor_scale: int = 8192):
    """2 dense layers: a RoPE layer with chunked attention (chunk 5) and a NoPE layer with full
    attention (the temperature-tuned one), as Llama 4 interleaves them."""
    return transformers.Llama4TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        intermediate_size_mlp=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        no_rope_layers=[1, 0],
        attention_chunk_size=CHUNK,
        moe_layers=[],
        initializer_range=0.3,
        floor_scale=floor_scale,
        pad_token_id=0,
        attn_implementation=attn,
    )


@functools.lru_cache(maxsize=None)
def tiny_model(attn: str = "sdpa", floor_scale: int = 8192):
    torch.manual_seed(0)
    return transformers.Llama4ForCausalLM(tiny_config(attn, floor_scale)).to(torch.float64).eval()


def samples() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g)} for n in LENGTHS]


def packed(attention: str = "mask", floor_scale: int = 8192):
    batch = THDCollator(schema=SCHEMA, layout=LAYOUT)(samples())
    return batch, to_hf_kwargs(
        batch,
        attention=attention,
        model_config=tiny_config(floor_scale=floor_scale),
        mask_dtype=torch.float64,
        labels=False,
    )


def worst(batch: dict, kwargs: dict, attn: str = "sdpa", floor_scale: int = 8192) -> float:
    model = tiny_model(attn, floor_scale)
    with torch.no_grad():
        out = model(**kwargs).logits[0]
        diffs = [
            (out[slots] - model(input_ids=s["input_ids"][None], use_cache=False).logits[0])
            .abs()
            .max()
            for slots, s in zip(real_slots(batch), samples(), strict=True)
        ]
    return float(max(diffs))


def row_chunked_masks(batch: dict) -> dict:
    """Negative control: the same masks with chunks counted from the row's start (global chunk
    boundaries), still inside each sequence: what the model's own chunked mask does to a packed
    row."""
    index = TokenMaskIndex.of(batch["cu_seqlens_padded"], batch["cu_seqlens"], None)
    index = dataclasses.replace(index, pos=torch.arange(index.pos.numel()))
    return layer_masks(
        index, tiny_config().layer_types, bidirectional=False, chunk=CHUNK, dtype=torch.float64
    )


def test_the_contract_declares_chunked_attention():
    c = model_contract(tiny_config())
    assert (c.position_kind, c.media_attention, c.local_attention) == ("1d", "causal", "chunked")
    assert c.fields() == ("position_ids", "cu_seqlens_padded", "attention_mask")
    assert tiny_config().layer_types == ["chunked_attention", "full_attention"]


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logits_equal_each_sequence_alone(attn):
    batch, kwargs = packed()
    assert set(kwargs["attention_mask"]) == {"chunked_attention", "full_attention"}
    assert batch["cu_seqlens_padded"].shape[0] == len(LENGTHS) + 1
    assert worst(batch, kwargs, attn) < TOL


@pytest.mark.slow
def test_chunks_counted_from_the_row_start_are_caught():
    batch, kwargs = packed()
    kwargs["attention_mask"] = row_chunked_masks(batch)
    assert worst(batch, kwargs) > CORRUPT


@pytest.mark.slow
def test_the_chunk_removed_is_caught():
    batch, kwargs = packed()
    masks = kwargs["attention_mask"]
    kwargs["attention_mask"] = {**masks, "chunked_attention": masks["full_attention"]}
    assert worst(batch, kwargs) > CORRUPT


def test_the_chunked_mask_is_the_per_sequence_rule():
    """Golden case, chunk 2: two sequences (3 real + 1 pad, then 3 real): chunks restart at slot
    4."""
    index = TokenMaskIndex.of(torch.tensor([0, 4, 7]), torch.tensor([0, 3, 6]), None)
    chunked = packed_token_mask(index, bidirectional=False, chunk=2)[0, 0].int().tolist()
    assert chunked == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0, 0],
        [0, 0, 1, 1, 0, 0, 0],  # the pad sees its chunk (no NaN row), nothing sees it
        [0, 0, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 1],
    ]


def test_the_mask_equals_transformers_chunked_mask_per_sequence():
    """Each sequence's block of the chunked mask equals transformers' own
    ``chunked_causal_mask_function`` on that
    sequence alone (the installed version's rule)."""
    from transformers.masking_utils import chunked_causal_mask_function

    batch, kwargs = packed()
    mask = kwargs["attention_mask"]["chunked_attention"][0, 0] == 0
    fn = chunked_causal_mask_function(CHUNK, torch.zeros(1, dtype=torch.long))
    for slots in real_slots(batch):
        n = slots.numel()
        q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
        want = fn(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long), q, k)
        assert torch.equal(mask[slots][:, slots], want.expand(n, n))


def test_the_flex_description_equals_the_dense_masks():
    assert_flex_equals_dense(packed()[0], tiny_config())


def test_the_contract_packs_for_eager_sdpa_flex_and_refuses_flash():
    contract = model_contract(tiny_config())
    for impl in ("eager", "sdpa", "flex_attention"):
        check_consumer(contract, Consumer.hf(impl), packed=True)
    for impl in ("flash_attention_2", "flash_attention_3"):
        with pytest.raises(ConsumerUnsupportedError, match="chunked local-attention") as err:
            check_consumer(contract, Consumer.hf(impl), packed=True)
        assert "'sdpa'" in err.value.way_out and "max_seqs=1" in err.value.way_out
    with pytest.raises(ConsumerUnsupportedError, match="chunked"):
        check_consumer(contract, Consumer.megatron("0.16.1"), packed=True)


def test_a_packed_row_without_its_masks_is_refused():
    for attention in ("positions", "varlen"):
        with pytest.raises(PackingUnsupportedError, match="attention='mask'"):
            packed(attention)


@pytest.mark.slow
def test_a_row_past_the_temperature_floor_is_refused_and_would_differ():
    """Llama 4's NoPE layers scale queries by the slot's index in the row: with ``floor_scale`` 16 a
    packed row of 48 slots is refused, and the control shows its logits would differ from each
    sequence alone."""
    with pytest.raises(PackingUnsupportedError, match="floor_scale=16"):
        packed(floor_scale=16)
    batch, kwargs = packed()
    assert worst(batch, kwargs, floor_scale=16) > CORRUPT
    assert worst(batch, kwargs, floor_scale=int(batch["cu_seqlens_padded"][-1]) + 1) < TOL


@pytest.mark.slow
def test_flex_attention_in_the_model_equals_each_sequence_alone():
    """``attn_implementation="flex_attention"`` with block masks from
    ``model_layer_masks(flex=True)``: the same
    logits packed as alone (float32: flex attention on CPU takes no float64; tolerance 1e-4, about
    5e-6 seen)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from prealign.collate.hf import model_layer_masks

    models = {}
    for attn in ("flex_attention", "sdpa"):  # the same weights (one seed), float32
        torch.manual_seed(0)
        models[attn] = transformers.Llama4ForCausalLM(tiny_config(attn)).float().eval()
    flex, alone = models["flex_attention"], models["sdpa"]
    batch, kwargs = packed()
    T = batch["input_ids"].shape[1]
    kwargs["attention_mask"] = {
        kind: create_block_mask(mod, 1, None, T, T, device="cpu")
        for kind, mod in model_layer_masks(batch, tiny_config(), flex=True).items()
    }
    with torch.no_grad():
        out = flex(**kwargs).logits[0]
        diffs = [
            (out[slots] - alone(input_ids=s["input_ids"][None], use_cache=False).logits[0])
            .abs()
            .max()
            for slots, s in zip(real_slots(batch), samples(), strict=True)
        ]
    assert float(max(diffs)) < 1e-4
