"""Safe decoding of webdataset members: nothing is unpickled or executed.

A member ``dir/0001.input_ids.npy`` belongs to sample key ``dir/0001`` with extension
``input_ids.npy``; the decoder is chosen by the last dot-part (``npy``):

==========================  ==============================================================
extension (last part)       value
==========================  ==============================================================
json                        ``json.loads`` of UTF-8 text
txt, text                   ``str``
cls, cls2, index, inx, id   ``int`` (``str`` if not an integer)
npy                         ``numpy.load(allow_pickle=False)``
npz                         ``dict`` of arrays, ``allow_pickle=False``
jpg jpeg png webp bmp ...   ``PIL.Image`` (fully loaded) or raw ``bytes`` (``image="bytes"``)
pickle pkl pyd pth pt ...   refused: :class:`~prealign.loaders.errors.UnsafeMemberError`
anything else               raw ``bytes``
==========================  ==============================================================
"""
from __future__ import annotations

import io
import json
import re
from typing import Callable, Mapping

import numpy as np

from .errors import BadSampleError, UnsafeMemberError

UNSAFE = frozenset({"pickle", "pkl", "pyd", "pth", "pt", "ckpt", "joblib", "dill", "mp", "msgpack_pickle"})
IMAGES = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm", "pbm", "pnm"})
_KEY_EXT = re.compile(r"^((?:.*/)?[^./][^/.]*)\.([^/]+)$")


def split_member_name(name: str) -> tuple[str, str] | None:
    """``"a/b/0001.input_ids.npy"`` -> ``("a/b/0001", "input_ids.npy")``; None without an extension.

    >>> split_member_name("a/0001.input_ids.npy"), split_member_name("README")
    (('a/0001', 'input_ids.npy'), None)
    """
    m = _KEY_EXT.match(name)
    return (m.group(1), m.group(2).lower()) if m else None


def _text(data: bytes) -> str:
    return data.decode("utf-8")


def _int_or_text(data: bytes):
    text = _text(data).strip()
    try:
        return int(text)
    except ValueError:
        return text


def _npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def _npz(data: bytes) -> dict:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _pil(data: bytes):
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    img.load()
    return img


_DECODERS: dict[str, Callable[[bytes], object]] = {
    "json": lambda d: json.loads(_text(d)), "txt": _text, "text": _text, "cls": _int_or_text,
    "cls2": _int_or_text, "index": _int_or_text, "inx": _int_or_text, "id": _int_or_text, "npy": _npy, "npz": _npz,
}


def decode_member(key: str, ext: str, data: bytes, *, image: str = "pil",
                  extra: Mapping[str, Callable[[bytes], object]] | None = None):
    """Decode one member's bytes by its extension; raises :class:`BadSampleError` on undecodable data
    and :class:`UnsafeMemberError` on pickle-like formats (whatever ``extra`` says).

    >>> decode_member("k", "meta.json", b'{"a": 1}'), decode_member("k", "cls", b" 7\\n")
    ({'a': 1}, 7)
    """
    last = ext.rsplit(".", 1)[-1]
    if last in UNSAFE:
        raise UnsafeMemberError(sample=key, field=ext, expected="a member format that cannot execute code "
                                "(json, txt, npy, npz, images, raw bytes)", actual=f".{last} (pickle-based)",
                                hint="prealign never unpickles webdataset members; store arrays as .npy")
    fn = (extra or {}).get(ext) or (extra or {}).get(last) or _DECODERS.get(last)
    if fn is None and last in IMAGES:
        fn = _pil if image == "pil" else None
    if fn is None:
        return data
    try:
        return fn(data)
    except Exception as exc:  # any decoder failure is a bad sample, reported with its member
        raise BadSampleError(sample=key, field=ext, expected=f"a decodable .{last} member",
                             actual=f"{type(exc).__name__}: {exc}") from None
