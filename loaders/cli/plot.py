"""A PNG of packed THD micro-batches: sequences, padding, image tokens and the CP zigzag chunks
each rank keeps, drawn with PIL only (no matplotlib).

One panel per micro-batch::

    global [1, T]   |seq0 text|img|text..pad|seq1 ....pad|seq2 ..|  one colour per sequence,
    owner           |r0 |r1 |r1 |r0 |r0|r1|r1|r0|...                image tokens darker, pads grey
    cp rank 0       |chunks 0 and 3 of every sequence|               T/cp slots; the dashed line
    cp rank 1       |chunks 1 and 2 of every sequence|               is the SP split over tp

Pixels per slot are the same in every row of a panel, so a rank's row is ``1/cp`` of the global one.
"""

from __future__ import annotations

import colorsys
from dataclasses import dataclass

import numpy as np
import torch

from prealign.collate.indices import cp_chunks, cu_seqlens_to_lengths, global_slots
from prealign.schemas.layout import ParallelLayout

_BG, _INK, _PAD, _HATCH = (255, 255, 255), (30, 30, 30), (205, 205, 205), (90, 90, 90)
_PAD_MIN_PX = 3
_LEGEND_LINE = 20
_RANK_COLORS = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
)


@dataclass(frozen=True)
class Panel:
    """One micro-batch to draw (global offsets, as every CP rank's batch carries them)."""

    cu_seqlens: torch.Tensor
    """int32 ``[N+1]`` true offsets."""
    cu_seqlens_padded: torch.Tensor
    """int32 ``[N+1]`` padded offsets; ``T = cu_seqlens_padded[-1]``."""
    image_mask: torch.Tensor | None = None
    """bool ``[T]``: image tokens of the whole packed sequence (optional)."""
    title: str = ""


def _seq_colors(n: int) -> np.ndarray:
    """uint8 ``[n, 3, 3]``: per sequence (text, image, pad) colours; hues spread by the golden
    ratio, image tokens darker, padding one neutral grey."""
    out = np.empty((n, 3, 3), dtype=np.uint8)
    out[:, 2] = _PAD
    for i in range(n):
        h = (0.13 + i * 0.618034) % 1.0
        for j, (light, sat) in enumerate(((0.62, 0.55), (0.36, 0.7))):
            out[i, j] = [int(255 * c) for c in colorsys.hls_to_rgb(h, light, sat)]
    return out


def slot_kinds(panel: Panel) -> torch.Tensor:
    """int64 ``[T]``: what every global slot holds, 0 text, 1 image token, 2 padding. Vectorised."""
    cu = panel.cu_seqlens.to(torch.int64)
    cup = panel.cu_seqlens_padded.to(torch.int64)
    padded = cu_seqlens_to_lengths(cup)
    seq = torch.repeat_interleave(torch.arange(padded.numel()), padded)
    pos = torch.arange(int(cup[-1])) - cup[:-1][seq]
    kind = (pos >= cu.diff()[seq]).to(torch.int64) * 2  # 0 text, 2 pad
    if panel.image_mask is not None:
        kind = torch.where(panel.image_mask.reshape(-1).bool(), 1, kind)
    return kind


def slot_colors(panel: Panel) -> np.ndarray:
    """uint8 ``[T, 3]``: the colour of every global slot (sequence hue; darker on image tokens,
    grey on padding). Vectorised."""
    padded = cu_seqlens_to_lengths(panel.cu_seqlens_padded.to(torch.int64))
    seq = torch.repeat_interleave(torch.arange(padded.numel()), padded)
    return _seq_colors(padded.numel())[seq.numpy(), slot_kinds(panel).numpy()]


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of True in ``mask``."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def _hatched(width: int, height: int):
    """A PIL image of grey padding with dark diagonal hatching."""
    from PIL import Image

    i, j = np.meshgrid(np.arange(height), np.arange(width), indexing="ij")
    px = np.where(
        ((i + j) % 5 == 0)[..., None], np.array(_HATCH, np.uint8), np.array(_PAD, np.uint8)
    )
    return Image.fromarray(np.ascontiguousarray(px.astype(np.uint8)), "RGB")


def _hatch_pads(img, pads: np.ndarray, x0: int, y: int, scale: float, bar_h: int) -> None:
    """Padding drawn hatched and at least ``_PAD_MIN_PX`` wide, so that a pad of a few slots among
    thousands stays visible."""
    for a, b in _runs(pads):
        xa = x0 + round(a * scale)
        xb = max(x0 + round(b * scale), xa + _PAD_MIN_PX)
        img.paste(_hatched(xb - xa, bar_h), (xa, y))


def _bar(colors: np.ndarray, width: int, height: int):
    from PIL import Image

    img = Image.fromarray(np.ascontiguousarray(colors[None, :, :].repeat(height, 0)), "RGB")
    return img.resize((max(1, width), height), Image.NEAREST)


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1
        return ImageFont.load_default()


def draw_packed_layout(
    panels: list[Panel], layout: ParallelLayout, path: str, *, title: str = "", width: int = 1100
) -> str:
    """Draw ``panels`` (micro-batches) under ``layout`` to a PNG at ``path``; returns ``path``."""
    from PIL import Image, ImageDraw

    cp = layout.cp
    left, bar_h, gap = 130, 26, 6
    panel_h = 22 + bar_h + 8 + gap + cp * (bar_h + gap) + 18
    legend_h = 3 * _LEGEND_LINE + 10
    height = 40 + len(panels) * panel_h + legend_h
    img = Image.new("RGB", (left + width + 20, height), _BG)
    draw = ImageDraw.Draw(img)
    font, small = _font(15), _font(12)
    draw.text((10, 10), title, fill=_INK, font=font)
    y = 40
    total_max = max(int(p.cu_seqlens_padded[-1]) for p in panels)
    scale = width / total_max
    for p in panels:
        y = _draw_panel(img, draw, p, layout, y, left, scale, bar_h, gap, small)
        y += 18
    _legend(img, draw, 10, y, small, layout)
    img.save(path, format="PNG")
    return path


def _draw_panel(
    img,
    draw,
    p: Panel,
    layout: ParallelLayout,
    y: int,
    left: int,
    scale: float,
    bar_h: int,
    gap: int,
    font,
) -> int:
    cp, tp = layout.cp, layout.tp
    cup = p.cu_seqlens_padded.to(torch.int64)
    total = int(cup[-1])
    colors = slot_colors(p)
    pads = (slot_kinds(p) == 2).numpy()
    draw.text((left, y), p.title, fill=_INK, font=font)
    y += 20
    w = round(total * scale)
    img.paste(_bar(colors, w, bar_h), (left, y))
    _hatch_pads(img, pads, left, y, scale, bar_h)
    draw.text((10, y + 6), f"global [1, {total}]", fill=_INK, font=font)
    for b in cup.tolist()[1:-1]:  # sequence boundaries
        x = left + round(b * scale)
        draw.line([(x, y), (x, y + bar_h - 1)], fill=_INK, width=1)
    owner_y = y + bar_h + 2
    padded = cu_seqlens_to_lengths(cup)
    rank_rows = [global_slots(cp_chunks(padded, layout, r), cup) for r in range(cp)]
    strip = np.zeros((total, 3), dtype=np.uint8)
    for r, rows in enumerate(rank_rows):
        strip[rows.numpy()] = _RANK_COLORS[r % len(_RANK_COLORS)]
    img.paste(_bar(strip, w, 6), (left, owner_y))
    y = owner_y + 6 + gap + 2
    for r, rows in enumerate(rank_rows):
        local = rows.numel()
        lw = round(local * scale)
        img.paste(_bar(colors[rows.numpy()], lw, bar_h), (left, y))
        _hatch_pads(img, pads[rows.numpy()], left, y, scale, bar_h)
        draw.rectangle(
            [(left - 1, y - 1), (left + lw, y + bar_h)],
            outline=_RANK_COLORS[r % len(_RANK_COLORS)],
            width=1,
        )
        draw.text(
            (10, y + 6),
            f"cp rank {r} [1, {local}]",
            fill=_RANK_COLORS[r % len(_RANK_COLORS)],
            font=font,
        )
        # chunk boundaries inside the rank's row, then the SP split over tp
        starts = torch.nonzero(torch.diff(rows, prepend=rows[:1] - 2) != 1).flatten().tolist()[1:]
        for s in starts:
            x = left + round(s * scale)
            draw.line([(x, y), (x, y + bar_h - 1)], fill=_BG, width=1)
        for k in range(1, tp if layout.sp else 1):
            x = left + round(k * local / tp * scale)
            for yy in range(y - 3, y + bar_h + 3, 6):
                draw.line([(x, yy), (x, yy + 3)], fill=_INK, width=2)
        draw.text(
            (left + lw + 8, y + 6),
            f"{local // tp} rows per tp rank" if layout.sp else "",
            fill=_INK,
            font=font,
        )
        y += bar_h + gap
    return y


def _legend(img, draw, x: int, y: int, font, layout: ParallelLayout) -> None:
    """Three lines: what the colours are, who keeps which chunk, and why a sequence shows twice per
    rank."""
    cp = layout.cp
    colors = _seq_colors(3)

    def swatch(x: int, color) -> int:
        draw.rectangle(
            [(x, y + 2), (x + 12, y + 14)], fill=tuple(int(v) for v in color), outline=_INK
        )
        return x + 14

    def label(x: int, text: str) -> int:
        draw.text((x + 4, y), text, fill=_INK, font=font)
        return x + 4 + int(draw.textlength(text, font=font)) + 22

    for i in range(3):
        x = swatch(x, colors[i, 0])
    x = label(x, "text tokens: one hue per sequence")
    for i in range(3):
        x = swatch(x, colors[i, 1])
    x = label(x, "image tokens: a darker shade of their sequence's hue")
    img.paste(_hatched(12, 13), (x, y + 2))
    label(x + 12, f"padding (hatched, drawn at least {_PAD_MIN_PX} px wide)")
    x, y = 10, y + _LEGEND_LINE
    for r in range(cp):
        x = label(swatch(x, _RANK_COLORS[r % len(_RANK_COLORS)]), f"kept by cp rank {r}")
    label(
        x - 18,
        "|  black bars: sequence boundaries, white ticks: chunk boundaries, dashed: SP split over "
        "tp",
    )
    if cp > 1:
        zigzag = str(getattr(layout.cp_layout, "value", layout.cp_layout)) == "zigzag"
        note = (
            f"zigzag CP: each padded sequence is cut into {2 * cp} chunks and cp rank r keeps "
            f"chunks r and "
            f"{2 * cp - 1}-r, so every sequence appears twice in each rank's row (its two chunks)"
            if zigzag
            else f"contiguous CP: each padded sequence is cut into {cp} chunks and cp rank r "
            f"keeps chunk r"
        )
        draw.text((10, y + _LEGEND_LINE), note, fill=_INK, font=font)
