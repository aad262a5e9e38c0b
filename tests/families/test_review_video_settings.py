"""Review: a LLaVA-OneVision video file's frame choice when the video processor's settings (a
checkpoint's ``video_preprocessor_config.json``) and the call's ``video_sampling`` name
``num_frames`` and ``fps`` between them: the installed transformers' ``sample_frames`` refuses the
two only when the call gives both; otherwise ``num_frames`` (the call's, else the settings') is
used and ``fps`` ignored."""

from __future__ import annotations

import types

import numpy as np
import pytest

from prealign.loaders.media.video_sampling import UniformSampling

transformers = pytest.importorskip("transformers")


def _theirs(total, source_fps, settings, call):
    from transformers.video_processing_utils import BaseVideoProcessor
    from transformers.video_utils import VideoMetadata

    ns = types.SimpleNamespace(num_frames=settings.get("num_frames"), fps=settings.get("fps"))
    meta = VideoMetadata(total_num_frames=total, fps=source_fps)
    try:
        got = np.asarray(BaseVideoProcessor.sample_frames(ns, meta, **call))
    except (ValueError, ZeroDivisionError, TypeError):
        return None
    return got[got < total].tolist()


@pytest.mark.parametrize(
    "settings, call",
    [
        ({"num_frames": 8}, {"fps": 1.0}),
        ({"fps": 1.0}, {"num_frames": 8}),
        ({"num_frames": 8, "fps": 1.0}, {}),
        ({"num_frames": 8, "fps": 1.0}, {"num_frames": 4}),
        ({}, {"num_frames": 8, "fps": 1.0}),
    ],
)
def test_settings_and_call_as_the_installed_sampler(settings, call):
    total, source_fps = 60, 10.0
    ours = UniformSampling.for_processor(
        {"do_sample_frames": True, **settings}, {k: v for k, v in call.items()}
    )
    want = _theirs(total, source_fps, settings, call)
    if want is None:
        with pytest.raises(ValueError):
            ours.indices(total, source_fps)
    else:
        assert ours.indices(total, source_fps).tolist() == want
