"""InternVL 3 / 3.5: prealign's transform equals transformers' ``InternVLProcessor`` +
``apply_chat_template`` (input ids, tiles, pixel values, 1-D positions) on random samples;
header-only token counts equal the processor's tiles; and a tiny InternVL (float64) gives the same
logits for a packed THD batch (cp=2, every rank unsharded back) as
for each sample alone, while a row whose positions do not restart is caught."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate import THDCollator, unpack_thd
from prealign.collate.vision import InternVL, vision_family
from prealign.collate.vision.internvl import tile_arrangements, tile_canvas
from prealign.loaders.media.vlm import VLMSampleTransform
from prealign.schemas import ConfigError, ParallelLayout
from tests.conftest import examples
from tests.consumers.models import CORRUPT
from tests.families import internvl_reference as ref
from tests.families.chat_samples import media_sample
from tests.families.packing import hf_kwargs, packed_batch, worst_gap

transformers = pytest.importorskip("transformers")
TOL = 1e-6


def schema(tile: int):
    """InternVL's batch: the token fields, ``mm_token_type_ids``, tiles ``[n, 3, tile, tile]`` and
    tiles per block."""
    tok = ref.hf_tokenizer()
    fam = vision_family(transformers.InternVLConfig(vision_config={"image_size": [tile, tile]}))
    return fam.batch_schema(
        pad_token_id=tok.pad_token_id, vocab_size=len(tok), pixel_dtypes=("float32",)
    )


def transform(processor, **cfg) -> VLMSampleTransform:
    tok = ref.hf_tokenizer()
    config = transformers.InternVLConfig(
        image_token_id=tok.context_image_token_id,
        image_seq_length=processor.image_seq_length,
        **cfg,
    )
    return VLMSampleTransform(processor=processor, model_config=config)


def raw_sample(
    key: str, sizes: list, question: str, reply: str, seed: int, videos: list[int] = ()
) -> tuple:
    """(raw sample for prealign, chat messages for transformers, PIL images); a video is ``n``
    frames of 40x30."""
    clips = [(n, 40, 30, None) for n in videos]
    return media_sample(key, sizes, question, reply, seed, videos=clips, newline=True)[:3]


words = st.text(alphabet=" abcdefgh?.\n", min_size=0, max_size=12)


@pytest.mark.slow
@given(
    st.lists(st.tuples(st.integers(8, 700), st.integers(8, 700)), max_size=2),
    st.sampled_from([1, 2, 6, 12]),
    words,
    words,
    st.integers(0, 2**31),
)
@examples(12)
def test_ids_tiles_pixels_and_positions_equal_the_processor(
    sizes, max_patches, question, reply, seed
):
    processor = ref.hf_processor(tile=112, max_patches=max_patches)
    raw, messages, images = raw_sample("s", sizes, question, reply, seed)
    out = transform(processor)(raw)
    text = processor.apply_chat_template(messages, tokenize=False)
    want = processor(text=text, images=images or None, return_tensors="pt")
    assert out["input_ids"].tolist() == want["input_ids"][0].tolist()
    if images:
        assert torch.equal(out["pixel_values"], want["pixel_values"].to(torch.float32))
    else:
        assert out["pixel_values"].shape == (0, 3, 112, 112)
    tiles = [
        processor.image_processor.get_number_of_image_patches(im.height, im.width, {})
        for im in images
    ]
    assert out["image_num_patches"].tolist() == tiles
    t = transform(processor)
    assert [t.header_image_tokens(w, h, sample="s", field="image") for w, h in sizes] == [
        processor.image_seq_length * n for n in tiles
    ]
    assert torch.equal(
        out["mm_token_type_ids"], (out["input_ids"] == processor.image_token_id).long()
    )
    batch = THDCollator(schema=schema(112), layout=ParallelLayout(tp=2))([out, out])
    for got in unpack_thd(
        batch["position_ids"],
        cu_seqlens=batch["cu_seqlens"],
        cu_seqlens_padded=batch["cu_seqlens_padded"],
    ):
        assert torch.equal(
            got, torch.arange(out["input_ids"].numel())
        )  # the model's own positions: 0..L-1


@given(st.lists(st.integers(1, 4), min_size=1, max_size=2), words)
@examples(10)
def test_video_frames_are_written_as_the_processor_writes_them(frames, question):
    """``Frame{i}: <img>...</img>`` per frame, joined by newlines: the text the installed processor
    makes of the template's ``<video>`` (its own expansion method; its video processor needs
    torchvision, absent here)."""
    processor = ref.hf_processor(tile=56)
    raw, messages, _ = raw_sample("v", [], question, "ok", 0, videos=frames)
    out = transform(processor)(raw)
    text = ref.expand_video_text(
        processor, processor.apply_chat_template(messages, tokenize=False), frames
    )
    assert out["input_ids"].tolist() == processor.tokenizer(text)["input_ids"]
    assert out["image_num_patches"].tolist() == [1] * sum(frames) and out["pixel_values"].shape[
        0
    ] == sum(frames)


def test_images_and_frames_share_pixel_values_in_text_order():
    """A video named before an image: its frames' tiles come first, as InternVLProcessor
    concatenates them."""
    processor = ref.hf_processor(tile=56, max_patches=6)
    raw, _, images = raw_sample("m", [(150, 60)], "q", "ok", 4, videos=[2])
    out = transform(processor)(raw)
    tiles = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    assert out["image_num_patches"].tolist() == [1, 1, tiles.shape[0]]
    assert torch.equal(out["pixel_values"][2:], tiles)


@given(st.integers(1, 5000), st.integers(1, 5000), st.integers(1, 3), st.integers(1, 40))
@examples(200)
def test_tile_canvas_equals_transformers(h, w, lo, hi):
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    hi = max(lo, hi)
    assert tile_canvas(h, w, (448, 448), lo, hi) == get_optimal_tiled_canvas(
        (h, w), (448, 448), lo, hi
    )


def test_golden_tiles():
    fam = vision_family(transformers.InternVLConfig())
    assert isinstance(fam, InternVL) and (
        fam.image_seq_length,
        fam.tile_size,
        fam.spatial_merge_size,
    ) == (256, 448, 2)
    assert (
        fam.position_kind == "1d"
        and fam.media_attention == "causal"
        and fam.local_attention is None
    )
    # 700x300: aspect 2.33, nearest arrangement within 12 tiles is 5x2 (2.5): 10 tiles + a thumbnail
    assert tile_canvas(300, 700, (448, 448), 1, 12) == (5, 2) and fam.tiles(300, 700) == 11
    assert fam.tiles(448, 448) == 1 and fam.image_tokens(448, 896) == 256 * 3  # 2x1 + thumbnail
    assert tile_arrangements(1, 3) == ((1, 1), (1, 2), (2, 1), (1, 3), (3, 1))


def test_a_tokenizer_without_the_config_image_token_is_refused():
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer

    with pytest.raises(ConfigError, match="image_token_id 99"):
        VLMSampleTransform(
            tokenizer=ByteTokenizer(), model_config=transformers.InternVLConfig(image_token_id=99)
        ).vision


# ---- in-model
# ---------------------------------------------------------------------------------------
def model_samples() -> list[dict]:
    """Three transformed samples for the tiny model (56-px tiles, 4 tokens per tile, up to 6
    tiles)."""
    processor = ref.hf_processor(tile=56, max_patches=6, image_seq_length=4)
    t = transform(
        processor,
        vision_config=ref.tiny_config().vision_config.to_dict(),
        text_config=ref.tiny_config().text_config.to_dict(),
    )
    raws = [
        raw_sample("a", [(150, 60)], "what?", "a cat.", 1, videos=[2])[0],
        raw_sample("b", [], "hi", "hello there", 2)[0],
        raw_sample("c", [(40, 90), (56, 56)], "compare", "same.", 3)[0],
    ]
    return [t(r) for r in raws]


def alone(sample: dict) -> dict:
    """One sample's kwargs: its tiles ``[tiles, 3, s, s]`` as they are (InternVL takes no batch
    axis)."""
    kwargs = {"input_ids": sample["input_ids"][None], "use_cache": False}
    if sample["pixel_values"].shape[0]:
        kwargs["pixel_values"] = sample["pixel_values"].to(torch.float64)
    return kwargs


def packed(samples: list[dict]) -> tuple[dict, dict]:
    """THD tp=2 cp=2: both CP ranks' shards unsharded back equal the whole batch; the model's kwargs
    from it."""
    whole = packed_batch(schema(56), samples)
    keys = ["input_ids", "mm_token_type_ids", "pixel_values", "position_ids", "use_cache"]
    return whole, hf_kwargs(whole, keys)


def worst(batch: dict, kwargs: dict, samples: list[dict]) -> float:
    return worst_gap(ref.tiny_model(), kwargs, batch, samples, alone)


@pytest.mark.slow
def test_packed_logits_equal_each_sample_alone():
    samples = model_samples()
    assert [s["image_num_patches"].tolist() for s in samples] == [[1, 1, 4], [], [3, 1]]
    batch, kwargs = packed(samples)
    assert worst(batch, kwargs, samples) < TOL


@pytest.mark.slow
def test_positions_that_do_not_restart_are_caught():
    samples = model_samples()
    batch, kwargs = packed(samples)
    kwargs["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
    assert worst(batch, kwargs, samples) > CORRUPT
