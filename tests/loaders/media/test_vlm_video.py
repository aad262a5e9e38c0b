"""Every family's transform: images through the image processor configured by the family, video
frames to ``pixel_values_videos`` / ``video_grid_thw`` / ``second_per_grid_ts``, and Qwen3-VL / 3.5
timestamp text, held to transformers' own code (the processors' resize arithmetic, timestamp and
placeholder functions, get_rope_index). transformers' video processors need torchvision, which
cannot be installed here: their arithmetic functions
are imported directly and their patch order is checked through the image processor (a still
video)."""

from __future__ import annotations

import io
import json
import math
import sys
import types

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate import THDCollator
from prealign.collate.mrope import MRoPECollator
from prealign.collate.vision import VisionGeometry, vision_family
from prealign.loaders.media.video import normalize_patches, normalize_table, video_patches
from prealign.loaders.media.vlm import MediaError, MediaProblem, VLMSampleTransform
from prealign.schemas import ParallelLayout, SampleError, validate_vlm_batch, vlm_schema
from tests.conftest import examples
from tests.families.test_vlm_families import fractional_seconds, hf_positions
from tests.vlm_families import FAMILY_TYPES, TOK, tiny_config

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # noqa: E402
    smart_resize as image_smart_resize,
)
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor  # noqa: E402
from transformers.models.qwen3_vl.video_processing_qwen3_vl import (  # noqa: E402
    smart_resize as video_smart_resize,
)

SCHEMA = vlm_schema()


def png(w: int, h: int, seed: int = 0, color=None) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = (
        np.full((h, w, 3), color, np.uint8)
        if color is not None
        else rng.integers(0, 256, (h, w, 3), np.uint8)
    )
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def video_raw(key: str, frames: int, w: int, h: int, fps: float, *, image: bool = True) -> dict:
    names = [f"v0_{i}.png" for i in range(frames)]
    content = ("<image> and " if image else "") + "<video> what happens?"
    meta = {
        "messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": "a cat runs"},
        ],
        "videos": [{"frames": names, "fps": fps}],
        **({"images": ["0.png"]} if image else {}),
    }
    raw = {
        "__key__": key,
        "json": json.dumps(meta).encode(),
        **{n: png(w, h, seed=i) for i, n in enumerate(names)},
    }
    if image:
        raw["0.png"] = png(64, 48, seed=99)
    return raw


# ---- grids equal the processors' resize arithmetic
# ----------------------------------------------------------
@given(
    frames=st.integers(2, 17),
    h=st.integers(8, 900),
    w=st.integers(8, 900),
    scale=st.sampled_from([1, 4, 64, 1024]),
    family=st.sampled_from(["qwen2_5_vl", "qwen3_vl"]),
)
@examples(200)
def test_video_grid_equals_the_processors_arithmetic(frames, h, w, scale, family):
    """Random sizes, odd frame counts, a pixel range from tiny (max-pixels branch) to huge
    (min-pixels branch)."""
    fam = vision_family(tiny_config(family))
    factor = fam.patch_size * fam.spatial_merge_size
    geo = VisionGeometry(
        patch_size=fam.patch_size,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=factor**2 * scale,
        max_pixels=factor**2 * scale * 8,
    )
    smart_resize = video_smart_resize if family == "qwen3_vl" else image_smart_resize
    args = (frames, h, w, 2) if family == "qwen3_vl" else (h, w)
    try:
        rh, rw = smart_resize(*args, factor, geo.min_pixels, geo.max_pixels)
    except (
        ValueError
    ):  # the processor refuses it (aspect ratio; transformers 5.10: a side under the factor)
        with pytest.raises(SampleError):
            fam.video_grid(frames, h, w, geo)
        return
    assert fam.video_grid(frames, h, w, geo) == (
        math.ceil(frames / 2),
        rh // fam.patch_size,
        rw // fam.patch_size,
    )


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5"])
@pytest.mark.parametrize("size", [(31, 17), (64, 48), (300, 40), (1000, 700)])
def test_image_grids_and_pixels_equal_the_family_image_processor(family, size):
    """The transform's default image processor takes the config's patch size; its fast path equals
    it."""
    from PIL import Image

    t = VLMSampleTransform(
        tokenizer=TOK, model_config=tiny_config(family), processor_options={"max_pixels": 200_000}
    )
    proc = t.image_processor
    assert proc.patch_size == (14 if family == "qwen2_vl" else 16)
    raw = {"__key__": "i", "json": json.dumps({"text": "<image> hi"}).encode(), "png": png(*size)}
    out = t(raw)
    want = proc(images=[Image.open(io.BytesIO(raw["png"])).convert("RGB")], return_tensors="pt")
    assert torch.equal(out["image_grid_thw"], want["image_grid_thw"])
    assert torch.equal(out["pixel_values"], want["pixel_values"])


# ---- video pixels
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mean", [(0.5, 0.5, 0.5), (0.48145466, 0.4578275, 0.40821073)])
def test_a_still_video_equals_the_image_processor(mean):
    """Two copies of one frame (one temporal patch) == the image processor's patches of that frame
    (it repeats a still image over the temporal patch): the patch order and normalisation of
    pixel_values_videos."""
    from PIL import Image

    proc = transformers.Qwen2VLImageProcessorPil(
        patch_size=16, image_mean=list(mean), image_std=[0.25, 0.5, 0.3]
    )
    frame = Image.open(io.BytesIO(png(90, 70, seed=3))).convert("RGB")
    want = proc(images=[frame], return_tensors="pt")
    grid = tuple(want["image_grid_thw"][0].tolist())
    codes = video_patches([frame, frame], grid, 16, 2, 2)
    got = normalize_patches(codes, normalize_table(mean, (0.25, 0.5, 0.3), proc.rescale_factor))
    assert np.array_equal(got, want["pixel_values"].numpy())


def test_frames_fill_the_temporal_patches_in_order():
    """Five constant-colour frames, tp=2: groups (0, 1), (2, 3), (4, 4) -- the last frame
    repeated."""
    from PIL import Image

    frames = [Image.new("RGB", (32, 32), (10 * i, 0, 0)) for i in range(5)]
    codes = video_patches(frames, (3, 2, 2), 16, 2, 2)  # [t*gh*gw, 3, tp, p, p]
    assert codes.shape == (12, 3, 2, 16, 16)
    red = codes[:, 0, :, 0, 0].reshape(3, 4, 2)
    assert red[:, 0].tolist() == [[0, 10], [20, 30], [40, 40]] and bool((red == red[:, :1]).all())


# ---- timestamps and placeholders as the Qwen3-VL processor writes them
# --------------------------------------
@given(
    frames=st.integers(2, 13), fps=st.floats(0.5, 30.0), gh=st.integers(1, 3), gw=st.integers(1, 3)
)
@examples(40)
def test_video_ids_are_the_qwen3_vl_processors_text(frames, fps, gh, gw):
    """The chat template's ``<|vision_start|><|video_pad|><|vision_end|>`` expanded by the installed
    processor's own code (its video processor, which needs torchvision, stood in for by its grid and
    metadata): on every transformers, what the transform writes, tokenized."""
    t = VLMSampleTransform(tokenizer=TOK, model_config=tiny_config("qwen3_5"))
    grid = (math.ceil(frames / 2), 2 * gh, 2 * gw)
    ours = t.video_ids(grid, frames, fps)
    assert TOK.decode(ours) == _runs(processor_video_text(grid, frames, fps))
    stamps = Qwen3VLProcessor._calculate_timestamps(None, list(range(frames)), fps, 2)
    assert TOK.decode(ours).count("seconds>") == len(stamps) == grid[0]
    assert all(f"<{s:.1f} seconds>" in TOK.decode(ours) for s in stamps)


def processor_video_text(grid, frames: int, fps: float, metadata=None) -> str:
    """What the installed ``Qwen3VLProcessor`` makes of the chat template's video block: >= 5.10
    through ``replace_video_token`` and ``ProcessorMixin.get_text_with_replacements`` (what its
    ``__call__`` runs), older through its own ``__call__``."""
    from transformers.processing_utils import ProcessorMixin

    block = "<|vision_start|><|video_pad|><|vision_end|>"
    if metadata is None:  # (a video file's: its source indices and rate)
        metadata = transformers.video_utils.VideoMetadata(
            total_num_frames=frames, fps=fps, frames_indices=list(range(frames))
        )
    video_inputs = {"video_grid_thw": torch.tensor([grid]), "video_metadata": [metadata]}
    seen = []
    self = types.SimpleNamespace(
        video_token="<|video_pad|>",
        image_token="<|image_pad|>",
        audio_token=None,
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
        all_special_multimodal_tokens=["<|image_pad|>", "<|video_pad|>"],
        video_processor=types.SimpleNamespace(merge_size=2, temporal_patch_size=2),
        tokenizer=types.SimpleNamespace(init_kwargs={}),
    )
    self._calculate_timestamps = types.MethodType(Qwen3VLProcessor._calculate_timestamps, self)
    if hasattr(Qwen3VLProcessor, "replace_video_token"):
        replacement = Qwen3VLProcessor.replace_video_token(self, video_inputs, 0)
        return ProcessorMixin.get_text_with_replacements(
            self, [block], videos_replacements=[replacement]
        )[0][0]
    self.video_processor = lambda videos, **kw: dict(video_inputs)  # noqa: E731 (its grid and metadata)
    self.video_processor.merge_size = self.video_processor.temporal_patch_size = 2
    self._merge_kwargs = lambda *a, **kw: {
        "images_kwargs": {},
        "videos_kwargs": {},
        "text_kwargs": {},
    }
    self.tokenizer = lambda text, **kw: seen.append(text[0]) or {"input_ids": [[0]]}
    self.tokenizer.init_kwargs = {}
    self._check_special_mm_tokens = lambda *a, **kw: None
    Qwen3VLProcessor.__call__(self, text=block, videos=[object()], return_metadata=True)
    return seen[0]


def _runs(text: str) -> str:
    """The demo tokenizer's decode writes a run of n video pads as ``<|video_pad|>*n``."""
    import re

    return re.sub(
        r"((?:<\|video_pad\|>)+)",
        lambda m: (
            "<|video_pad|>" + (f"*{m.group(1).count('<')}" if m.group(1).count("<") > 1 else "")
        ),
        text,
    )


# ---- the whole transform
# -------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILY_TYPES)
def test_transform_video_end_to_end(family):
    """An image and a 5-frame video at 3 fps: fields, fractional second_per_grid_ts, token runs, the
    family's positions == transformers' get_rope_index, and a collated THD batch that validates."""
    cfg = tiny_config(family)
    t = VLMSampleTransform(tokenizer=TOK, model_config=cfg)
    fps = (
        2.0 if family == "qwen2_5_vl" and not fractional_seconds() else 3.0
    )  # transformers 5.10 truncates 2/3 s
    out = t(video_raw("v", 5, 96, 64, fps))
    fam = t.family
    t_grid, gh, gw = out["video_grid_thw"][0].tolist()
    assert t_grid == 3 and out["second_per_grid_ts"].dtype == torch.float32
    assert out["second_per_grid_ts"].tolist() == [pytest.approx(2 / fps)]
    assert out["pixel_values_videos"].shape == (3 * gh * gw, 3 * 2 * fam.patch_size**2)
    ids = out["input_ids"]
    assert int((ids == TOK.video_token_id).sum()) == 3 * gh * gw // 4
    assert torch.equal(
        out["mm_token_type_ids"],
        (ids == TOK.image_token_id).long() + 2 * (ids == TOK.video_token_id),
    )
    text = TOK.decode(ids)
    assert ("<0.2 seconds>" in text and "<0.8 seconds>" in text and "<1.3 seconds>" in text) == (
        fam.frame_texts(5, 3.0) is not None
    )
    assert torch.equal(out["mrope_position_ids"], hf_positions(family, [out])[0])
    batch = MRoPECollator(
        collator=THDCollator(schema=SCHEMA, layout=ParallelLayout(tp=2)), model_config=cfg
    )([out, t(video_raw("w", 3, 40, 40, 2.0, image=False))])
    validate_vlm_batch(batch, SCHEMA, ParallelLayout(tp=2))
    assert batch["video_grid_thw"].shape == (2, 3) and batch["second_per_grid_ts"].tolist() == [
        pytest.approx(2 / fps),
        1.0,
    ]


def test_bad_videos_are_typed_errors():
    t = VLMSampleTransform(tokenizer=TOK, model_config=tiny_config("qwen3_vl"))
    raw = video_raw("b", 3, 64, 64, 2.0, image=False)
    raw["v0_1.png"] = png(32, 64)
    with pytest.raises(MediaError) as err:
        t(raw)
    assert err.value.problem is MediaProblem.BAD_VIDEO and "one size" in err.value.expected
    thin = video_raw(
        "c", 2, 500, 2, 2.0, image=False
    )  # an aspect ratio the video processor refuses
    with pytest.raises(MediaError, match="the Qwen3-VL video processor accepts"):
        t(thin)
    missing = video_raw("d", 2, 64, 64, 2.0, image=False)
    del missing["v0_1.png"]
    with pytest.raises(MediaError) as err:
        t(missing)
    assert err.value.problem is MediaProblem.MISSING_IMAGE
    meta = {"text": "no video here", "videos": [{"frames": ["v0_0.png", "v0_1.png"], "fps": 2}]}
    with pytest.raises(MediaError, match="placeholders"):
        t({**video_raw("e", 2, 64, 64, 2.0, image=False), "json": json.dumps(meta).encode()})


@pytest.mark.parametrize(
    "fps", [1e-300, 1e-20, 1e-4, float("inf"), float("nan"), 1e4, 0, -2, "2", True]
)
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_an_fps_out_of_range_is_a_bad_video(fps, family):
    """A frame rate outside [MIN_FPS, MAX_FPS] (whose seconds per grid would be inf or overflow the
    int64 temporal positions) names the sample and the field."""
    t = VLMSampleTransform(tokenizer=TOK, model_config=tiny_config(family))
    raw = video_raw("f", 4, 64, 64, 2.0, image=False)
    meta = json.loads(raw["json"])
    meta["videos"][0]["fps"] = fps
    with pytest.raises(MediaError) as err:
        t({**raw, "json": json.dumps(meta).encode()})
    assert (err.value.problem, err.value.sample, err.value.field) == (
        MediaProblem.BAD_VIDEO,
        "f",
        "videos[0].fps",
    )
    meta["videos"][0]["fps"] = 1e-3  # the range's ends are accepted
    assert t({**raw, "json": json.dumps(meta).encode()})["second_per_grid_ts"].tolist() == [2000.0]


# ---- header-only lengths and the demo
# -------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_header_index_equals_the_full_pass_with_videos(tmp_path, model):
    """``prealign demo --model`` data (images and videos): the header-only index (frame headers ->
    family video grid -> the family's video ids) gives every sample the length the full transform
    gives."""
    from prealign.loaders import BadDataPolicy, WebDatasetSource, build_index
    from prealign.loaders.cli.demo_data import build_demo_dataset, demo_model_config
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.index.header_pass import write_sidecars

    ds = build_demo_dataset(
        str(tmp_path), num_samples=24, samples_per_shard=12, topk=4, model=model, bad=()
    )
    transform = VLMSampleTransform(
        tokenizer=ByteTokenizer(), topk=4, model_config=demo_model_config(model)
    )
    schema = vlm_schema(topk=4, vocab_size=ds.vocab_size)
    policy = BadDataPolicy(on_error="raise")
    full = build_index(
        WebDatasetSource(list(ds.shards), transform=transform, image="bytes", sidecars=False),
        schema,
        policy=policy,
    )
    write_sidecars(WebDatasetSource(list(ds.shards), transform=transform, image="bytes"), schema)
    side = build_index(
        WebDatasetSource(list(ds.shards), transform=transform, image="bytes"), schema, policy=policy
    )
    assert len(full) == len(side) == 24
    assert (
        full.lengths.tolist() == side.lengths.tolist()
        and full.media.tolist() == side.media.tolist()
    )
    # the header path's video ids against transformers' own arithmetic and processor text, from the
    # frames alone
    checked = 0
    for raw in _tar_samples(ds.shards):
        meta = json.loads(raw["json"])
        blocks = transform.header_video_ids(
            raw, meta, raw["__key__"], lambda name, value: _image_size(value)
        )
        for video, ours in zip(meta.get("videos", ()), blocks, strict=True):
            if isinstance(
                video,
                str,
                # an mp4 member (tests/loaders/media/test_video_files.py holds those to
                # transformers)
            ):
                continue
            frames, (w, h) = len(video["frames"]), _image_size(raw[video["frames"][0]])
            assert TOK.decode(ours) == _runs(
                _processor_video_block(model, transform, frames, h, w, video["fps"])
            )
            checked += 1
    assert checked > 0


def _tar_samples(shards):
    """Each webdataset sample of the shards as ``{"__key__", member: bytes}``, in order."""
    import tarfile

    for shard in shards:
        samples: dict = {}
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                key, name = member.name.split(".", 1)
                samples.setdefault(key, {"__key__": key})[name] = tar.extractfile(member).read()
        yield from samples.values()


def _image_size(data: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.size


def _processor_video_block(model: str, transform, frames: int, h: int, w: int, fps: float) -> str:
    """The chat template's video block as the installed processor expands it, the grid from
    transformers' resize (Qwen3-VL: the video processor's volume rule; Qwen2 families: the per-frame
    area rule)."""
    geo = transform.video_geometry
    factor = geo.patch_size * geo.merge_size
    if model in ("qwen3_vl", "qwen3_5"):
        rh, rw = video_smart_resize(
            frames, h, w, geo.temporal_patch_size, factor, geo.min_pixels, geo.max_pixels
        )
        grid = (
            math.ceil(frames / geo.temporal_patch_size),
            rh // geo.patch_size,
            rw // geo.patch_size,
        )
        return processor_video_text(grid, frames, fps)
    rh, rw = image_smart_resize(h, w, factor, geo.min_pixels, geo.max_pixels)
    tokens = (
        math.ceil(frames / geo.temporal_patch_size)
        * rh
        * rw
        // (geo.patch_size * geo.merge_size) ** 2
    )
    return "<|vision_start|>" + "<|video_pad|>" * tokens + "<|vision_end|>"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen2_5_vl", "qwen3_5"])
def test_demo_command_with_a_model_streams_videos(tmp_path, capsys, model):
    """``prealign demo --model``: every batch on every CP rank valid, video fields in the
    batches."""
    from prealign.loaders.cli import main

    args = [
        "demo",
        "--model",
        model,
        "--samples",
        "40",
        "--out",
        str(tmp_path / "l.png"),
        "--workers",
        "0",
        "--token-budget",
        "2048",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    n = int(out.split("micro-batches  ")[1].split(" ")[0])
    assert f"{2 * n}/{2 * n} batches valid" in out
    assert "pixel_values_videos" in out and "second_per_grid_ts      float32" in out
    assert " imgs  vids " in out and " videos" in out.split("micro-batches  ")[1].splitlines()[0]


def test_processor_and_tokenizer_ids_come_together_with_the_config():
    """``processor=`` an image processor is used as given; a processor with a tokenizer gives the
    tokenizer; ids that disagree with the config are a ConfigError naming both."""
    from prealign.loaders.media.chat_tokenizer import HFChatTokenizer
    from prealign.schemas import ConfigError
    from tests.loaders.media.test_vlm import _tiny_hf_tokenizer

    proc = transformers.Qwen2VLImageProcessorPil(
        patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    t = VLMSampleTransform(tokenizer=TOK, processor=proc, model_config=tiny_config("qwen3_vl"))
    assert t.image_processor is proc and t.vision.image_token_id == 6
    hf = _tiny_hf_tokenizer()
    both = types.SimpleNamespace(tokenizer=hf, image_processor=proc)
    t = VLMSampleTransform(processor=both, model_config=tiny_config("qwen3_vl"))
    assert isinstance(t.tokenizer, HFChatTokenizer) and t.image_processor is proc
    with pytest.raises(ConfigError, match="differ from the tokenizer's"):
        t.vision  # the tiny tokenizer's <|image_pad|> is 5, the config's 6
    with pytest.raises(ConfigError, match="tokenizer= or a processor="):
        VLMSampleTransform(model_config=tiny_config("qwen3_vl"))
    with pytest.raises(ConfigError, match="needs model_config"):
        VLMSampleTransform(tokenizer=TOK).video_geometry


def test_index_key_names_the_family_and_the_grid_settings():
    """A sidecar index built for one family or processor setting is never taken for another (lengths
    differ)."""
    from prealign.loaders.index.sidecar import describe_transform

    keys = {
        describe_transform(VLMSampleTransform(tokenizer=TOK, **kw))
        for kw in (
            {},
            {"model_config": tiny_config("qwen2_vl")},
            {"model_config": tiny_config("qwen3_vl")},
            {"model_config": tiny_config("qwen3_vl"), "video_fps": 4.0},
            {"processor_options": {"max_pixels": 50_000}},
        )
    }
    assert len(keys) == 5
    assert describe_transform(VLMSampleTransform(tokenizer=TOK, topk=4)) == describe_transform(
        VLMSampleTransform(tokenizer=TOK, topk=4)
    )


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_index_key_names_transformers_where_its_video_rules_apply(family, monkeypatch):
    """Qwen3-VL's video grids (smart_resize) and video text change between transformers releases: a
    sidecar built under one is never taken under another. Qwen2.5-VL's arithmetic is prealign's own:
    its key does not move."""
    t = VLMSampleTransform(tokenizer=TOK, model_config=tiny_config(family))
    before = t.index_key()
    installed = sys.modules[
        "transformers"
    ]  # the module index_key imports (transformers may rebind it lazily)
    monkeypatch.setattr(
        installed, "__version__", "5.10.4" if installed.__version__ != "5.10.4" else "5.24.0"
    )
    assert (t.index_key() != before) == (family != "qwen2_5_vl")


def test_video_frame_and_pixel_limits_are_bad_videos_before_decoding():
    """``DecodeLimits.max_video_frames`` is checked before any frame is decoded,
    ``max_video_pixels`` on the running total while decoding (the header pass refuses the same
    sample from the frames' sizes)."""
    from prealign.loaders.sources.tar_decode import DecodeLimits

    t = VLMSampleTransform(
        tokenizer=TOK,
        model_config=tiny_config("qwen2_5_vl"),
        limits=DecodeLimits(max_video_frames=3, max_video_pixels=2 * 64 * 64),
    )
    raw = video_raw("g", 4, 64, 64, 2.0, image=False)
    raw["v0_3.png"] = b"not an image"  # decoding it would be corrupt_image: each limit fires before
    with pytest.raises(MediaError) as err:
        t(raw)
    assert (err.value.problem, err.value.sample, err.value.field) == (
        MediaProblem.BAD_VIDEO,
        "g",
        "videos[0].frames",
    )
    assert "max_video_frames" in err.value.expected
    three = video_raw("h", 3, 64, 64, 2.0, image=False)
    three["v0_2.png"] = (
        b"not an image"  # the third frame is never decoded: two already reach the limit + 1 px
    )
    t = VLMSampleTransform(
        tokenizer=TOK,
        model_config=tiny_config("qwen2_5_vl"),
        limits=DecodeLimits(max_video_pixels=2 * 64 * 64 - 1),
    )
    with pytest.raises(MediaError, match="max_video_pixels") as err:
        t(three)
    assert (err.value.problem, err.value.field) == (MediaProblem.BAD_VIDEO, "videos[0]")
    meta = json.loads(three["json"])
    with pytest.raises(MediaError, match="max_video_pixels"):
        t.header_video_ids(three, meta, "h", lambda name, value: (64, 64))
    assert (
        len(
            VLMSampleTransform(
                tokenizer=TOK,
                model_config=tiny_config("qwen2_5_vl"),
                limits=DecodeLimits(max_video_frames=4, max_video_pixels=4 * 64 * 64),
            )(video_raw("i", 4, 64, 64, 2.0, image=False))["video_grid_thw"]
        )
        == 1
    )


def test_video_processor_config_sets_the_video_grids_and_defaults_warn_once(monkeypatch):
    """The checkpoint's video_preprocessor_config.json (a dict) decides the grids where no video
    processor can be built; without it the class defaults are used and a VideoDefaultsWarning says
    so once per family."""
    import warnings

    import prealign.loaders.media.vlm as vlm
    from prealign.loaders.media.vlm import VideoDefaultsWarning

    monkeypatch.setattr(vlm, "_WARNED_DEFAULTS", set())
    raw = video_raw("j", 4, 96, 64, 2.0, image=False)
    config = {
        "size": {"shortest_edge": 4096, "longest_edge": 4 * 32 * 32 * 4},
        "patch_size": 16,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
        "rescale_factor": 1 / 255,
        "fps": 2,
    }
    cfg = tiny_config("qwen3_vl")
    with warnings.catch_warnings():
        warnings.simplefilter("error", VideoDefaultsWarning)
        ours = VLMSampleTransform(tokenizer=TOK, model_config=cfg, video_processor_config=config)(
            raw
        )
    assert (
        VLMSampleTransform(
            tokenizer=TOK, model_config=cfg, video_processor_config=config
        ).video_geometry.max_pixels
        == 4 * 32 * 32 * 4
    )
    h, w = video_smart_resize(
        4, 64, 96, 2, 32, 4096, 4 * 32 * 32 * 4
    )  # the processor's rule, the config's bounds
    assert ours["video_grid_thw"].tolist() == [[2, h // 16, w // 16]]
    as_processor = types.SimpleNamespace(
        video_processor=types.SimpleNamespace(**config), image_processor=None
    )
    t = VLMSampleTransform(tokenizer=TOK, model_config=cfg, processor=as_processor)
    assert (
        t.video_geometry
        == VLMSampleTransform(
            tokenizer=TOK, model_config=cfg, video_processor_config=config
        ).video_geometry
    )
    default = VLMSampleTransform(tokenizer=TOK, model_config=cfg)
    with pytest.warns(VideoDefaultsWarning, match="video_processor_config"):
        out = default(raw)
    assert out["video_grid_thw"].tolist() != ours["video_grid_thw"].tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("error", VideoDefaultsWarning)
        default(raw)  # once per family
