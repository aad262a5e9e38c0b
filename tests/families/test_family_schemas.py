"""The 1-D families' shared pieces (``collate/vision/common.py``): each family's batch schema
(golden fields, names, token-type range; pixel shapes following its tile or patch size), the check
of its constants and of an image's size, named by family, field and sample."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate.vision import Idefics3, InternVL, LlavaOneVision, Mistral3
from prealign.schemas import ConfigError
from prealign.schemas.errors import SampleError
from prealign.schemas.schema import Role, core_token_fields, topk_fields
from tests.conftest import examples

BASE = dict(image_token_id=0, patch_size=14, spatial_merge_size=2, temporal_patch_size=1)


def family(name: str, side: int = 28):
    """A family of each kind, its tiles (Mistral3: patches) ``side`` px."""
    if name == "idefics3":
        return Idefics3(model_type="smolvlm", **BASE, tile_size=side)
    if name == "mistral3":
        return Mistral3(model_type="mistral3", **{**BASE, "patch_size": side})
    if name == "internvl":
        return InternVL(model_type="internvl", **BASE, tile_size=side)
    return LlavaOneVision(
        model_type="llava_onevision",
        **{**BASE, "spatial_merge_size": 1},
        video_token_id=1,
        tile_size=side,
        pinpoints=((side, side),),
    )


GOLDEN = {
    "idefics3": ("smolvlm", 1, [("pixel_values", (3, 28, 28)), ("image_rows_cols", (2,))]),
    "mistral3": ("mistral3", 1, [("pixel_values", (3, 28, 28)), ("image_sizes", (2,))]),
    "internvl": ("internvl", 1, [("pixel_values", (3, 28, 28)), ("image_num_patches", ())]),
    "llava_onevision": (
        "llava_onevision",
        2,
        [
            ("pixel_values", (3, 28, 28)),
            ("pixel_values_videos", (3, 28, 28)),
            ("video_num_frames", ()),
            ("image_sizes", (2,)),
            ("batch_num_images", ()),
        ],
    ),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_batch_schema(name):
    schema_name, max_type, media = GOLDEN[name]
    plain = family(name).batch_schema(pad_token_id=3, vocab_size=300)
    topk = family(name).batch_schema(pad_token_id=3, vocab_size=300, topk=4)
    assert (plain.name, topk.name) == (schema_name, f"{schema_name}_topk")
    tokens = core_token_fields(3, -100, 300)
    assert plain.fields[: len(tokens)] == tokens
    types = plain["mm_token_type_ids"]
    assert (types.dtypes, types.pad_value, types.min_value, types.max_value) == (
        ("int64", "int32"),
        0,
        0,
        max_type,
    )
    rest = plain.fields[len(tokens) + 1 :]
    assert [(f.name, tuple(f.dense_shape)) for f in rest] == media
    assert all(f.role == Role.MEDIA for f in rest)
    assert [f.dtypes for f in rest if f.name.startswith("pixel")] == [
        ("float32", "bfloat16")
    ] * sum(n.startswith("pixel") for n, _ in media)
    assert topk.fields == plain.fields + topk_fields(4, 300)


@given(st.sampled_from(sorted(GOLDEN)), st.integers(1, 1024), st.sampled_from(["float32", "bf16"]))
@examples(40)
def test_pixels_follow_the_tile_size_and_the_dtypes_asked(name, side, dtype):
    dtypes = ("float32",) if dtype == "float32" else ("bfloat16",)
    schema = family(name, side).batch_schema(pixel_dtypes=dtypes)
    pixels = [f for f in schema.fields if f.name.startswith("pixel_values")]
    assert pixels and all(f.dense_shape == (3, side, side) and f.dtypes == dtypes for f in pixels)


@pytest.mark.parametrize("cls", [Idefics3, Mistral3, InternVL])
@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "4"])
def test_a_constant_that_is_not_a_positive_int_is_named(cls, bad):
    with pytest.raises(ConfigError, match=rf"^{cls.__name__}\.patch_size: expected a positive int"):
        cls(model_type="x", **{**BASE, "patch_size": bad})
    with pytest.raises(ConfigError, match=rf"^{cls.__name__}\.image_token_id: "):
        cls(model_type="x", **{**BASE, "image_token_id": -1})
    assert cls(model_type="x", **BASE).image_token_id == 0  # id 0 is a token like any other


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_an_image_of_no_pixels_names_the_sample_and_field(name):
    fam = family(name)
    measure = {
        "idefics3": "rows_cols",
        "mistral3": "token_grid",
        "internvl": "tiles",
        "llava_onevision": "image_tokens",
    }[name]
    with pytest.raises(SampleError, match=r"sample s9, field 'img'.*at least 1x1 pixels.*7x0"):
        getattr(fam, measure)(0, 7, sample="s9", field="img")
