"""The fast Qwen2-VL image path (``image_codes`` + ``expand_codes``) against transformers' own image
processor: ``pixel_values`` and ``image_grid_thw`` bit-identical (tolerance 0), on random sizes and
contents (hypothesis), on the demo's images, through ``VLMSampleTransform`` and its compact form."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
from prealign.loaders.media.vlm import (
    MediaError,
    VLMSampleTransform,
    expand_codes,
    image_codes,
    image_processor,
    process_images,
)
from tests.conftest import examples

TOK = ByteTokenizer()


def _reference(images, processor):
    out = processor(images=images, return_tensors="pt")
    return out["pixel_values"].to(torch.float32), out["image_grid_thw"].to(torch.int64)


def _image(h: int, w: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


@examples(25)  # a quarter of it in verl and floor (PREALIGN_EXAMPLES_SCALE=0.25)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 700), st.integers(1, 700)), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
    pixels=st.sampled_from(
        [{}, {"max_pixels": 200704}, {"min_pixels": 112 * 112, "max_pixels": 401408}]
    ),
)
def test_fast_path_equals_transformers_bitwise(sizes, seed, pixels):
    processor = image_processor(**pixels)
    images = [
        _image(h, w, seed + i) for i, (h, w) in enumerate(sizes) if max(h, w) / min(h, w) <= 200
    ]
    if not images:
        return
    codes, grid = image_codes(images, processor)
    assert codes is not None and codes.dtype == torch.uint8  # the fast path was taken
    want_pixels, want_grid = _reference(images, processor)
    assert torch.equal(grid, want_grid)
    got = expand_codes(codes, processor)
    assert got.dtype == torch.float32 and torch.equal(got, want_pixels)
    assert torch.equal(process_images(images, processor)[0], want_pixels)


def test_golden_black_image():
    """56x56 black image: grid (1, 4, 4); every value is -mean/std of its channel (CLIP
    statistics)."""
    from PIL import Image

    pixels, grid = process_images([Image.new("RGB", (56, 56))], image_processor())
    assert grid.tolist() == [[1, 4, 4]] and pixels.shape == (16, 1176)
    per_channel = pixels.reshape(16, 3, 2 * 14 * 14)
    want = torch.tensor([-1.7922626, -1.7520971, -1.4802198])
    assert torch.allclose(per_channel[:, :, 0], want.expand(16, 3), atol=1e-6)
    assert bool((per_channel == per_channel[:, :, :1]).all())


def test_demo_images_and_non_rgb_fallback(tmp_path):
    """Every image of the demo data (JPEG and PNG, 48..360 px) equal to transformers'; a grayscale
    PIL image (not RGB) takes transformers' own path and gives its result."""
    from PIL import Image

    from prealign.loaders import WebDatasetSource
    from prealign.loaders.cli.demo_data import build_demo_dataset

    data = build_demo_dataset(str(tmp_path), num_samples=30, samples_per_shard=30, bad=())
    source = WebDatasetSource(list(data.shards), image="bytes")
    processor, seen = image_processor(), 0
    for _, raw in source.scan(0):
        for name in [n for n in raw if n.endswith(("jpg", "png"))]:
            img = Image.open(io.BytesIO(raw[name])).convert("RGB")
            got, grid = process_images([img], processor)
            want, want_grid = _reference([img], processor)
            assert torch.equal(got, want) and torch.equal(grid, want_grid)
            seen += 1
    assert seen >= 20
    gray = _image(70, 90, 1).convert("L")
    assert image_codes([gray], processor) == (None, None)
    assert torch.equal(process_images([gray], processor)[0], _reference([gray], processor)[0])


def _raw(key: str, sizes) -> dict:

    raw = {"__key__": key}
    names = []
    for i, (h, w) in enumerate(sizes):
        buf = io.BytesIO()
        _image(h, w, i).save(buf, format="PNG")
        raw[f"{i}.png"] = buf.getvalue()
        names.append(f"{i}.png")
    text = "".join("<image>" for _ in sizes) + "Describe."
    raw["json"] = json.dumps(
        {
            "messages": [
                {"role": "user", "content": text},
                {"role": "assistant", "content": "A picture."},
            ],
            "images": names,
        }
    )
    return raw


@pytest.mark.parametrize("pixel_dtype", ["float32", "bfloat16"])
def test_transform_compact_then_expand_equals_the_processor(pixel_dtype):
    from PIL import Image

    transform = VLMSampleTransform(tokenizer=TOK, pixel_dtype=pixel_dtype)
    raw = _raw("s1", [(40, 300), (260, 120)])
    compact = transform.compact(raw)
    assert "pixel_values" not in compact and compact["pixel_codes"].dtype == torch.uint8
    out = transform(raw)
    assert list(out) == [
        k if k != "pixel_codes" else "pixel_values" for k in compact
    ]  # field order kept
    images = [Image.open(io.BytesIO(raw[n])).convert("RGB") for n in ("0.png", "1.png")]
    want, want_grid = _reference(images, transform.image_processor)
    assert torch.equal(out["pixel_values"], want.to(getattr(torch, pixel_dtype)))
    assert torch.equal(out["image_grid_thw"], want_grid)
    assert int(out["mm_token_type_ids"].sum()) == int(want_grid.prod(-1).sum()) // 4
    plain = {"input_ids": torch.arange(3)}
    assert transform.expand(plain) is plain  # nothing to expand
    text_only = transform({"__key__": "t", "json": json.dumps({"text": "hello"})})
    assert text_only["pixel_values"].shape == (0, 1176) and "pixel_codes" not in text_only


def test_too_wide_image_is_a_media_error_on_the_fast_path():
    transform = VLMSampleTransform(tokenizer=TOK)
    with pytest.raises(MediaError) as err:
        transform(_raw("wide", [(2, 500)]))
    assert err.value.reason == "corrupt_image" and "wide" in str(err.value)


# ---- vision-token check + mRoPE of one sequence in NumPy
# --------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    parts=st.lists(
        st.one_of(
            st.integers(1, 6), st.tuples(st.integers(1, 2), st.integers(1, 5), st.integers(1, 5))
        ),
        min_size=1,
        max_size=6,
    ),
    merge=st.sampled_from([1, 2]),
)
def test_vision_types_and_mrope_equal_the_torch_functions(parts, merge):
    """Random text runs and images (grid t, h*merge, w*merge), against reference_types +
    mrope_position_ids (the latter checked against transformers' get_rope_index in test_mrope)."""
    import dataclasses

    from prealign.collate.mrope import mrope_position_ids
    from prealign.loaders.media.vlm import vision_types_and_mrope

    vision = dataclasses.replace(TOK.vision, spatial_merge_size=merge)
    ids, grids = [], []
    for p in parts:
        if isinstance(p, int):
            ids += [100] * p
        else:
            t, h, w = p[0], p[1] * merge, p[2] * merge
            grids.append([t, h, w])
            ids += [
                vision.vision_start_token_id,
                *[vision.image_token_id] * (t * h * w // merge**2),
                vision.vision_end_token_id,
            ]
    input_ids = torch.tensor(ids)
    grid = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)
    types, positions = vision_types_and_mrope(input_ids, grid, vision, sample="s")
    want_types = reference_types(input_ids, grid, vision)
    want = mrope_position_ids(
        want_types, grid, torch.tensor([0, len(ids)]), spatial_merge_size=merge
    )
    assert torch.equal(types, want_types) and torch.equal(positions, want)
    assert types.dtype == positions.dtype == torch.int64
    if grids:  # one image token too few: a typed error
        short = torch.cat(
            [
                input_ids[: int(torch.nonzero(input_ids == vision.image_token_id)[0])],
                input_ids[int(torch.nonzero(input_ids == vision.image_token_id)[0]) + 1 :],
            ]
        )
        with pytest.raises(MediaError) as err:
            vision_types_and_mrope(short, grid, vision, sample="s")
        assert err.value.reason == "vision_token_mismatch"


def test_vision_types_and_mrope_golden():
    """The collate/mrope.py docstring trace: x <v> I I I I I I </v> y, grid (1, 4, 6), merge 2."""
    from prealign.loaders.media.vlm import vision_types_and_mrope

    v = TOK.vision
    ids = torch.tensor(
        [100, v.vision_start_token_id, *[v.image_token_id] * 6, v.vision_end_token_id, 101]
    )
    types, pos = vision_types_and_mrope(ids, torch.tensor([[1, 4, 6]]), v, sample="g")
    assert types.tolist() == [0, 0, 1, 1, 1, 1, 1, 1, 0, 0]
    assert pos.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6],
    ]


def reference_types(input_ids: torch.Tensor, image_grid_thw: torch.Tensor, vision) -> torch.Tensor:
    """An independent torch reference: ``mm_token_type_ids`` (1 on image tokens), after asserting
    one run of ``t*h*w / merge**2`` image tokens per grid."""
    is_img = input_ids == vision.image_token_id
    edges = torch.diff(
        is_img.to(torch.int8),
        prepend=torch.zeros(1, dtype=torch.int8),
        append=torch.zeros(1, dtype=torch.int8),
    )
    runs = torch.nonzero(edges == -1).flatten() - torch.nonzero(edges == 1).flatten()
    assert torch.equal(runs, vision.tokens_per_image(image_grid_thw))
    return is_img.to(torch.int64)
