"""The loaders' int checks are ``prealign.schemas.checks.int_at_least``: each keeps its error class
and the message its tests pin, takes a numpy int as an ``int`` (stored as a Python int, so a state
or a key written from it stays JSON) and refuses a bool."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prealign.loaders.errors import PlanError, ResumeError
from prealign.loaders.handoff.media_share import SharedMediaTransform
from prealign.loaders.index.shard_writer import ShardWriter
from prealign.loaders.media.video_sampling import FrameSampling
from prealign.loaders.options import IndexOptions, LoadingOptions, ShuffleOptions, WorkerConfig
from prealign.loaders.plan.elastic import Segment
from prealign.loaders.plan.schedule import check_count
from prealign.loaders.policy import BadDataPolicy
from prealign.loaders.sources.tar_decode import DecodeLimits
from prealign.schemas.errors import ConfigError


def test_check_count():
    got = check_count("epoch", np.int64(3))
    assert got == 3 and type(got) is int
    for bad, got in [(-1, "got -1$"), (True, r"got True \(bool\)$"), (1.0, r"got 1.0 \(float\)")]:
        with pytest.raises(PlanError, match=rf"^epoch: expected an int >= 0, {got}"):
            check_count("epoch", bad)


def test_segment_checked():
    seg = Segment.checked(
        dp_size=np.int64(2), microbatches_per_step=1, num_workers=np.int32(0), position=3
    )
    assert type(seg.dp_size) is int and type(seg.num_workers) is int
    assert Segment.from_dict(json.loads(json.dumps(seg.to_dict()))) == seg
    match = r"^loader state: key segments\.position: expected an int >= 1, got "
    for bad, got in [(0, "0$"), (True, r"True \(bool\)$"), ("3", r"'3' \(str\)$")]:
        with pytest.raises(ResumeError, match=match + got):
            Segment.from_dict({**seg.to_dict(), "position": bad})


def test_loader_options():
    options = [
        ShuffleOptions(window=np.int64(8)),
        IndexOptions(workers=np.int32(2)),
        LoadingOptions(prefetch_factor=np.int64(2), shm_cap=np.int64(0)),
        WorkerConfig(
            dp_rank=np.int64(1), dp_size=np.int32(2), cp_rank=np.int64(0), num_workers=np.int8(1)
        ),
    ]
    for option in options:
        assert all(
            type(v) in (int, bool, type(None))
            for k, v in vars(option).items()
            if k not in ("prebuilt", "multiprocessing_context", "group", "timeout")
        )
    cases = [
        (
            lambda: ShuffleOptions(window=True),
            r"ShuffleOptions.window: expected an int >= 1, got "
            r"True \(bool\)",
        ),
        (
            lambda: LoadingOptions(shm_cap=-1),
            r"LoadingOptions.shm_cap: expected an int >= 0 or "
            r"None, got -1",
        ),
        (
            lambda: WorkerConfig(num_workers=np.bool_(True)),
            r"num_workers: expected an int >= 0, "
            r"got .*\(bool",
        ),
        (
            lambda: WorkerConfig(dp_rank=2, dp_size=2),
            r"dp_rank: expected an int in \[0, 2\), "
            r"got 2$",
        ),
        (lambda: WorkerConfig(dp_rank=False), r"dp_rank: expected an int in \[0, 1\), got False"),
        (lambda: WorkerConfig(dp_size=0), r"dp_size: expected an int >= 1, got 0$"),
    ]
    for make, match in cases:
        with pytest.raises(PlanError, match=f"^{match}"):
            make()


def test_bad_data_policy():
    policy = BadDataPolicy(on_error="skip", max_consecutive=np.int64(4))
    assert type(policy.max_consecutive) is int and json.dumps(policy.to_dict())
    for bad, got in [(0, "0$"), (True, r"True \(bool\)$")]:
        with pytest.raises(PlanError, match=rf"^max_consecutive: expected an int >= 1, got {got}"):
            BadDataPolicy(max_consecutive=bad)


def test_decode_limits():
    limits = DecodeLimits(max_video_frames=np.int64(16))
    assert type(limits.max_video_frames) is int
    for bad, got in [(0, "0$"), (False, r"False \(bool\)$"), (2.0, r"2.0 \(float\)$")]:
        match = rf"^DecodeLimits.max_ratio: expected an int >= 1, got {got}"
        with pytest.raises(ConfigError, match=match):
            DecodeLimits(max_ratio=bad)


def _same(sample: dict) -> dict:
    return sample


def test_shared_media_transform(tmp_path):
    share = SharedMediaTransform(
        transform=_same, run="r", cp_rank=np.int64(1), cp_size=np.int32(2), cache_dir=str(tmp_path)
    )
    assert (type(share.cp_rank), type(share.cp_size)) == (int, int)
    for bad, got in [(-1, "-1$"), (True, r"True \(bool\)$"), ("0", r"'0' \(str\)$")]:
        match = rf"^SharedMediaTransform.cp_rank: expected an int >= 0, got {got}"
        with pytest.raises(ConfigError, match=match):
            SharedMediaTransform(transform=_same, run="r", cp_rank=bad, cp_size=2)


def test_shard_writer(tmp_path):
    pattern = str(tmp_path / "s-%03d.tar")
    writer = ShardWriter(pattern, max_bytes=np.int64(4096), max_samples=np.int32(2))
    assert (type(writer.max_bytes), type(writer.max_samples)) == (int, int)
    cases = [
        (dict(max_bytes=1023), r"max_bytes: expected an int >= 1024, got 1023$"),
        (dict(max_bytes=4096.0), r"max_bytes: expected an int >= 1024, got 4096.0 \(float\)$"),
        (dict(max_samples=True), r"max_samples: expected None or an int >= 1, got True \(bool\)$"),
        (dict(max_samples=0), r"max_samples: expected None or an int >= 1, got 0$"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ConfigError, match=f"^{match}"):
            ShardWriter(pattern, **kwargs)


def test_frame_sampling():
    sampling = FrameSampling.for_family(
        volume=True, overrides={"num_frames": np.int64(8), "max_frames": np.int32(64)}
    )
    assert json.dumps(sampling.key()) and type(sampling.num_frames) is int
    for bad, got in [(0, "0$"), (True, r"True \(bool\)$"), (4.0, r"4.0 \(float\)$")]:
        match = rf"^video sampling min_frames: expected an int >= 1, got {got}"
        with pytest.raises(ConfigError, match=match):
            FrameSampling.for_family(volume=False, overrides={"min_frames": bad})


def test_decode_threads():
    pytest.importorskip("transformers")
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.media.vlm import VLMSampleTransform

    transform = VLMSampleTransform(tokenizer=ByteTokenizer(), decode_threads=np.int64(2))
    assert type(transform.decode_threads) is int and transform.decode_threads == 2
    for bad, got in [(-1, "-1$"), (True, r"True \(bool\)$"), (None, r"None \(NoneType\)$")]:
        match = r"^VLMSampleTransform.decode_threads: expected an int >= 0 \(0: ffmpeg's choice\)"
        with pytest.raises(ConfigError, match=f"{match}, got {got}"):
            VLMSampleTransform(tokenizer=ByteTokenizer(), decode_threads=bad)
