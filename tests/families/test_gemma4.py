"""Gemma 4 (issue 32): Gemma4SampleTransform against transformers' ``Gemma4Processor`` on
``apply_chat_template``'s text (tests/families/gemma4_reference.py) on random conversations and
images of random sizes: ``input_ids``, ``mm_token_type_ids``, ``pixel_values`` and
``image_position_ids`` equal, header-only ids equal the full pass, the resize rule equals
transformers'; a tiny Gemma 4 with bidirectional vision (float64, the vision tower run) gives the
same logits for a packed THD batch (cp=2, every rank unsharded) as for each sample alone, and the
image blocks removed, or the other release's layer rule, are caught."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from prealign.collate import to_hf_kwargs
from prealign.collate.vision import Gemma4, model_contract, vision_family
from prealign.collate.vision.gemma4 import resized_size
from prealign.loaders.media.gemma4 import Gemma4SampleTransform
from prealign.loaders.media.vlm import MediaError
from prealign.schemas import ConfigError
from prealign.schemas.contract import Consumer, ConsumerUnsupportedError, check_consumer
from tests.conftest import examples
from tests.consumers.models import CORRUPT
from tests.families import chat_samples
from tests.families import gemma4_reference as ref
from tests.families.packing import packed_batch, worst_gap

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma4ForConditionalGeneration"):
    pytest.skip("platform: the installed transformers lacks Gemma 4", allow_module_level=True)
PATCH, POOL, BUDGET, WINDOW = ref.PATCH, ref.POOL, ref.BUDGET, ref.WINDOW
config, transform = ref.config, ref.transform


def png(seed: int, lo: int = 4, hi: int = 120) -> bytes:
    return chat_samples.png(seed, lo, hi)


def raw_sample(messages, images) -> dict:
    return chat_samples.raw_sample(messages, images, key="g4")


TEXT = chat_samples.CHAT_TEXT


@pytest.mark.slow
@given(
    contents=st.lists(TEXT, min_size=1, max_size=4),
    roles=st.lists(st.sampled_from(["user", "assistant"]), min_size=4, max_size=4),
    system=st.sampled_from([None, "system", "developer"]),
    budget=st.sampled_from([70, 140]),
    seed=st.integers(0, 99),
)
@examples(60)
def test_ids_types_pixels_and_positions_equal_the_processor(contents, roles, system, budget, seed):
    messages = [{"role": r, "content": c} for r, c in zip(roles, contents)]
    if system:
        messages.insert(0, {"role": system, "content": "\n sys \n"})
    n = sum(m["content"].count("<image>") for m in messages)
    assume(n <= 3)
    images = [png(seed + i) for i in range(n)]
    t = transform(budget)
    ours = t(raw_sample(messages, images))
    want = ref.reference(messages, images, PATCH, POOL, budget)
    assert ours["input_ids"].tolist() == want["input_ids"][0].tolist()
    assert ours["mm_token_type_ids"].tolist() == want["mm_token_type_ids"][0].tolist()
    if n:
        assert torch.equal(ours["pixel_values"], want["pixel_values"].to(torch.float32))
        assert torch.equal(ours["image_position_ids"], want["image_position_ids"].long())
    assert t.header_ids(raw_sample(messages, images))[0].tolist() == ours["input_ids"].tolist()
    ends = (ours["input_ids"] == ref.tid("<turn|>")) & (ours["loss_mask"] > 0)
    assert int(ends.sum()) == sum(m["role"] == "assistant" for m in messages)


@given(
    h=st.integers(1, 3000),
    w=st.integers(1, 3000),
    patch=st.sampled_from([4, 14, 16]),
    pool=st.sampled_from([1, 2, 3]),
    budget=st.sampled_from([70, 140, 280, 560, 1120]),
)
@examples(300)
def test_resize_rule_equals_transformers(h, w, patch, pool, budget):
    from transformers.models.gemma4.image_processing_pil_gemma4 import (
        get_aspect_ratio_preserving_size,
    )

    try:
        want = get_aspect_ratio_preserving_size(h, w, patch, budget * pool**2, pool)
    except ValueError:  # transformers refuses it: so do we
        with pytest.raises(Exception):
            resized_size(h, w, patch_size=patch, max_soft_tokens=budget, pooling=pool)
        return
    assert resized_size(h, w, patch_size=patch, max_soft_tokens=budget, pooling=pool) == want


def test_golden_sample():
    messages = [
        {"role": "system", "content": " be brief\n"},
        {"role": "user", "content": "\nlook <image>?"},
        {"role": "assistant", "content": " <|channel>hm<channel|>a "},
        {"role": "assistant", "content": "b"},
    ]
    t = transform()
    ours = t(raw_sample(messages, [png(1, 20, 21)]))  # 20 x 20 -> 64 x 64: 8 x 8 soft tokens
    text = ref.tokenizer().decode(ours["input_ids"].tolist())
    assert text == (
        "<bos><|turn>system\nbe brief<turn|>\n<|turn>user\nlook<|image>"
        + "<|image|>" * 64
        + "<image|>?<turn|>\n<|turn>model\na<turn|>\nb<turn|>\n"
    )
    trained = ref.tokenizer().decode(ours["input_ids"][ours["loss_mask"] > 0].tolist())
    assert trained == "a<turn|>b<turn|>"
    assert ours["pixel_values"].shape == (1, BUDGET * POOL**2, 3 * PATCH**2)
    assert ours["image_position_ids"][0, 255].tolist() == [15, 15]  # the 16 x 16 patches' last
    assert ours["image_position_ids"][0, 256:].eq(-1).all()
    import pickle  # the transform goes to loader workers

    again = pickle.loads(pickle.dumps(t))(raw_sample(messages, [png(1, 20, 21)]))
    assert torch.equal(again["input_ids"], ours["input_ids"])


def test_bad_samples_are_typed_errors():
    with pytest.raises(MediaError, match="placeholder"):
        transform()(raw_sample([{"role": "user", "content": "<image> <image>"}], [png(1)]))
    with pytest.raises(MediaError, match="system"):
        transform()(raw_sample([{"role": "system", "content": "<image>"}], [png(1)]))
    with pytest.raises(MediaError, match="tool"):
        transform()(raw_sample([{"role": "tool", "content": "x"}], []))
    with pytest.raises(MediaError, match="unprocessed_video"):
        transform()(raw_sample([{"role": "user", "content": "<video>"}], []))
    with pytest.raises(MediaError, match="unprocessed_video"):
        transform().header_ids(raw_sample([{"role": "user", "content": "<video>"}], []))
    with pytest.raises(ConfigError, match="gemma4"):
        Gemma4SampleTransform(model_config=transformers.Qwen2VLConfig(), tokenizer=ref.tokenizer())
    with pytest.raises(ConfigError, match="pooling_kernel_size"):
        Gemma4SampleTransform(
            model_config=config(),
            tokenizer=ref.tokenizer(),
            processor=ref.image_processor(PATCH, 3, BUDGET),
        )


def test_the_family_and_its_contract():
    fam = vision_family(config())
    assert isinstance(fam, Gemma4) and (fam.patch_size, fam.spatial_merge_size) == (PATCH, POOL)
    contract = model_contract(config())
    assert contract.media_attention == "bidirectional" and contract.local_attention == "sliding"
    assert model_contract(config(None)).media_attention == "causal"
    with pytest.raises(ConsumerUnsupportedError, match="gemma4"):
        check_consumer(contract, Consumer.hf("flash_attention_2"))
    # a config without a vision tower falls back to transformers' vision defaults
    assert vision_family(transformers.Gemma4Config()).patch_size == 16


# ---- in a tiny model --------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def model(bidirectional: str | None = "vision"):
    torch.manual_seed(0)
    return (
        transformers.Gemma4ForConditionalGeneration(config(bidirectional)).to(torch.float64).eval()
    )


CONVERSATIONS = (
    [{"role": "user", "content": "hello <image> world\n\n"}, {"role": "assistant", "content": "a"}],
    [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "\n\nhello ."}],
    [{"role": "user", "content": "<image><image> ? "}, {"role": "assistant", "content": "b"}],
)


@functools.lru_cache(maxsize=None)
def samples() -> list[dict]:
    t = transform()
    return [
        t(raw_sample(m, [png(7 + i, 6, 40) for i in range(m[0]["content"].count("<image>"))]))
        for m in CONVERSATIONS
    ]


def alone(sample: dict) -> dict:
    kw = {
        "input_ids": sample["input_ids"][None],
        "mm_token_type_ids": sample["mm_token_type_ids"][None],
        "use_cache": False,
    }
    if sample["pixel_values"].shape[0]:
        kw["pixel_values"] = sample["pixel_values"].to(torch.float64)
        kw["image_position_ids"] = sample["image_position_ids"]
    return kw


def packed(bidirectional: str | None = "vision"):
    schema = vision_family(config(bidirectional)).batch_schema(
        pad_token_id=ref.tid("<pad>"), vocab_size=len(ref.tokenizer())
    )
    rows = [{k: v for k, v in s.items() if k != "__key__"} for s in samples()]
    batch = packed_batch(schema, rows)
    kwargs = to_hf_kwargs(
        batch,
        attention="mask",
        model_config=config(bidirectional),
        mask_dtype=torch.float64,
        labels=False,
    )
    kwargs["pixel_values"] = kwargs["pixel_values"].to(torch.float64)
    return batch, kwargs


@pytest.mark.slow
def test_packed_logits_equal_each_sample_alone():
    batch, kwargs = packed()
    assert set(kwargs) >= {"pixel_values", "image_position_ids", "attention_mask"}
    from tests.consumers.models import real_slots

    for slots, s in zip(real_slots(batch), samples(), strict=True):  # positions restart
        assert batch["position_ids"][0, slots].tolist() == list(range(s["input_ids"].numel()))
    assert worst_gap(model(), kwargs, batch, samples(), alone) < 1e-6


@pytest.mark.slow
def test_the_image_blocks_removed_are_caught():
    from tests.consumers.test_gemma3 import blockless_masks

    batch, kwargs = packed()
    kwargs["attention_mask"] = blockless_masks(batch, WINDOW)
    assert worst_gap(model(), kwargs, batch, samples(), alone) > CORRUPT


@pytest.mark.slow
def test_the_other_releases_layer_rule_is_caught():
    from tests.consumers.test_gemma3 import two_layer_masks

    batch, kwargs = packed()
    ours = model_contract(config()).bidirectional_layers
    other = None if ours else ("sliding_attention",)
    kwargs["attention_mask"] = two_layer_masks(batch, WINDOW, bidirectional_layers=other)
    assert worst_gap(model(), kwargs, batch, samples(), alone) > CORRUPT


@pytest.mark.slow
def test_the_other_releases_window_rule_is_caught():
    """Images longer than the window (64 tokens, window 6): transformers 5.6 / 5.10 OR the block
    over the windowed causal mask, 5.17+ AND the window after it; the other rule is caught."""
    from tests.consumers.test_gemma3 import two_layer_masks

    batch, kwargs = packed()
    contract = model_contract(config())
    kwargs["attention_mask"] = two_layer_masks(
        batch,
        WINDOW,
        bidirectional_layers=contract.bidirectional_layers,
        block_over_window=not contract.media_over_window,
    )
    assert worst_gap(model(), kwargs, batch, samples(), alone) > CORRUPT


@pytest.mark.slow
def test_a_causal_gemma4_packs_from_its_masks_too():
    batch, kwargs = packed(None)
    assert worst_gap(model(None), kwargs, batch, samples(), alone) < 1e-6


# ---- the demo, the header-only index and the CLI ----------------------------------------------
def test_header_index_equals_the_full_pass(tmp_path):
    from tests.families.header_index import assert_header_index_equals_full_pass

    assert_header_index_equals_full_pass(tmp_path, "gemma4")


@pytest.mark.slow
def test_demo_command_with_gemma4(tmp_path, capsys):
    """``prealign demo --model gemma4``: every batch on every CP rank valid against Gemma 4's
    schema, padded patches and their positions in the media fields."""
    import re

    from tests.families.header_index import run_demo

    out = run_demo(tmp_path, capsys, "gemma4", token_budget=4096)
    assert "Gemma4.batch_schema" in out
    assert re.search(r"pixel_values +float32 +\[\d+, 2520, 768\]", out)
    assert re.search(r"image_position_ids +int64 +\[\d+, 2520, 2\]", out)


@pytest.mark.slow
def test_inspect_and_index_with_the_model_config(tmp_path, capsys):
    """``prealign inspect`` / ``prealign index --model-config`` of a Gemma 4 folder (its config
    and image processor, a budget of 70 soft tokens): Gemma4SampleTransform with that budget and
    its batch schema; the sidecars give every sample the full pass's length. No teacher top-k:
    the demo's rows follow the default budget of 280."""
    from argparse import Namespace

    from prealign.loaders import BadDataPolicy, WebDatasetSource, build_index
    from prealign.loaders.cli import main
    from prealign.loaders.cli.demo_data import build_demo_dataset, demo_model_config
    from prealign.loaders.cli.index_cmd import transform_schema, vlm_transform

    ds = build_demo_dataset(
        str(tmp_path), num_samples=12, samples_per_shard=6, topk=4, model="gemma4"
    )
    folder = str(tmp_path / "model")
    demo_model_config("gemma4").save_pretrained(folder)
    ref.image_processor(16, 3, 70).save_pretrained(folder)
    common = ["--model-config", folder, "--processor", folder, "--topk", "0"]
    args = ["inspect", *ds.shards, *common, "--workers", "0", "--out", str(tmp_path / "i.png")]
    assert main(args) == 0
    said = capsys.readouterr()
    out = said.out + said.err
    n = int(out.split("validated")[1].split("/")[0])
    assert n > 0 and f"{n}/{n} batches valid (schema gemma4 " in out and "(gemma4)" in out
    out_dir = str(tmp_path / "index")
    assert main(["index", *ds.shards, *common, "--out", out_dir]) == 0
    t, _ = vlm_transform(Namespace(model_config=folder, tokenizer=None, processor=folder), None)
    assert isinstance(t, Gemma4SampleTransform) and t.max_soft_tokens == 70
    schema, policy = transform_schema(t, None), BadDataPolicy(on_error="skip")
    full = build_index(
        WebDatasetSource(list(ds.shards), transform=t, image="bytes", sidecars=False),
        schema,
        policy=policy,
    )
    side = build_index(
        WebDatasetSource(list(ds.shards), transform=t, image="bytes", index_dir=out_dir),
        schema,
        policy=policy,
    )
    assert len(full) == len(side) == 12 - len(ds.bad)
    assert full.lengths.tolist() == side.lengths.tolist()


def test_the_flex_description_equals_the_dense_masks():
    from tests.consumers.models import assert_flex_equals_dense

    assert_flex_equals_dense(packed()[0], config())


def test_the_window_rules_golden():
    """One sequence of 5 slots, an image at slots 1-3, window 2: ORed over the window (5.6, 5.10)
    the image's last token still sees its first; ANDed after it (5.17+) it does not."""
    from prealign.collate.vision.attention import TokenMaskIndex, packed_token_mask

    index = TokenMaskIndex.of(
        torch.tensor([0, 5]), torch.tensor([0, 5]), torch.tensor([0, 1, 1, 1, 0])
    )
    over = packed_token_mask(index, bidirectional=True, window=2, block_over_window=True)
    after = packed_token_mask(index, bidirectional=True, window=2)
    assert over[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0],
        [0, 1, 1, 1, 0],
        [0, 1, 1, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    assert after[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0],
        [0, 1, 1, 1, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1],
    ]
