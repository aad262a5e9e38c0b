"""One multimodal sample, raw -> model-ready, for every Qwen vision family (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL, Qwen3.5; :mod:`prealign.collate.vision`, chosen by ``model_config``): images through
transformers' Qwen2-VL image processor (its arithmetic on a lookup-table fast path), video frames
through the same arithmetic (:mod:`~prealign.loaders.media.video`), ``<image>`` / ``<video>``
placeholders expanded into the exact vision tokens (Qwen3-VL / 3.5: a ``<t seconds>`` text per frame
group, as their processor writes it), chat rendered to ids with a loss mask, teacher top-k decoded
and checked.

    raw webdataset sample                          VLMSampleTransform(raw)
    __key__            "s000042"                   input_ids          int64   [L]
    json               {"messages": [...],         loss_mask          float32 [L]  1 on the replies
                        "images": ["0.jpg"]}       mm_token_type_ids  int64   [L]  1 on image tokens
                                                   mrope_position_ids int64   [3, L]
    0.jpg              JPEG bytes           ---->  pixel_values       float32 [sum t*h*w, 1176]
    teacher_topk_log_probs.npy  [L, K]             image_grid_thw     int64   [num_images, 3]
    teacher_topk_ids.npy        [L, K]             teacher_topk_*     [L, K]  (when topk is set)

Video (with ``model_config``): ``json["videos"]`` lists ``{"frames": [member names], "fps": float}``
(the frames as sampled, ``fps`` of those frames, default 2 as the Qwen processors sample), one per
``<video>``; the output adds ``pixel_values_videos`` float ``[sum t*h*w, patch_dim]``,
``video_grid_thw`` int64 ``[num_videos, 3]`` and ``second_per_grid_ts`` float32 ``[num_videos]``
(``temporal_patch_size / fps``).

An HF dataset row works too: ``messages`` (or ``text``), ``images`` (PIL images, bytes or
``{"bytes": ...}``), ``videos`` (``{"frames": [images], "fps": ...}``), teacher columns as nested
lists. A sample may also come pre-tokenized (``input_ids`` with the placeholders already expanded);
then only the counts are checked.

Every problem raises :class:`MediaError` (a :class:`~prealign.loaders.errors.BadSampleError`) naming
the sample key, with a :class:`MediaProblem` whose value is its ``.reason``: the index pass counts
skips under it (``corrupt_image``, ``missing_image``, ...), through the source's transform wrapping.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import functools
import json
import re
import types
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from prealign.collate.vision import (
    VisionFamily,
    VisionGeometry,
    image_grid,
    rope_positions,
    vision_family,
)
from prealign.loaders.errors import BadSampleError
from prealign.loaders.handoff.identity import tokenizer_definition
from prealign.loaders.media import glm4v, internvl
from prealign.loaders.media.chat_tokenizer import ChatTokenizer, HFChatTokenizer, encode_segments
from prealign.loaders.media.teacher_topk import with_teacher_topk
from prealign.loaders.media.video import (
    fused_normalize_table,
    normalize_patches,
    normalize_table,
    patchify,
)
from prealign.loaders.media.video_file import (
    VideoFileError,
    VideoHeader,
    decode_frames,
    probe_video,
    resize_frames,
)
from prealign.loaders.media.video_sampling import FrameSampling, sampled_fps
from prealign.loaders.sources.tar_decode import (
    DEFAULT_LIMITS,
    IMAGE_FORMATS,
    DecodeLimits,
    ImageTooLarge,
    image_errors,
    open_image,
)
from prealign.schemas.checks import int_at_least
from prealign.schemas.errors import ConfigError, SampleError
from prealign.schemas.vlm import IMAGE_TOKEN_TYPE, VIDEO_TOKEN_TYPE, VisionTokens

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
_PLACEHOLDERS = re.compile(
    "(" + re.escape(IMAGE_PLACEHOLDER) + "|" + re.escape(VIDEO_PLACEHOLDER) + ")"
)
_IMAGE_ONLY = re.compile("(" + re.escape(IMAGE_PLACEHOLDER) + ")")
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp")
VIDEO_EXTENSIONS = ("mp4", "webm", "mkv", "mov", "avi", "m4v")
"""Member extensions that hold a video file (decoded with PyAV, never opened as an image)."""
MIN_FPS, MAX_FPS = 1e-3, 1e3
"""The frame rates a video entry may declare (a frame every ~17 minutes to 1000 a second): finite,
and far from the ``temporal_patch_size / fps`` seconds per grid that would overflow the temporal
positions."""


MEDIA_ROOT_HINT = (
    "a dataset row naming media files by path reads them from HFSource(media_root=DIR) "
    "(prealign inspect --hf: the file's folder, or --media-root DIR)"
)


def _row_hint(raw: dict) -> str:
    """For a dataset row (no webdataset ``__key__``): how its media files are found."""
    return "" if "__key__" in raw else f" ({MEDIA_ROOT_HINT})"


class VideoDefaultsWarning(UserWarning):
    """Videos are sized and normalised with transformers' class defaults: no video processor could
    be built and no ``video_processor_config`` was given, so a checkpoint with other video settings
    would get other grids."""


_WARNED_DEFAULTS: set[str] = set()


class MediaProblem(enum.Enum):
    """Why a multimodal sample was rejected (the key a loader counts skips under)."""

    CORRUPT_IMAGE = "corrupt_image"
    MISSING_IMAGE = "missing_image"
    PLACEHOLDER_MISMATCH = "placeholder_mismatch"
    VISION_TOKEN_MISMATCH = "vision_token_mismatch"
    BAD_TEXT = "bad_text"
    BAD_VIDEO = "bad_video"
    CORRUPT_VIDEO = "corrupt_video"
    UNPROCESSED_VIDEO = "unprocessed_video"
    """A ``<video>`` placeholder or a video in a sample whose transform has no video rules (no
    ``model_config``)."""


class MediaError(BadSampleError):
    """A multimodal sample's media or text is unusable; ``.problem`` (and ``.reason``, its value)
    says why, ``.sample`` is its key."""

    problem = None  # when rebuilt from its message alone (see PrealignError)

    def __init__(
        self,
        problem: MediaProblem,
        *,
        sample,
        field: str | None,
        expected: str,
        actual: str,
        hint: str = "",
    ):
        self.problem = problem
        # reason= prefixes the message too, so the cause survives being reported as text
        super().__init__(
            sample=sample,
            field=field,
            expected=expected,
            actual=actual,
            hint=hint,
            reason=problem.value,
        )

    @classmethod
    def from_check(
        cls, problem: MediaProblem, exc: SampleError, *, sample, field: str | None
    ) -> "MediaError":
        """The failed check ``exc`` (a :class:`~prealign.schemas.errors.SampleError`, e.g. a
        :class:`~prealign.loaders.sources.header_lengths.HeaderError`) as a :class:`MediaError` of
        ``problem`` naming ``sample`` and ``field``, with ``exc``'s expected and actual (raise it
        ``from None``)."""
        return cls(problem, sample=sample, field=field, expected=exc.expected, actual=exc.actual)


def refused_images(processor: str, actual: str, *, sample) -> MediaError:
    """A ``corrupt_image`` naming ``sample``'s ``images``: ``processor`` (as the message names it,
    e.g. ``"the InternVL image processor"``) refused them, saying ``actual`` (raise it ``from
    None``)."""
    return MediaError(
        MediaProblem.CORRUPT_IMAGE,
        sample=sample,
        field="images",
        expected=f"images {processor} accepts",
        actual=actual,
    )


def check_float_dtypes(transform) -> None:
    """``transform.log_prob_dtype`` / ``pixel_dtype`` each ``'float32'`` or ``'bfloat16'``, else a
    :class:`ConfigError` naming the transform's class and the field."""
    for name in ("log_prob_dtype", "pixel_dtype"):
        if getattr(transform, name) not in ("float32", "bfloat16"):
            raise ConfigError(
                f"{type(transform).__name__}.{name}: expected 'float32' or 'bfloat16', got "
                f"{getattr(transform, name)!r}"
            )


_PROCESSOR_INTS = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size")


def check_processor_options(transform) -> None:
    """``transform.processor_options`` a dict of image processor settings whose known ones are of
    their type (pixel counts and patch sizes ints >= 1, ``do_*`` bools, ``rescale_factor`` a
    finite number, ``image_mean`` / ``image_std`` a number or a list of numbers), else a
    :class:`ConfigError` naming the transform's class, the option and what came."""
    options = transform.processor_options
    where = f"{type(transform).__name__}.processor_options"
    if not isinstance(options, dict):
        raise ConfigError(f"{where}: expected a dict, got {type(options).__name__}")
    for name, value in options.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if name in _PROCESSOR_INTS:
            ok, want = number and isinstance(value, int) and value >= 1, "an int >= 1"
        elif name.startswith("do_"):
            ok, want = isinstance(value, bool), "True or False"
        elif name == "rescale_factor":
            ok, want = number and 0 < value < float("inf"), "a finite number > 0"
        elif name in ("image_mean", "image_std"):
            items = value if isinstance(value, (list, tuple)) else [value]
            ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items)
            ok, want = ok and bool(items), "a number or a list of numbers"
        else:
            continue
        if not ok:
            raise ConfigError(f"{where}[{name!r}]: expected {want}, got {value!r:.80}")


def check_resize_bound(
    where: str, processor, given: dict | None, *, volume: bool, limit: int
) -> None:
    """The smallest picture ``processor``'s resize makes within its ``max_pixels``, and its
    ``temporal_patch_size`` at most ``limit``, else a :class:`ConfigError` naming ``where`` and the
    options of ``given`` (the user's settings; ``None``: ``processor`` is the user's object) that
    decide it, what was expected and what came.

    Each side of a resized picture is a multiple of ``factor = patch_size * merge_size`` and at
    least one (Qwen2-VL's ``smart_resize`` and the processors built on it), so the smallest is
    ``factor**2`` pixels where ``max_pixels`` bounds a frame's area, ``temporal_patch_size *
    factor**2`` where it bounds the ``volume`` (GLM-4.1V images, Qwen3-VL videos). A factor
    past that would have every picture resized past ``max_pixels`` (unbounded memory). An image (or
    a short video) is padded to ``temporal_patch_size`` frames: at most ``limit`` (the decode
    limits' frames of one video). A processor without a patch grid is not checked."""
    if not all(hasattr(processor, k) for k in ("patch_size", "merge_size", "temporal_patch_size")):
        return
    geometry = VisionGeometry.of(processor)
    p, m, t = geometry.patch_size, geometry.merge_size, geometry.temporal_patch_size
    frames = t if volume else 1
    smallest, most = frames * (p * m) ** 2, geometry.max_pixels
    if smallest > most:
        named = ["patch_size", "merge_size", *["temporal_patch_size"] * volume, "max_pixels"]
        raise ConfigError(
            f"{where}{_named(named, given)}: expected "
            f"{'temporal_patch_size * ' * volume}(patch_size * merge_size)**2 <= max_pixels (each "
            f"side of a resized picture is at least patch_size * merge_size pixels), got "
            f"{f'{t} * ' * volume}({p} * {m})**2 = {smallest} > max_pixels {most}"
        )
    if t > limit:
        raise ConfigError(
            f"{where}{_named(['temporal_patch_size'], given)}: expected temporal_patch_size <= "
            f"{limit} (limits.max_video_frames: a picture is padded to temporal_patch_size "
            f"frames), got {t}"
        )


def _named(names: list[str], given: dict | None) -> str:
    """``['a']['b']``: those of ``names`` the user set in ``given`` (``size`` sets max_pixels);
    none set: where the settings came from; ``given`` None (a processor object): nothing."""
    if given is None:
        return ""
    given = {*given, *(["max_pixels"] if "size" in given else [])}
    named = "".join(f"[{k!r}]" for k in names if k in given)
    return named or " (not set there: the model config's or the processor's own sizes)"


def check_decode_threads(transform) -> None:
    """``transform.decode_threads`` (a frozen dataclass's) stored as an ``int`` when it is an int
    >= 0 (decoder threads per video file; 0: ffmpeg's choice; numpy ints too), else a
    :class:`ConfigError` naming the transform's class."""
    threads = int_at_least(
        f"{type(transform).__name__}.decode_threads",
        transform.decode_threads,
        0,
        ConfigError,
        expected="an int >= 0 (0: ffmpeg's choice)",
    )
    object.__setattr__(transform, "decode_threads", threads)


# ---- the image processor -------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def _processor(options: tuple):
    # transformers >= 5 without torchvision: the PIL backend, named explicitly (no fallback warning)
    try:
        from transformers import Qwen2VLImageProcessorPil as cls
    except ImportError:  # older transformers
        from transformers import Qwen2VLImageProcessor as cls
    kwargs = {k: list(v) if isinstance(v, tuple) else v for k, v in options}  # (image_processor)
    if "size" not in kwargs:  # the pixel range as a size of its own: transformers 5.10 writes
        # min_pixels= / max_pixels= into the class's default size, which every processor built
        # after it then starts from (so a default built later would silently get that range)
        kwargs["size"] = {
            "shortest_edge": kwargs.pop("min_pixels", QWEN2VL_MIN_PIXELS),
            "longest_edge": kwargs.pop("max_pixels", QWEN2VL_MAX_PIXELS),
        }
    return cls(**kwargs)


QWEN2VL_MIN_PIXELS, QWEN2VL_MAX_PIXELS = 56 * 56, 28 * 28 * 1280
"""The Qwen2-VL image processor's default pixel range (``size``'s shortest / longest edge)."""


def image_processor(**options):
    """transformers' Qwen2-VL image processor with its default configuration, overridden by
    ``options`` (e.g. ``max_pixels``). Built locally, no hub access; cached per process."""
    key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))
    try:  # (a list, e.g. a preprocessor_config.json's image_mean, is a tuple in the cache's key)
        hash(key)
    except TypeError:
        bad = [k for k, v in key if not isinstance(v, collections.abc.Hashable)]
        raise ConfigError(
            f"image processor options {bad}: expected numbers, bools, strings or lists of them, "
            f"got {', '.join(type(options[k]).__name__ for k in bad)}"
        ) from None
    return _processor(key)


def process_images(images: list, processor, *, sample=None) -> tuple[torch.Tensor, torch.Tensor]:
    """PIL images -> (``pixel_values`` float32 ``[sum t*h*w, patch_dim]``, ``image_grid_thw`` int64
    ``[num_images, 3]``); no images -> ``[0, patch_dim]`` and ``[0, 3]``."""
    if not images:
        patch_dim = 3 * processor.temporal_patch_size * processor.patch_size**2
        return torch.zeros(0, patch_dim), torch.zeros(0, 3, dtype=torch.int64)
    codes, grid = image_codes(images, processor, sample=sample)
    if codes is not None:
        return expand_codes(codes, processor), grid
    try:
        out = processor(images=images, return_tensors="pt")
    except ValueError as exc:  # e.g. an aspect ratio over 200
        raise refused_images("the Qwen2-VL processor", str(exc), sample=sample) from None
    return out["pixel_values"].to(torch.float32), out["image_grid_thw"].to(torch.int64)


def _fast_tables(processor):
    """For transformers' PIL-backend Qwen2-VL processor in its standard configuration (bicubic
    resize, rescale, normalize): ``(table, geometry)`` where ``table`` float32 ``[3, 256]`` holds
    what rescale + normalize make of each uint8 value per channel, computed with transformers' own
    operations (float64 rescale, float32 cast, float32 ``(x - mean) / std``), so a lookup gives
    bit-identical values. ``None`` otherwise (then the processor itself runs). Cached per processor
    object."""
    hit = _FAST.get(id(processor))
    if hit is not None and hit[0] is processor:
        return hit[1]
    from PIL import Image

    fast = None
    if (
        type(processor).__name__ == "Qwen2VLImageProcessorPil"
        and processor.do_resize
        and processor.do_rescale
        and processor.do_normalize
        and int(processor.resample) == int(Image.Resampling.BICUBIC)
        and len(processor.image_mean) == 3
        and len(processor.image_std) == 3
    ):
        table = normalize_table(
            tuple(processor.image_mean), tuple(processor.image_std), float(processor.rescale_factor)
        )
        fast = (table, VisionGeometry.of(processor))
    _FAST[id(processor)] = (processor, fast)
    return fast


_FAST: dict = {}


def image_codes(
    images: list, processor, *, sample=None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """RGB PIL images -> (uint8 ``[sum gh*gw, 3, p, p]`` resized pixels in transformers' patch
    order, int64 ``[num_images, 3]`` grids): :func:`process_images` before rescale + normalize, 1/8
    of its size. ``(None, None)`` when the processor is not the standard PIL-backend Qwen2-VL one or
    an image is not RGB (the processor then runs as is)."""
    fast = _fast_tables(processor)
    if fast is None or not images or not all(getattr(im, "mode", None) == "RGB" for im in images):
        return None, None
    pieces = [_resized_patches(im, fast[1], sample=sample) for im in images]
    codes = np.concatenate([c for c, _ in pieces]) if len(pieces) > 1 else pieces[0][0]
    return torch.from_numpy(codes), torch.tensor([g for _, g in pieces], dtype=torch.int64)


def expand_codes(codes: torch.Tensor, processor) -> torch.Tensor:
    """uint8 ``[N, 3, p, p]`` from :func:`image_codes` -> float32 ``[N, 3*t*p*p]``, bit-identical to
    the processor's ``pixel_values``: one table lookup (rescale + normalize) and the temporal
    copies."""
    table, geometry = _fast_tables(processor)
    n, c, p, _ = codes.shape
    t = geometry.temporal_patch_size
    values = np.take(table, np.add(codes.numpy(), _CHANNEL_OFFSET, dtype=np.uint16)).reshape(
        n, c, 1, p, p
    )
    out = np.empty((n, c, t, p, p), dtype=np.float32)
    out[...] = values  # a still image repeated over the temporal patch
    return torch.from_numpy(out.reshape(n, c * t * p * p))


def _resized_patches(img, geometry, *, sample) -> tuple[np.ndarray, list[int]]:
    """One RGB PIL image -> (uint8 ``[gh*gw, 3, p, p]``, ``[1, gh, gw]``): the processor's resize
    (the same PIL call), cut into patches in transformers' order."""
    from PIL import Image

    try:
        _, gh, gw = image_grid(img.height, img.width, geometry, sample=sample)
    except SampleError as exc:
        raise refused_images("the Qwen2-VL processor", exc.actual, sample=sample) from None
    p, m = geometry.patch_size, geometry.merge_size
    resized = np.asarray(
        img.resize((gw * p, gh * p), resample=Image.Resampling.BICUBIC)
    )  # [H, W, 3] uint8
    # (gh/m, m, p, gw/m, m, p, C) -> (gh/m, gw/m, m, m, C, p, p): transformers' patch order
    blocks = resized.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    return np.ascontiguousarray(blocks).reshape(gh * gw, 3, p, p), [1, gh, gw]


_CHANNEL_OFFSET = (np.arange(3, dtype=np.uint16) * 256)[
    :, None, None
]  # channel c reads table[c*256 + v]


def decode_image(value, *, sample, name: str, limits: DecodeLimits = DEFAULT_LIMITS):
    """Bytes / ``{"bytes": ...}`` / PIL image -> an RGB PIL image, fully decoded (a truncated or
    corrupt file fails here, not later inside the processor). Bytes open only as
    :data:`~prealign.loaders.sources.tar_decode.IMAGE_FORMATS` (never PostScript through
    Ghostscript); an image over ``limits.max_image_pixels`` (checked from its header, before
    decoding; a PIL image given as is, by its size, and refused before loading when another format
    opened it) is a ``corrupt_image`` bomb."""
    from PIL import Image

    if isinstance(value, dict) and "bytes" in value:
        value = value["bytes"]
    try:
        if isinstance(value, Image.Image):
            w, h = value.size
            if w * h > limits.max_image_pixels:
                raise ImageTooLarge(
                    f"{w}x{h} = {w * h} pixels, over max_image_pixels {limits.max_image_pixels}"
                )
            if (
                value.format is not None and value.format not in IMAGE_FORMATS
            ):  # opened elsewhere (HF), lazily
                raise ValueError(
                    f"a {value.format} image (formats decoded: {', '.join(IMAGE_FORMATS)})"
                )
            img = value
            img.load()
        elif isinstance(value, (bytes, bytearray, memoryview)):
            img = open_image(bytes(value), limits)
        else:
            raise TypeError(f"{type(value).__name__} is not image bytes or a PIL image")
        return to_rgb(img)
    except ImageTooLarge as exc:
        raise MediaError(
            MediaProblem.CORRUPT_IMAGE,
            sample=sample,
            field=name,
            expected=f"at most {limits.max_image_pixels} pixels (DecodeLimits.max_image_pixels)",
            actual=str(exc),
        ) from None
    except image_errors() as exc:
        size = (
            f"{len(value)} bytes"
            if isinstance(value, (bytes, bytearray, memoryview))
            else type(value).__name__
        )
        raise MediaError(
            MediaProblem.CORRUPT_IMAGE,
            sample=sample,
            field=name,
            expected=f"a decodable image ({', '.join(IMAGE_FORMATS)})",
            actual=f"{size} ({type(exc).__name__}: {exc})",
        ) from None


def to_rgb(img):
    """A decoded PIL image -> RGB as the installed transformers' image processors convert it: an
    image with an alpha band or a transparency index (a palette PNG's) goes through transformers'
    own ``convert_to_rgb`` (5.24 composites it onto white; 5.10 and older drop the alpha), any other
    through ``convert("RGB")``."""
    if img.mode == "RGB":
        return img
    if "A" not in img.getbands() and img.info.get("transparency") is None:
        return img.convert("RGB")
    return _transformers_rgb()(img)


@functools.cache
def _transformers_rgb():
    """``PIL image -> RGB PIL image`` by the installed transformers' ``convert_to_rgb``."""
    import inspect

    from PIL import Image
    from transformers.image_transforms import convert_to_rgb

    if (
        "return_numpy" in inspect.signature(convert_to_rgb).parameters
    ):  # newer: arrays (PIL deprecated)
        return lambda img: Image.fromarray(convert_to_rgb(img, return_numpy=True))
    return convert_to_rgb


# ---- placeholder expansion -----------------------------------------------------------------------
def render_chat(
    meta: dict,
    tokenizer: ChatTokenizer,
    tokens_per_image: list[int],
    *,
    sample,
    videos: list[np.ndarray] | None = None,
    system: str | None = None,
    frame=None,
) -> tuple[np.ndarray, np.ndarray]:
    """Chat messages (or plain ``text``) -> (``input_ids`` int64 ``[L]``, ``loss_mask`` float32
    ``[L]``).

    Each ``<image>`` in the text becomes ``<|vision_start|>`` + ``tokens_per_image[i]`` x
    ``<|image_pad|>`` + ``<|vision_end|>``, images taken in order; each ``<video>`` becomes
    ``videos[i]`` (the ids :meth:`VLMSampleTransform.video_ids` writes; with ``videos=None`` a
    ``<video>`` is plain text, as before videos were supported). Loss is on assistant replies and
    their ``<|im_end|>`` (chat) or on every text token (plain text); never on vision blocks.
    ``system``: a system turn written first when the messages have none (what the Qwen2-VL template
    does with its default).

    The text is tokenized as the chat template's rendered string is (:func:`~prealign.loaders.media.
    chat_tokenizer.encode_segments`): each turn's role header and the content up to its first vision
    block in one piece, so a content that starts with a newline merges with the header's as the
    template's does. ``frame``: a family's own chat frame in place of ``<|im_start|>`` turns (GLM's:
    :class:`~prealign.loaders.media.glm4v.GlmChatFrame`; :meth:`VLMSampleTransform.chat_frame`).
    """
    turns = chat_turns(meta, sample)
    split = (_PLACEHOLDERS if videos is not None else _IMAGE_ONLY).split
    videos = [] if videos is None else videos
    segments: list[
        tuple
    ] = []  # (text or special ids, trained): encode_segments tokenizes as the template would
    images, clips = iter(tokens_per_image), iter(videos)

    def add_content(text: str, trained: bool):
        for part in split(text):
            if part == IMAGE_PLACEHOLDER:
                n = next(images, None)
                if n is None:
                    raise _placeholder_mismatch(meta, tokens_per_image, videos, sample)
                segments.append(
                    (
                        [
                            tokenizer.vision_start_token_id,
                            *([tokenizer.image_token_id] * n),
                            tokenizer.vision_end_token_id,
                        ],
                        False,
                    )
                )
            elif part == VIDEO_PLACEHOLDER:
                block = next(clips, None)
                if block is None:
                    raise _placeholder_mismatch(meta, tokens_per_image, videos, sample)
                segments.append((block, False))
            else:
                segments.append((part, trained))

    if turns is None:
        add_content(meta["text"], True)
    elif frame is not None:
        for i, turn in enumerate(turns):
            check_turn(turn, i, sample, getattr(frame, "roles", None))
        for text, trained, content in frame.pieces(turns):
            if content:
                add_content(text, trained)
            else:
                segments.append((text, trained))
    else:
        if system is not None and not (
            turns and isinstance(turns[0], dict) and turns[0].get("role") == "system"
        ):
            segments += [
                ([tokenizer.im_start_id], False),
                (f"system\n{system}", False),
                ([tokenizer.im_end_id], False),
                ("\n", False),
            ]
        for i, turn in enumerate(turns):
            check_turn(turn, i, sample)
            reply = turn["role"] == "assistant"
            segments += [([tokenizer.im_start_id], False), (turn["role"] + "\n", False)]
            add_content(turn["content"], reply)
            segments += [([tokenizer.im_end_id], reply), ("\n", False)]
    if next(images, None) is not None or next(clips, None) is not None:
        raise _placeholder_mismatch(meta, tokens_per_image, videos, sample)
    return encode_segments(tokenizer, segments)


def chat_turns(meta: dict, sample) -> list | None:
    """The sample's messages (``meta['messages']``, a list; each turn checked by its reader), or
    ``None`` for a plain ``meta['text']`` sample; neither is a ``bad_text`` naming ``sample`` and
    the keys it has."""
    turns = meta.get("messages")
    if isinstance(turns, list):
        return turns
    if not isinstance(meta.get("text"), str):
        raise MediaError(
            MediaProblem.BAD_TEXT,
            sample=sample,
            field="json",
            expected="'messages' (a list) or 'text'",
            actual=f"keys {sorted(meta)}",
        )
    return None


def check_turn(turn, i: int, sample, roles=None) -> None:
    """A chat turn is ``{'role': str, 'content': str}`` (with ``roles``: one of them), else a
    ``bad_text``."""
    if (
        not isinstance(turn, dict)
        or not isinstance(turn.get("content"), str)
        or not isinstance(turn.get("role"), str)
    ):
        raise MediaError(
            MediaProblem.BAD_TEXT,
            sample=sample,
            field=f"json.messages[{i}]",
            expected="{'role': str, 'content': str}",
            actual=repr(turn)[:80],
        )
    if roles is not None and turn["role"] not in roles:
        raise MediaError(
            MediaProblem.BAD_TEXT,
            sample=sample,
            field=f"json.messages[{i}].role",
            expected=f"one of {list(roles)} (the roles this model's chat template writes)",
            actual=repr(turn["role"]),
        )


def placeholder_mismatch(images: int, videos: int, seen: tuple[int, int], *, sample) -> MediaError:
    """A ``placeholder_mismatch`` naming ``sample``: it has ``images`` images and ``videos`` videos,
    but its text names ``seen`` ``(<image>, <video>)`` placeholders."""
    return MediaError(
        MediaProblem.PLACEHOLDER_MISMATCH,
        sample=sample,
        field="json",
        expected=f"{images} '{IMAGE_PLACEHOLDER}' placeholders (one per image) and "
        f"{videos} '{VIDEO_PLACEHOLDER}' (one per video)",
        actual=f"{seen[0]} and {seen[1]}",
    )


def _placeholder_mismatch(
    meta: dict, tokens_per_image: list[int], videos: list, sample
) -> MediaError:
    text = meta.get("text") or " ".join(
        str(t.get("content", "")) for t in meta.get("messages", []) if isinstance(t, dict)
    )
    seen = (text.count(IMAGE_PLACEHOLDER), text.count(VIDEO_PLACEHOLDER))
    return placeholder_mismatch(len(tokens_per_image), len(videos), seen, sample=sample)


def vision_types_and_mrope(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor,
    vision: VisionTokens,
    *,
    sample,
    mrope: bool = True,
    family: VisionFamily | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``mm_token_type_ids`` after checking that the image tokens form one run per image of exactly
    ``t*h*w / merge**2`` tokens, and (``mrope``) the family's positions, of one sequence in one pass
    of NumPy operations (:func:`prealign.collate.vision.rope_positions`; a fixed number, no loop
    over tokens or images). With a ``family``, its video tokens are type 2 and its video runs are
    checked against ``video_grid_thw``. Returns ``mm_token_type_ids`` int64 ``[L]`` and
    ``mrope_position_ids`` int64 ``[3, L]`` (or ``None``)."""
    ids = input_ids.numpy()
    merge = vision.spatial_merge_size
    grid = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    types = (ids == vision.image_token_id).astype(np.int64) * IMAGE_TOKEN_TYPE
    runs, steps = np.zeros((0, 3), dtype=np.int64), None
    if family is not None:
        if hasattr(
            family, "token_types"
        ):  # GLM-4.1V: video frames use the image token, typed by their context
            types = family.token_types(ids)
        else:
            types[ids == family.video_token_id] = VIDEO_TOKEN_TYPE
        videos = (
            np.zeros((0, 3), np.int64)
            if video_grid_thw is None
            else np.asarray(video_grid_thw).reshape(-1, 3)
        )
        runs, steps = family.video_runs(videos), family.video_steps(videos, second_per_grid_ts)
        if getattr(family, "one_media_kind", False) and grid.shape[0] and videos.shape[0]:
            raise MediaError(
                MediaProblem.BAD_VIDEO,
                sample=sample,
                field="videos",
                actual=f"{grid.shape[0]} image(s) and {videos.shape[0]} video(s)",
                expected=f"images or video, not both, in "
                f"a {family.model_type} sample (its forward counts video tokens as image tokens)",
            )
    for kind, type_id, want in (
        ("image", IMAGE_TOKEN_TYPE, grid),
        ("video", VIDEO_TOKEN_TYPE, runs),
    ):
        edges = np.diff((types == type_id).astype(np.int8), prepend=np.int8(0), append=np.int8(0))
        got = np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)
        need = want.prod(-1) // merge**2
        if got.shape != need.shape or not np.array_equal(got, need):
            raise MediaError(
                MediaProblem.VISION_TOKEN_MISMATCH,
                sample=sample,
                field="input_ids",
                expected=f"{kind} token runs {need.tolist()} (t*h*w / {merge}**2 of each "
                f"{kind} grid {want.tolist()})",
                actual=f"runs {got.tolist()}",
            )
    if not mrope:
        return torch.from_numpy(types), None
    try:
        positions = rope_positions(types, np.array([0, ids.size]), grid, runs, steps, merge)
    except SampleError as exc:
        raise MediaError.from_check(
            MediaProblem.VISION_TOKEN_MISMATCH, exc, sample=sample, field=exc.field
        ) from None
    return torch.from_numpy(types), torch.from_numpy(positions)


# ---- the transform
# ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class VLMSampleTransform:
    """Raw multimodal sample -> the sample dict :func:`prealign.schemas.vlm_schema` describes
    (module docstring).

    The family comes from ``model_config`` (the model's transformers config;
    :func:`~prealign.collate.vision. vision_family`): token ids, patch / merge / temporal sizes,
    video rules. Without one, Qwen2-VL images with the tokenizer's ids (as before video support).
    ``processor``: the model's transformers processor (its tokenizer, image processor and, where
    built, video processor are used) or an image processor; unset, transformers' Qwen2-VL image
    processor with ``processor_options`` and the family's patch sizes. Picklable (DataLoader
    workers); the image processor is built lazily once per process.

    >>> from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    >>> from transformers import Qwen3VLConfig
    >>> cfg = Qwen3VLConfig(image_token_id=6, video_token_id=7, vision_start_token_id=4,
    ...                     vision_end_token_id=5)
    >>> t = VLMSampleTransform(tokenizer=ByteTokenizer(), model_config=cfg)
    >>> t.family.patch_size, t.image_processor.patch_size, t.video_geometry.max_pixels
    (16, 16, 786432)
    """

    tokenizer: ChatTokenizer | None = None
    """Any :class:`~prealign.loaders.media.chat_tokenizer.ChatTokenizer`: a real one wrapped by
    :class:`~prealign.loaders.media.chat_tokenizer.HFChatTokenizer` (the demo uses its byte
    tokenizer); unset, ``processor.tokenizer`` wrapped."""
    topk: int | None = None
    """Expect teacher top-k members with this K (``None``: none expected, any present are
    ignored)."""
    log_prob_dtype: str = "float32"
    """``"float32"`` or ``"bfloat16"``: dtype of ``teacher_topk_log_probs`` in the output."""
    pixel_dtype: str = "float32"
    processor_options: dict = field(default_factory=dict)
    """Overrides of the default image processor's settings (e.g. ``{"max_pixels": 200704}``)."""
    text_key: str = "json"
    mrope: bool = True
    """Add ``mrope_position_ids`` int64 ``[3, L]`` (the family's positions of this sample), so the
    sample validates against the full :func:`prealign.schemas.vlm_schema` when a loader indexes it;
    the collator then pads and shards them like the tokens."""
    model_config: Any = None
    """The model's transformers config (object or dict) or a
    :class:`~prealign.collate.vision.VisionFamily`."""
    processor: Any = None
    """The model's transformers processor (``AutoProcessor``) or an image processor; see the class
    docstring."""
    video_fps: float = 2.0
    """Frames per second of a video's frames when its entry gives no ``fps`` (the Qwen processors
    sample 2)."""
    video_processor_config: dict | None = None
    """The checkpoint's video processor settings (its ``video_preprocessor_config.json`` as a dict:
    ``size`` or ``min/max_pixels``, ``patch_size``, ``merge_size``, ``temporal_patch_size``,
    ``image_mean``, ``image_std``, ``rescale_factor``), used where ``processor`` has no video
    processor (transformers' needs torchvision); keys
    left out take the family's defaults."""
    video_sampling: dict | None = None
    """Per-call overrides of the frame choice for video files (``do_sample_frames``, ``fps``,
    ``num_frames``, ``min_frames``, ``max_frames``: what a call of the video processor takes), over
    ``video_processor_config`` (or the processor's video processor) over the family's defaults
    (:mod:`~prealign.loaders.media.video_sampling`).
    Part of the index key."""
    decode_threads: int = 1
    """Decoder threads per video file (one per DataLoader worker by default)."""
    decode_videos: bool = True
    """False: video files are sampled and sized from their headers and their frames left undecoded
    (zero pixels): what the index pass's check of a header rule runs, so indexing decodes no
    video."""
    limits: DecodeLimits = DEFAULT_LIMITS
    """Caps checked before decoding or stacking: an image's pixels, a video's frames and its pixels
    over all frames (:class:`~prealign.loaders.sources.tar_decode.DecodeLimits`)."""
    default_system: bool = True
    """Write the family's default system turn before a conversation that has none, as its chat
    template does (Qwen2-VL / Qwen2.5-VL: ``"You are a helpful assistant."``;
    :attr:`VisionFamily.default_system`). ``False``:
    the messages as given. Without ``model_config`` there is no family and no default."""
    chat_frame: str | None = None
    """The chat frame by name, over the family's own
    (:func:`~prealign.loaders.media.glm4v.chat_frame`): ``"chatml"`` (``<|im_start|>`` turns),
    ``"glm4.1v"`` (GLM-4.1V's), ``"glm4.5v"`` (with GLM-4.5V's think
    block: also the template of some ``glm4v`` checkpoints, e.g. GLM-4.6V-Flash); ``None``: the
    family's."""
    family: VisionFamily | None = field(init=False, repr=False, compare=False, default=None)

    @property
    def system_prompt(self) -> str | None:
        """The system turn :func:`render_chat` writes when the messages have none (``None``:
        nothing)."""
        return (
            self.family.default_system if self.default_system and self.family is not None else None
        )

    @property
    def frame(self):
        """The chat frame :func:`render_chat` writes (``None``: ``<|im_start|>`` turns),
        :attr:`chat_frame`."""
        return glm4v.chat_frame(self.family, self.chat_frame)

    def __post_init__(self):
        check_float_dtypes(self)
        check_processor_options(self)
        if self.model_config is not None:
            object.__setattr__(self, "family", vision_family(self.model_config))
            if self.family.transform is not None:
                raise ConfigError(
                    f"VLMSampleTransform: {self.family.model_type} samples have their own "
                    f"transform: {self.family.transform}"
                )
        if self.tokenizer is None:
            if getattr(self.processor, "tokenizer", None) is None:
                raise ConfigError(
                    "VLMSampleTransform: give tokenizer= or a processor= that has a tokenizer"
                )
            wrap = (
                internvl.internvl_chat_tokenizer if self.tiled else HFChatTokenizer
            )  # InternVL's own names
            names = (
                glm4v.TOKEN_NAMES
                if getattr(self.family, "model_type", "").startswith("glm4v")
                else {}
            )
            object.__setattr__(self, "tokenizer", wrap(self.processor.tokenizer, **names))
        check_decode_threads(self)
        self._check_resize_bounds()
        if self.video_sampling is not None:
            self.frame_sampling  # noqa: B018 (checks the settings now, not at the first video)
        if self.frame is None and not hasattr(self.tokenizer, "im_start_id"):
            raise ConfigError(
                "VLMSampleTransform: chat_frame 'chatml' writes <|im_start|> / <|im_end|> turns, "
                "but the tokenizer has no such tokens (GLM's names them with its own frame); leave "
                "chat_frame unset or wrap the tokenizer with im_start= / im_end= names it has"
            )

    @property
    def image_processor(self):
        """The image processor this transform runs: ``processor``'s, else transformers' Qwen2-VL one
        with the family's patch / merge / temporal sizes and ``processor_options`` (cached per
        process)."""
        if self.processor is not None:
            return getattr(self.processor, "image_processor", self.processor)
        if self.tiled:
            return internvl.internvl_image_processor(self.family, **self.processor_options)
        if getattr(self.family, "model_type", "").startswith("glm4v"):
            return glm4v.glm4v_image_processor(**self.processor_options)
        options = dict(self.processor_options)
        if self.family is not None:
            for name, value in (
                ("patch_size", self.family.patch_size),
                ("merge_size", self.family.spatial_merge_size),
                ("temporal_patch_size", self.family.temporal_patch_size),
            ):
                options.setdefault(name, value)
        return image_processor(**options)

    @property
    def video_settings(self) -> Any:
        """The video processor settings in use: ``processor.video_processor`` where one is built,
        else ``video_processor_config`` over the family's transformers defaults
        (:attr:`VisionFamily.video_defaults`),
        else those defaults alone (:meth:`_video_grid` then warns once,
        :class:`VideoDefaultsWarning`)."""
        video = getattr(self.processor, "video_processor", None)
        if video is None:
            fam = self._require_family("video")
            d = fam.video_defaults
            video = types.SimpleNamespace(
                **{
                    "patch_size": fam.patch_size,
                    "merge_size": fam.spatial_merge_size,
                    "temporal_patch_size": fam.temporal_patch_size,
                    "min_pixels": d["min_pixels"],
                    "max_pixels": d["max_pixels"],
                    "image_mean": d["image_mean"],
                    "image_std": d["image_std"],
                    "rescale_factor": 1 / 255,
                    **(self.video_processor_config or {}),
                }
            )
        if getattr(video, "cap_pixels_per_frame", None):
            raise ConfigError(
                "VLMSampleTransform: a video processor with cap_pixels_per_frame=True is not "
                "supported (its per-frame cap); leave it unset"
            )
        return video

    @property
    def video_geometry(self) -> VisionGeometry:
        """The grid settings of :attr:`video_settings` (its ``size`` or ``min/max_pixels``)."""
        return VisionGeometry.of(self.video_settings)

    def _video_table(self) -> np.ndarray:
        video = self.video_settings
        return fused_normalize_table(
            tuple(video.image_mean), tuple(video.image_std), float(video.rescale_factor)
        )

    @property
    def frame_sampling(self) -> FrameSampling:
        """Which frames of a video file are kept: the family's processor rules with
        :attr:`video_settings` and :attr:`video_sampling`."""
        fam = self._require_family("video")
        return FrameSampling.for_family(
            volume=fam.volume_resize, settings=self.video_settings, overrides=self.video_sampling
        )

    def _warn_if_defaults(self) -> None:
        """Warn once per process and family when videos are sized by transformers' class
        defaults."""
        fam = self.family
        if (
            getattr(self.processor, "video_processor", None) is None
            and self.video_processor_config is None
            and fam.model_type not in _WARNED_DEFAULTS
        ):
            _WARNED_DEFAULTS.add(fam.model_type)
            warnings.warn(
                VideoDefaultsWarning(
                    f"VLMSampleTransform: no video processor (transformers' needs torchvision) "
                    f"and no video_processor_config: {fam.model_type} videos are sized with "
                    f"transformers' class defaults "
                    f"{fam.video_defaults}; pass video_processor_config= (the checkpoint's "
                    "video_preprocessor_config.json as a dict) to use the checkpoint's"
                ),
                stacklevel=3,
            )

    def _check_resize_bounds(self) -> None:
        """The image processor's (and, with a family, the video settings') patch sizes within their
        pixel range (:func:`check_resize_bound`): checked now, not by the resize of the first
        image."""
        if self.tiled:
            return
        own = self.processor is None
        name = type(self).__name__
        check_resize_bound(
            f"{name}.processor_options" if own else f"{name}.processor",
            self.image_processor,
            self.processor_options if own else None,
            volume=getattr(self.family, "model_type", "").startswith("glm4v"),
            limit=self.limits.max_video_frames,
        )
        if self.family is None:
            return
        video = getattr(self.processor, "video_processor", None)  # (its own checks on first use)
        own = video is None
        video = self.video_settings if own else video
        check_resize_bound(
            f"{name}.video_processor_config" if own else f"{name}.processor.video_processor",
            video,
            (self.video_processor_config or {}) if own else None,
            volume=self.family.volume_resize,
            limit=self.limits.max_video_frames,
        )

    def _require_family(self, what: str) -> VisionFamily:
        if self.family is None:
            raise ConfigError(
                f"VLMSampleTransform: {what} needs model_config= (the model's transformers config)"
            )
        return self.family

    @property
    def tiled(self) -> bool:
        """Whether the family cuts images into tiles (InternVL,
        :mod:`prealign.loaders.media.internvl`) rather than
        Qwen-style patch grids."""
        return getattr(self.family, "model_type", None) == "internvl"

    def header_image_tokens(self, width: int, height: int, *, sample, field: str) -> int:
        """Image tokens of one image from its size alone (its header): what :meth:`__call__` writes
        between the
        image's start and end tokens. Qwen families: ``t*gh*gw / merge**2`` of its grid; InternVL:
        256 per tile."""
        try:
            if self.tiled:
                return internvl.tiling_family(self.family, self.image_processor).image_tokens(
                    height, width, sample=sample, field=field
                )
            grid = image_grid if self.family is None else self.family.image_grid
            t, gh, gw = grid(
                height, width, VisionGeometry.of(self.image_processor), sample=sample, field=field
            )
        except SampleError as exc:
            raise MediaError.from_check(
                MediaProblem.CORRUPT_IMAGE, exc, sample=sample, field=field
            ) from None
        return t * gh * gw // self.spatial_merge_size**2

    @property
    def spatial_merge_size(self) -> int:
        """Patches merged per side (one vision token per ``merge**2`` patches): the family's, else
        the image processor's; handed on to ``MRoPECollator`` and ``validate_vlm_batch``."""
        if self.tiled:
            return self.family.spatial_merge_size
        merge = int(self.image_processor.merge_size)
        if self.family is not None and self.family.spatial_merge_size != merge:
            raise ConfigError(
                f"VLMSampleTransform: the image processor merges {merge} patches per side but the "
                f"{self.family.model_type} config says {self.family.spatial_merge_size}"
            )
        return merge

    @property
    def vision(self) -> VisionTokens:
        """The vision token ids (the family's, which the tokenizer must agree with, else the
        tokenizer's) with the merge size. A tokenizer that declares another ``spatial_merge_size``
        or other ids is a :class:`~prealign.schemas.ConfigError`."""
        merge = self.spatial_merge_size
        declared = getattr(self.tokenizer, "spatial_merge_size", None)
        if declared is not None and declared != merge:
            raise ConfigError(
                f"VLMSampleTransform: the tokenizer declares spatial_merge_size={declared} but "
                f"the image "
                f"processor merges {merge} patches per side; leave the tokenizer's unset (None) "
                f"so the "
                "processor's is used"
            )
        tokens = dataclasses.replace(self.tokenizer.vision, spatial_merge_size=merge)
        fam = self.family
        if fam is not None and self.tiled:  # <img>, </img> are the tokenizer's alone
            internvl.check_tokenizer(self.tokenizer, fam)
        elif fam is not None:
            ours = (fam.image_token_id, fam.vision_start_token_id, fam.vision_end_token_id)
            theirs = (
                tokens.image_token_id,
                tokens.vision_start_token_id,
                tokens.vision_end_token_id,
            )
            video = getattr(self.tokenizer, "video_token_id", None)
            if ours != theirs or (video is not None and video != fam.video_token_id):
                raise ConfigError(
                    f"VLMSampleTransform: the {fam.model_type} config's (image, vision start, "
                    f"vision "
                    f"end, video) ids {(*ours, fam.video_token_id)} differ from the tokenizer's "
                    f"{(*theirs, video)}"
                )
        return tokens

    def index_key(self) -> str:
        """Every setting a sample's length depends on (what an index's sidecar is keyed by): the
        tokenizer (its ids and a probe encoding), teacher K, dtypes, the family, the image and video
        grid settings, and for Qwen3-VL / 3.5 (whose video grids are the installed transformers'
        ``smart_resize`` and whose video text
        follows its processor, :mod:`prealign.collate.vision.qwen3_vl`) the transformers version."""
        tok = self.tokenizer
        probe = np.asarray(tok.encode("prealign probe: <image> <video> Hello, world!")).tolist()
        video = None
        if self.tiled:
            video = {"frames": "one tile each"}
        elif self.family is not None:
            video = {
                "geometry": repr(self.video_geometry),
                "fps": self.video_fps,
                "sampling": self.frame_sampling.key(),
            }
            if (
                self.family.volume_resize
            ):  # grids and the video text follow the installed transformers' rules
                import transformers

                video["transformers"] = transformers.__version__
        return json.dumps(
            {
                "vlm": {
                    "tokenizer": f"{type(tok).__module__}.{type(tok).__qualname__}",
                    "vocab_size": int(tok.vocab_size),
                    "vision": repr(self.vision),
                    "probe": probe,
                    "topk": self.topk,
                    "log_prob_dtype": self.log_prob_dtype,
                    "pixel_dtype": self.pixel_dtype,
                    "mrope": self.mrope,
                    "family": repr(self.family),
                    "images": self._image_key(),
                    "videos": video,
                    "text_key": self.text_key,
                    "system": self.system_prompt,
                    **({"frame": self.frame.name} if self.frame is not None else {}),
                }
            },
            sort_keys=True,
            default=str,
        )

    def _image_key(self) -> str:
        if self.tiled:
            return repr(internvl.tiling_family(self.family, self.image_processor))
        return repr(VisionGeometry.of(self.image_processor))

    def identity_fields(self) -> dict[str, str]:
        """What decides this transform's output, field by field
        (:mod:`~prealign.loaders.handoff.identity`: the index key and the share key are digests of
        them): the tokenizer (class, vocabulary size, vision tokens, a probe encoding, its whole
        definition), image processor options, text member, top-k, the family's grids
        and video rules; ``output_*`` (dtypes, decode limits) decide the output but not its
        lengths."""
        tok = self.tokenizer
        probe = np.asarray(tok.encode("prealign probe: <image> Hello, world!")).tolist()
        vlm = json.loads(self.index_key())[
            "vlm"
        ]  # the family's grids and video rules (transformers version)
        return {
            "transform": "VLMSampleTransform",
            "tokenizer": f"{type(tok).__module__}.{type(tok).__qualname__}",
            "vocab_size": str(int(tok.vocab_size)),
            "vision_tokens": repr(tok.vision),
            "tokenizer_probe": json.dumps(probe),
            "tokenizer_definition": tokenizer_definition(tok),
            "processor": json.dumps(sorted(self.processor_options.items()), default=str),
            "text_key": self.text_key,
            "topk": str(self.topk),
            "images": "upright by EXIF",
            **{
                f"vision_{k}": json.dumps(vlm.get(k), sort_keys=True)
                for k in ("family", "images", "videos", "mrope", "system")
            },
            "limits": repr(self.limits),  # (which samples are refused: part of the index key too)
            "output_dtypes": json.dumps([self.log_prob_dtype, self.pixel_dtype]),
            "output_decode_videos": str(self.decode_videos),
        }

    def video_ids(
        self, grid: tuple[int, int, int], frames: int, fps: float, frame_indices=None
    ) -> np.ndarray:
        """int64 ids of one video as the family's processor and chat template write it:
        ``<|vision_start|>``, then its ``<|video_pad|>`` tokens (Qwen3-VL / 3.5: per frame group,
        the ``<t seconds>`` text and the group's tokens inside their own start / end), then
        ``<|vision_end|>`` (Qwen3-VL / 3.5 with transformers
        < 5.10: without that outer pair, as the installed processor writes it;
        :meth:`VisionFamily.wraps_video`)."""
        fam = self._require_family("video")
        if hasattr(fam, "video_ids"):  # GLM-4.1V: its own frame groups and timestamps
            return fam.video_ids(self.tokenizer.encode, grid, frames, fps, frame_indices)
        t, gh, gw = grid
        per_group = gh * gw // fam.spatial_merge_size**2
        start, end, pad = fam.vision_start_token_id, fam.vision_end_token_id, fam.video_token_id
        texts = fam.frame_texts(frames, fps, frame_indices)
        if texts is None:
            return np.array([start, *([pad] * (t * per_group)), end], dtype=np.int64)
        body = [
            np.concatenate((self.tokenizer.encode(text), [start], np.full(per_group, pad), [end]))
            for text in texts
        ]
        outer = ([start], *body, [end]) if fam.wraps_video() else body
        return np.concatenate(outer).astype(np.int64)

    def __call__(self, raw: dict) -> dict:
        return self.expand(self.compact(raw))

    def for_indexing(self) -> "VLMSampleTransform":
        """This transform with video files sized from their headers and left undecoded
        (``decode_videos=False``): what an index pass runs
        (:meth:`~prealign.loaders.sources.source.Source.for_indexing`); the same lengths
        and shapes, no frame decoded."""
        return dataclasses.replace(self, decode_videos=False) if self.decode_videos else self

    def compact(self, raw: dict) -> dict:
        """The output with ``pixel_codes`` uint8 ``[sum t*h*w, 3, p, p]`` (:func:`image_codes`) in
        place of ``pixel_values`` where the fast path applies: what
        :class:`~prealign.loaders.handoff.media_share.
        SharedMediaTransform` publishes (1/8 of the bytes). :meth:`expand` finishes it."""
        if self.tiled:
            return self._compact_tiled(raw)
        key = raw.get("__key__", "?")
        meta = sample_metadata(raw, self.text_key, key)
        images = decode_images(raw, meta, key, self.limits)
        vision = self.vision
        codes, grid = image_codes(images, self.image_processor, sample=key)
        pixel_values = None
        if codes is None:
            pixel_values, grid = process_images(images, self.image_processor, sample=key)
        videos = (
            self._videos(raw, meta, key)
            if self.family is not None
            else refuse_videos(raw, meta, key)
        )
        if (
            "input_ids" in raw or "input_ids.npy" in raw
        ):  # pre-tokenized (a row's column or a shard's .npy member)
            input_ids = torch.as_tensor(
                np.asarray(raw.get("input_ids", raw.get("input_ids.npy"))), dtype=torch.int64
            ).reshape(-1)
            mask = raw.get("loss_mask", raw.get("loss_mask.npy"))
            loss_mask = torch.as_tensor(
                np.asarray(np.ones(input_ids.numel()) if mask is None else mask),
                dtype=torch.float32,
            ).reshape(-1)
        else:
            ids, mask = render_chat(
                meta,
                self.tokenizer,
                vision.tokens_per_image(grid).tolist(),
                sample=key,
                system=self.system_prompt,
                frame=self.frame,
                videos=None if videos is None else videos["ids"],
            )
            input_ids, loss_mask = torch.from_numpy(ids), torch.from_numpy(mask)
        video_fields = {} if videos is None else {k: v for k, v in videos.items() if k != "ids"}
        types, positions = vision_types_and_mrope(
            input_ids,
            grid,
            vision,
            sample=key,
            mrope=self.mrope,
            family=self.family,
            video_grid_thw=video_fields.get("video_grid_thw"),
            second_per_grid_ts=video_fields.get("second_per_grid_ts"),
        )
        dtype = getattr(torch, self.pixel_dtype)
        out: dict[str, Any] = {
            "__key__": key,
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "mm_token_type_ids": types,
            **(
                {"pixel_codes": codes}
                if pixel_values is None
                else {"pixel_values": pixel_values.to(dtype)}
            ),
            "image_grid_thw": grid,
        }
        if video_fields:
            out["pixel_values_videos"] = video_fields["pixel_values_videos"].to(dtype)
            out["video_grid_thw"] = video_fields["video_grid_thw"]
            out["second_per_grid_ts"] = video_fields["second_per_grid_ts"]
        if positions is not None:
            out["mrope_position_ids"] = positions
        return with_teacher_topk(out, raw, self)

    def _compact_tiled(self, raw: dict) -> dict:
        """An InternVL sample (:mod:`prealign.loaders.media.internvl`): tiles, ``<img>`` blocks,
        ``Frame{i}:`` videos."""
        key, fam, tok = raw.get("__key__", "?"), self.family, self.tokenizer
        internvl.check_tokenizer(tok, fam)
        meta = sample_metadata(raw, self.text_key, key)
        images = decode_images(raw, meta, key, self.limits)
        try:
            pixels, tiles = internvl.image_tiles(images, self.image_processor)
        except ValueError as exc:
            raise refused_images("the InternVL image processor", str(exc), sample=key) from None
        clips = [
            internvl.frame_tiles(
                [
                    decode_image(v, sample=key, name=n, limits=self.limits)
                    for n, v in _tiled_frames(video, key)
                ],
                self.image_processor,
            )
            for video in video_members(
                raw, meta, key, default_fps=self.video_fps, limits=self.limits
            )
        ]
        ids, mask = render_chat(
            meta,
            tok,
            [n * fam.image_seq_length for n in tiles],
            sample=key,
            videos=[internvl.video_ids(tok, fam, c.shape[0]) for c in clips],
            system=self.system_prompt,
        )
        pixel_values, counts = internvl.arrange_tiles(
            internvl.media_order(meta), pixels, tiles, clips
        )
        input_ids = torch.from_numpy(ids)
        types = (input_ids == fam.image_token_id).to(torch.int64)
        if int(types.sum()) != fam.image_seq_length * int(counts.sum()):
            raise MediaError(
                MediaProblem.VISION_TOKEN_MISMATCH,
                sample=key,
                field="input_ids",
                expected=f"{fam.image_seq_length * int(counts.sum())} image tokens "
                f"({fam.image_seq_length} per tile)",
                actual=f"{int(types.sum())}",
            )
        out = {
            "__key__": key,
            "input_ids": input_ids,
            "loss_mask": torch.from_numpy(mask),
            "mm_token_type_ids": types,
            "pixel_values": pixel_values.to(getattr(torch, self.pixel_dtype)),
            "image_num_patches": counts,
        }
        return with_teacher_topk(out, raw, self)

    def _videos(self, raw: dict, meta: dict, key) -> dict:
        """The sample's videos: ``pixel_values_videos`` float32, ``video_grid_thw`` int64 ``[n,
        3]``, ``second_per_grid_ts`` float32 ``[n]`` and each video's ids (``ids``). A video file is
        probed, sampled by the family's rules and only its sampled frames decoded
        (:mod:`~prealign.loaders.media.video_file`); a frame list's frames are decoded as images.
        Both are resized and normalised as transformers' video
        processors do (torch bicubic with antialias, rescale fused into normalize)."""
        geometry, table = self.video_geometry, self._video_table()
        p, m, tp = geometry.patch_size, geometry.merge_size, geometry.temporal_patch_size
        pixels, grids, seconds, ids = [], [], [], []
        for video in video_members(raw, meta, key, default_fps=self.video_fps, limits=self.limits):
            if video.data is not None:
                plan = self._file_plan(video, key)
                if not self.decode_videos:
                    frames = np.zeros(
                        (len(plan.indices), 3, plan.grid[1] * p, plan.grid[2] * p), np.uint8
                    )
                    pixels.append(normalize_patches(patchify(frames, plan.grid, p, m, tp), table))
                    grids.append(plan.grid)
                    seconds.append(plan.seconds)
                    ids.append(plan.ids)
                    continue
                frames = decode_kept(
                    video,
                    plan.header,
                    plan.indices,
                    (plan.grid[1] * p, plan.grid[2] * p),
                    key,
                    self.limits,
                    threads=self.decode_threads,
                )
                grid, block, second = plan.grid, plan.ids, plan.seconds
            else:
                decoded = decode_frame_list(video, key, self.limits)
                grid = self._video_grid(video.name, [im.size for im in decoded], geometry, key)
                frames = np.concatenate(
                    [
                        resize_frames(
                            torch.from_numpy(np.array(im)).permute(2, 0, 1)[None],
                            (grid[1] * p, grid[2] * p),
                        ).numpy()
                        for im in decoded
                    ]
                )
                block, second = self._list_ids(video, grid), tp / video.fps
            pixels.append(normalize_patches(patchify(frames, grid, p, m, tp), table))
            grids.append(grid)
            seconds.append(second)
            ids.append(block)
        dim = 3 * tp * p**2
        return {
            "pixel_values_videos": torch.from_numpy(np.concatenate(pixels))
            if pixels
            else torch.zeros(0, dim),
            "video_grid_thw": torch.tensor(grids, dtype=torch.int64).reshape(-1, 3),
            "second_per_grid_ts": torch.tensor(seconds, dtype=torch.float32),
            "ids": ids,
        }

    def header_video_ids(self, raw: dict, meta: dict, key, frame_size) -> list[np.ndarray] | None:
        """Each video's ids from headers alone: a frame list's from its frames' sizes
        (``frame_size(name, value) -> (width, height)``, e.g. from image headers), a video file's
        from its container headers and the family's frame choice; what :meth:`__call__` writes,
        without decoding a pixel. Without a family, a sample with a
        video is refused (:func:`refuse_videos`) and ``None`` returned for one without."""
        if self.family is None:
            return refuse_videos(raw, meta, key)
        if self.tiled:
            return [
                internvl.video_ids(self.tokenizer, self.family, len(_tiled_frames(v, key)))
                for v in video_members(
                    raw, meta, key, default_fps=self.video_fps, limits=self.limits
                )
            ]
        geometry = self.video_geometry
        out = []
        for video in video_members(raw, meta, key, default_fps=self.video_fps, limits=self.limits):
            if video.data is not None:
                out.append(self._file_plan(video, key).ids)
            else:
                grid = self._video_grid(
                    video.name, [frame_size(n, v) for n, v in video.frames], geometry, key
                )
                out.append(self._list_ids(video, grid))
        return out

    def _list_ids(self, video: "VideoEntry", grid: tuple) -> np.ndarray:
        """A frame list's ids: Qwen3-VL timestamps from its ``frame_indices`` / ``source_fps`` where
        given."""
        if video.frame_indices is not None:
            return self.video_ids(
                grid, len(video.frames), video.source_fps or video.fps, video.frame_indices
            )
        return self.video_ids(grid, len(video.frames), video.fps)

    def _file_plan(self, video: "VideoEntry", key) -> "VideoPlan":
        """A video file's header, kept frames, grid, ids and seconds per grid, from its headers
        alone; every limit checked before anything is decoded (:func:`file_plan`)."""
        tp = self.video_geometry.temporal_patch_size
        header, indices = file_plan(
            video, lambda total, fps: self.frame_sampling.indices(total, fps, tp), key, self.limits
        )
        n = len(indices)
        grid = self._video_grid(
            video.name, [(header.width, header.height)] * n, self.video_geometry, key
        )
        fps = sampled_fps(indices, header.frames, header.fps)
        return VideoPlan(
            header=header,
            indices=indices,
            grid=grid,
            seconds=tp / fps,
            ids=self.video_ids(grid, n, header.fps, indices),
        )

    def _video_grid(
        self, name: str, sizes: list[tuple[int, int]], geometry: VisionGeometry, key
    ) -> tuple:
        if len(set(sizes)) != 1:
            raise MediaError(
                MediaProblem.BAD_VIDEO,
                sample=key,
                field=name,
                expected="frames of one size",
                actual=f"sizes {sorted(set(sizes))}",
            )
        w, h = sizes[0]
        check_video_pixels(name, len(sizes) * w * h, key, self.limits)
        self._warn_if_defaults()
        try:
            return self.family.video_grid(len(sizes), h, w, geometry, sample=key, field=name)
        except SampleError as exc:
            raise MediaError.from_check(
                MediaProblem.BAD_VIDEO, exc, sample=key, field=name
            ) from None

    def expand(self, sample: dict) -> dict:
        """:meth:`compact`'s output -> the sample (``pixel_codes`` -> ``pixel_values`` of
        ``pixel_dtype``, in the same position among the fields). Anything without ``pixel_codes`` is
        returned as is."""
        if "pixel_codes" not in sample:
            return sample
        pixels = expand_codes(sample["pixel_codes"], self.image_processor).to(
            getattr(torch, self.pixel_dtype)
        )
        return {
            ("pixel_values" if k == "pixel_codes" else k): (pixels if k == "pixel_codes" else v)
            for k, v in sample.items()
        }


def sample_metadata(raw: dict, text_key: str, key) -> dict:
    value = raw.get(text_key)
    if value is None and ("messages" in raw or "text" in raw):
        meta = {k: raw[k] for k in ("messages", "text") if k in raw}
        if "images" in raw and not _is_image_list(raw["images"]):
            meta["images"] = raw["images"]  # member names
        return meta
    if value is None and ("input_ids" in raw or "input_ids.npy" in raw):
        return {}
    try:
        meta = json.loads(value) if isinstance(value, (bytes, bytearray, str)) else value
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise MediaError(
            MediaProblem.BAD_TEXT,
            sample=key,
            field=text_key,
            expected="a JSON object",
            actual=f"undecodable ({exc})",
        ) from None
    if not isinstance(meta, dict):
        raise MediaError(
            MediaProblem.BAD_TEXT,
            sample=key,
            field=text_key,
            expected="a JSON object",
            actual=type(meta).__name__ if value is not None else "missing",
        )
    return meta


def _is_image_list(value) -> bool:
    return isinstance(value, list) and any(not isinstance(v, str) for v in value)


_MEMBER = re.compile(r"^(?:(\d+)\.)?(" + "|".join(IMAGE_EXTENSIONS) + r")$", re.IGNORECASE)


def image_members(raw: dict, meta: dict, key) -> list[tuple[str, Any]]:
    """(name, value) of the sample's images, in placeholder order.

    ``meta["images"]`` (member names) fixes the order and makes a missing member an error;
    otherwise members named ``jpg``/``png`` or ``<i>.jpg``/``<i>.png`` are taken by index ``i``,
    except those ``meta["videos"]`` names as frames.
    An HF row's ``images`` column (a list of images) is taken as given.
    """
    if _is_image_list(raw.get("images")):
        return [(f"images[{i}]", v) for i, v in enumerate(raw["images"])]
    declared = meta.get("images")
    if isinstance(declared, list):
        videos = [n for n in declared if isinstance(n, str) and is_video_file(n)]
        if videos:
            raise MediaError(
                MediaProblem.BAD_VIDEO,
                sample=key,
                field=videos[0],
                actual="a video file under 'images'",
                expected="images under json['images'], videos under json['videos']",
            )
        missing = [n for n in declared if not isinstance(n, str) or n not in raw]
        if missing:
            raise MediaError(
                MediaProblem.MISSING_IMAGE,
                sample=key,
                field=missing[0],
                expected=f"image members {declared}{_row_hint(raw)}",
                actual=f"members {sorted(k for k in raw if not k.startswith('__'))}",
            )
        return [(n, raw[n]) for n in declared]
    frames = _frame_names(meta)
    found = []
    for name in raw:
        m = _MEMBER.match(name)
        if m and name not in frames:
            found.append((int(m.group(1) or 0), name))
    return [(name, raw[name]) for _, name in sorted(found)]


def _frame_names(meta: dict) -> set:
    """The member names ``meta["videos"]`` lists as frames (never images by the implicit rule)."""
    videos = meta.get("videos")
    names = set()
    for video in videos if isinstance(videos, list) else ():
        frames = video.get("frames") if isinstance(video, dict) else None
        if isinstance(frames, list):
            names.update(f for f in frames if isinstance(f, str))
    return names


@dataclass(frozen=True)
class VideoEntry:
    """One video of a sample: a frame list (``frames``: ``[(frame name, value)]`` at ``fps``,
    optionally with the source's ``frame_indices`` and ``source_fps``) or a video file (``data``:
    its bytes)."""

    name: str
    frames: list | None = None
    fps: float = 2.0
    data: bytes | None = None
    frame_indices: list[int] | None = None
    source_fps: float | None = None


@dataclass(frozen=True)
class VideoPlan:
    """A video file from its headers: the header, the kept frames' indices int64 ``[n]``, the grid,
    the seconds per temporal grid step (``temporal_patch_size / sampled fps``) and the ids the text
    gets."""

    header: VideoHeader
    indices: np.ndarray
    grid: tuple[int, int, int]
    seconds: float
    ids: np.ndarray


def check_video_pixels(name: str, pixels: int, key, limits: DecodeLimits) -> None:
    """``bad_video`` naming sample ``key`` and video ``name`` where its frames' running pixel total
    ``pixels`` is over ``limits.max_video_pixels``."""
    if pixels > limits.max_video_pixels:
        raise MediaError(
            MediaProblem.BAD_VIDEO,
            sample=key,
            field=name,
            actual=f"{pixels} pixels or more",
            expected=f"at most {limits.max_video_pixels} pixels over its frames "
            "(DecodeLimits.max_video_pixels)",
        )


def decode_images(raw: dict, meta: dict, key, limits: DecodeLimits) -> list:
    """The sample's images (:func:`image_members`, in placeholder order) decoded: RGB PIL, each
    checked against ``limits`` (:func:`decode_image`)."""
    return [
        decode_image(v, sample=key, name=n, limits=limits) for n, v in image_members(raw, meta, key)
    ]


def decode_frame_list(video: VideoEntry, key, limits: DecodeLimits) -> list:
    """A frame list's frames decoded (RGB PIL, each checked against ``limits``), their running
    pixel total checked against ``limits.max_video_pixels`` frame by frame
    (:func:`check_video_pixels`): never more than the limit in memory."""
    frames, area = [], 0
    for name, value in video.frames:
        frames.append(decode_image(value, sample=key, name=name, limits=limits))
        area += frames[-1].width * frames[-1].height
        check_video_pixels(video.name, area, key, limits)
    return frames


def corrupt_video(video: VideoEntry, key, actual: str, expected: str) -> MediaError:
    """``corrupt_video`` naming sample ``key`` and ``video``."""
    return MediaError(
        MediaProblem.CORRUPT_VIDEO, sample=key, field=video.name, actual=actual, expected=expected
    )


def file_plan(
    video: VideoEntry, choose, key, limits: DecodeLimits
) -> tuple[VideoHeader, np.ndarray]:
    """A video file's header and kept frames' indices int64 ``[n]`` (``choose(total, source_fps)``,
    the family's frame choice), from its headers alone: ``corrupt_video`` where PyAV cannot read
    them, ``bad_video`` where ``choose`` refuses (a :class:`ValueError`) or the video is over
    ``limits`` (its seconds; its kept frames, their pixels and RGB bytes at the source size), all
    before anything is decoded."""

    def bad(actual: str, expected: str) -> MediaError:
        return MediaError(
            MediaProblem.BAD_VIDEO, sample=key, field=video.name, actual=actual, expected=expected
        )

    try:
        header = probe_video(video.data)
    except VideoFileError as exc:
        raise corrupt_video(
            video, key, str(exc), "a video file PyAV reads (mp4, webm, mkv, ...)"
        ) from None
    if header.seconds > limits.max_video_seconds:
        raise bad(
            f"{header.seconds:.1f} s",
            f"at most {limits.max_video_seconds} s (DecodeLimits.max_video_seconds)",
        )
    try:
        indices = choose(header.frames, header.fps)
    except ValueError as exc:
        raise bad(str(exc), "a video the family's frame sampling takes") from None
    n, area = len(indices), header.width * header.height
    if n > limits.max_video_frames:
        raise bad(
            f"{n} sampled frames of {header.frames}",
            f"at most {limits.max_video_frames} frames (DecodeLimits.max_video_frames; "
            "sample fewer: video_sampling={'num_frames': ...} or {'fps': ...})",
        )
    if n * area > limits.max_video_pixels:
        raise bad(
            f"{n} frames of {header.width}x{header.height} = {n * area} pixels",
            f"at most {limits.max_video_pixels} pixels over its frames "
            "(DecodeLimits.max_video_pixels)",
        )
    if n * area * 3 > limits.max_video_bytes:
        raise bad(
            f"{n} frames of {header.width}x{header.height}",
            f"at most {limits.max_video_bytes} decoded bytes (DecodeLimits.max_video_bytes)",
        )
    return header, indices


def decode_kept(
    video: VideoEntry,
    header: VideoHeader,
    indices: np.ndarray,
    size: tuple[int, int],
    key,
    limits: DecodeLimits,
    *,
    threads: int = 1,
) -> np.ndarray:
    """A video file's frames at ``indices`` (:func:`file_plan`'s) -> uint8 ``[n, 3, *size]``
    (:func:`~.video_file.decode_frames`: only those frames decoded, each resized as decoded); a
    stream that disagrees with its headers, or a decode over ``limits.max_video_decode_seconds``,
    is ``corrupt_video``."""
    try:
        return decode_frames(
            video.data,
            indices,
            header,
            size,
            threads=threads,
            deadline_s=limits.max_video_decode_seconds,
        )
    except VideoFileError as exc:
        raise corrupt_video(
            video, key, str(exc), "a video file whose sampled frames decode as its headers say"
        ) from None


def _tiled_frames(video: VideoEntry, key) -> list:
    """A tiled family's (InternVL) video frames: a frame list only (its video files are not decoded
    yet)."""
    if video.frames is None:
        raise MediaError(
            MediaProblem.BAD_VIDEO,
            sample=key,
            field=video.name,
            actual="a video file",
            expected="InternVL videos as frame lists ({'frames': [...], 'fps': f}); decode the "
            "file first",
        )
    return video.frames


def _members_listing(raw: dict) -> str:
    return f"members {sorted(k for k in raw if not k.startswith('__'))}"


def video_members(
    raw: dict, meta: dict, key, *, default_fps: float = 2.0, limits: DecodeLimits = DEFAULT_LIMITS
) -> list[VideoEntry]:
    """The sample's videos (:class:`VideoEntry`), in placeholder order. ``meta["videos"]`` (or an HF
    row's ``videos`` column) lists, per video, a video file member (``"clip.mp4"`` or ``{"file":
    "clip.mp4"}``) or a frame list ``{"frames": [...], "fps": ..., "frame_indices": [...],
    "source_fps": ...}`` (frames as member names, a missing one an error, or as images; at most
    ``limits.max_video_frames`` frames; ``frame_indices`` and ``source_fps`` optional, for
    Qwen3-VL's timestamps). Without ``videos``, the members with a video extension
    (:data:`VIDEO_EXTENSIONS`: ``mp4``, ``0.mp4``, ``clip.webm``) are the videos, by their leading
    index."""
    declared = raw.get("videos") if isinstance(raw.get("videos"), list) else meta.get("videos")
    if declared is None:
        files = [n for n in raw if not n.startswith("__") and is_video_file(n)]
        order = sorted(
            files, key=lambda n: (int(n.split(".")[0]) if n.split(".")[0].isdigit() else -1, n)
        )
        return [_video_file(raw, n, n, key) for n in order]
    if not isinstance(declared, list):
        raise MediaError(
            MediaProblem.BAD_VIDEO,
            sample=key,
            field="videos",
            actual=type(declared).__name__,
            expected="a list of video file members or {'frames', 'fps'}",
        )
    out = []
    for i, video in enumerate(declared):
        name = f"videos[{i}]"
        if isinstance(video, str) or (
            isinstance(video, dict) and isinstance(video.get("file"), str)
        ):
            out.append(
                _video_file(raw, video if isinstance(video, str) else video["file"], name, key)
            )
            continue
        frames = video.get("frames") if isinstance(video, dict) else None
        fps = video.get("fps", default_fps) if isinstance(video, dict) else None
        if not isinstance(frames, list) or not frames:
            raise MediaError(
                MediaProblem.BAD_VIDEO,
                sample=key,
                field=name,
                actual=repr(video)[:80],
                expected="a video file member ('clip.mp4' or {'file': 'clip.mp4'}) or "
                "{'frames': [at least one frame], 'fps': ...}",
            )
        if len(frames) > limits.max_video_frames:
            raise MediaError(
                MediaProblem.BAD_VIDEO,
                sample=key,
                field=f"{name}.frames",
                actual=f"{len(frames)} frames",
                expected=f"at most {limits.max_video_frames} frames "
                f"(DecodeLimits.max_video_frames)",
            )
        for field_name, value in (("fps", fps), ("source_fps", video.get("source_fps", fps))):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not MIN_FPS <= value <= MAX_FPS
            ):
                raise MediaError(
                    MediaProblem.BAD_VIDEO,
                    sample=key,
                    field=f"{name}.{field_name}",
                    actual=repr(value)[:80],
                    expected=f"a number of frames per second in "
                    f"[{MIN_FPS:g}, {MAX_FPS:g}] (MIN_FPS, MAX_FPS)",
                )
        indices = video.get("frame_indices")
        if indices is not None and (
            not isinstance(indices, list)
            or len(indices) != len(frames)
            or any(isinstance(j, bool) or not isinstance(j, int) or j < 0 for j in indices)
            or any(b < a for a, b in zip(indices, indices[1:]))
        ):
            raise MediaError(
                MediaProblem.BAD_VIDEO,
                sample=key,
                field=f"{name}.frame_indices",
                actual=repr(indices)[:80],
                expected=f"{len(frames)} ascending non-negative ints (one source index per frame)",
            )
        named = []
        for j, frame in enumerate(frames):
            if isinstance(frame, str):
                if frame not in raw:
                    raise MediaError(
                        MediaProblem.MISSING_IMAGE,
                        sample=key,
                        field=frame,
                        expected=f"the frame members of {name}",
                        actual=_members_listing(raw),
                    )
                named.append((frame, raw[frame]))
            else:
                named.append((f"{name}.frames[{j}]", frame))
        source = video.get("source_fps")
        out.append(
            VideoEntry(
                name=name,
                frames=named,
                fps=float(fps),
                frame_indices=indices,
                source_fps=None if source is None else float(source),
            )
        )
    return out


def _video_file(raw: dict, member: str, name: str, key) -> VideoEntry:
    if member not in raw:
        raise MediaError(
            MediaProblem.MISSING_IMAGE,
            sample=key,
            field=member,
            actual=_members_listing(raw),
            expected=f"the video file of {name}{_row_hint(raw)}",
        )
    value = raw[member]
    if isinstance(value, dict) and "bytes" in value:
        value = value["bytes"]
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise MediaError(
            MediaProblem.BAD_VIDEO,
            sample=key,
            field=member,
            actual=type(value).__name__,
            expected="a video file's bytes",
        )
    return VideoEntry(name=member, data=bytes(value))


def is_video_file(name: str) -> bool:
    """Whether a member name's last extension is a video container (:data:`VIDEO_EXTENSIONS`).

    >>> is_video_file("clip.mp4"), is_video_file("webm"), is_video_file("0.png")
    (True, True, False)
    """
    return name.rsplit(".", 1)[-1].lower() in VIDEO_EXTENSIONS


def _placeholder_texts(meta: dict) -> list[str]:
    if isinstance(meta.get("text"), str):
        return [meta["text"]]
    turns = meta.get("messages")
    return (
        [t["content"] for t in turns if isinstance(t, dict) and isinstance(t.get("content"), str)]
        if isinstance(turns, list)
        else []
    )


def refuse_videos(raw: dict, meta: dict, key) -> None:
    """For a transform without video rules (no ``model_config``): a sample with a ``<video>``
    placeholder, a ``videos`` entry or a video file member is a :class:`MediaError`
    (``unprocessed_video``) naming the sample and
    what holds the video, never read as text with the video dropped. Returns ``None`` (no video
    ids)."""
    declared = raw.get("videos") if isinstance(raw.get("videos"), list) else meta.get("videos")
    files = sorted(n for n in raw if not n.startswith("__") and is_video_file(n))
    if declared:
        field, what = "videos", f"a 'videos' entry ({repr(declared)[:60]})"
    elif files:
        field, what = files[0], f"a video member {files[0]!r}"
    elif any(VIDEO_PLACEHOLDER in text for text in _placeholder_texts(meta)):
        field, what = "json", f"a '{VIDEO_PLACEHOLDER}' placeholder"
    else:
        return None
    raise MediaError(
        MediaProblem.UNPROCESSED_VIDEO,
        sample=key,
        field=field,
        actual=what,
        expected="a transform that processes videos: VLMSampleTransform(model_config=<the model's "
        "transformers config>), or prealign index / inspect --model-config DIR",
        hint="without model_config the transform has no video rules, and the video would be "
        "dropped",
    )
