"""A minimal, strict tar reader for webdataset shards (regular files, ustar/GNU/pax names).

Python's ``tarfile`` reads a shard cut at a header boundary as a clean end; this reader checks every
header's checksum and requires the end-of-archive marker, so truncation and corruption are errors,
not silently shorter shards. It also reads a sample's byte range (no end marker there).

>>> import io, tarfile
>>> buf = io.BytesIO()
>>> with tarfile.open(fileobj=buf, mode="w") as tf:
...     info = tarfile.TarInfo("k.txt"); info.size = 2; tf.addfile(info, io.BytesIO(b"hi"))
>>> [(m.name, m.offset, m.end, m.data) for m in iter_members(io.BytesIO(buf.getvalue()))]
[('k.txt', 0, 1024, b'hi')]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO, Iterator

BLOCK = 512
_REGULAR = (b"0", b"\0", b"7")


class TarFormatError(Exception):
    """The bytes at ``offset`` are not a valid continuation of the archive."""

    def __init__(self, offset: int, message: str):
        self.offset = offset
        super().__init__(f"{message} at byte {offset}")


@dataclass(frozen=True, slots=True)
class Member:
    name: str
    offset: int
    """Byte offset of the member's first header (extended name headers included)."""
    end: int
    """Byte offset just after its padded data."""
    data: bytes


def _padded(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def _number(field: bytes, offset: int) -> int:
    if field[0] & 0x80:  # GNU base-256
        return int.from_bytes(field[1:], "big")
    text = field.replace(b"\0", b" ").strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise TarFormatError(offset, f"bad number field {field!r}") from None


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax(data: bytes, offset: int) -> dict[str, str]:
    """Records (``<length> <key>=<value>`` and a newline) of a pax header whose data starts at byte
    ``offset``; a malformed record (a length that is not a positive decimal or runs past the data, no
    ``=``, a key that is not UTF-8) is a :class:`TarFormatError`, never a hang or a bare ``ValueError``."""
    out, pos = {}, 0
    while pos < len(data):
        space = data.find(b" ", pos, pos + 21)
        digits = data[pos:space] if space > pos else b""
        length = int(digits) if digits.isdigit() else 0
        # the record holds at least its length, the space, "=" and the newline
        if not length or length < space - pos + 3 or pos + length > len(data):
            raise TarFormatError(offset + pos, f"bad pax record length {data[pos:pos + 20]!r}")
        key, eq, value = data[space + 1:pos + length - 1].partition(b"=")
        try:
            if not eq:
                raise ValueError("no '='")
            out[key.decode()] = value.decode("utf-8", "surrogateescape")
        except ValueError as exc:
            raise TarFormatError(offset + pos, f"bad pax record ({exc})") from None
        pos += length
    return out


def iter_members(f: BinaryIO, *, base: int = 0, need_end_marker: bool = True) -> Iterator[Member]:
    """Regular-file members of the tar stream ``f`` in order (other entries are skipped).

    ``base`` is the archive offset of ``f``'s first byte. Raises :class:`TarFormatError` on a bad
    checksum, a short header or data, or (``need_end_marker``) a missing end-of-archive marker; with
    ``need_end_marker=False`` the end of ``f`` at a header boundary is a normal end.
    """
    pos = base
    long_name: str | None = None
    pax: dict[str, str] = {}
    first = None  # offset of the first header of the current member (extended headers included)
    while True:
        head = f.read(BLOCK)
        if not head and not need_end_marker and first is None:
            return
        if len(head) < BLOCK:
            raise TarFormatError(pos, "truncated archive (no end-of-archive marker)" if not head
                                 else "truncated header")
        if head == b"\0" * BLOCK:
            if first is not None:
                raise TarFormatError(pos, "end marker after an extended header")
            return
        if sum(head) - sum(head[148:156]) + 8 * 32 != _number(head[148:156], pos):
            raise TarFormatError(pos, "header checksum mismatch")
        size = _number(head[124:136], pos)
        kind = head[156:157]
        if "size" in pax:
            if not (pax["size"].isascii() and pax["size"].isdigit()):
                raise TarFormatError(first if first is not None else pos, f"bad pax size {pax['size'][:20]!r}")
            size = int(pax["size"])
        readable = kind in _REGULAR or kind in (b"L", b"x")
        data = f.read(size) if readable else b""
        if readable and len(data) < size:
            raise TarFormatError(pos + BLOCK, f"truncated data ({len(data)} of {size} bytes)")
        pad = _padded(size) - len(data)
        if pad and len(f.read(pad)) < pad:
            raise TarFormatError(pos + BLOCK + len(data), "truncated padding")
        start, data_at = (pos if first is None else first), pos + BLOCK
        pos += BLOCK + _padded(size)
        if kind == b"L":
            long_name, first = _text(data), start
            continue
        if kind == b"x":
            pax, first = _pax(data, data_at), start
            continue
        if kind in (b"g", b"K"):
            first = start if first is not None else None
            continue
        name = long_name or pax.get("path")
        if name is None:
            name = _text(head[:100])
            if head[257:263] == b"ustar\0" and head[345]:
                name = _text(head[345:500]) + "/" + name
        long_name, pax, first = None, {}, None
        if kind in _REGULAR:
            yield Member(name, start, pos, data)
