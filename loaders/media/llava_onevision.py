"""One LLaVA-OneVision sample, raw -> model-ready (:class:`LlavaOnevisionSampleTransform`), as
transformers' ``LlavaOnevisionProcessor`` and the LLaVA-OneVision chat template write it (the
AnyRes token count is :mod:`prealign.collate.vision.llava_onevision`'s).

    raw sample (as VLMSampleTransform's): json {"messages": [...], "images": [...],
    "videos": [{"frames": [...]}]}, 0.jpg (JPEG bytes), ...
        ──LlavaOnevisionSampleTransform──►
    input_ids            int64   [L]
    loss_mask            float32 [L]                1 on assistant text + <|im_end|>
    mm_token_type_ids    int64   [L]                1 <image>, 2 <video>
    pixel_values         float   [tiles, 3, s, s]
    image_sizes          int64   [images, 2]        (height, width)
    batch_num_images     int64   [1]                images in the sample (empty without images)
    pixel_values_videos  float   [frames, 3, s, s]  (from json["videos"])
    video_num_frames     int64   [videos]

The chat template (rendered here, tokenized as its string is:
:func:`~.chat_tokenizer.encode_segments`): per turn ``<|im_start|>{role} ``, then the turn's
images (``<image>`` each), its videos (``<video>`` each), each text piece as ``"\\n" + text``,
then ``<|im_end|>`` (no newline between turns, no default system turn). A message's content is
read as the other families read it: ``<image>`` / ``<video>`` placeholders split it into media
items and text items (a piece that starts with a newline keeps it: ``"<image>\\nWhat?"`` renders
``<image>`` + ``"\\n\\nWhat?"``, as the template renders ``[image, text "\\nWhat?"]``). Each
``<image>`` becomes the processor's count of ``<image>`` tokens: an image alone in its sample,
the base view + its unpadded AnyRes tiles + a newline per row; among several, the base view +
one newline (``vision_feature_select_strategy == "default"``: one fewer).

``pixel_values`` are the image processor's own (transformers' LLaVA-OneVision image processor:
an image alone is its base view then its tiles of the best ``image_grid_pinpoints`` resolution;
an image among several is padded to a square with the mean colour), each image's rows without
the zero rows the processor pads a batch with: what the model's 4-D ``pixel_values`` path takes,
with ``image_sizes`` and ``batch_num_images`` (concatenated over a packed batch, one count per
sample that has images, they tell it which images are tiled; a text-only sample adds none, so it
carries no media row). Positions are 1-D (the collator's ``position_ids``).

Videos are frame lists (``json["videos"]``, as for every family) or video files (``clip.mp4``
members): a file keeps the frames transformers' LLaVA-OneVision video processor keeps (every frame
by default; ``video_sampling={"num_frames": n}`` or ``{"fps": f}`` as its call takes them, by the
installed transformers' rule: :class:`~.video_sampling.UniformSampling`), read from its headers
and checked against the decode limits before only those frames are decoded
(:func:`~.vlm.file_plan`). Each frame is resized to the tile square as transformers' video
processors resize (torch bicubic with antialias), written as ``frames * ceil(side / 2)**2 + 1``
``<video>`` tokens (each frame's features pooled, one ``image_newline`` per video),
``mm_token_type_ids`` 2.
The token count depends on the kept frame count alone, so an index reads it from the headers."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from prealign.collate.vision import LlavaOneVision
from prealign.loaders.media.chat_tokenizer import encode_segments
from prealign.loaders.media.sized_images import FamilyTransform
from prealign.loaders.media.teacher_topk import with_teacher_topk
from prealign.loaders.media.video import fused_normalize_table
from prealign.loaders.media.video_file import resize_frames
from prealign.loaders.media.video_sampling import UniformSampling
from prealign.loaders.media.vlm import (
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    MediaError,
    MediaProblem,
    VideoEntry,
    chat_turns,
    check_decode_threads,
    check_float_dtypes,
    check_turn,
    check_video_pixels,
    decode_frame_list,
    decode_images,
    decode_kept,
    file_plan,
    image_members,
    placeholder_mismatch,
    refused_images,
    sample_metadata,
    video_members,
)
from prealign.loaders.sources.header_lengths import HeaderError, image_header_size
from prealign.loaders.sources.tar_decode import DEFAULT_LIMITS, DecodeLimits
from prealign.schemas.errors import ConfigError, SampleError
from prealign.schemas.vlm import VIDEO_TOKEN_TYPE

_SPLIT = re.compile("(" + re.escape(IMAGE_PLACEHOLDER) + "|" + re.escape(VIDEO_PLACEHOLDER) + ")")


@dataclass(frozen=True)
class OnevisionChatTokenizer:
    """A Hugging Face tokenizer with LLaVA-OneVision's tokens (``<|im_start|>``, ``<|im_end|>``,
    ``<image>``, ``<video>``) for the transform: ``encode(text) -> int64 [n]`` without added special
    tokens. Picklable."""

    tokenizer: Any
    im_start: str = "<|im_start|>"
    im_end: str = "<|im_end|>"
    image: str = "<image>"
    video: str = "<video>"

    def __post_init__(self):
        unk = getattr(self.tokenizer, "unk_token_id", None)
        for name in (self.im_start, self.im_end, self.image):
            tid = self.tokenizer.convert_tokens_to_ids(name)
            if tid is None or (tid == unk and name != getattr(self.tokenizer, "unk_token", None)):
                raise ConfigError(f"OnevisionChatTokenizer: the tokenizer has no {name!r} token")

    def _id(self, name: str) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(name))

    @property
    def im_start_id(self) -> int:
        return self._id(self.im_start)

    @property
    def im_end_id(self) -> int:
        return self._id(self.im_end)

    @property
    def image_token_id(self) -> int:
        return self._id(self.image)

    @property
    def video_token_id(self) -> int:
        return self._id(self.video)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def eos_token_id(self) -> int:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return self.im_end_id if eos is None else int(eos)

    @property
    def pad_token_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return self.eos_token_id if pad is None else int(pad)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(
            self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64
        )


@functools.lru_cache(maxsize=4)
def _image_processor(tile: int, pinpoints: tuple):
    try:  # transformers >= 5 without torchvision: the PIL backend
        from transformers import LlavaOnevisionImageProcessorPil as cls
    except ImportError:  # pragma: no cover - older transformers
        from transformers import LlavaOnevisionImageProcessor as cls
    return cls(
        size={"height": tile, "width": tile}, image_grid_pinpoints=[list(p) for p in pinpoints]
    )


def onevision_image_processor(family: LlavaOneVision):
    """transformers' LLaVA-OneVision image processor (PIL backend) with the config's tile size and
    ``image_grid_pinpoints``; built locally, cached per process."""
    return _image_processor(family.tile_size, family.pinpoints)


@dataclass(frozen=True, kw_only=True)
class LlavaOnevisionSampleTransform(FamilyTransform):
    """Raw multimodal sample -> LLaVA-OneVision fields (module docstring). ``model_config``: the
    ``LlavaOnevisionConfig`` (or its dict); ``tokenizer``: the model's HF tokenizer (wrapped by
    :class:`OnevisionChatTokenizer`) or an object with ``encode``, ``im_start_id``, ``im_end_id``,
    ``image_token_id``, ``vocab_size``; ``processor``: the model's processor or image processor
    (default :func:`onevision_image_processor`), whose tile size and pinpoints must be the config's.
    The other settings are :class:`~prealign.loaders.media.sized_images.FamilyTransform`'
    (``limits`` here also caps videos). Picklable."""

    limits: DecodeLimits = DEFAULT_LIMITS
    """Caps checked before decoding: an image's pixels; a video file's seconds, kept frames, their
    pixels and bytes (from its headers); a frame list's frames."""
    video_sampling: dict | None = None
    """Per-call overrides of a video file's frame choice (``do_sample_frames``, ``num_frames``,
    ``fps``: what a call of the video processor takes), over the processor's video processor
    settings, over the class defaults (every frame). Part of the index key."""
    decode_threads: int = 1
    """Decoder threads per video file (one per DataLoader worker by default; 0: ffmpeg's
    choice)."""
    decode_videos: bool = True
    """False: video files are sampled from their headers and left undecoded (zero pixels): what an
    index pass runs (:meth:`for_indexing`)."""
    family: LlavaOneVision = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self):
        fam = self.checked_family(LlavaOneVision, "llava_onevision")
        object.__setattr__(self, "family", fam)
        if not hasattr(self.tokenizer, "im_start_id"):  # a plain HF tokenizer
            object.__setattr__(self, "tokenizer", OnevisionChatTokenizer(self.tokenizer))
        if self.tokenizer.image_token_id != fam.image_token_id:
            raise ConfigError(
                f"LlavaOnevisionSampleTransform: the config's image_token_index "
                f"{fam.image_token_id} "
                f"is not the tokenizer's <image> {self.tokenizer.image_token_id}"
            )
        size = self.image_processor.size
        get = size.get if isinstance(size, dict) else (lambda k, d=None: getattr(size, k, d))
        pins = tuple(tuple(int(v) for v in p) for p in self.image_processor.image_grid_pinpoints)
        if (get("height"), get("width")) != (fam.tile_size, fam.tile_size) or pins != fam.pinpoints:
            raise ConfigError(
                f"LlavaOnevisionSampleTransform: the image processor's size {size} and pinpoints "
                f"{[list(p) for p in pins]} differ from the config's vision_config.image_size "
                f"{fam.tile_size} and image_grid_pinpoints {[list(p) for p in fam.pinpoints]}"
            )
        check_float_dtypes(self)
        check_decode_threads(self)
        self.frame_sampling  # noqa: B018 (the settings checked now, not at the first video)

    @property
    def frame_sampling(self) -> UniformSampling:
        """Which frames of a video file are kept: the video processor's settings (where the
        processor has one) and :attr:`video_sampling`, by the installed transformers' rule."""
        return UniformSampling.for_processor(
            getattr(self.processor, "video_processor", None), self.video_sampling
        )

    def for_indexing(self) -> "LlavaOnevisionSampleTransform":
        """This transform with video files sampled from their headers and left undecoded
        (``decode_videos=False``): the same lengths and shapes, no frame decoded."""
        return dataclasses.replace(self, decode_videos=False) if self.decode_videos else self

    @property
    def image_processor(self):
        if self.processor is not None:
            return getattr(self.processor, "image_processor", self.processor)
        return onevision_image_processor(self.family)

    def segments(
        self, meta: dict, sizes: list[tuple[int, int]], frames: list[int] = (), *, sample
    ) -> list[tuple]:
        """The rendered chat as :func:`encode_segments` parts for images of ``sizes`` ``(height,
        width)`` and videos of ``frames`` frames, each in the order the text names them."""
        tok, fam = self.tokenizer, self.family
        counts = [
            fam.image_tokens(h, w, images_in_sample=len(sizes), sample=sample, field=f"images[{i}]")
            for i, (h, w) in enumerate(sizes)
        ]
        images, videos = iter(counts), iter(fam.video_tokens(n) for n in frames)
        segments: list[tuple] = []
        seen = {IMAGE_PLACEHOLDER: 0, VIDEO_PLACEHOLDER: 0}

        def media_block(kind: str) -> tuple:
            seen[kind] += 1
            n = next(images if kind == IMAGE_PLACEHOLDER else videos, None)
            token = tok.image_token_id if kind == IMAGE_PLACEHOLDER else fam.video_token_id
            return ([token] * (0 if n is None else n), False)

        turns = chat_turns(meta, sample)
        if turns is None:
            for part in _SPLIT.split(
                meta["text"]
            ):  # plain text: the media where the text names them
                segments.append(media_block(part) if part in seen else (part, True))
        else:
            for i, turn in enumerate(turns):
                check_turn(turn, i, sample)
                reply = turn["role"] == "assistant"
                parts = [p for p in _SPLIT.split(turn["content"]) if p]
                segments += [([tok.im_start_id], False), (turn["role"] + " ", False)]
                segments += [
                    media_block(p) for p in parts if p == IMAGE_PLACEHOLDER
                ]  # the template: images,
                segments += [
                    media_block(p) for p in parts if p == VIDEO_PLACEHOLDER
                ]  # then videos, then text
                segments += [("\n" + p, reply) for p in parts if p not in seen]
                segments.append(([tok.im_end_id], reply))
        named = (seen[IMAGE_PLACEHOLDER], seen[VIDEO_PLACEHOLDER])
        if named != (len(sizes), len(frames)):
            raise placeholder_mismatch(len(sizes), len(frames), named, sample=sample)
        return segments

    def index_key(self) -> str:
        """What a sample's length depends on (an index sidecar's key): the tokenizer (ids and a
        probe encoding), the family (tile size, pinpoints, ``anyres_max``, feature strategy),
        teacher K."""
        tok = self.tokenizer
        probe = np.asarray(tok.encode("prealign probe:\n\n <image> Hello, world!")).tolist()
        return json.dumps(
            {
                "llava_onevision": {
                    "tokenizer": f"{type(tok).__module__}.{type(tok).__qualname__}",
                    "vocab_size": int(tok.vocab_size),
                    "probe": probe,
                    "family": repr(self.family),
                    "turn": [tok.im_start_id, tok.im_end_id],
                    "topk": self.topk,
                    "text_key": self.text_key,
                    "video_sampling": self.frame_sampling.key(),
                }
            },
            sort_keys=True,
        )

    def header_ids(
        self, raw: dict, sizes: list[tuple[int, int]] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(``input_ids``, ``loss_mask``) from the images' header sizes alone (upright by EXIF, as
        decoded; or ``sizes``, ``(height, width)`` per image, where the caller has read them): what
        :meth:`__call__` writes, without decoding a pixel (what an index pass needs)."""
        key = raw.get("__key__", "?")
        meta = sample_metadata(raw, self.text_key, key)
        frames = [self._frame_count(video, key) for video in self.video_frames(raw, meta, key)]
        if sizes is None:
            sizes = [
                self._header_size(name, value, key) for name, value in image_members(raw, meta, key)
            ]
        return encode_segments(self.tokenizer, self.segments(meta, sizes, frames, sample=key))

    def video_frames(self, raw: dict, meta: dict, key) -> list[VideoEntry]:
        """The sample's videos (frame lists and video files), in placeholder order."""
        return video_members(raw, meta, key, limits=self.limits)

    def _frame_count(self, video: VideoEntry, key) -> int:
        """A video's frames as the processor keeps them: a frame list's (their pixels summed from
        their headers, checked against ``limits.max_video_pixels``), or a file's kept frames from
        its headers (nothing decoded)."""
        if video.frames is not None:
            area = 0
            for name, value in video.frames:
                h, w = self._header_size(name, value, key)
                area += h * w
                check_video_pixels(video.name, area, key, self.limits)
            return len(video.frames)
        return len(file_plan(video, self.frame_sampling.indices, key, self.limits)[1])

    @property
    def video_settings(self) -> tuple:
        """``(tile, mean, std, rescale_factor)`` of the frames: the processor's video processor
        where it has one, else the image processor's (transformers' LLaVA-OneVision video processor
        has the same defaults)."""
        video = getattr(self.processor, "video_processor", None) or self.image_processor
        size = video.size
        get = size.get if isinstance(size, dict) else (lambda k, d=None: getattr(size, k, d))
        return (
            (int(get("height")), int(get("width"))),
            tuple(float(v) for v in video.image_mean),
            tuple(float(v) for v in video.image_std),
            float(video.rescale_factor),
        )

    def video_pixels(self, frames: list) -> torch.Tensor:
        """A video's RGB PIL frames -> float32 ``[frames, 3, s, s]``, as transformers' video
        processors make them: each frame resized by torch's bicubic with antialias on uint8, rescale
        fused into normalize."""
        size = self.video_settings[0]
        return self.normalize_frames(
            torch.cat(
                [
                    resize_frames(torch.from_numpy(np.array(im)).permute(2, 0, 1)[None], size)
                    for im in frames
                ]
            ).numpy()
        )

    def file_pixels(self, video: VideoEntry, key) -> torch.Tensor:
        """A video file -> float32 ``[kept frames, 3, s, s]``: its kept frames decoded (each
        resized as it leaves the decoder) and normalised as :meth:`video_pixels`; with
        ``decode_videos=False`` zeros of that shape, nothing decoded."""
        size = self.video_settings[0]
        header, indices = file_plan(video, self.frame_sampling.indices, key, self.limits)
        if not self.decode_videos:
            return torch.zeros(len(indices), 3, *size)
        return self.normalize_frames(
            decode_kept(video, header, indices, size, key, self.limits, threads=self.decode_threads)
        )

    def normalize_frames(self, codes: np.ndarray) -> torch.Tensor:
        """uint8 ``[n, 3, s, s]`` resized frames -> float32: rescale fused into normalize, one
        table lookup per value."""
        _, mean, std, rescale = self.video_settings
        table = fused_normalize_table(mean, std, rescale)
        offsets = (np.arange(3, dtype=np.uint16) * 256).reshape(1, 3, 1, 1)
        return torch.from_numpy(np.take(table, np.add(codes, offsets, dtype=np.uint16)))

    @staticmethod
    def _header_size(name: str, value, key) -> tuple[int, int]:
        if isinstance(value, dict) and "bytes" in value:
            value = value["bytes"]
        if hasattr(value, "size") and not isinstance(
            value, (bytes, bytearray, memoryview)
        ):  # a PIL image
            w, h = value.size
            return int(h), int(w)
        try:
            w, h = image_header_size(value, field=name, sample=key)
        except HeaderError as exc:
            raise MediaError.from_check(
                MediaProblem.CORRUPT_IMAGE, exc, sample=key, field=name
            ) from None
        return h, w

    def pixels(self, images: list, *, sample) -> torch.Tensor:
        """RGB PIL images of one sample -> float32 ``[tiles, 3, s, s]``: the image processor run on
        them as one prompt's images, each image's rows without the processor's batch padding."""
        fam = self.family
        if not images:
            return torch.zeros(0, 3, fam.tile_size, fam.tile_size)
        try:
            out = self.image_processor([images], return_tensors="pt")
        except ValueError as exc:
            raise refused_images(
                "the LLaVA-OneVision image processor", str(exc), sample=sample
            ) from None
        values = out["pixel_values"].to(torch.float32)  # [images, most tiles, 3, s, s]
        tiles = [fam.tiles(im.height, im.width, images_in_sample=len(images)) for im in images]
        if values.shape[:2] != (len(images), max(tiles)):
            raise MediaError(
                MediaProblem.VISION_TOKEN_MISMATCH,
                sample=sample,
                field="pixel_values",
                expected=f"{len(images)} images of at most {max(tiles)} tiles {tiles}",
                actual=f"shape {tuple(values.shape)}",
            )
        return torch.cat([values[i, :n] for i, n in enumerate(tiles)])

    def __call__(self, raw: dict) -> dict:
        key = raw.get("__key__", "?")
        meta = sample_metadata(raw, self.text_key, key)
        images = decode_images(raw, meta, key, self.limits)
        clips = [
            self.file_pixels(video, key)
            if video.frames is None
            else self.video_pixels(decode_frame_list(video, key, self.limits))
            for video in self.video_frames(raw, meta, key)
        ]
        sizes = [(im.height, im.width) for im in images]
        try:
            ids, mask = encode_segments(
                self.tokenizer, self.segments(meta, sizes, [c.shape[0] for c in clips], sample=key)
            )
        except SampleError as exc:
            if isinstance(exc, MediaError):
                raise
            raise MediaError.from_check(
                MediaProblem.CORRUPT_IMAGE, exc, sample=key, field=exc.field
            ) from None
        input_ids = torch.from_numpy(ids)
        types = (input_ids == self.family.image_token_id).to(torch.int64)
        types[input_ids == self.family.video_token_id] = VIDEO_TOKEN_TYPE
        dtype, (h, w) = getattr(torch, self.pixel_dtype), self.video_settings[0]
        out = {
            "__key__": key,
            "input_ids": input_ids,
            "loss_mask": torch.from_numpy(mask),
            "mm_token_type_ids": types,
            "pixel_values": self.pixels(images, sample=key).to(dtype),
            "pixel_values_videos": (torch.cat(clips) if clips else torch.zeros(0, 3, h, w)).to(
                dtype
            ),
            "video_num_frames": torch.tensor([c.shape[0] for c in clips], dtype=torch.int64),
            "image_sizes": torch.tensor(sizes, dtype=torch.int64).reshape(-1, 2),
            "batch_num_images": torch.tensor([len(images)] if images else [], dtype=torch.int64),
        }
        return with_teacher_topk(out, raw, self)
