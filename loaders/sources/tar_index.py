"""The tar walk at machine speed: a block of a shard's bytes, its member headers parsed in
bulk (numpy).

    buf (bytes of the archive from a header boundary)
      │ every 512-byte block read as if it were a header: size and type in a few array ops
      ▼
    chain: from the first header, each header's successor 1 + ceil(size / 512) blocks on
      │ (a list walk, a few list lookups a member); the chain's checksums in one reduction
      ▼
    :class:`Walked`: each member's offsets and size (``int64 [M]``) and name

Exact for regular files (type ``0``, NUL or ``7``) with their number fields as zero-padded
octal (what ``tarfile``, GNU tar and webdataset's writer write), and for GNU long-name (``L``)
and pax (``x``) headers before one (those parsed by
:func:`~prealign.loaders.sources.tar_reader.iter_members` itself, the reference). Anything else
(a link, a directory, a global pax header, a base-256 number, a bad checksum, a truncated
archive) raises :class:`Unhandled`: the caller reads that shard with
:func:`~prealign.loaders.sources.tar_reader.iter_members`, so what a shard yields is the
reference's by construction.

>>> import io, tarfile
>>> buf = io.BytesIO()
>>> with tarfile.open(fileobj=buf, mode="w") as tf:
...     info = tarfile.TarInfo("k.txt"); info.size = 2; tf.addfile(info, io.BytesIO(b"hi"))
>>> w = walk(buf.getvalue(), eof=True)
>>> w.names, w.offset.tolist(), w.data_at.tolist(), w.size.tolist(), w.end.tolist(), w.ended
(['k.txt'], [0], [512], [2], [1024], True)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prealign.loaders.sources.tar_reader import BLOCK, TarFormatError, iter_members

_ZERO = bytes(BLOCK)
_PLAIN = (ord("0"), 0, ord("7"))
_EXTENDED = (ord("L"), ord("x"))


class Unhandled(Exception):
    """The bytes hold something this walker does not parse exactly (read them with the
    reference)."""


@dataclass(frozen=True)
class Walked:
    """The whole members of a block, in archive order (offsets are the archive's)."""

    offset: np.ndarray
    """``int64 [M]``: each member's first header (its extended headers included)."""
    data_at: np.ndarray
    """``int64 [M]``: where its data begins."""
    size: np.ndarray
    """``int64 [M]``: its data bytes."""
    end: np.ndarray
    """``int64 [M]``: just after its padded data."""
    names: list[str]
    done: int
    """Archive offset of the first header not walked (the end marker's, when ``ended``)."""
    ended: bool
    """The end-of-archive marker was reached."""
    need: int
    """When not ``ended``: the archive offset the bytes must reach for the walk to go on."""


def octal_fields(fields: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(values int64 [m], ok bool [m])`` of tar number fields ``uint8 [m, w]``, as
    ``tar_reader`` reads them (NULs as spaces, spaces around one run of octal digits; all spaces
    is 0); ``ok`` is False for any other spelling (base-256, a sign, an underscore, a tab),
    which this walker leaves to the reference.

    >>> fields = b"00000000017\\0" + b"  17 " + bytes(7) + b"1 2" + bytes(9)
    >>> values, ok = octal_fields(np.frombuffer(fields, np.uint8).reshape(3, 12))
    >>> values[ok].tolist(), ok.tolist()
    ([15, 15], [True, True, False])
    """
    c = np.where(fields == 0, 32, fields).astype(np.int64)
    digit = (c >= 48) & (c <= 55)
    ok = (digit | (c == 32)).all(1)
    runs = digit[:, 0].astype(np.int64) + (digit[:, 1:] & ~digit[:, :-1]).sum(1)
    ok &= runs <= 1
    value = np.zeros(len(c), np.int64)
    for j in range(c.shape[1]):
        value = np.where(digit[:, j], value * 8 + (c[:, j] - 48), value)
    return value, ok


class _View:
    """A file over ``buf[at:]`` for :func:`iter_members`; notes a read the bytes held cut short."""

    def __init__(self, buf: bytes, at: int):
        self.mv, self.at, self.short = memoryview(buf), at, False

    def read(self, n: int = -1) -> bytes:
        stop = len(self.mv) if n < 0 else self.at + n
        if stop > len(self.mv):
            self.short = True
        out = bytes(self.mv[self.at : stop])
        self.at += len(out)
        return out


def _extended(buf: bytes, at: int, base: int, eof: bool):
    """The member whose extended headers begin at ``buf[at:]``, read by the reference; None when
    the bytes held end before it does (and more will come)."""
    view = _View(buf, at)
    try:
        member = next(iter_members(view, base=base + at, need_end_marker=False), None)
    except TarFormatError as exc:
        if view.short and not eof:
            return None
        raise Unhandled(str(exc)) from None
    if member is None or member.kind != "file":
        raise Unhandled("an extended header before a member that is not a regular file")
    return member


def walk(buf: bytes, base: int = 0, *, eof: bool) -> Walked:
    """The whole members of ``buf``, the bytes of an archive from offset ``base`` (a header
    boundary) on; ``eof``: ``buf`` runs to the end of the archive (no end marker is then
    :class:`Unhandled`)."""
    nb = len(buf) // BLOCK
    blocks = np.frombuffer(buf, np.uint8, count=nb * BLOCK).reshape(nb, BLOCK)
    size, ok = octal_fields(blocks[:, 124:136])
    kind = blocks[:, 156]
    ok &= (blocks[:, 148:156] != 0).any(1)  # (a block of zeros, the end marker, is no header)
    plain = (ok & ((kind == _PLAIN[0]) | (kind == _PLAIN[1]) | (kind == _PLAIN[2]))).tolist()
    successor = (np.arange(1, nb + 1) + (size + BLOCK - 1) // BLOCK).tolist()
    heads: list[int] = []  # block of each member's own header
    extended: list[tuple[int, object]] = []  # (position in heads, the reference's Member)
    i, ended, need = 0, False, base + len(buf) + BLOCK
    while i < nb:
        if plain[i]:
            nxt = successor[i]
            if nxt > nb:
                need = base + nxt * BLOCK
                break
            heads.append(i)
            i = nxt
            continue
        head = buf[i * BLOCK : (i + 1) * BLOCK]
        if head == _ZERO:
            ended = True
            break
        if head[156] not in _EXTENDED:
            raise Unhandled(f"a tar member of type {head[156:157]!r} at byte {base + i * BLOCK}")
        member = _extended(buf, i * BLOCK, base, eof)
        if member is None:
            break
        own = (member.end - base) // BLOCK - (len(member.data) + BLOCK - 1) // BLOCK - 1
        extended.append((len(heads), member))
        heads.append(own)
        i = (member.end - base) // BLOCK
    if not ended and eof:
        raise Unhandled(f"no end-of-archive marker (truncated) at byte {base + i * BLOCK}")
    h = np.asarray(heads, np.int64)
    check = np.asarray(heads + ([i] if not ended and i < nb else []), np.int64)
    if len(check):
        rows = blocks[check]
        chk, chk_ok = octal_fields(rows[:, 148:156])
        sums = rows.sum(1, dtype=np.int64) - rows[:, 148:156].sum(1, dtype=np.int64) + 8 * 32
        if not (chk_ok & (sums == chk)).all():
            raise Unhandled("a header checksum mismatch")
    offset = base + h * BLOCK
    sizes = size[h]
    names = _names(blocks, h)
    for pos, member in extended:
        offset[pos], sizes[pos], names[pos] = member.offset, len(member.data), member.name
    data_at = base + (h + 1) * BLOCK
    return Walked(
        offset,
        data_at,
        sizes,
        data_at + (sizes + BLOCK - 1) // BLOCK * BLOCK,
        names,
        base + i * BLOCK,
        ended,
        need,
    )


def _names(blocks: np.ndarray, h: np.ndarray) -> list[str]:
    """Member names of the headers ``blocks[h]`` as ``tar_reader`` reads them: the name field up
    to its first NUL, after the ustar prefix field and a ``/`` when the header is ustar's and the
    prefix is not empty."""
    raw = np.ascontiguousarray(blocks[h, :100]).view("S100").ravel().tolist()
    names = [b.partition(b"\0")[0].decode("utf-8", "surrogateescape") for b in raw]
    magic = np.frombuffer(b"ustar\0", np.uint8)
    ustar = (blocks[h, 257:263] == magic).all(1) & (blocks[h, 345] != 0)
    for pos in np.flatnonzero(ustar).tolist():
        prefix = bytes(blocks[h[pos], 345:500]).partition(b"\0")[0]
        prefix = prefix.decode("utf-8", "surrogateescape")
        names[pos] = prefix + "/" + names[pos]
    return names
