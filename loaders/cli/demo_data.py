"""A small synthetic multimodal webdataset with teacher top-k, for ``prealign demo`` and the tests.

Synthetic but shaped like the real thing: chat samples (a user turn with 0-2 ``<image>``
placeholders and a question, an assistant reply of 1-6 generated sentences), PIL images of varied
sizes and aspect ratios (JPEG and PNG), and teacher top-k ``[L, K]`` whose rows match the
*expanded* token sequence (the builder counts vision tokens with the Qwen2-VL processor's own
resize rule). Deterministic for a seed.

Shard layout (one tar member per field, webdataset naming ``<key>.<field>``)::

    demo-000000.tar
      s000000.json                         {"messages": [...], "images": ["0.jpg", "1.png"]}
      s000000.0.jpg, s000000.1.png
      s000000.teacher_topk_log_probs.npy   float32 [L, K], sorted descending, finite, < 0
      s000000.teacher_topk_ids.npy         int64   [L, K], distinct per row, column 0 = next token

``model`` (one of :data:`DEMO_MODELS`) makes the samples that family's (:func:`demo_model_config`:
its patch size, its video rules) and adds short videos to some of them, one ``<video>`` placeholder
each: half real mp4 files (member ``clip.mp4``, encoded with PyAV, sampled by the family's rules),
half 2-5 frames as members ``v0_<j>.jpg`` listed in ``json["videos"]`` with their ``fps``.
LLaVA-OneVision gets mp4 files only, in samples without images, 4 frames kept of each (its forward
takes one frame count for every video).
GLM-4.1V / 4.5V (``glm4v``, ``glm4v_moe``) get images only: one forward takes images or video, never
both (:mod:`prealign.collate.vision.glm4v`), so a packed demo row could not mix them.

``bad`` plants deliberately broken samples (one of each
:class:`~prealign.loaders.media.vlm.MediaProblem` asked for) so a loader's error policy can be seen
to skip and count them.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from dataclasses import dataclass

import numpy as np

from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
from prealign.loaders.media.teacher_topk import encode_npy
from prealign.loaders.media.vlm import (
    MediaProblem,
    VLMSampleTransform,
    image_processor,
    render_chat,
)
from prealign.loaders.sources.header_lengths import Qwen2VLGeometry, qwen2vl_grid, tokens_of_grid

DEMO_MODELS = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_5",
    "gemma3",
    "gemma4",
    "internvl",
    "glm4v",
    "glm4v_moe",
    "llava_onevision",
    "mistral3",
    "smolvlm",
)
"""The families ``prealign demo --model`` builds data for."""

_WORDS = (
    "the a small large red blue green bright dark round square tall narrow old new quiet busy "
    "cat dog bird tree house river road window table cup book chart plot graph city field cloud "
    "sits stands shows holds crosses follows rises falls near under above beside behind inside "
    "morning evening light shadow line point curve corner edge center pattern color shape"
).split()
_QUESTIONS = (
    "What is in the picture?",
    "Describe the image.",
    "Compare the two images.",
    "What changed?",
    "Summarise the scene in one paragraph.",
    "Which object is largest?",
    "Explain the chart.",
)
BAD_KINDS = (
    MediaProblem.CORRUPT_IMAGE,
    MediaProblem.MISSING_IMAGE,
    MediaProblem.PLACEHOLDER_MISMATCH,
)


@dataclass(frozen=True)
class DemoDataset:
    """What :func:`build_demo_dataset` wrote."""

    shards: tuple[str, ...]
    """Paths of the tar shards, in order."""
    num_samples: int
    """Samples written, bad ones included."""
    bad: dict
    """Key of each planted bad sample -> its :class:`~prealign.loaders.media.vlm.MediaProblem`
    value."""
    topk: int
    vocab_size: int


def _sentence(rng: np.random.Generator) -> str:
    words = rng.choice(_WORDS, size=int(rng.integers(4, 14)))
    return " ".join(words).capitalize() + "."


def _image(rng: np.random.Generator, fmt: str) -> tuple[bytes, tuple[int, int]]:
    """A PIL drawing (gradient background, a few shapes) of a random size, encoded; returns (bytes,
    (w, h))."""
    from PIL import Image, ImageDraw

    w, h = (int(v) for v in rng.integers(48, 360, size=2))
    x = np.linspace(0, 1, w, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 1, h, dtype=np.float32)[:, None, None]
    c0, c1 = rng.random(3, dtype=np.float32), rng.random(3, dtype=np.float32)
    pixels = ((c0 * (1 - x) + c1 * y) * 0.5 + 0.25) * 255
    img = Image.fromarray(pixels.clip(0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(1, 5))):
        x0, x1 = sorted(int(v) for v in rng.integers(0, w, 2))
        y0, y1 = sorted(int(v) for v in rng.integers(0, h, 2))
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(
            (x0, y0, x1 + 1, y1 + 1), fill=fill
        )
    buf = io.BytesIO()
    img.save(
        buf, format="JPEG" if fmt == "jpg" else "PNG", **({"quality": 85} if fmt == "jpg" else {})
    )
    return buf.getvalue(), (w, h)


def synthetic_teacher(
    input_ids: np.ndarray, topk: int, vocab_size: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Plausible teacher top-k for a token sequence: float32 ``[L, K]`` log-probs (descending, < 0,
    total mass < 1) and int64 ``[L, K]`` distinct ids whose first column is the next token."""
    n = input_ids.size
    nxt = np.append(input_ids[1:], ByteTokenizer.eos_token_id)
    stride = rng.integers(1, max(2, vocab_size // topk), size=(n, 1))
    ids = (nxt[:, None] + stride * np.arange(topk)) % vocab_size
    logits = np.sort(rng.normal(0.0, 2.0, size=(n, topk + 1)).astype(np.float32), axis=1)[:, ::-1]
    logits[:, -1] += 1.0  # the "rest of the vocabulary" bucket keeps the top-k mass below 1
    log_probs = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    return np.ascontiguousarray(log_probs[:, :topk], dtype=np.float32), ids.astype(np.int64)


def demo_model_config(model: str):
    """A transformers config of the ``model`` family with the demo byte tokenizer's special ids (its
    vision sizes are transformers' defaults; no weights): what the demo's transform reads the family
    from."""
    import transformers

    if model not in DEMO_MODELS:
        from prealign.schemas.errors import ConfigError

        raise ConfigError(
            f"demo_model_config: expected one of {', '.join(DEMO_MODELS)}, got {model!r}"
        )
    tok = ByteTokenizer()
    text = {
        "vocab_size": tok.vocab_size,
        "bos_token_id": tok.eos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    if (
        model == "gemma3"
    ):  # 224-px images, 16 x 16 patches pooled to 8 x 8 = 64 image tokens (released: 896, 256)
        return transformers.Gemma3Config(
            text_config={
                "vocab_size": tok.vocab_size,
                "bos_token_id": tok.eos_token_id,
                "eos_token_id": tok.eos_token_id,
                "pad_token_id": tok.pad_token_id,
            },
            vision_config={"image_size": 224, "patch_size": 14},
            mm_tokens_per_image=64,
            boi_token_index=tok.vision_start_token_id,
            eoi_token_index=tok.vision_end_token_id,
            image_token_index=tok.image_token_id,
        )
    if model == "gemma4":  # transformers' vision defaults: 16-px patches pooled 3 x 3
        return transformers.Gemma4Config(
            text_config={**text, "use_bidirectional_attention": "vision"},
            vision_config={"patch_size": 16, "pooling_kernel_size": 3},
            boi_token_id=tok.vision_start_token_id,
            eoi_token_id=tok.vision_end_token_id,
            image_token_id=tok.image_token_id,
            video_token_id=tok.video_token_id,
        )
    if (
        model == "llava_onevision"
    ):  # transformers' defaults: 384-px tiles of 14-px patches, 36 pinpoints
        return transformers.LlavaOnevisionConfig(
            image_token_index=tok.image_token_id,
            video_token_index=tok.video_token_id,
            text_config={"model_type": "qwen2", **text},
        )
    if model in (
        "glm4v",
        "glm4v_moe",
    ):  # GLM's frame writes its role tags as text: <|im_start|> / <|im_end|>
        cls = (
            transformers.Glm4vConfig if model == "glm4v" else transformers.Glm4vMoeConfig
        )  # serve as the
        return cls(
            image_token_id=tok.image_token_id,
            video_token_id=tok.video_token_id,  # video's start / end
            image_start_token_id=tok.vision_start_token_id,
            image_end_token_id=tok.vision_end_token_id,
            video_start_token_id=tok.im_start_id,
            video_end_token_id=tok.im_end_id,
            text_config=text,
        )
    if (
        model == "mistral3"
    ):  # Mistral Small 3.1's tower (14-px patches, merged 2 x 2, up to 1540 px)
        return transformers.Mistral3Config(
            image_token_id=tok.image_token_id, text_config={"model_type": "mistral", **text}
        )
    if (
        model == "smolvlm"
    ):  # 128-px tiles of 16-px patches, pixel shuffle 2: 16 tokens per tile (released: 512, 64)
        return transformers.SmolVLMConfig(
            image_token_id=tok.image_token_id,
            scale_factor=2,
            vision_config={"image_size": 128, "patch_size": 16},
            text_config={"model_type": "llama", **text},
        )
    if model == "internvl":  # <img>, </img> are the tokenizer's vision start / end
        return transformers.InternVLConfig(
            image_token_id=tok.image_token_id, text_config={"model_type": "qwen2", **text}
        )
    cls = {
        "qwen2_vl": transformers.Qwen2VLConfig,
        "qwen2_5_vl": transformers.Qwen2_5_VLConfig,
        "qwen3_vl": transformers.Qwen3VLConfig,
        "qwen3_5": transformers.Qwen3_5Config,
    }[model]
    return cls(
        image_token_id=tok.image_token_id,
        video_token_id=tok.video_token_id,
        vision_start_token_id=tok.vision_start_token_id,
        vision_end_token_id=tok.vision_end_token_id,
        text_config=text,
    )


def demo_transform(model: str | None, tok, topk: int | None = None):
    """The transform that reads ``model``'s demo samples: :class:`~prealign.loaders.media.gemma3.
    Gemma3SampleTransform` for ``gemma3``, else :class:`VLMSampleTransform` (the family's default
    video settings: no checkpoint to read them from)."""
    config = None if model is None else demo_model_config(model)
    if model == "gemma3":
        from prealign.loaders.media.gemma3 import Gemma3SampleTransform

        return Gemma3SampleTransform(tokenizer=tok, model_config=config, topk=topk)
    if model == "gemma4":  # <|turn> / <turn|> / <|image> / <image|> / <|image|>: ids 2 to 6
        from prealign.loaders.media.gemma4 import Gemma4SampleTransform

        return Gemma4SampleTransform(tokenizer=tok, model_config=config, topk=topk)
    if model == "llava_onevision":
        from prealign.loaders.media.llava_onevision import LlavaOnevisionSampleTransform

        return LlavaOnevisionSampleTransform(
            tokenizer=tok,
            model_config=config,
            topk=topk,
            video_sampling={"do_sample_frames": True, "num_frames": 4},  # one count per forward
        )
    if (
        model == "smolvlm"
    ):  # <end_of_utterance>, <fake_token_around_image>, <image>: the byte tokenizer's 3, 4, 6
        from prealign.loaders.media.idefics3 import Idefics3SampleTransform

        return Idefics3SampleTransform(tokenizer=tok, model_config=config, topk=topk)
    if (
        model == "mistral3"
    ):  # [INST] / [/INST] / [IMG_BREAK] / [IMG_END] / [IMG]: the byte tokenizer's 2 to 6
        from prealign.loaders.media.mistral3 import Mistral3SampleTransform

        return Mistral3SampleTransform(tokenizer=tok, model_config=config, topk=topk)
    return VLMSampleTransform(
        tokenizer=tok,
        topk=topk,
        model_config=config,
        video_processor_config=None if config is None else {},
    )


def _video(
    rng: np.random.Generator, members: dict, files: bool = True, only_files: bool = False
) -> dict | str:
    """A clip (one drawing drifting sideways) added to ``members``; returns its ``videos`` entry:
    half the time (with ``files``) a real mp4 file (4-12 frames at 10, 24 or 30 fps, encoded with
    PyAV), else a 2-5 frame list of JPEG members."""
    from PIL import Image

    data, (w, h) = _image(rng, "png")
    base = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    if only_files or (rng.random() < 0.5 and files):
        from prealign.loaders.media.video_file import encode_video

        frames = np.stack([np.roll(base, 3 * j, axis=1) for j in range(int(rng.integers(4, 13)))])
        members["clip.mp4"] = encode_video(frames, float(rng.choice([10.0, 24.0, 30.0])))
        return "clip.mp4"
    names = [f"v0_{j}.jpg" for j in range(int(rng.integers(2, 6)))]
    for j, name in enumerate(names):
        buf = io.BytesIO()
        Image.fromarray(np.roll(base, 4 * j, axis=1)).save(buf, format="JPEG", quality=85)
        members[name] = buf.getvalue()
    return {"frames": names, "fps": float(rng.choice([1.0, 2.0, 4.0]))}


def _sample(
    rng: np.random.Generator,
    key: str,
    topk: int,
    tok: ByteTokenizer,
    geometry: Qwen2VLGeometry,
    bad: MediaProblem | None,
    transform: VLMSampleTransform | None = None,
) -> dict[str, bytes]:
    n_images = int(rng.choice([0, 1, 1, 1, 2]))
    if bad is not None:
        n_images = max(n_images, 1)
    members: dict[str, bytes] = {}
    names, tokens = [], []
    for i in range(n_images):
        fmt = "jpg" if rng.random() < 0.6 else "png"
        data, (w, h) = _image(rng, fmt)
        names.append(f"{i}.{fmt}")
        members[names[-1]] = data
        tokens.append(
            transform.header_image_tokens(w, h, sample=key, field=names[-1])
            if isinstance(transform, VLMSampleTransform)
            else tokens_of_grid(qwen2vl_grid(h, w, geometry), geometry)
        )
    question = str(rng.choice(_QUESTIONS))
    user = "".join("<image>\n" for _ in range(n_images)) + question
    reply = " ".join(_sentence(rng) for _ in range(int(rng.integers(1, 7))))
    meta = {
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}],
        "images": names,
    }
    videos, ids = None, None
    if hasattr(
        transform, "header_ids"
    ):  # Gemma 3, LLaVA-OneVision: their own chat (from image headers); LLaVA-OneVision's videos
        if getattr(transform, "video_sampling", None) and bad is None and not n_images:
            if rng.random() < 0.5:  # (mp4 files, 4 frames kept: one frame count per forward)
                meta["videos"] = [_video(rng, members, only_files=True)]
                meta["messages"][0]["content"] = "<video>\n" + user
        ids = transform.header_ids({**members, "json": json.dumps(meta)})[0]
        transform = None
    elif transform is not None:
        one_kind = getattr(
            transform.family, "one_media_kind", False
        )  # GLM: images or video per batch, not both
        if bad is None and not one_kind and rng.random() < 0.4:
            meta["videos"] = [
                _video(rng, members, files=not transform.tiled)
            ]  # (InternVL: frame lists)
            meta["messages"][0]["content"] = "<video>\n" + user
        videos = transform.header_video_ids(members, meta, key, _frame_size)
    if ids is None:
        ids, _ = render_chat(
            meta,
            tok,
            tokens,
            sample=key,
            videos=videos,
            system=None if transform is None else transform.system_prompt,
            frame=None if transform is None else transform.frame,
        )
    log_probs, top_ids = synthetic_teacher(ids, topk, tok.vocab_size, rng)
    if bad is MediaProblem.CORRUPT_IMAGE:
        members[names[0]] = members[names[0]][:64] + b"\x00 not an image" * 8
    elif bad is MediaProblem.MISSING_IMAGE:
        del members[names[0]]
    elif bad is MediaProblem.PLACEHOLDER_MISMATCH:
        meta["messages"][0]["content"] = "<image>\n" + user
    members["json"] = json.dumps(meta).encode()
    members["teacher_topk_log_probs.npy"] = encode_npy(log_probs)
    members["teacher_topk_ids.npy"] = encode_npy(top_ids)
    return members


def _frame_size(name: str, data: bytes) -> tuple[int, int]:
    from prealign.loaders.sources.header_lengths import image_header_size

    return image_header_size(data, field=name)


def build_demo_dataset(
    out_dir: str,
    *,
    num_samples: int = 240,
    samples_per_shard: int = 60,
    topk: int = 8,
    seed: int = 0,
    bad: tuple[MediaProblem, ...] = BAD_KINDS,
    tokenizer: ByteTokenizer | None = None,
    model: str | None = None,
) -> DemoDataset:
    """Write ``ceil(num_samples / samples_per_shard)`` tar shards under ``out_dir`` (created).

    The planted bad samples sit at evenly spread positions. Takes ~0.5 s per 100 samples. ``model``:
    one of :data:`DEMO_MODELS` (images of that family, and videos); read them with
    ``VLMSampleTransform(tokenizer=ByteTokenizer(), model_config=demo_model_config(model))``.
    """
    if num_samples < 1 or samples_per_shard < 1 or topk < 1:
        raise ValueError(
            f"build_demo_dataset: num_samples, samples_per_shard and topk must be >= 1, got "
            f"{num_samples}, {samples_per_shard}, {topk}"
        )
    tok = tokenizer or ByteTokenizer()
    transform = None if model is None else demo_transform(model, tok)
    # the image processor's resize rule (the family's patch size with a model), the same on every
    # transformers
    geometry = (
        Qwen2VLGeometry.of(image_processor())
        if not isinstance(transform, VLMSampleTransform)
        else None
    )
    rng = np.random.default_rng(seed)
    bad_at = (
        {
            int(p): kind
            for p, kind in zip(np.linspace(num_samples // 7, num_samples - 1, len(bad)), bad)
        }
        if bad
        else {}
    )
    os.makedirs(out_dir, exist_ok=True)
    shards, planted = [], {}
    for first in range(0, num_samples, samples_per_shard):
        path = os.path.join(out_dir, f"demo-{first // samples_per_shard:06d}.tar")
        with tarfile.open(path, "w") as tar:
            for i in range(first, min(first + samples_per_shard, num_samples)):
                key = f"s{i:06d}"
                kind = bad_at.get(i)
                if kind is not None:
                    planted[key] = kind.value
                for name, data in _sample(rng, key, topk, tok, geometry, kind, transform).items():
                    info = tarfile.TarInfo(f"{key}.{name}")
                    info.size, info.mtime, info.mode = len(data), 0, 0o644
                    tar.addfile(info, io.BytesIO(data))
        shards.append(path)
    return DemoDataset(
        shards=tuple(shards),
        num_samples=num_samples,
        bad=planted,
        topk=topk,
        vocab_size=tok.vocab_size,
    )
