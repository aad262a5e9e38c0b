"""The raw chat samples the family tests share: random PNGs; for the image-only families (SmolVLM /
Idefics3, Mistral3 / Pixtral) a webdataset-style sample of a conversation, the hypothesis text of
its turns and the three conversations of the in-model checks; for the families with video
(InternVL, GLM-4V) a question about images and frame videos, with what transformers' processor
takes of it."""

from __future__ import annotations

import io
import json
import re

import numpy as np
from hypothesis import strategies as st

PIECES = st.sampled_from(
    ["\n", "\n\n", " ", "a", "b", "hello", "world", ".", "?", " \n", "<image>"]
)
CHAT_TEXT = st.lists(PIECES, max_size=7).map("".join)
"""A turn's text: newlines, spaces, words and ``<image>`` placeholders."""

MODEL_CONVERSATIONS = (
    [
        {"role": "user", "content": "what <image> is it?"},
        {"role": "assistant", "content": "a cat."},
    ],
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "\n\nworld ."}],
    [{"role": "user", "content": "<image>a b<image>"}, {"role": "assistant", "content": "c ?"}],
)
"""One image, none, two: the samples of the packed-logits checks."""


def sized_png(rng: np.random.Generator, w: int, h: int) -> bytes:
    """A ``w x h`` PNG of random pixels drawn from ``rng``."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def png(seed: int, lo: int = 4, hi: int = 150) -> bytes:
    """A PNG of random pixels, each side in ``[lo, hi)`` (drawn from ``seed``)."""
    rng = np.random.default_rng(seed)
    w, h = int(rng.integers(lo, hi)), int(rng.integers(lo, hi))
    return sized_png(rng, w, h)


def raw_sample(messages, images, key: str = "s") -> dict:
    """A webdataset-style sample: ``json`` the conversation, ``<i>.png`` the images in order."""
    return {
        "__key__": key,
        "json": json.dumps({"messages": messages}).encode(),
        **{f"{i}.png": b for i, b in enumerate(images)},
    }


def image_items(text: str) -> list[dict]:
    """A turn's text as the content items of transformers' chat templates: ``<image>`` an image
    item, the rest text items."""
    return [
        {"type": "image"} if p == "<image>" else {"type": "text", "text": p}
        for p in re.split("(<image>)", text)
        if p
    ]


def model_samples(transform, *, hi: int, key: str = "s") -> list[dict]:
    """:data:`MODEL_CONVERSATIONS` through ``transform``, their images PNGs of sides in ``[8,
    hi)``."""
    return [
        transform(
            raw_sample(
                m,
                [png(11 + 3 * i + j, 8, hi) for j in range(m[0]["content"].count("<image>"))],
                key,
            )
        )
        for i, m in enumerate(MODEL_CONVERSATIONS)
    ]


def media_sample(
    key: str, sizes, question: str, reply: str, seed: int, *, videos=(), newline: bool = False
) -> tuple:
    """(raw sample for prealign, chat messages for transformers, PIL images, PIL frame lists) of a
    user turn naming its videos, then its images, then ``question`` (each placeholder followed by a
    newline when ``newline``), and an assistant ``reply``. ``sizes``: the images' ``(w, h)``;
    ``videos``: ``(frames, w, h, fps)`` each (``fps`` ``None``: not recorded); pixels drawn from
    ``seed``, images first."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    members = {f"{i}.png": sized_png(rng, w, h) for i, (w, h) in enumerate(sizes)}
    end = "\n" if newline else ""
    meta = {
        "messages": [
            {
                "role": "user",
                "content": f"<video>{end}" * len(videos) + f"<image>{end}" * len(sizes) + question,
            },
            {"role": "assistant", "content": reply},
        ],
        "images": list(members),
    }
    clips = []
    if videos:
        meta["videos"] = []
        for v, (n, w, h, fps) in enumerate(videos):
            names = [f"v{v}_{j}.png" for j in range(n)]
            members.update({name: sized_png(rng, w, h) for name in names})
            meta["videos"].append(
                {"frames": names} if fps is None else {"frames": names, "fps": fps}
            )
            clips.append([Image.open(io.BytesIO(members[n])).convert("RGB") for n in names])
    content = (
        [{"type": "video"}] * len(videos)
        + [{"type": "image"}] * len(sizes)
        + [{"type": "text", "text": question}]
    )
    images = [Image.open(io.BytesIO(members[f"{i}.png"])).convert("RGB") for i in range(len(sizes))]
    return (
        {"__key__": key, "json": json.dumps(meta), **members},
        [{"role": "user", "content": content}, {"role": "assistant", "content": reply}],
        images,
        clips,
    )
