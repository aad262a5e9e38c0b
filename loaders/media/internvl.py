"""InternVL 3 / 3.5 samples, raw -> model-ready (:mod:`prealign.collate.vision.internvl` holds the tiling rule).

    raw sample (as for every family)              VLMSampleTransform(model_config=InternVLConfig(...))(raw)
    json  {"messages": [...], "images": [...],    input_ids          int64   [L]
           "videos": [{"frames": [...]}]}         loss_mask          float32 [L]
    0.jpg, v0_0.jpg, ...                   ---->  mm_token_type_ids  int64   [L]  1 on every <IMG_CONTEXT>
                                                  pixel_values       float   [tiles, 3, 448, 448]
                                                  image_num_patches  int64   [blocks]  tiles per <img> block

Each ``<image>`` becomes ``<img>`` + ``256 * tiles`` x ``<IMG_CONTEXT>`` + ``</img>`` (the tiles of
transformers' GotOcr2 image processor with ``crop_to_patches``: the canvas tiles plus a thumbnail); each
``<video>`` becomes ``Frame1: <img>...</img>\\nFrame2: <img>...</img>...``, one tile per frame. The tiles of images
and frames are concatenated in the order the text names them, as ``InternVLProcessor`` does. There are no
``mrope_position_ids``: positions are 1-D (``position_ids`` restarting per sequence, from the collator).

The tokenizer is the model's (wrapped by :class:`~prealign.loaders.media.chat_tokenizer.HFChatTokenizer` with
``vision_start="<img>"``, ``vision_end="</img>"``, ``image_pad="<IMG_CONTEXT>"``; :func:`internvl_chat_tokenizer`
does it). Video frames are resized by the image processor (PIL bicubic) to one tile; transformers' InternVL
video processor (torchvision) resizes with its own kernel, so video pixels are close to, not bit-equal with, it.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np
import torch

from prealign.collate.vision.internvl import InternVL
from prealign.schemas.errors import ConfigError

IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER = "<image>", "<video>"
_ORDER = re.compile(re.escape(IMAGE_PLACEHOLDER) + "|" + re.escape(VIDEO_PLACEHOLDER))


def internvl_chat_tokenizer(tokenizer):
    """A Hugging Face InternVL tokenizer as the transform's chat tokenizer (its ``<img>``, ``</img>``,
    ``<IMG_CONTEXT>`` and ``<video>`` tokens)."""
    from prealign.loaders.media.chat_tokenizer import HFChatTokenizer

    return HFChatTokenizer(tokenizer, vision_start="<img>", vision_end="</img>", image_pad="<IMG_CONTEXT>",
                           video_pad="<video>")


@functools.lru_cache(maxsize=4)
def _processor(options: tuple):
    try:  # transformers >= 5 without torchvision: the PIL backend
        from transformers import GotOcr2ImageProcessorPil as cls
    except ImportError:  # pragma: no cover - older transformers
        from transformers import GotOcr2ImageProcessor as cls
    return cls(**{k: dict(v) if k == "size" else v for k, v in options})


def internvl_image_processor(family: InternVL, **options):
    """transformers' GotOcr2 image processor as InternVL's checkpoints configure it (``tile_size`` square tiles,
    ``crop_to_patches``, 1 to 12 tiles), overridden by ``options``; built locally, cached per process."""
    settings = {"size": {"height": family.tile_size, "width": family.tile_size}, "crop_to_patches": True,
                "min_patches": 1, "max_patches": 12, **options}
    return _processor(tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, dict) else v)
                                   for k, v in settings.items())))


def tiling_family(family: InternVL, image_processor) -> InternVL:
    """``family`` with the tiling settings of the image processor that runs (its ``size``, ``crop_to_patches``,
    ``min_patches``, ``max_patches``): what header-only lengths must use to match the pixels."""
    size = image_processor.size
    get = size.get if isinstance(size, dict) else (lambda k, d=None: getattr(size, k, d))
    if get("height") != get("width"):
        raise ConfigError(f"InternVL: expected square tiles, the image processor's size is {size}")
    return dataclasses.replace(family, tile_size=int(get("height")), crop_to_patches=bool(image_processor.crop_to_patches),
                               min_tiles=int(image_processor.min_patches), max_tiles=int(image_processor.max_patches))


def media_order(meta: dict) -> list[str]:
    """``"image"`` / ``"video"`` for each placeholder, in the order the rendered text holds them."""
    texts = [meta["text"]] if isinstance(meta.get("text"), str) and not isinstance(meta.get("messages"), list) else \
        [t.get("content", "") for t in meta.get("messages", []) if isinstance(t, dict)]
    return [m.group(0)[1:-1] for text in texts if isinstance(text, str) for m in _ORDER.finditer(text)]


def video_ids(tokenizer, family: InternVL, frames: int) -> np.ndarray:
    """int64 ids of a video of ``frames`` frames: ``Frame{i}: <img>`` + ``image_seq_length`` x ``<IMG_CONTEXT>`` +
    ``</img>``, the frames joined by ``\\n`` (encoded with the next frame's label, as one text run)."""
    block = [tokenizer.vision_start_token_id, *([tokenizer.image_token_id] * family.image_seq_length),
             tokenizer.vision_end_token_id]
    parts = []
    for i in range(frames):
        parts += [tokenizer.encode(("\n" if i else "") + family.frame_text(i)), block]
    return np.concatenate(parts).astype(np.int64)


def image_tiles(images: list, processor, *, sample) -> tuple[torch.Tensor, list[int]]:
    """RGB PIL images -> (``pixel_values`` float32 ``[tiles, 3, s, s]``, tiles per image), the processor run as is."""
    from prealign.loaders.media.vlm import MediaError, MediaProblem

    if not images:
        s = int(processor.size["height"] if isinstance(processor.size, dict) else processor.size.height)
        return torch.zeros(0, 3, s, s), []
    try:
        out = processor(images=images, return_tensors="pt")
    except ValueError as exc:
        raise MediaError(MediaProblem.CORRUPT_IMAGE, sample=sample, field="images",
                         expected="images the InternVL image processor accepts", actual=str(exc)) from None
    return out["pixel_values"].to(torch.float32), [int(n) for n in out["num_patches"]]


def internvl_compact(t, raw: dict) -> dict:
    """The sample of an InternVL :class:`~prealign.loaders.media.vlm.VLMSampleTransform` ``t`` (module docstring)."""
    from prealign.loaders.media.teacher_topk import teacher_topk
    from prealign.loaders.media.vlm import (
        MediaError,
        MediaProblem,
        decode_image,
        image_members,
        render_chat,
        sample_metadata,
        video_members,
    )

    key = raw.get("__key__", "?")
    fam, tok = t.family, t.tokenizer
    check_tokenizer(tok, fam)
    meta = sample_metadata(raw, t.text_key, key)
    images = [decode_image(v, sample=key, name=n, limits=t.limits) for n, v in image_members(raw, meta, key)]
    processor = t.image_processor
    pixels, tiles = image_tiles(images, processor, sample=key)
    clips, clip_ids = [], []
    for name, frames, _fps in video_members(raw, meta, key, default_fps=t.video_fps, limits=t.limits):
        decoded = [decode_image(v, sample=key, name=n, limits=t.limits) for n, v in frames]
        out = processor(images=decoded, crop_to_patches=False, return_tensors="pt")
        clips.append(out["pixel_values"].to(torch.float32))
        clip_ids.append(video_ids(tok, fam, len(decoded)))
    ids, mask = render_chat(meta, tok, [n * fam.image_seq_length for n in tiles], sample=key, videos=clip_ids)
    order = media_order(meta)
    if order.count("image") != len(tiles) or order.count("video") != len(clips):
        raise MediaError(MediaProblem.PLACEHOLDER_MISMATCH, sample=key, field="json",
                         expected=f"{len(tiles)} '<image>' and {len(clips)} '<video>' placeholders",
                         actual=f"{order.count('image')} and {order.count('video')}")
    image_starts = np.concatenate(([0], np.cumsum(tiles))).astype(int)
    blocks, counts, i, v = [], [], 0, 0
    for kind in order:  # tiles in the order the text names them, as InternVLProcessor concatenates them
        if kind == "image":
            blocks.append(pixels[image_starts[i]:image_starts[i + 1]])
            counts.append(tiles[i])
            i += 1
        else:
            blocks.append(clips[v])
            counts += [1] * clips[v].shape[0]
            v += 1
    input_ids = torch.from_numpy(ids)
    types = (input_ids == fam.image_token_id).to(torch.int64)
    want = fam.image_seq_length * sum(counts)
    if int(types.sum()) != want:
        raise MediaError(MediaProblem.VISION_TOKEN_MISMATCH, sample=key, field="input_ids",
                         expected=f"{want} <IMG_CONTEXT> tokens ({fam.image_seq_length} per tile)",
                         actual=f"{int(types.sum())}")
    out = {"__key__": key, "input_ids": input_ids, "loss_mask": torch.from_numpy(mask), "mm_token_type_ids": types,
           "pixel_values": (torch.cat(blocks) if blocks else pixels).to(getattr(torch, t.pixel_dtype)),
           "image_num_patches": torch.tensor(counts, dtype=torch.int64)}
    if t.topk is not None:
        out.update(teacher_topk(raw, sample=key, length=input_ids.numel(), topk=t.topk,
                                vocab_size=tok.vocab_size, log_prob_dtype=getattr(torch, t.log_prob_dtype)))
    return out


def check_tokenizer(tokenizer, family: InternVL) -> None:
    """The tokenizer's ``<IMG_CONTEXT>`` id must be the config's ``image_token_id``."""
    if tokenizer.image_token_id != family.image_token_id:
        raise ConfigError(f"VLMSampleTransform: the internvl config's image_token_id {family.image_token_id} is not "
                          f"the tokenizer's image token {tokenizer.image_token_id}; wrap the tokenizer with "
                          "internvl_chat_tokenizer() (its <IMG_CONTEXT>)")

