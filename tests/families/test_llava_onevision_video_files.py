"""LLaVA-OneVision video files (``clip.mp4`` members): the frames kept as transformers' video
processor keeps them on the installed version (every frame by default; ``num_frames`` / ``fps``
by its base ``sample_frames``, whose rule changed between 5.10 and 5.24), decoded with PyAV, and
the sample equal to ``LlavaOnevisionProcessor`` + ``apply_chat_template`` fed with the frames
transformers' own ``load_video(backend="pyav", sample_indices_fn=...)`` reads (ids, video pixels,
frame counts, positions); header-only lengths decode nothing; limits are typed errors before any
decoding; a tiny model gives the same logits packed and alone with a video file in the batch.

Not real here: the video processor's resize + normalize (transformers' needs torchvision, which
does not import beside CPU torch): the test's stand-in
(:class:`tests.families.llava_onevision_reference.FramesVideoProcessor`) is fed the frames
transformers decoded and sampled."""

from __future__ import annotations

import dataclasses
import functools
import json
import tempfile
import types

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate import THDCollator, unpack_thd
from prealign.loaders.media import video_file
from prealign.loaders.media.video_sampling import UniformSampling, uniform_rule
from prealign.loaders.media.vlm import MediaError
from prealign.loaders.sources.tar_decode import DecodeLimits
from prealign.schemas import ConfigError, ParallelLayout
from tests.conftest import examples
from tests.families import llava_onevision_reference as ref
from tests.families.test_llava_onevision_transform import PINS, items, sample, transform
from tests.video_clips import make_clip

av = pytest.importorskip("av")
transformers = pytest.importorskip("transformers")


def theirs_indices(total: int, source_fps: float, **kw) -> list[int] | None:
    """transformers' own ``BaseVideoProcessor.sample_frames`` (what LLaVA-OneVision's inherits) on
    the installed version, as the PyAV reader keeps them (indices below ``total``); None where it
    refuses."""
    from transformers.video_processing_utils import BaseVideoProcessor
    from transformers.video_utils import VideoMetadata

    settings = types.SimpleNamespace(num_frames=None, fps=None)
    meta = VideoMetadata(total_num_frames=total, fps=source_fps)
    try:
        got = np.asarray(BaseVideoProcessor.sample_frames(settings, meta, **kw))
    except (ValueError, ZeroDivisionError, TypeError):
        return None
    return got[got < total].tolist()


# ---- the frame choice
# ------------------------------------------------------------------------------------
@given(
    st.integers(1, 400),
    st.sampled_from([10.0, 24.0, 25.0, 29.97, 30.0, 60.0, 16.623376623376622]),
    st.one_of(
        st.builds(lambda n: {"num_frames": n}, st.integers(1, 450)),
        st.builds(lambda f: {"fps": f}, st.sampled_from([0.01, 0.5, 1.0, 2.0, 3.3, 30.0, 100.0])),
        st.just({}),
    ),
)
@examples(300)
def test_frame_choice_equals_the_installed_sample_frames(total, source_fps, ask):
    """``do_sample_frames=True`` with ``num_frames`` or ``fps`` (or neither): the indices, or the
    refusal, of the installed transformers' sampler."""
    ours = UniformSampling.for_processor(None, {"do_sample_frames": True, **ask})
    want = theirs_indices(total, source_fps, **ask)
    if want is None:
        with pytest.raises(ValueError):
            ours.indices(total, source_fps)
    else:
        assert ours.indices(total, source_fps).tolist() == want


def test_each_rule_golden():
    """The two rules where they part: 1 frame per 20 of a 10-frame clip at 1 fps (5.24 keeps frame
    0, 5.6 / 5.10 refuse 0 frames); 13 of 15 (5.6 / 5.10's float step also reaches 15, which no
    frame has: the reader drops it). The installed one is the one its own sampler follows."""
    arange, floor = (
        functools.partial(UniformSampling, rule=r, do_sample_frames=True)
        for r in ("arange", "floor")
    )
    assert floor(fps=0.05).indices(10, 1.0).tolist() == [0]
    with pytest.raises(ValueError, match="0 frames"):
        arange(fps=0.05).indices(10, 1.0)
    assert floor(num_frames=13).indices(15, 1.0).tolist() == [
        0,
        1,
        2,
        3,
        4,
        5,
        6,
        8,
        9,
        10,
        11,
        12,
        13,
    ]
    assert arange(num_frames=13).indices(15, 1.0).tolist() == [
        0,
        1,
        2,
        3,
        4,
        5,
        6,
        8,
        9,
        10,
        11,
        12,
        13,
    ]
    assert floor(num_frames=4).indices(95, 30.0).tolist() == [0, 23, 47, 71]
    assert UniformSampling(rule="floor").indices(5, 30.0).tolist() == [0, 1, 2, 3, 4]  # default
    version = tuple(int(v) for v in transformers.__version__.split(".")[:2])
    assert uniform_rule() == ("floor" if version >= (5, 24) else "arange")
    with pytest.raises(ConfigError, match="unknown settings"):
        UniformSampling.for_processor(None, {"min_frames": 4})
    with pytest.raises(ConfigError, match="num_frames"):
        UniformSampling.for_processor(None, {"num_frames": 0})


# ---- the sample against the processor
# ----------------------------------------------------------------------
def clip_sample(key: str, clips: list[bytes], text: str = "what moves?") -> dict:
    members = {f"{i}.mp4": c for i, c in enumerate(clips)}
    meta = {
        "messages": [
            {"role": "user", "content": "<video>" * len(clips) + text},
            {"role": "assistant", "content": "\na dot."},
        ]
    }
    return {"__key__": key, "json": json.dumps(meta), **members}


def reference(processor, raw: dict, ask: dict) -> tuple:
    """transformers' side: each clip read by ``load_video(backend="pyav")`` with its base video
    processor's ``sample_frames`` (``do_sample_frames`` as ``ask`` says), the frames given to the
    processor with the chat template's text."""
    from transformers.video_processing_utils import BaseVideoProcessor
    from transformers.video_utils import load_video

    settings = types.SimpleNamespace(num_frames=None, fps=None)
    kw = {k: v for k, v in ask.items() if k != "do_sample_frames"}
    sampler = (
        functools.partial(BaseVideoProcessor.sample_frames, settings, **kw)
        if ask.get("do_sample_frames")
        else None
    )
    clips = []
    for name in sorted(k for k in raw if k.endswith(".mp4")):
        with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
            f.write(raw[name])
            f.flush()
            frames, _ = load_video(f.name, backend="pyav", sample_indices_fn=sampler)
        clips.append(list(frames))
    meta = json.loads(raw["json"])
    chat = [{"role": m["role"], "content": items(m["content"])} for m in meta["messages"]]
    text = processor.apply_chat_template(chat, tokenize=False)
    return processor(text=text, videos=clips, return_tensors="pt"), clips


ASKS = [
    {},
    {"do_sample_frames": True, "num_frames": 3},
    {"do_sample_frames": True, "fps": 7.0},
    {"do_sample_frames": True, "fps": 0.5},
]


@pytest.mark.slow
@given(
    st.integers(3, 24),
    st.integers(2, 40).map(lambda v: 2 * v),
    st.integers(2, 40).map(lambda v: 2 * v),
    st.sampled_from([10.0, 24.0, 30.0]),
    st.integers(1, 2),
    st.sampled_from(ASKS),
    st.integers(0, 100),
)
@examples(25)
def test_video_files_equal_the_processor(frames, w, h, fps, videos, ask, seed):
    """Random clips written with PyAV (1-2 per sample, one length per sample: 5.6 / 5.10 expand
    every ``<video>`` by the first video's count): ids, header-only ids, frame counts, video
    pixels (the stand-in's unfused normalisation: float32 rounding apart) and positions."""
    processor = ref.hf_processor(tile=56, pinpoints=PINS, video=True)
    t = transform(processor, tile=56, pinpoints=PINS)
    t = dataclasses.replace(t, video_sampling=ask or None)
    raw = clip_sample("v", [make_clip(frames, w, h, fps, seed=seed + i) for i in range(videos)])
    asked = {k: v for k, v in ask.items() if k != "do_sample_frames"}
    if ask and not theirs_indices(frames, fps, **asked):  # refused by transformers
        with pytest.raises(MediaError, match="bad_video"):
            t(raw)
        with pytest.raises(MediaError, match="bad_video"):
            t.header_ids(raw)
        return
    want, clips = reference(processor, raw, ask)
    before = video_file.DECODE_COUNT[0]
    header_ids = t.header_ids(raw)[0]
    assert video_file.DECODE_COUNT[0] == before  # header-only: nothing decoded
    out = t(raw)
    assert out["input_ids"].tolist() == want["input_ids"][0].tolist() == header_ids.tolist()
    assert out["video_num_frames"].tolist() == [len(c) for c in clips]
    if ask.get("do_sample_frames"):
        assert len(clips[0]) < frames or ask.get("fps", 0) >= fps
    theirs = want["pixel_values_videos"].flatten(0, 1)
    got = out["pixel_values_videos"]
    assert got.shape == theirs.shape and torch.allclose(got, theirs, atol=1e-5, rtol=0)
    assert int((out["mm_token_type_ids"] == 2).sum()) == videos * (len(clips[0]) * 4 + 1)
    indexing = t.for_indexing()(raw)  # what an index pass runs: same shapes, nothing decoded
    assert indexing["input_ids"].tolist() == out["input_ids"].tolist()
    assert indexing["pixel_values_videos"].shape == got.shape
    schema = t.family.batch_schema(
        pad_token_id=0, vocab_size=len(ref.hf_tokenizer()), pixel_dtypes=("float32",)
    )
    batch = THDCollator(schema=schema, layout=ParallelLayout(tp=2))([out, out])
    for pos in unpack_thd(
        batch["position_ids"],
        cu_seqlens=batch["cu_seqlens"],
        cu_seqlens_padded=batch["cu_seqlens_padded"],
    ):
        assert torch.equal(pos, torch.arange(out["input_ids"].numel()))


def test_a_golden_clip():
    """9 frames of 64 x 48 at 30 fps: every frame by default (9 x 2 x 2 pooled features + one
    newline = 37 ``<video>`` tokens on 56-px tiles), 3 with ``num_frames=3`` ([0, 3, 6])."""
    processor = ref.hf_processor(tile=56, pinpoints=PINS, video=True)
    t = transform(processor, tile=56, pinpoints=PINS)
    raw = clip_sample("g", [make_clip(9, 64, 48, 30.0)])
    out = t(raw)
    assert out["video_num_frames"].tolist() == [9]
    assert int((out["mm_token_type_ids"] == 2).sum()) == 9 * 4 + 1
    assert out["pixel_values_videos"].shape == (9, 3, 56, 56)
    three = dataclasses.replace(t, video_sampling={"do_sample_frames": True, "num_frames": 3})
    assert three.frame_sampling.indices(9, 30.0).tolist() == [0, 3, 6]
    assert three(raw)["video_num_frames"].tolist() == [3]
    assert torch.equal(three(raw)["pixel_values_videos"], out["pixel_values_videos"][[0, 3, 6]])
    assert json.loads(three.index_key()) != json.loads(t.index_key())  # the settings are keyed


@pytest.mark.parametrize(
    "limits,clip,name",
    [
        (DecodeLimits(max_video_frames=8), (9, 64, 48, 30.0), "max_video_frames"),
        (DecodeLimits(max_video_pixels=9 * 64 * 48 - 1), (9, 64, 48, 30.0), "max_video_pixels"),
        (DecodeLimits(max_video_bytes=9 * 64 * 48 * 3 - 1), (9, 64, 48, 30.0), "max_video_bytes"),
        (DecodeLimits(max_video_seconds=4), (45, 32, 32, 10.0), "max_video_seconds"),
    ],
)
def test_limits_are_typed_errors_before_decoding(limits, clip, name):
    """Every frame kept by default: a clip that would decode past a limit is a ``bad_video`` naming
    the sample, the member and the limit, from its headers (nothing decoded), in the loader and
    the header-only lengths alike."""
    processor = ref.hf_processor(tile=56, pinpoints=PINS, video=True)
    t = dataclasses.replace(transform(processor, tile=56, pinpoints=PINS), limits=limits)
    raw = clip_sample("big", [make_clip(*clip)])
    before = video_file.DECODE_COUNT[0]
    for run in (t, t.header_ids):
        with pytest.raises(MediaError, match=name) as err:
            run(raw)
        assert err.value.sample == "big" and err.value.field == "0.mp4"
        assert "bad_video" in str(err.value)
    assert video_file.DECODE_COUNT[0] == before
    small = dataclasses.replace(t, video_sampling={"do_sample_frames": True, "num_frames": 2})
    if name != "max_video_seconds":  # the way out: fewer frames
        assert small(raw)["video_num_frames"].tolist() == [2]


def test_a_frame_lists_pixels_are_held_to_the_limit_too():
    """A frame list's frames summed (from their headers in the header-only lengths, as decoded in
    the loader) over ``max_video_pixels`` is a ``bad_video`` naming the video; at the limit it
    passes."""
    from prealign.loaders.media.llava_onevision import LlavaOnevisionSampleTransform

    processor = ref.hf_processor(tile=56, pinpoints=PINS, video=True)
    raw, _, _, clips = sample("fl", ["<video>what?", "ok"], [], 3, [3])
    total = sum(f.width * f.height for f in clips[0])
    t = transform(processor, tile=56, pinpoints=PINS)
    assert isinstance(t, LlavaOnevisionSampleTransform)
    for limit, ok in ((total, True), (total - 1, False)):
        limited = dataclasses.replace(t, limits=DecodeLimits(max_video_pixels=limit))
        for run in (limited, limited.header_ids):
            if ok:
                run(raw)
                continue
            with pytest.raises(MediaError, match="max_video_pixels") as err:
                run(raw)
            assert err.value.sample == "fl" and err.value.field == "videos[0]"


def test_corrupt_and_truncated_files_are_corrupt_videos():
    processor = ref.hf_processor(tile=56, pinpoints=PINS, video=True)
    t = transform(processor, tile=56, pinpoints=PINS)
    clip = make_clip(30, 64, 48, 30.0, gop=5)
    for data in (b"not a video", clip[: len(clip) // 2]):
        with pytest.raises(MediaError, match="corrupt_video") as err:
            t(clip_sample("c", [data]))
        assert err.value.field == "0.mp4"


# ---- header-only index and in-model
# ------------------------------------------------------------------------
def test_header_index_decodes_no_frame_and_equals_the_full_pass(tmp_path):
    """``prealign index``'s header rule (``AnyResRule``) counts a file's kept frames from its
    headers; its lengths equal the loader's full pass (which, as every index pass, runs the
    transform's indexing form: no frame decoded either); the loader then decodes."""
    from prealign.loaders import BadDataPolicy, ShardWriter, WebDatasetSource, build_index
    from prealign.loaders.index.header_pass import AnyResRule, length_rule, write_sidecars

    processor = ref.hf_processor(tile=56, pinpoints=PINS, video=True)
    t = dataclasses.replace(
        transform(processor, tile=56, pinpoints=PINS),
        video_sampling={"do_sample_frames": True, "fps": 10.0},
    )
    schema = t.family.batch_schema(
        pad_token_id=0, vocab_size=len(ref.hf_tokenizer()), pixel_dtypes=("float32",)
    )
    with ShardWriter(str(tmp_path / "o-%03d.tar"), sidecars=False) as w:
        for i, (n, fps) in enumerate([(9, 30.0), (30, 30.0), (23, 10.0), (12, 25.0)]):
            raw = clip_sample(f"k{i}", [make_clip(n, 48, 32, fps, seed=i)], text="hi" * i)
            w.write({**raw, "json": json.loads(raw["json"])})
        w.write({"__key__": "text", "json": {"messages": [{"role": "user", "content": "hi"}]}})
    source = WebDatasetSource(w.shards, transform=t, image="bytes")
    assert isinstance(length_rule(source, schema), AnyResRule)
    before = video_file.DECODE_COUNT[0]
    write_sidecars(source, schema, workers=1)
    assert video_file.DECODE_COUNT[0] == before
    side = build_index(
        WebDatasetSource(w.shards, transform=t, image="bytes"),
        schema,
        policy=BadDataPolicy(on_error="raise"),
    )
    scanned = WebDatasetSource(w.shards, transform=t, image="bytes", sidecars=False)
    before = video_file.DECODE_COUNT[0]
    full = build_index(scanned, schema, policy=BadDataPolicy(on_error="raise"))
    assert video_file.DECODE_COUNT[0] == before
    assert side.lengths.tolist() == full.lengths.tolist() and len(full) == 5
    assert side.media.tolist() == full.media.tolist() and int(full.media.sum()) == 4
    loaded = [scanned.load(tuple(loc)) for loc in full.locations.tolist()]
    assert video_file.DECODE_COUNT[0] > before
    assert [int(s["input_ids"].numel()) for s in loaded] == full.lengths.tolist()


@pytest.mark.slow
def test_packed_logits_equal_alone_with_a_video_file():
    """The in-model samples plus one whose video is an mp4 (2 frames kept, as sample d's frame
    list, so one forward takes both videos): packed THD (cp=2, unsharded back) == alone."""
    from tests.families import test_llava_onevision_transform as lo

    samples = lo.model_samples()
    processor = ref.hf_processor(
        tile=42, pinpoints=lo.MODEL["pinpoints"], aspect=lo.MODEL["aspect"]
    )
    t = dataclasses.replace(
        transform(processor, **lo.MODEL),
        video_sampling={"do_sample_frames": True, "num_frames": 2},
    )
    video = t(clip_sample("e", [make_clip(7, 60, 44, 24.0)], text="and now?"))
    assert video["video_num_frames"].tolist() == [2]
    samples = [samples[0], video, samples[3]]
    batch, kwargs = lo.packed(samples)
    assert batch["video_num_frames"].tolist() == [2, 2]
    assert lo.worst(batch, kwargs, samples) < lo.TOL
    kwargs["pixel_values_videos"] = kwargs["pixel_values_videos"][[1, 0]]  # videos swapped
    assert lo.worst(batch, kwargs, samples) > lo.CORRUPT


def test_demo_data_holds_mp4_clips_with_four_frames_kept(tmp_path):
    """``prealign demo --model llava_onevision``'s data: some samples hold an mp4 (no image beside
    it), each read as 4 kept frames (one frame count per forward) with the teacher rows' length."""
    import tarfile

    from prealign.loaders.cli.demo_data import build_demo_dataset, demo_transform
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer

    ds = build_demo_dataset(
        str(tmp_path), num_samples=16, samples_per_shard=16, topk=2, model="llava_onevision", bad=()
    )
    t = demo_transform("llava_onevision", ByteTokenizer(), 2)
    raws: dict = {}
    with tarfile.open(ds.shards[0]) as tar:
        for member in tar.getmembers():
            key, ext = member.name.split(".", 1)
            raws.setdefault(key, {"__key__": key})[ext] = tar.extractfile(member).read()
    clips = [r for r in raws.values() if "clip.mp4" in r]
    assert clips
    for raw in clips:
        out = t(raw)
        assert out["video_num_frames"].tolist() == [4] and out["pixel_values"].shape[0] == 0
        assert out["teacher_topk_ids"].shape[0] == out["input_ids"].numel()
