"""Every Qwen vision family's mRoPE positions, images and video: equal to transformers' own
``get_rope_index`` of a tiny model built from the family's config, per sample, packed (THD, tp=2,
cp=2) on every CP rank and unsharded, on every real token. Plus golden traces of each family's video
rule and the config checks."""

from __future__ import annotations

import functools
import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate import THDCollator, unpack_thd, unshard_cp
from prealign.collate.mrope import MRoPECollator
from prealign.collate.vision import (
    SUPPORTED_MODEL_TYPES,
    Qwen2_5VL,
    Qwen3_5,
    Qwen3VL,
    vision_family,
)
from prealign.schemas import (
    ConfigError,
    ParallelLayout,
    SampleError,
    validate_vlm_batch,
    vlm_schema,
)
from tests.conftest import examples
from tests.vlm_families import FAMILY_TYPES, tiny_config, tiny_model, vision_sample

transformers = pytest.importorskip("transformers")
SCHEMA = vlm_schema()


@functools.lru_cache(maxsize=None)
def fractional_seconds() -> bool:
    """Whether the installed transformers keeps Qwen2.5-VL's ``second_per_grid_ts`` fractional (>=
    5.18; the wheels through 5.17 truncate it to an int first, the bug prealign does not copy): only
    then are fractions compared with it."""
    s = vision_sample("qwen2_5_vl", [("video", 2, 2, 2, 0.75)])
    return int(hf_positions("qwen2_5_vl", [s])[0][0, -2]) == 1 + int(2 * 0.75)


def hf_positions(model_type: str, samples: list[dict]) -> list[torch.Tensor]:
    """transformers' positions for a right-padded batch, cut back to each sample's ``[3, L]``."""
    lengths = [s["input_ids"].numel() for s in samples]
    ids = torch.zeros(len(samples), max(lengths), dtype=torch.int64)
    types, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, s in enumerate(samples):
        ids[i, : lengths[i]], types[i, : lengths[i]], mask[i, : lengths[i]] = (
            s["input_ids"],
            s["mm_token_type_ids"],
            1,
        )
    images = torch.cat([s["image_grid_thw"] for s in samples])
    videos = torch.cat([s["video_grid_thw"] for s in samples])
    kwargs = dict(
        image_grid_thw=images if images.numel() else None,
        video_grid_thw=videos if videos.numel() else None,
        attention_mask=mask,
    )
    if model_type == "qwen2_5_vl" and videos.numel():
        kwargs["second_per_grid_ts"] = torch.cat([s["second_per_grid_ts"] for s in samples])
    with torch.no_grad():
        pos, _ = tiny_model(model_type).model.get_rope_index(ids, types, **kwargs)
    return [pos[:, i, :n] for i, n in enumerate(lengths)]


def segments_st(fractional: bool):
    even = st.integers(1, 4).map(lambda v: 2 * v)
    seconds = st.floats(0.0625, 3.0, width=32) if fractional else st.integers(1, 3).map(float)
    image = st.tuples(st.just("image"), even, even)
    video = st.tuples(st.just("video"), st.integers(1, 3), even, even, seconds)
    return st.lists(st.one_of(st.integers(0, 6), image, video), min_size=1, max_size=5).filter(
        lambda segs: any(not isinstance(s, int) or s > 0 for s in segs)
    )


@st.composite
def family_batch(draw):
    model_type = draw(st.sampled_from(FAMILY_TYPES))
    fractional = model_type == "qwen2_5_vl" and fractional_seconds()
    batch = draw(st.lists(segments_st(fractional), min_size=1, max_size=3))
    return model_type, [vision_sample(model_type, segs) for segs in batch]


@given(family_batch())
@examples(40)
def test_positions_equal_transformers_packed_sharded_and_unsharded(case):
    """THD tp=2 cp=2: each CP rank's shard, all-gathered and unpacked, and the unsharded batch,
    equal transformers' get_rope_index on every real token of every sample, for every family."""
    model_type, samples = case
    cfg = tiny_config(model_type)
    want = hf_positions(model_type, samples)
    layout = ParallelLayout(tp=2, cp=2)
    shards = [
        MRoPECollator(
            collator=THDCollator(schema=SCHEMA, layout=layout, cp_rank=r), model_config=cfg
        )(samples)
        for r in range(2)
    ]
    for b in shards:
        validate_vlm_batch(b, SCHEMA, layout)
        assert b["mrope_position_ids"].shape == (3, 1, b["input_ids"].shape[1])
        assert bool((b["mrope_position_ids"][:, b["padding_mask"]] == 0).all())
    cu, padded = shards[0]["cu_seqlens"], shards[0]["cu_seqlens_padded"]
    whole = unshard_cp([b["mrope_position_ids"] for b in shards], cu_seqlens_padded=padded, dim=2)
    for got, w in zip(
        unpack_thd(whole, cu_seqlens=cu, cu_seqlens_padded=padded, dim=2), want, strict=True
    ):
        assert torch.equal(got, w)
    flat = MRoPECollator(
        collator=THDCollator(schema=SCHEMA, layout=layout, cp_rank=None), model_config=cfg
    )(samples)
    validate_vlm_batch(flat, SCHEMA, layout)
    for got, w in zip(
        unpack_thd(flat["mrope_position_ids"], cu_seqlens=cu, cu_seqlens_padded=padded, dim=2),
        want,
        strict=True,
    ):
        assert torch.equal(got, w)


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(2, 5), st.floats(0.0625, 4.0, width=32)),
        min_size=1,
        max_size=4,
    )
)
@examples(30)
def test_qwen2_5_vl_video_time_steps_equal_transformers(videos):
    """Qwen2.5-VL videos of several temporal grids and fractional seconds per grid (integral ones
    where the installed transformers truncates them): the temporal rows equal get_rope_index's."""
    fractional = fractional_seconds()
    samples = [
        vision_sample(
            "qwen2_5_vl",
            [text, ("video", t, 2, 4, sec if fractional else float(max(1, int(sec)))), 1],
        )
        for text, t, sec in videos
    ]
    cfg = tiny_config("qwen2_5_vl")
    b = MRoPECollator(
        collator=THDCollator(schema=SCHEMA, layout=ParallelLayout(tp=2)), model_config=cfg
    )(samples)
    parts = unpack_thd(
        b["mrope_position_ids"],
        cu_seqlens=b["cu_seqlens"],
        cu_seqlens_padded=b["cu_seqlens_padded"],
        dim=2,
    )
    for got, want in zip(parts, hf_positions("qwen2_5_vl", samples), strict=True):
        assert torch.equal(got, want)


# ---- golden traces
# ---------------------------------------------------------------------------------
def positions(model_type: str, segments: list, **cfg) -> list[list[int]]:
    s = vision_sample(model_type, segments)
    return (
        vision_family(tiny_config(model_type, **cfg))
        .positions(
            s["mm_token_type_ids"],
            torch.tensor([0, s["input_ids"].numel()]),
            image_grid_thw=s["image_grid_thw"],
            video_grid_thw=s["video_grid_thw"],
            second_per_grid_ts=s["second_per_grid_ts"],
        )
        .tolist()
    )


def test_golden_qwen2_vl_video_steps_one_per_temporal_grid():
    # x <vs> V*3 frames of (2x2 merged to 1) <ve> y: temporal 1, 2, 3; the run advances p by max(1,
    # 1) = 1
    assert (
        positions("qwen2_vl", [1, ("video", 3, 2, 2, 1.0), 1])
        == [[0, 1, 2, 3, 4, 3, 4]] + [[0, 1, 2, 2, 2, 3, 4]] * 2
    )


def test_golden_qwen2_5_vl_fractional_seconds():
    # tokens_per_second 2, 0.75 s per grid: steps floor(0 * 1.5), floor(1 * 1.5), floor(2 * 1.5) =
    # 0, 1, 3
    assert positions("qwen2_5_vl", [1, ("video", 3, 2, 2, 0.75), 1])[0] == [0, 1, 2, 3, 5, 3, 4]
    # 25 tokens per second, 0.5 s: steps of 12.5 truncate to 0, 12, 25 (transformers <= 5.10 made
    # them 0, 0, 0)
    assert positions("qwen2_5_vl", [("video", 3, 2, 2, 0.5)], tokens_per_second=25)[0] == [
        0,
        1,
        13,
        26,
        2,
    ]


def test_golden_qwen3_vl_frames_restart_their_temporal_position():
    # <vs> [5 ts] <vs> V V <ve> [5 ts] <vs> V V <ve> <ve>: each frame (2x4 patches -> 1x2 tokens) is
    # its own run, temporal offset 0, advancing p by max(1, 2) = 2
    t, h, w = positions("qwen3_vl", [("video", 2, 2, 4, 1.0)])
    assert t == h == [0, 1, 2, 3, 4, 5, 6, 7, 7, 9, 10, 11, 12, 13, 14, 15, 16, 16, 18, 19]
    assert w == list(range(20))


def test_golden_images_are_the_same_in_every_family():
    for model_type in FAMILY_TYPES:
        assert positions(model_type, [1, ("image", 4, 6), 1]) == [
            [0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
            [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
            [0, 1, 2, 3, 4, 2, 3, 4, 5, 6],
        ]


# ---- configs
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_family_reads_the_config(model_type):
    cfg = tiny_config(model_type)
    fam = vision_family(cfg)
    assert fam == vision_family(cfg.to_dict()) and pickle.loads(pickle.dumps(fam)) == fam
    assert (
        fam.image_token_id,
        fam.video_token_id,
        fam.vision_start_token_id,
        fam.vision_end_token_id,
    ) == (6, 7, 4, 5)
    assert fam.patch_size == cfg.vision_config.patch_size and fam.spatial_merge_size == 2
    assert isinstance(
        fam,
        {
            "qwen2_5_vl": Qwen2_5VL,
            "qwen3_vl": Qwen3VL,
            "qwen3_vl_moe": Qwen3VL,
            "qwen3_5": Qwen3_5,
            "qwen3_5_moe": Qwen3_5,
        }.get(model_type, type(fam)),
    )
    assert not fam.linear_attention  # the tiny Qwen3.5 is all full attention


def test_qwen3_5_default_layers_are_linear_attention_and_others_are_refused():
    assert vision_family(transformers.Qwen3_5MoeConfig()).linear_attention
    with pytest.raises(ConfigError, match="supported: qwen2_vl, qwen2_5_vl, qwen3_vl"):
        vision_family(transformers.LlavaConfig())
    assert set(SUPPORTED_MODEL_TYPES) == set(FAMILY_TYPES) | {
        "gemma3",
        "gemma4",
        "internvl",
        "glm4v",
        "glm4v_moe",
        "llava_onevision",
    } | {"mistral3", "idefics3", "smolvlm"}
    with pytest.raises(ConfigError, match="spatial_merge_size=4"):
        MRoPECollator(
            collator=THDCollator(schema=SCHEMA, layout=ParallelLayout()),
            spatial_merge_size=4,
            model_config=tiny_config("qwen3_vl"),
        )


def test_media_checks_count_video_patches_and_tokens():
    s = vision_sample("qwen2_5_vl", [2, ("video", 3, 2, 4, 0.5), 1, ("image", 2, 2)])
    b = MRoPECollator(
        collator=THDCollator(schema=SCHEMA, layout=ParallelLayout()),
        model_config=tiny_config("qwen2_5_vl"),
    )([s])
    assert validate_vlm_batch(b, SCHEMA, ParallelLayout()) == []
    short = {**b, "pixel_values_videos": b["pixel_values_videos"][:-2]}
    fewer = {
        **b,
        "mm_token_type_ids": b["mm_token_type_ids"].masked_fill(b["mm_token_type_ids"] == 2, 0),
    }
    assert "pixel_values_videos" in str(
        validate_vlm_batch(short, SCHEMA, ParallelLayout(), raise_on_error=False)
    )
    assert "6 video tokens" in str(
        validate_vlm_batch(fewer, SCHEMA, ParallelLayout(), raise_on_error=False)
    )


def test_video_run_mismatch_names_the_sample():
    good = vision_sample("qwen3_vl", [2, ("video", 2, 2, 4, 1.0)])
    bad = {
        **good,
        "video_grid_thw": torch.tensor([[3, 2, 4]]),
        "pixel_values_videos": torch.zeros(24, 1536),
    }
    coll = MRoPECollator(
        collator=THDCollator(schema=SCHEMA, layout=ParallelLayout()),
        model_config=tiny_config("qwen3_vl"),
    )
    coll([good])
    with pytest.raises(SampleError) as err:
        coll([good, bad])
    assert err.value.sample == 1 and "3 runs of video tokens" in err.value.expected


@pytest.mark.parametrize("seconds", [float("nan"), -1.0, 1e30, float("inf")])
def test_bad_seconds_per_grid_name_the_sample_and_field(seconds):
    good = vision_sample("qwen2_5_vl", [2, ("video", 2, 2, 4, 1.0)])
    bad = {**good, "second_per_grid_ts": torch.tensor([seconds])}
    coll = MRoPECollator(
        collator=THDCollator(schema=SCHEMA, layout=ParallelLayout()),
        model_config=tiny_config("qwen2_5_vl"),
    )
    with pytest.raises(SampleError) as err:
        coll([good, bad])
    assert (
        err.value.sample == 1
        and err.value.field == "second_per_grid_ts[0]"
        and "finite seconds" in err.value.expected
    )


def test_a_wrong_count_of_seconds_names_the_sample():
    good = vision_sample("qwen2_5_vl", [2, ("video", 2, 2, 4, 1.0)])
    two = {**good, "second_per_grid_ts": torch.tensor([1.0, 2.0])}
    coll = MRoPECollator(
        collator=THDCollator(schema=SCHEMA, layout=ParallelLayout()),
        model_config=tiny_config("qwen2_5_vl"),
    )
    with pytest.raises(SampleError) as err:
        coll([good, good, two])
    assert (err.value.sample, err.value.field) == (
        2,
        "second_per_grid_ts",
    ) and "one value per video (1)" in err.value.expected


def test_bf16_seconds_give_the_float32_steps():
    fam = vision_family(tiny_config("qwen2_5_vl"))
    grid = torch.tensor([[2, 2, 4], [3, 2, 2]])
    assert (
        fam.video_steps(grid, torch.tensor([0.5, 1.5], dtype=torch.bfloat16)).tolist()
        == fam.video_steps(grid, torch.tensor([0.5, 1.5])).tolist()
        == [1.0, 3.0]
    )
