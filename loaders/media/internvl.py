"""InternVL 3 / 3.5 samples, raw -> model-ready (:mod:`prealign.collate.vision.internvl` holds the
tiling rule).

    raw sample (as for every family)            VLMSampleTransform(model_config=InternVLConfig(...))
    json  {"messages": [...], "images": [...],  input_ids          int64   [L]
           "videos": [{"frames": [...]}]}       loss_mask          float32 [L]
    0.jpg, v0_0.jpg, ...                 ---->  mm_token_type_ids  int64   [L]  1 on <IMG_CONTEXT>
                                                pixel_values       float   [tiles, 3, 448, 448]
                                                image_num_patches  int64   [blocks]  tiles per block

Each ``<image>`` becomes ``<img>`` + ``256 * tiles`` x ``<IMG_CONTEXT>`` + ``</img>`` (the tiles of
transformers' GotOcr2 image processor with ``crop_to_patches``: the canvas tiles plus a thumbnail);
each ``<video>`` becomes ``Frame1: <img>...</img>\\nFrame2: <img>...</img>...``, one tile per frame.
The tiles of images and frames are concatenated in the order the text names them, as
``InternVLProcessor`` does. There are no ``mrope_position_ids``: positions are 1-D (``position_ids``
restarting per sequence, from the collator).

The tokenizer is the model's (wrapped by
:class:`~prealign.loaders.media.chat_tokenizer.HFChatTokenizer` with ``vision_start="<img>"``,
``vision_end="</img>"``, ``image_pad="<IMG_CONTEXT>"``; :func:`internvl_chat_tokenizer` does it).
Video frames are resized by the image processor (PIL bicubic) to one tile; transformers' InternVL
video processor (torchvision) resizes with its own kernel, so video pixels are close to, not
bit-equal with, it.
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
    """A Hugging Face InternVL tokenizer as the transform's chat tokenizer (its ``<img>``,
    ``</img>``, ``<IMG_CONTEXT>`` and ``<video>`` tokens)."""
    from prealign.loaders.media.chat_tokenizer import HFChatTokenizer

    return HFChatTokenizer(
        tokenizer,
        vision_start="<img>",
        vision_end="</img>",
        image_pad="<IMG_CONTEXT>",
        video_pad="<video>",
    )


@functools.lru_cache(maxsize=4)
def _processor(options: tuple):
    try:  # transformers >= 5 without torchvision: the PIL backend
        from transformers import GotOcr2ImageProcessorPil as cls
    except ImportError:  # pragma: no cover - older transformers
        from transformers import GotOcr2ImageProcessor as cls
    return cls(**{k: dict(v) if k == "size" else v for k, v in options})


def internvl_image_processor(family: InternVL, **options):
    """transformers' GotOcr2 image processor as InternVL's checkpoints configure it (``tile_size``
    square tiles, ``crop_to_patches``, 1 to 12 tiles), overridden by ``options``; built locally,
    cached per process."""
    settings = {
        "size": {"height": family.tile_size, "width": family.tile_size},
        "crop_to_patches": True,
        "min_patches": 1,
        "max_patches": 12,
        **options,
    }
    return _processor(
        tuple(
            sorted(
                (k, tuple(sorted(v.items())) if isinstance(v, dict) else v)
                for k, v in settings.items()
            )
        )
    )


def tiling_family(family: InternVL, image_processor) -> InternVL:
    """``family`` with the tiling settings of the image processor that runs (its ``size``,
    ``crop_to_patches``, ``min_patches``, ``max_patches``): what header-only lengths must use to
    match the pixels."""
    size = image_processor.size
    get = size.get if isinstance(size, dict) else (lambda k, d=None: getattr(size, k, d))
    if get("height") != get("width"):
        raise ConfigError(f"InternVL: expected square tiles, the image processor's size is {size}")
    return dataclasses.replace(
        family,
        tile_size=int(get("height")),
        crop_to_patches=bool(image_processor.crop_to_patches),
        min_tiles=int(image_processor.min_patches),
        max_tiles=int(image_processor.max_patches),
    )


def media_order(meta: dict) -> list[str]:
    """``"image"`` / ``"video"`` for each placeholder, in the order the rendered text holds them."""
    texts = (
        [meta["text"]]
        if isinstance(meta.get("text"), str) and not isinstance(meta.get("messages"), list)
        else [t.get("content", "") for t in meta.get("messages", []) if isinstance(t, dict)]
    )
    return [
        m.group(0)[1:-1] for text in texts if isinstance(text, str) for m in _ORDER.finditer(text)
    ]


def video_ids(tokenizer, family: InternVL, frames: int) -> np.ndarray:
    """int64 ids of a video of ``frames`` frames: ``Frame{i}: <img>`` + ``image_seq_length`` x
    ``<IMG_CONTEXT>`` + ``</img>``, the frames joined by ``\\n`` (encoded with the next frame's
    label, as one text run)."""
    block = [
        tokenizer.vision_start_token_id,
        *([tokenizer.image_token_id] * family.image_seq_length),
        tokenizer.vision_end_token_id,
    ]
    parts = []
    for i in range(frames):
        parts += [tokenizer.encode(("\n" if i else "") + family.frame_text(i)), block]
    return np.concatenate(parts).astype(np.int64)


def image_tiles(images: list, processor) -> tuple[torch.Tensor, list[int]]:
    """RGB PIL images -> (``pixel_values`` float32 ``[tiles, 3, s, s]``, tiles per image), the
    processor run as is (its ``ValueError`` on an image it refuses passes through)."""
    if not images:
        s = int(
            processor.size["height"] if isinstance(processor.size, dict) else processor.size.height
        )
        return torch.zeros(0, 3, s, s), []
    out = processor(images=images, return_tensors="pt")
    return out["pixel_values"].to(torch.float32), [int(n) for n in out["num_patches"]]


def frame_tiles(frames: list, processor) -> torch.Tensor:
    """A video's RGB PIL frames -> float32 ``[frames, 3, s, s]``: each resized to one tile (no
    crop)."""
    return processor(images=frames, crop_to_patches=False, return_tensors="pt")["pixel_values"].to(
        torch.float32
    )


def arrange_tiles(
    order: list[str], pixels: torch.Tensor, tiles: list[int], clips: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images' and videos' tiles in the order the text names them (``order`` from
    :func:`media_order`), as ``InternVLProcessor`` concatenates them -> (``pixel_values`` ``[tiles,
    3, s, s]``, int64 tiles per ``<img>`` block: an image's tiles, 1 per video frame)."""
    starts = np.concatenate(([0], np.cumsum(tiles))).astype(int)
    blocks, counts, images, videos = [], [], iter(range(len(tiles))), iter(clips)
    for kind in order:
        if kind == "image":
            i = next(images)
            blocks.append(pixels[starts[i] : starts[i + 1]])
            counts.append(tiles[i])
        else:
            clip = next(videos)
            blocks.append(clip)
            counts += [1] * clip.shape[0]
    return (torch.cat(blocks) if blocks else pixels), torch.tensor(counts, dtype=torch.int64)


def check_tokenizer(tokenizer, family: InternVL) -> None:
    """The tokenizer's ``<IMG_CONTEXT>`` id must be the config's ``image_token_id``."""
    if tokenizer.image_token_id != family.image_token_id:
        raise ConfigError(
            f"VLMSampleTransform: the internvl config's image_token_id {family.image_token_id} is "
            f"not the tokenizer's image token {tokenizer.image_token_id}; wrap the tokenizer with "
            "internvl_chat_tokenizer() (its <IMG_CONTEXT>)"
        )
