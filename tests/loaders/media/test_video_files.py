"""Video files in the shards (issue 29): never silently dropped without video rules, decoded with
PyAV by the family's frame choice (held to transformers' own samplers, its
``load_video(backend="pyav")`` frames and its
Qwen3-VL processor text), header-only lengths that decode nothing, limits and corrupt files as typed
errors."""

from __future__ import annotations

import io
import json
import math
import tempfile
import types

import numpy as np
import pytest
import torch

from prealign.loaders.media import video_file
from prealign.loaders.media.video_file import VideoFileError, decode_frames, probe_video
from prealign.loaders.media.video_sampling import FrameSampling
from prealign.loaders.media.vlm import MediaError, MediaProblem, VLMSampleTransform
from prealign.loaders.sources.tar_decode import DecodeLimits
from prealign.schemas import vlm_schema
from tests.video_clips import make_clip
from tests.vlm_families import TOK, tiny_config

av = pytest.importorskip("av")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    """Several lengths, 10-60 fps, a variable-frame-rate file, 64-640 px, mp4 and webm (and mkv)."""
    return {
        "short30": make_clip(9, 64, 48, 30),
        "long30": make_clip(95, 80, 64, 30),
        "fast60": make_clip(60, 96, 64, 60, gop=10),
        "slow10": make_clip(23, 64, 64, 10),
        "vfr": make_clip(30, 64, 64, 24, vfr=True),
        "wide": make_clip(12, 640, 96, 25),
        "webm": make_clip(20, 96, 64, 10, container="webm"),
        "mkv": make_clip(16, 64, 80, 15, container="mkv"),
    }


def chat(placeholders: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"{placeholders} what happens?"},
            {"role": "assistant", "content": "a cat runs"},
        ]
    }


def file_sample(key: str, clip: bytes, *, member: str = "mp4", declared=None, ext=None) -> dict:
    meta = chat("<video>")
    if declared is not None:
        meta["videos"] = declared
    return {"__key__": key, "json": json.dumps(meta).encode(), member: clip, **(ext or {})}


def frame_list_sample(key: str) -> dict:
    from tests.loaders.media.test_vlm_video import video_raw

    return video_raw(key, 4, 64, 64, 2.0, image=False)


# ---- 1. never silently dropped
# ---------------------------------------------------------------------------------
def _dropped_cases(clips) -> dict[str, dict]:
    return {
        "frame list": frame_list_sample("f"),
        "mp4 member": file_sample("m", clips["short30"]),
        "declared file": file_sample(
            "d", clips["short30"], member="clip.mp4", declared=["clip.mp4"]
        ),
        "placeholder only": {"__key__": "p", "json": json.dumps(chat("<video>")).encode()},
        "member without placeholder": {
            "__key__": "n",
            "json": json.dumps(chat("")).encode(),
            "clip.webm": clips["webm"],
        },
    }


@pytest.mark.parametrize(
    "case",
    ["frame list", "mp4 member", "declared file", "placeholder only", "member without placeholder"],
)
def test_a_transform_without_video_rules_refuses_every_video(clips, case):
    """The default transform (no model_config), full pass and header pass: a typed error naming the
    sample and the member or placeholder, never the text kept with ``<video>`` literal and the video
    dropped."""
    from prealign.loaders.index.header_pass import VLMRule

    raw = _dropped_cases(clips)[case]
    t = VLMSampleTransform(tokenizer=TOK)
    with pytest.raises(MediaError) as err:
        t(raw)
    assert (
        err.value.problem is MediaProblem.UNPROCESSED_VIDEO and err.value.sample == raw["__key__"]
    )
    want_field = {
        "frame list": "videos",
        "mp4 member": "mp4",
        "declared file": "videos",
        "placeholder only": "json",
        "member without placeholder": "clip.webm",
    }[case]
    assert err.value.field == want_field and "model_config" in str(err.value)
    members = {k: v for k, v in raw.items() if k != "__key__"}
    with pytest.raises(MediaError) as err:
        VLMRule(t, vlm_schema())(members, raw["__key__"])
    assert err.value.problem is MediaProblem.UNPROCESSED_VIDEO


def _shards(tmp_path, clips, transform=None) -> list[str]:
    from prealign.loaders import ShardWriter

    good = [{"__key__": f"g{i}", "json": chat("hello there"), "txt": "x"} for i in range(3)]
    videos = [
        {"__key__": "v0", "json": chat("<video>"), "mp4": clips["short30"]},
        {
            "__key__": "v1",
            "json": {**chat("<video>"), "videos": [{"frames": ["a.png", "b.png"], "fps": 2}]},
            "a.png": _png(),
            "b.png": _png(),
        },
    ]
    with ShardWriter(str(tmp_path / "s-%03d.tar"), sidecars=False) as w:
        for sample in good + videos:
            w.write(sample)
    return w.shards


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (9, 99, 199)).save(buf, format="PNG")
    return buf.getvalue()


def test_index_under_skip_counts_each_video_sample(tmp_path, clips):
    """build_index with the default transform and policy skip: both video samples counted as
    unprocessed_video."""
    from prealign.loaders import BadDataPolicy, WebDatasetSource, build_index

    shards = _shards(tmp_path, clips)
    src = WebDatasetSource(
        shards, transform=VLMSampleTransform(tokenizer=TOK), image="bytes", sidecars=False
    )
    with pytest.warns(Warning):
        index = build_index(src, vlm_schema(), policy=BadDataPolicy(on_error="skip"))
    assert len(index) == 3 and index.report.counts == {"unprocessed_video": 2}


def test_prealign_index_and_inspect_never_drop_a_video(tmp_path, clips, capsys):
    """``prealign index`` (header pass) counts both video samples as bad (recorded in the sidecar,
    so a loader raises or skips them by its policy); ``prealign inspect`` (reading those sidecars)
    counts both as skipped."""
    from prealign.loaders.cli import main

    shards = _shards(tmp_path, clips)
    assert main(["index", *shards]) == 0
    assert "2 sample(s) refused (unprocessed_video 2)" in capsys.readouterr().err
    main(
        [
            "inspect",
            *shards,
            "--workers",
            "0",
            "--out",
            str(tmp_path / "x.png"),
            "--token-budget",
            "1024",
        ]
    )
    out = capsys.readouterr()
    assert "unprocessed_video 2" in out.out + out.err


# ---- 2. samplers, exactly transformers'
# -----------------------------------------------------------------------
def _qwen2_sampler():
    """transformers' Qwen2-VL ``sample_frames`` (its module imports torchvision at the top, only for
    the resize this test does not run: a stand-in module lets it import)."""
    import sys

    saved = {
        k: sys.modules.get(k)
        for k in (
            "torchvision",
            "torchvision.transforms",
            "torchvision.transforms.v2",
            "torchvision.transforms.v2.functional",
        )
    }
    try:
        import torchvision  # noqa: F401
    except ImportError:
        for name in saved:
            sys.modules[name] = types.ModuleType(name)
    try:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
    return Qwen2VLVideoProcessor


def _theirs(family: str, total: int, source_fps: float, **over):
    """The frame indices transformers' video processor of ``family`` keeps (its sample_frames on its
    class defaults, with ``over`` as call arguments)."""
    from transformers.video_utils import VideoMetadata

    meta = VideoMetadata(total_num_frames=total, fps=source_fps)
    if family == "qwen3_vl":
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
            Qwen3VLVideoProcessor as cls,
        )
    else:
        cls = _qwen2_sampler()
    self = types.SimpleNamespace(
        **{
            k: getattr(cls, k, None)
            for k in (
                "fps",
                "num_frames",
                "min_frames",
                "max_frames",
                "temporal_patch_size",
                "do_sample_frames",
            )
        }
    )
    for k in ("min_frames", "max_frames"):
        if k in over:
            setattr(self, k, over[k])
    if not over.get("do_sample_frames", cls.do_sample_frames):
        return np.arange(total)
    kwargs = {k: v for k, v in over.items() if k in ("fps", "num_frames")}
    if family != "qwen3_vl":
        kwargs.update({k: v for k, v in over.items() if k in ("min_frames", "max_frames")})
    return np.asarray(cls.sample_frames(self, meta, **kwargs))


SAMPLING_CASES = [
    {},
    {"do_sample_frames": True},
    {"do_sample_frames": True, "fps": 2.0},
    {"do_sample_frames": True, "fps": 1.0, "min_frames": 2},
    {"do_sample_frames": True, "fps": 7.5},
    {"do_sample_frames": True, "num_frames": 6},
    {"do_sample_frames": True, "num_frames": 5},
    {"do_sample_frames": True, "fps": 0.5, "max_frames": 4},
]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("over", SAMPLING_CASES)
@pytest.mark.parametrize(
    "total,fps",
    [
        (95, 30.0),
        (9, 30.0),
        (60, 60.0),
        (23, 10.0),
        (30, 16.623376623376622),
        (4, 24.0),
        (1000, 29.97),
    ],
)
def test_frame_choice_equals_the_processors_sample_frames(family, over, total, fps):
    ours = FrameSampling.for_family(volume=family == "qwen3_vl", overrides=over)
    try:
        want = _theirs(family, total, fps, **over)
    except (
        ValueError,
        ZeroDivisionError,
        TypeError,
    ):  # refused (Qwen2 without fps or num_frames: a TypeError)
        with pytest.raises(ValueError):
            ours.indices(total, fps, 2)
        return
    assert ours.indices(total, fps, 2).tolist() == want.tolist()


def test_the_issues_examples():
    """Qwen3-VL: [0, 19, 38, 56, 75, 94] of 95 frames at 30 fps; Qwen2.5-VL with num_frames=4: 2 /
    sampled fps."""
    from prealign.loaders.media.video_sampling import sampled_fps

    assert FrameSampling.for_family(volume=True).indices(95, 30.0, 2).tolist() == [
        0,
        19,
        38,
        56,
        75,
        94,
    ]
    four = FrameSampling.for_family(
        volume=False, overrides={"do_sample_frames": True, "num_frames": 4}
    )
    idx = four.indices(95, 30.0, 2)
    assert idx.tolist() == [0, 23, 47, 71] and round(2 / sampled_fps(idx, 95, 30.0), 4) == 1.5833


# ---- 3. decoding: only the sampled frames, equal to load_video(backend="pyav")
# ------------------------------------
@pytest.mark.parametrize("name", ["short30", "long30", "fast60", "slow10", "vfr", "wide"])
def test_decoded_frames_equal_transformers_load_video(clips, name):
    from transformers.video_utils import load_video

    data = clips[name]
    header = probe_video(data)
    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        f.write(data)
        f.flush()
        video, meta = load_video(f.name, backend="pyav")
    assert (header.frames, header.fps, header.width, header.height) == (
        meta.total_num_frames,
        meta.fps,
        meta.width,
        meta.height,
    )
    idx = np.linspace(0, header.frames - 1, 7).round().astype(int)
    got = decode_frames(data, idx, header, None)
    assert np.array_equal(got.transpose(0, 2, 3, 1), video[idx])


def test_webm_and_mkv_frame_counts_come_from_packets(clips):
    """A matroska/webm stream header has no frame count: the packets are counted (nothing decoded);
    the frames decoded match them."""
    for name, frames in (("webm", 20), ("mkv", 16)):
        before = video_file.DECODE_COUNT[0]
        header = probe_video(clips[name])
        assert header.frames == frames and header.counted and video_file.DECODE_COUNT[0] == before
        assert decode_frames(clips[name], np.arange(frames), header, None).shape[0] == frames


def test_decoding_seeks_keyframes_and_work_scales_with_sampled_frames():
    """Keyframe every 10 frames: 3 sampled frames of 60 and of 240 decode at most 3 * 10 frames each
    (counted, not timed); the whole clip would decode 60 or 240."""
    work = []
    for total in (60, 240):
        data = make_clip(total, 64, 48, 30, gop=10)
        header = probe_video(data)
        before = video_file.DECODE_COUNT[0]
        decode_frames(data, [0, total // 2, total - 1], header, (32, 32))
        work.append(video_file.DECODE_COUNT[0] - before)
    assert all(w <= 30 for w in work) and work[0] >= 3


def test_corrupt_truncated_and_bad_headers_are_typed(clips):
    t = VLMSampleTransform(tokenizer=TOK, model_config=tiny_config("qwen3_vl"))
    for data in (
        b"not a video at all",
        clips["long30"][: len(clips["long30"]) // 3],
        b"\x00" * 4096,
    ):
        with pytest.raises(MediaError) as err:
            t(file_sample("c", data))
        assert err.value.problem in (MediaProblem.CORRUPT_VIDEO, MediaProblem.BAD_VIDEO)
        assert err.value.sample == "c" and err.value.field == "mp4"
    with pytest.raises(VideoFileError):
        probe_video(b"garbage")


def test_limits_are_checked_from_headers_before_decoding(clips):
    before = video_file.DECODE_COUNT[0]
    for limits, what in (
        (DecodeLimits(max_video_seconds=1), "max_video_seconds"),
        (DecodeLimits(max_video_frames=8), "max_video_frames"),
        (DecodeLimits(max_video_bytes=10_000), "max_video_bytes"),
        (DecodeLimits(max_video_pixels=10_000), "max_video_pixels"),
    ):
        t = VLMSampleTransform(tokenizer=TOK, model_config=tiny_config("qwen2_5_vl"), limits=limits)
        with pytest.raises(MediaError, match=what) as err:
            t(file_sample("l", clips["long30"]))
        assert err.value.problem is MediaProblem.BAD_VIDEO and err.value.field == "mp4"
    assert video_file.DECODE_COUNT[0] == before


def test_a_valid_mp4_is_never_an_image(clips):
    t = VLMSampleTransform(tokenizer=TOK, model_config=tiny_config("qwen3_vl"))
    raw = {
        "__key__": "i",
        "json": json.dumps({**chat("<image>"), "images": ["clip.mp4"]}).encode(),
        "clip.mp4": clips["short30"],
    }
    with pytest.raises(MediaError) as err:
        t(raw)
    assert err.value.problem is MediaProblem.BAD_VIDEO and "videos" in err.value.expected


# ---- 4. the transform: grids, tokens, seconds, timestamps, positions == transformers
# ----------------------------
def _hf_text(family, transform, header, idx) -> str:
    geo = transform.video_geometry
    n = len(idx)
    factor = geo.patch_size * geo.merge_size
    if family == "qwen3_vl":
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        rh, rw = smart_resize(
            n, header.height, header.width, 2, factor, geo.min_pixels, geo.max_pixels
        )
        grid = (math.ceil(n / 2), rh // geo.patch_size, rw // geo.patch_size)
        from transformers.video_utils import VideoMetadata

        meta = VideoMetadata(
            total_num_frames=header.frames, fps=header.fps, frames_indices=list(idx)
        )
        return grid, processor_video_text_meta(grid, meta)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    rh, rw = smart_resize(header.height, header.width, factor, geo.min_pixels, geo.max_pixels)
    grid = (math.ceil(n / 2), rh // geo.patch_size, rw // geo.patch_size)
    return grid, "<|vision_start|>" + "<|video_pad|>" * (
        grid[0] * grid[1] * grid[2] // 4
    ) + "<|vision_end|>"


def processor_video_text_meta(grid, metadata) -> str:
    """The installed Qwen3-VL processor's video text for a grid and its metadata (frame indices,
    source fps)."""
    from tests.loaders.media.test_vlm_video import processor_video_text

    return processor_video_text(grid, len(metadata.frames_indices), metadata.fps, metadata)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("name", ["short30", "long30", "fast60", "slow10", "vfr", "wide", "webm"])
@pytest.mark.parametrize("over", [None, {"do_sample_frames": True, "fps": 2.0}])
def test_file_videos_equal_transformers(clips, family, name, over):
    """Frames chosen, grid, token count, second_per_grid_ts (Qwen2.5-VL: 2 / sampled fps), the
    Qwen3-VL timestamp text from source indices / source fps, and mRoPE positions == transformers'
    get_rope_index."""
    from tests.families.test_vlm_families import fractional_seconds, hf_positions
    from tests.loaders.media.test_vlm_video import _runs

    t = VLMSampleTransform(
        tokenizer=TOK,
        model_config=tiny_config(family),
        video_sampling=over,
        video_processor_config={"min_pixels": 4096, "max_pixels": 65536},
    )
    header = probe_video(clips[name])
    idx = _theirs(family, header.frames, header.fps, **(over or {}))
    grid, text = _hf_text(family, t, header, idx)
    out = t(file_sample("s", clips[name]))
    assert out["video_grid_thw"].tolist() == [list(grid)]
    assert int((out["input_ids"] == TOK.video_token_id).sum()) == grid[0] * grid[1] * grid[2] // 4
    assert _runs(text) in TOK.decode(out["input_ids"])
    sampled = len(idx) / header.frames * header.fps
    assert out["second_per_grid_ts"].tolist() == [pytest.approx(2 / sampled, rel=1e-6)]
    assert out["pixel_values_videos"].shape == (
        grid[0] * grid[1] * grid[2],
        3 * 2 * t.family.patch_size**2,
    )
    if (
        family == "qwen3_vl" or fractional_seconds()
    ):  # transformers <= 5.10 truncates Qwen2.5-VL's seconds to
        assert torch.equal(
            out["mrope_position_ids"], hf_positions(family, [out])[0]
        )  # ints (docs/vlm.md)


def test_frame_lists_carry_source_indices_for_qwen3_timestamps():
    """A pre-decoded frame list with frame_indices / source_fps writes the timestamps its source
    frames have."""
    from tests.loaders.media.test_vlm_video import png

    t = VLMSampleTransform(tokenizer=TOK, model_config=tiny_config("qwen3_vl"))
    names = [f"f{i}.png" for i in range(6)]
    video = {
        "frames": names,
        "fps": 2.0,
        "frame_indices": [0, 19, 38, 56, 75, 94],
        "source_fps": 30.0,
    }
    raw = {
        "__key__": "q",
        "json": json.dumps({**chat("<video>"), "videos": [video]}).encode(),
        **{n: png(64, 64, seed=i) for i, n in enumerate(names)},
    }
    text = TOK.decode(t(raw)["input_ids"])
    assert "<0.3 seconds>" in text and "<1.6 seconds>" in text and "<2.8 seconds>" in text
    bad = {**video, "frame_indices": [3, 2, 1, 0, 4, 5]}
    with pytest.raises(MediaError, match="frame_indices"):
        t({**raw, "json": json.dumps({**chat("<video>"), "videos": [bad]}).encode()})


# ---- 5. header-only lengths: no pixel decoded, lengths equal the loader's
# ---------------------------------------
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_index_pass_decodes_no_pixels_and_lengths_equal_the_loaders(tmp_path, clips, family):
    from prealign.loaders import BadDataPolicy, ShardWriter, WebDatasetSource, build_index
    from prealign.loaders.index.header_pass import write_sidecars

    t = VLMSampleTransform(
        tokenizer=TOK,
        model_config=tiny_config(family),
        video_processor_config={"min_pixels": 4096, "max_pixels": 65536},
    )
    with ShardWriter(str(tmp_path / "v-%03d.tar"), sidecars=False) as w:
        for i, name in enumerate(sorted(clips)):
            ext = "webm" if name == "webm" else "mkv" if name == "mkv" else "mp4"
            w.write({"__key__": f"k{i}", "json": chat("<video>"), ext: clips[name]})
        w.write(
            {
                "__key__": "two",
                "json": {**chat("<video> then <video>"), "videos": ["a.mp4", {"file": "b.webm"}]},
                "a.mp4": clips["vfr"],
                "b.webm": clips["webm"],
            }
        )
    schema = vlm_schema()
    before = video_file.DECODE_COUNT[0]
    write_sidecars(WebDatasetSource(w.shards, transform=t, image="bytes"), schema, workers=1)
    assert video_file.DECODE_COUNT[0] == before  # `prealign index`: headers only
    side = build_index(
        WebDatasetSource(w.shards, transform=t, image="bytes"),
        schema,
        policy=BadDataPolicy(on_error="raise"),
    )  # (its schema check loads one sample per signature)
    scanned = WebDatasetSource(w.shards, transform=t, image="bytes", sidecars=False)
    before = video_file.DECODE_COUNT[0]
    full = build_index(
        scanned, schema, policy=BadDataPolicy(on_error="raise")
    )  # the transform on every sample
    assert video_file.DECODE_COUNT[0] == before  # its index pass too: no frame decoded
    assert (
        len(side) == len(full) == len(clips) + 1 and side.lengths.tolist() == full.lengths.tolist()
    )
    loaded = [
        scanned.load(tuple(loc)) for loc in full.locations.tolist()
    ]  # the loader decodes, same lengths
    assert video_file.DECODE_COUNT[0] > before
    assert [int(s["input_ids"].numel()) for s in loaded] == full.lengths.tolist()


# ---- 6. HF rows naming image and video files by path
# ------------------------------------------------------------
def test_hf_rows_name_media_files_relative_to_their_folder(tmp_path, clips):
    """A jsonl whose rows name an image and a video by path (the common layout): read from the
    jsonl's folder, through the same decoders and sampling as a shard's members; a path leaving the
    folder or missing is a counted bad sample naming the row and the path, and no file outside the
    folder is read."""
    import datasets

    from prealign.loaders import BadDataPolicy, build_index
    from prealign.loaders.sources.source import HFSource
    from tests.loaders.media.test_vlm_video import png

    (tmp_path / "media" / "clips").mkdir(parents=True)
    (tmp_path / "media" / "clips" / "c.mp4").write_bytes(clips["vfr"])
    (tmp_path / "media" / "a.png").write_bytes(png(64, 48))
    (tmp_path / "secret.png").write_bytes(png(8, 8))
    rows = [
        {**chat("<image> and <video>"), "images": ["a.png"], "videos": ["clips/c.mp4"]},
        {**chat("<image>"), "images": ["../secret.png"], "videos": []},
        {**chat("<video>"), "images": [], "videos": ["clips/none.mp4"]},
    ]  # (one type per column: datasets 3.1)
    data = tmp_path / "media" / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    ds = datasets.load_dataset(
        "json", data_files=str(data), split="train", cache_dir=str(tmp_path / "cache")
    )
    t = VLMSampleTransform(tokenizer=TOK, model_config=tiny_config("qwen3_vl"))
    src = HFSource(ds, transform=t, media_root=str(tmp_path / "media"))
    before = video_file.DECODE_COUNT[0]
    with pytest.warns(Warning):
        index = build_index(src, vlm_schema(), policy=BadDataPolicy(on_error="skip"))
    assert len(index) == 1 and index.report.counts == {"missing_image": 2}
    assert video_file.DECODE_COUNT[0] == before  # lengths from the video's headers
    got = src.load((0,))
    assert int(got["input_ids"].numel()) == int(index.lengths[0])
    want = t(
        {
            "__key__": "w",
            "json": json.dumps(rows[0]).encode(),
            "a.png": png(64, 48),
            "clips/c.mp4": clips["vfr"],
        }
    )
    for name in (
        "input_ids",
        "pixel_values",
        "pixel_values_videos",
        "video_grid_thw",
        "second_per_grid_ts",
    ):
        assert torch.equal(got[name], want[name]), name
    from prealign.loaders.errors import BadSampleError

    with pytest.raises(
        BadSampleError, match="media_root"
    ) as err:  # without media_root: the fix is said
        HFSource(ds, transform=t).load((0,))
    assert err.value.reason == "missing_image" and err.value.field == "a.png"


# ---- 7. pixels: transformers' video processors' resize and fused normalisation
# ----------------------------------
@pytest.mark.parametrize(
    "mean,std",
    [
        ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
        ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    ],
)
def test_fused_normalisation_equals_transformers_fused_mean_and_std(mean, std):
    """Every uint8 value of every channel: ``(x - 255*mean) / (255*std)`` with transformers' own
    fused mean and std (its backend's helper), in float32 as ``normalize`` runs it; the unfused
    rescale-then-normalize differs."""
    from transformers.image_processing_backends import (
        TorchvisionBackend,
    )  # (5.6.1 to 5.24: importable alone)

    from prealign.loaders.media.video import fused_normalize_table, normalize_table

    m, s, rescale = TorchvisionBackend._fuse_mean_std_and_rescale_factor(
        object(), True, mean, std, True, 1 / 255, None
    )
    assert rescale is False
    values = torch.arange(256, dtype=torch.uint8).to(torch.float32).expand(3, 256).clone()
    want = values.sub_(m.view(3, 1)).div_(s.view(3, 1)).reshape(-1).numpy()
    assert np.array_equal(fused_normalize_table(mean, std, 1 / 255), want)
    assert not np.array_equal(normalize_table(mean, std, 1 / 255), want) or mean == (0.5, 0.5, 0.5)


def test_pixels_equal_the_video_processor_where_it_runs(clips):
    """Where transformers' Qwen3-VL video processor can be built (it needs torchvision, which cannot
    be installed beside CPU torch 2.13): pixel_values_videos bit-equal to it given
    load_video(backend="pyav") frames."""
    pytest.importorskip(
        "torchvision"
    )  # (not a declared dependency: it cannot be installed beside CPU torch 2.13)
    from transformers import Qwen3VLVideoProcessor
    from transformers.video_utils import load_video

    config = {"size": {"shortest_edge": 4096, "longest_edge": 65536}}
    proc = Qwen3VLVideoProcessor(**config)
    t = VLMSampleTransform(
        tokenizer=TOK,
        model_config=tiny_config("qwen3_vl"),
        processor=types.SimpleNamespace(
            video_processor=proc,
            image_processor=transformers.Qwen2VLImageProcessorPil(patch_size=16),
        ),
    )
    for name in ("long30", "wide", "vfr"):
        with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
            f.write(clips[name])
            f.flush()
            video, meta = load_video(f.name, backend="pyav")
        want = proc(
            videos=[video], video_metadata=[meta], return_tensors="pt", cap_pixels_per_frame=False
        )
        got = t(file_sample("p", clips[name]))
        assert torch.equal(got["video_grid_thw"], want["video_grid_thw"])
        assert torch.equal(got["pixel_values_videos"], want["pixel_values_videos"])


def test_frames_resized_one_by_one_equal_the_stacked_video_resized():
    """transformers resizes a video's stacked uint8 frames at once; we resize each as it is decoded
    (memory bounded by the sampled frames): the same values, down and up, odd sizes, with torch's
    uint8 bicubic-antialias kernel (what torchvision's CPU resize runs for a uint8 bicubic resize);
    a frame at its size is left as is."""
    from prealign.loaders.media.video_file import resize_frames

    rng = np.random.default_rng(0)
    frames = torch.from_numpy(rng.integers(0, 256, (5, 3, 37, 53), dtype=np.uint8))
    assert resize_frames(frames, (37, 53)) is frames
    for size in ((16, 32), (64, 96), (20, 20)):
        stacked = torch.nn.functional.interpolate(
            frames, size=size, mode="bicubic", align_corners=False, antialias=True
        )
        one_by_one = torch.cat([resize_frames(frames[i : i + 1], size) for i in range(5)])
        assert one_by_one.dtype == torch.uint8 and torch.equal(one_by_one, stacked)


def test_a_decode_past_its_deadline_is_a_corrupt_video(clips):
    """The decode deadline (DecodeLimits.max_video_decode_seconds) is checked frame by frame."""
    header = probe_video(clips["long30"])
    with pytest.raises(VideoFileError, match="deadline"):
        decode_frames(clips["long30"], np.arange(header.frames), header, None, deadline_s=0.0)


# ---- 8. writing: ShardWriter encodes frames to a video file member, the demo builds real mp4 clips
# ----------------
def test_shard_writer_writes_video_files(tmp_path):
    import tarfile

    from prealign.loaders import ShardWriter
    from prealign.schemas import ConfigError

    frames = np.stack([np.full((48, 64, 3), 20 * i, np.uint8) for i in range(7)])
    with ShardWriter(str(tmp_path / "w-%03d.tar"), sidecars=False) as w:
        w.write(
            {"__key__": "a", "json": chat("<video>"), "clip.mp4": {"frames": frames, "fps": 12.0}}
        )
        w.write(
            {"__key__": "b", "json": chat("<video>"), "clip.webm": {"frames": frames, "fps": 5}}
        )
        with pytest.raises(ConfigError, match="clip.mp4"):
            w.write(
                {"__key__": "c", "clip.mp4": {"frames": frames.astype(np.float32), "fps": 12.0}}
            )
    with tarfile.open(w.shards[0]) as tar:
        names = tar.getnames()
        headers = [probe_video(tar.extractfile(n).read()) for n in ("a.clip.mp4", "b.clip.webm")]
    assert "c.clip.mp4" not in names
    assert [(h.frames, h.fps, h.width, h.height) for h in headers] == [
        (7, 12.0, 64, 48),
        (7, 5.0, 64, 48),
    ]


def test_demo_data_holds_real_mp4_clips_read_by_the_family(tmp_path):
    import tarfile

    from prealign.loaders.cli.demo_data import build_demo_dataset

    ds = build_demo_dataset(
        str(tmp_path), num_samples=30, samples_per_shard=30, model="qwen3_vl", bad=()
    )
    with tarfile.open(ds.shards[0]) as tar:
        clips = [tar.extractfile(n).read() for n in tar.getnames() if n.endswith(".clip.mp4")]
    assert clips and all(probe_video(c).codec == "h264" for c in clips)


def test_frames_that_disagree_with_the_headers_are_a_counted_bad_sample(clips, monkeypatch):
    """The index trusted the headers; when the decoded stream holds other frames or sizes, the
    loader's sample is a corrupt_video naming the video (never a crash, never a silently different
    length)."""
    import dataclasses

    from prealign.loaders.media import vlm

    real = probe_video
    for lie in ({"frames": 96}, {"width": 96}):
        monkeypatch.setattr(
            vlm, "probe_video", lambda data, lie=lie: dataclasses.replace(real(data), **lie)
        )
        t = VLMSampleTransform(tokenizer=TOK, model_config=tiny_config("qwen3_vl"))
        with pytest.raises(MediaError) as err:
            t(file_sample("h", clips["long30"]))
        assert (err.value.problem, err.value.sample, err.value.field) == (
            MediaProblem.CORRUPT_VIDEO,
            "h",
            "mp4",
        )


def test_index_key_names_every_sampling_setting():
    base = VLMSampleTransform(tokenizer=TOK, model_config=tiny_config("qwen3_vl"))
    keys = {base.index_key()}
    for over in (
        {"fps": 1.0},
        {"num_frames": 8},
        {"max_frames": 64},
        {"min_frames": 2},
        {"do_sample_frames": False},
    ):
        keys.add(
            VLMSampleTransform(
                tokenizer=TOK, model_config=tiny_config("qwen3_vl"), video_sampling=over
            ).index_key()
        )
    keys.add(
        VLMSampleTransform(
            tokenizer=TOK, model_config=tiny_config("qwen3_vl"), video_processor_config={"fps": 4}
        ).index_key()
    )
    assert len(keys) == 7
    from prealign.schemas import ConfigError

    with pytest.raises(ConfigError, match="unknown"):
        VLMSampleTransform(
            tokenizer=TOK, model_config=tiny_config("qwen3_vl"), video_sampling={"fsp": 1}
        )
