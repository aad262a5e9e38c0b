"""A minimal, strict tar reader for webdataset shards (regular files, ustar/GNU/pax names).

Python's ``tarfile`` reads a shard cut at a header boundary as a clean end; this reader checks every
header's checksum and requires the end-of-archive marker, so truncation and corruption are errors,
not silently shorter shards. It also reads a sample's byte range (no end marker there).

Sizes are untrusted: a member can never be larger than what is left of the archive (a header
claiming 100 GiB, or a pax ``size=10**30``, is a :class:`TarFormatError`, never a 100 GiB
allocation), and an extended header (pax, GNU long name) is at most :data:`MAX_EXTENDED` bytes.
Hard links, symbolic links, special files and members of any other type (GNU sparse, an unknown
typeflag, a directory named like a sample's member or declaring data) are yielded with their
``kind`` (no data) so the caller can count them; plain directory entries (``data/``) are skipped.

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
MAX_EXTENDED = 1 << 20
"""Largest pax / GNU long-name header data accepted (bytes); real ones are a few hundred."""
_REGULAR = (b"0", b"\0", b"7")
_KINDS = {b"1": "hardlink", b"2": "symlink", b"3": "chardev", b"4": "blockdev", b"6": "fifo"}
_OTHER = {
    b"5": "directory",
    b"S": "GNU sparse",
    b"D": "GNU dumpdir",
    b"M": "GNU multivolume",
    b"V": "volume label",
}
_CHUNK = 16 << 20
MAX_MEMBER = 1 << 30
"""Default cap on one member's declared size (:attr:`DecodeLimits.max_member_bytes`)."""


class TarFormatError(Exception):
    """The bytes at ``offset`` are not a valid continuation of the archive."""

    def __init__(self, offset: int, message: str):
        self.offset, self.message = offset, message
        super().__init__(f"{message} at byte {offset}")


@dataclass(frozen=True, slots=True)
class Member:
    name: str
    offset: int
    """Byte offset of the member's first header (extended name headers included)."""
    end: int
    """Byte offset just after its padded data."""
    data: bytes
    kind: str = "file"
    """``"file"`` (a regular member, with its data), or ``"hardlink"`` / ``"symlink"`` /
    ``"chardev"`` / ``"blockdev"`` / ``"fifo"`` / ``"directory"`` / ``"GNU sparse"`` / ``"typeflag
    b'X'"``... (no data: webdataset has no use for them; the caller counts them)."""


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
    ``offset``; a malformed record (a length that is not a positive decimal or runs past the data,
    no ``=``, a key that is not UTF-8) is a :class:`TarFormatError`, never a hang or a bare
    ``ValueError``."""
    out, pos = {}, 0
    while pos < len(data):
        space = data.find(b" ", pos, pos + 21)
        digits = data[pos:space] if space > pos else b""
        length = int(digits) if digits.isdigit() else 0
        # the record holds at least its length, the space, "=" and the newline
        if not length or length < space - pos + 3 or pos + length > len(data):
            raise TarFormatError(offset + pos, f"bad pax record length {data[pos : pos + 20]!r}")
        key, eq, value = data[space + 1 : pos + length - 1].partition(b"=")
        try:
            if not eq:
                raise ValueError("no '='")
            out[key.decode()] = value.decode("utf-8", "surrogateescape")
        except ValueError as exc:
            raise TarFormatError(offset + pos, f"bad pax record ({exc})") from None
        pos += length
    return out


def _remaining(f: BinaryIO) -> int | None:
    """Bytes left in ``f`` after its current position, or None when it cannot tell (a pipe). A
    reader with ``length`` and ``pos`` attributes
    (:class:`~prealign.loaders.sources.deadline.TimedReader`) says so itself."""
    if getattr(f, "length", None) is not None:
        return f.length - f.pos
    try:
        if not f.seekable():
            return None
        here = f.tell()
        end = f.seek(0, 2)
        f.seek(here)
        return end - here
    except (OSError, ValueError, AttributeError):
        return None


def _read(f: BinaryIO, n: int) -> bytes:
    """Up to ``n`` bytes of ``f``, read in chunks (a lying size never allocates more than arrives)
    until ``n`` or the end (a short read is read on: a failure behind it is raised by the next)."""
    first = f.read(min(n, _CHUNK))
    if len(first) == n or not first:
        return first
    parts, got = [first], len(first)
    while got < n:
        part = f.read(min(_CHUNK, n - got))
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def iter_members(
    f: BinaryIO, *, base: int = 0, need_end_marker: bool = True, max_member: int = MAX_MEMBER
) -> Iterator[Member]:
    """Regular-file and link members of the tar stream ``f`` in order (directories are skipped).

    ``base`` is the archive offset of ``f``'s first byte. Raises :class:`TarFormatError` on a bad
    checksum, a short header or data, a member larger than the rest of the archive, an oversized
    extended header, a member declaring more than ``max_member`` bytes (checked before any of it is
    read; :attr:`~prealign.loaders.sources.tar_decode.DecodeLimits.max_member_bytes`), or
    (``need_end_marker``) a missing end-of-archive marker; with ``need_end_marker=False`` the end of
    ``f`` at a header boundary is a normal end. An error raised by ``f`` itself while a member's
    data is read (a :class:`TarFormatError` of a bounded gzip stream) is raised again naming that
    member.
    """
    left = _remaining(f)
    pos = base
    long_name: str | None = None
    pax: dict[str, str] = {}
    first = None  # offset of the first header of the current member (extended headers included)
    while True:
        head = _read(f, BLOCK)
        if not head and not need_end_marker and first is None:
            return
        if len(head) < BLOCK:
            raise TarFormatError(
                pos,
                "truncated archive (no end-of-archive marker)" if not head else "truncated header",
            )
        if head == b"\0" * BLOCK:
            if first is not None:
                raise TarFormatError(pos, "end marker after an extended header")
            return
        if sum(head) - sum(head[148:156]) + 8 * 32 != _number(head[148:156], pos):
            raise TarFormatError(pos, "header checksum mismatch")
        size = _number(head[124:136], pos)
        kind = head[156:157]
        if "size" in pax:
            if not (pax["size"].isascii() and pax["size"].isdigit()) or len(pax["size"]) > 20:
                raise TarFormatError(
                    first if first is not None else pos, f"bad pax size {pax['size'][:20]!r}"
                )
            size = int(pax["size"])
        if left is not None:
            left -= BLOCK
            if _padded(size) > left:
                raise TarFormatError(
                    pos, f"member claims {size} bytes, only {max(left, 0)} left in the archive"
                )
            left -= _padded(size)
        if kind in (b"L", b"K", b"x", b"g") and size > MAX_EXTENDED:
            raise TarFormatError(pos, f"extended header of {size} bytes (limit {MAX_EXTENDED})")
        label = long_name or pax.get("path") or _text(head[:100])
        if size > max_member:
            raise TarFormatError(
                pos,
                f"member {label!r} declares {size} bytes, more than "
                f"DecodeLimits.max_member_bytes ({max_member})",
            )
        readable = kind in _REGULAR or kind in (b"L", b"x")
        try:
            data = _read(f, size) if readable else b""
            if readable and len(data) < size:
                raise TarFormatError(pos + BLOCK, f"truncated data ({len(data)} of {size} bytes)")
            pad = _padded(size) - len(data)
            if pad and len(_read(f, pad)) < pad:
                raise TarFormatError(pos + BLOCK + len(data), "truncated padding")
        except (
            TarFormatError
        ) as exc:  # (and the stream's own limit, a bounded gzip's): name the member
            raise TarFormatError(exc.offset, f"{exc.message} (in member {label!r})") from None
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
        elif kind in _KINDS:
            yield Member(name, start, pos, b"", _KINDS[kind])
        elif kind != b"5" or size or "." in name.rstrip("/").rsplit("/", 1)[-1]:
            # a member of no kind webdataset reads (GNU sparse, an unknown typeflag, a directory
            # named like a sample's member or holding data): yielded without data, so the caller
            # counts it, never dropped
            yield Member(
                name.rstrip("/") or name, start, pos, b"", _OTHER.get(kind, f"typeflag {kind!r}")
            )
