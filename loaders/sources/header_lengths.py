"""Sizes from headers alone: what an index needs to know of a member without decoding it.

    .npy bytes  --npy_header-->          shape, dtype     (the header only; never unpickled)
    image bytes --image_header_size-->   (width, height)  (PIL's lazy open of the allowed formats)
    (h, w)      --qwen2vl_grid-->        (t, gh, gw)      (the Qwen2-VL processor's resize rule)
                --tokens_of_grid-->      t*gh*gw / merge**2 image tokens

A length then costs a few hundred bytes of header instead of a decode: ``qwen2vl_grid`` gives
exactly the ``image_grid_thw`` row transformers' Qwen2-VL image processor produces for an image of
that size (tested on random sizes and on the demo's images).
"""

from __future__ import annotations

import io
import warnings
from typing import TYPE_CHECKING

import numpy as np

from prealign.loaders.sources.npy import NpyFormatError, parse_npy_header
from prealign.loaders.sources.tar_decode import IMAGE_FORMATS
from prealign.schemas.errors import SampleError

if TYPE_CHECKING:
    from prealign.collate.vision import VisionGeometry


class HeaderError(SampleError):
    """A member's header is unreadable or describes something we refuse (not an npy array, an image
    format outside :data:`IMAGE_FORMATS`, a size past a cap)."""


def npy_header(
    data: bytes | memoryview, *, field: str = "npy", sample=None
) -> tuple[tuple[int, ...], np.dtype]:
    """The ``(shape, dtype)`` an ``.npy`` member declares, read from its header only.

    The one parser of :mod:`~prealign.loaders.sources.npy` (object dtypes, which would need
    unpickling, and dtypes torch does not hold are refused); the data is not touched, so this costs
    the same for 10 tokens as for 10 million.

    >>> buf = io.BytesIO(); np.save(buf, np.arange(6, dtype=np.int32).reshape(2, 3))
    >>> npy_header(buf.getvalue())
    ((2, 3), dtype('int32'))
    """
    try:
        header = parse_npy_header(data, member=field)
    except NpyFormatError as exc:
        raise HeaderError(
            sample=sample,
            field=field,
            expected="an .npy header of a numeric array",
            actual=str(exc),
        ) from None
    return header.shape, header.dtype


def image_header_size(
    data: bytes | memoryview,
    *,
    field: str = "image",
    sample=None,
    formats: tuple[str, ...] = IMAGE_FORMATS,
) -> tuple[int, int]:
    """``(width, height)`` of an encoded image as decoded upright: from its header (PIL's lazy open:
    no pixel is decoded), width and height swapped when its EXIF orientation turns it by 90 degrees
    (5-8), as :func:`~prealign.loaders.sources.tar_decode.open_image` does. A PNG's orientation is
    read when its ``eXIf`` chunk precedes the pixels, as the PNG specification asks (one after them
    is not looked for); a TIFF (rare in training sets) is decoded, since how its reader applies
    orientation varies.

    >>> from PIL import Image
    >>> buf = io.BytesIO(); Image.new("RGB", (40, 30)).save(buf, format="PNG")
    >>> image_header_size(buf.getvalue())
    (40, 30)
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with warnings.catch_warnings():  # the size is what the caller caps; nothing is decoded here
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(bytes(data)), formats=list(formats)) as img:
                if (
                    img.format == "TIFF"
                ):  # how Pillow's TIFF reader applies orientation varies: decode (rare)
                    img.load()
                    return ImageOps.exif_transpose(img).size
                w, h = int(img.size[0]), int(img.size[1])
                return (h, w) if _orientation(img) in (5, 6, 7, 8) else (w, h)
    except (
        UnidentifiedImageError,
        Image.DecompressionBombError,
        OSError,
        ValueError,
        SyntaxError,
    ) as exc:
        raise HeaderError(
            sample=sample,
            field=field,
            expected=f"an image in one of {list(formats)}",
            actual=f"{len(data)} bytes ({type(exc).__name__}: {exc})",
        ) from None


_PNG_EXIF = frozenset({"exif", "Raw profile type exif", "xmp", "XML:com.adobe.xmp"})
"""PNG blocks that can carry an orientation (an ``eXIf`` chunk, ImageMagick's text profile, XMP)."""


def _orientation(img) -> int:
    """The EXIF orientation tag (1: upright) of a lazily opened image, from its header alone."""
    if img.format == "PNG" and not _PNG_EXIF.intersection(
        img.info
    ):  # getexif() would decode the pixels to look
        return 1  # further: a PNG with no EXIF or XMP block before its pixels is taken as upright
    try:
        return int(img.getexif().get(0x0112, 1))
    except (
        ValueError,
        TypeError,
        OSError,
        SyntaxError,
    ):  # a malformed EXIF block: PIL's transpose ignores it too
        return 1


def __getattr__(name: str):
    """``Qwen2VLGeometry``: the image processor settings that decide an image's grid (the family
    package's :class:`VisionGeometry`), imported on first use (this module is on the path of
    ``prealign index --text``, which imports no torch; the family package does)."""
    if name == "Qwen2VLGeometry":
        from prealign.collate.vision import VisionGeometry

        return VisionGeometry
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def qwen2vl_grid(
    height: int,
    width: int,
    geometry: VisionGeometry | None = None,
    *,
    sample=None,
    field: str = "image",
) -> tuple[int, int, int]:
    """``(t, gh, gw)``: the ``image_grid_thw`` row of one image of ``height x width`` pixels
    (:func:`prealign.collate.vision.image_grid`; an unusable size is a :class:`HeaderError`). Every
    Qwen family's images follow it; video grids are
    :meth:`prealign.collate.vision.VisionFamily.video_grid`.

    >>> qwen2vl_grid(480, 640)
    (1, 34, 46)
    >>> qwen2vl_grid(20, 20)   # scaled up to min_pixels
    (1, 4, 4)
    """
    from prealign.collate.vision import VisionGeometry, image_grid

    try:
        return image_grid(
            height,
            width,
            VisionGeometry() if geometry is None else geometry,
            sample=sample,
            field=field,
        )
    except SampleError as exc:
        raise HeaderError(
            sample=sample, field=field, expected=exc.expected, actual=exc.actual
        ) from None


def tokens_of_grid(grid: tuple[int, int, int], geometry: VisionGeometry | None = None) -> int:
    """Image tokens the LLM sees for one ``(t, gh, gw)`` grid: ``t*gh*gw / merge_size**2``.

    >>> tokens_of_grid((1, 34, 46))
    391
    """
    if geometry is None:
        from prealign.collate.vision import VisionGeometry

        geometry = VisionGeometry()
    t, gh, gw = grid
    return t * gh * gw // geometry.merge_size**2
