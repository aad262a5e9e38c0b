"""Safe decoding of webdataset members: nothing is unpickled or executed.

A member ``dir/0001.input_ids.npy`` belongs to sample key ``dir/0001`` with extension
``input_ids.npy``; the decoder is chosen by the last dot-part (``npy``):

=========================  =========================================================================
extension (last part)      value
=========================  =========================================================================
json                       ``json.loads`` of UTF-8 text
txt, text                  ``str``
cls, cls2, index, inx, id  ``int`` (``str`` if not an integer)
npy                        ``numpy`` array of a dtype torch holds (no pickle; at most
                           ``max_array_bytes``)
npz                        ``dict`` of such arrays (every member checked before inflating)
jpg jpeg png webp bmp ...  ``PIL.Image`` (fully loaded) or raw ``bytes`` (``image="bytes"``)
pickle pkl pyd pth pt ...  refused: :class:`~prealign.loaders.errors.UnsafeMemberError`
anything else              raw ``bytes``
=========================  =========================================================================

Untrusted bytes get bounded work: images open only as :data:`IMAGE_FORMATS` (never PostScript /
EPS through Ghostscript, whatever the member is named) and their size is checked from the header
before any pixel is decoded (:attr:`DecodeLimits.max_image_pixels`); arrays' declared sizes (the
``.npy`` header's shape x itemsize, each ``.npz`` entry's size in the zip directory and in its own
header) are checked before anything is inflated (:attr:`DecodeLimits.max_array_bytes`). Bombs are
bad samples (``corrupt_image``, ``array_too_large``), counted by the loader's bad-data policy.
"""

from __future__ import annotations

import functools
import io
import json
import re
import struct
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from prealign.loaders.errors import BadSampleError, UnsafeMemberError
from prealign.loaders.sources.npy import ArrayTooLarge, read_npy, read_npz
from prealign.schemas.checks import int_at_least
from prealign.schemas.errors import ConfigError

UNSAFE = frozenset(
    {"pickle", "pkl", "pyd", "pth", "pt", "ckpt", "joblib", "dill", "mp", "msgpack_pickle"}
)
IMAGES = frozenset(
    {"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm", "pbm", "pnm"}
)
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF", "PPM")
"""The only formats PIL may open (any image member may hold any of them: datasets mislabel PNGs
as ``.jpg``); everything else (EPS/PostScript, PSD, ...) is ``corrupt_image``."""
_KEY_EXT = re.compile(r"^((?:.*/)?[^./][^/.]*)\.([^/]+)$")


@dataclass(frozen=True, kw_only=True)
class DecodeLimits:
    """Caps on what one member may decode to, checked from its header before decoding.

    >>> limits = DecodeLimits()
    >>> limits.max_image_pixels, limits.max_array_bytes, limits.max_member_bytes
    (67108864, 268435456, 1073741824)
    """

    max_image_pixels: int = 1 << 26
    """Width x height of one image (about 8192 x 8192); a larger one is ``corrupt_image``."""
    max_array_bytes: int = 1 << 28
    """Decoded bytes of one ``.npy`` member or of all entries of one ``.npz`` (256 MiB); more is
    ``array_too_large``."""
    max_video_frames: int = 2048
    """Frames of one video (the Qwen video processors sample at most 768); more is ``bad_video``."""
    max_video_pixels: int = 1 << 30
    """Width x height summed over one video's frames, as decoded (about 512 frames of 1920 x 1080, 3
    GiB as RGB); more is ``bad_video``."""
    max_member_bytes: int = 1 << 30
    """Bytes of one tar member (1 GiB): a header declaring more is ``corrupt_shard`` before any of
    it is read (a compressed shard's declared sizes are not bounded by its file's)."""
    max_shard_bytes: int = 1 << 36
    """Decompressed bytes of one compressed shard (``.tar.gz``, 64 GiB); more is
    ``corrupt_shard``."""
    max_ratio: int = 250
    """Decompressed / compressed bytes of a compressed shard, checked once past 64 MiB decompressed
    (gzip's best is about 1000 for zeros; real shards of tokens, text and images stay far below);
    more is ``corrupt_shard`` (a decompression bomb)."""

    max_video_seconds: int = 4 * 3600
    """Duration of one video file from its headers (four hours); longer is ``bad_video``, found
    before decoding."""
    max_video_bytes: int = 1 << 32
    """RGB bytes of one video file's sampled frames at their source size (4 GiB), from the headers
    before decoding; more is ``bad_video``."""
    max_video_decode_seconds: int = 600
    """Wall seconds to decode one video file's sampled frames; longer is ``corrupt_video`` (checked
    between frames: bounds a decoder stuck on hostile data frame after frame)."""

    def __post_init__(self):
        for name in (
            "max_image_pixels",
            "max_array_bytes",
            "max_video_frames",
            "max_video_pixels",
            "max_video_seconds",
            "max_video_bytes",
            "max_video_decode_seconds",
            "max_member_bytes",
            "max_shard_bytes",
            "max_ratio",
        ):
            value = int_at_least(f"DecodeLimits.{name}", getattr(self, name), 1, ConfigError)
            object.__setattr__(self, name, value)


DEFAULT_LIMITS = DecodeLimits()

IMAGE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    TypeError,
    SyntaxError,
    EOFError,
    IndexError,
    KeyError,
    struct.error,
    zlib.error,
)
"""What Pillow raises on malformed image bytes (plus ``DecompressionBombError``, added at
import)."""
ARRAY_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    EOFError,
    OSError,
    zipfile.BadZipFile,
    zlib.error,
    KeyError,
    NotImplementedError,
)
"""What the ``.npy`` / ``.npz`` reader (``NpyFormatError``, a ``ValueError``), ``zipfile`` and
``zlib`` raise on malformed bytes."""
TEXT_ERRORS: tuple[type[BaseException], ...] = (ValueError, RecursionError)
"""``UnicodeDecodeError`` / ``JSONDecodeError`` (both ``ValueError``) and JSON nested too deep."""


def split_member_name(name: str) -> tuple[str, str] | None:
    """``"a/b/0001.input_ids.npy"`` -> ``("a/b/0001", "input_ids.npy")``; None without an extension.

    >>> split_member_name("a/0001.input_ids.npy"), split_member_name("README")
    (('a/0001', 'input_ids.npy'), None)
    """
    m = _KEY_EXT.match(name)
    return (m.group(1), m.group(2).lower()) if m else None


class ImageTooLarge(Exception):
    """Internal: an image declares more pixels than :attr:`DecodeLimits.max_image_pixels`."""


def _text(data: bytes) -> str:
    return data.decode("utf-8")


def _int_or_text(data: bytes):
    text = _text(data).strip()
    try:
        return int(text)
    except ValueError:
        return text


def decode_npy(data: bytes, limits: DecodeLimits = DEFAULT_LIMITS) -> np.ndarray:
    """``.npy`` bytes -> a writable array, its header parsed once
    (:func:`~prealign.loaders.sources.npy.read_npy`); raises
    :class:`~prealign.loaders.sources.npy.NpyFormatError` (a ``ValueError``: malformed, a dtype
    torch does not hold, short data) or :class:`ArrayTooLarge` before allocating."""
    return read_npy(data, max_bytes=limits.max_array_bytes, member="npy")


def decode_npz(data: bytes, limits: DecodeLimits = DEFAULT_LIMITS) -> dict[str, np.ndarray]:
    """``.npz`` bytes -> ``{name: writable array}``
    (:func:`~prealign.loaders.sources.npy.read_npz`): the entries' declared sizes, then each
    ``.npy`` header, checked against ``max_array_bytes`` before anything
    is inflated; duplicate names, entries that are not ``.npy``, outside the file or with a wrong
    crc32 refused."""
    return read_npz(data, max_bytes=limits.max_array_bytes, member="npz")


def open_image(data: bytes, limits: DecodeLimits = DEFAULT_LIMITS):
    """Bytes -> a fully loaded ``PIL.Image``, opened only as :data:`IMAGE_FORMATS`, its pixel count
    checked from the header before decoding, turned upright by its EXIF orientation as transformers'
    ``load_image`` does (a phone photo stored sideways is trained on as it is shown; the header
    pass's :func:`~prealign.loaders.sources.header_lengths.image_header_size` swaps width and height
    alike). Raises one of :data:`IMAGE_ERRORS` on malformed bytes, :class:`ImageTooLarge` on a
    bomb."""
    from PIL import Image, ImageOps

    with warnings.catch_warnings():  # PIL's own bomb warning: the cap below decides
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        img = Image.open(io.BytesIO(data), formats=list(IMAGE_FORMATS))
    w, h = img.size
    if w * h > limits.max_image_pixels:
        img.close()
        raise ImageTooLarge(
            f"{w}x{h} = {w * h} pixels, over max_image_pixels {limits.max_image_pixels} "
            f"(a decompression bomb: {len(data)} bytes)"
        )
    img.load()
    return ImageOps.exif_transpose(img)


def image_errors() -> tuple[type[BaseException], ...]:
    from PIL import Image

    return (*IMAGE_ERRORS, Image.DecompressionBombError)


_DECODERS: dict[str, Callable[[bytes], object]] = {
    "json": lambda d: json.loads(_text(d)),
    "txt": _text,
    "text": _text,
    "cls": _int_or_text,
    "cls2": _int_or_text,
    "index": _int_or_text,
    "inx": _int_or_text,
    "id": _int_or_text,
}


def decode_member(
    key: str,
    ext: str,
    data: bytes,
    *,
    image: str = "pil",
    extra: Mapping[str, Callable[[bytes], object]] | None = None,
    limits: DecodeLimits = DEFAULT_LIMITS,
):
    """Decode one member's bytes by its extension; raises :class:`BadSampleError` on undecodable
    data (reason ``corrupt_image`` for images, ``array_too_large`` for array bombs) and
    :class:`UnsafeMemberError` on pickle-like formats (whatever ``extra`` says). An ``extra``
    decoder signals bad bytes by raising ``ValueError`` (or a
    :class:`~prealign.schemas.errors.SampleError`); anything else it raises is a bug and propagates.

    >>> decode_member("k", "meta.json", b'{"a": 1}'), decode_member("k", "cls", b" 7\\n")
    ({'a': 1}, 7)
    """
    last = ext.rsplit(".", 1)[-1]
    if last in UNSAFE:
        raise UnsafeMemberError(
            sample=key,
            field=ext,
            expected="a member format that cannot execute code "
            "(json, txt, npy, npz, images, raw bytes)",
            actual=f".{last} (pickle-based)",
            hint="prealign never unpickles webdataset members; store arrays as .npy",
        )
    user = (extra or {}).get(ext) or (extra or {}).get(last)
    reason, errors = None, (ValueError,)
    if user is not None:
        fn = user
    elif last in ("npy", "npz"):
        fn, errors = (decode_npy if last == "npy" else decode_npz), ARRAY_ERRORS
        fn = functools.partial(fn, limits=limits)
    elif last in IMAGES:
        if image != "pil":
            return data
        fn, errors, reason = (
            functools.partial(open_image, limits=limits),
            image_errors(),
            "corrupt_image",
        )
    elif last in _DECODERS:
        fn, errors = _DECODERS[last], TEXT_ERRORS
    else:
        return data
    try:
        return fn(data)
    except ConfigError:
        raise
    except ArrayTooLarge as exc:
        raise BadSampleError(
            sample=key,
            field=ext,
            expected=f"at most {limits.max_array_bytes} decoded bytes "
            "(DecodeLimits.max_array_bytes)",
            actual=str(exc),
            reason="array_too_large",
        ) from None
    except ImageTooLarge as exc:
        raise BadSampleError(
            sample=key,
            field=ext,
            expected=f"at most {limits.max_image_pixels} pixels (DecodeLimits.max_image_pixels)",
            actual=str(exc),
            reason="corrupt_image",
        ) from None
    except BadSampleError:
        raise
    except (
        errors
    ) as exc:  # what the decoder raises on malformed bytes; anything else is a bug and propagates
        raise BadSampleError(
            sample=key,
            field=ext,
            expected=f"a decodable .{last} member",
            actual=f"{type(exc).__name__}: {exc}",
            reason=reason,
        ) from None
