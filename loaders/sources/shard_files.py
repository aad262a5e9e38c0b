"""Names and checksums of webdataset shard files and of the sidecar index files kept beside them.

What a source and the index agree on without either importing the other: where a shard's sidecar lives
(:func:`sidecar_path`), the name it goes by (:func:`shard_name`) and the crc32 of a sample's members
recorded at indexing and checked at every read (:func:`sample_checksum`).
"""
from __future__ import annotations

import os
import zlib
from typing import Iterable

from prealign.schemas.errors import ConfigError

SUFFIX = ".prealign-index.npz"


def sample_checksum(members: Iterable[tuple]) -> int:
    """crc32 over a sample's members (``extension NUL data`` each, in tar order; ``(extension, data, ...)``
    tuples, anything after the data ignored): what a read checks.

    >>> sample_checksum([("txt", b"hi")]) == sample_checksum([("txt", b"hi")]) != sample_checksum([("txt", b"ho")])
    True
    """
    crc = 0
    for ext, data, *_ in members:
        crc = zlib.crc32(data, zlib.crc32(ext.encode() + b"\0", crc))
    return crc


def sidecar_path(url: str, index_dir: str | None = None) -> str:
    """Where the sidecar of shard ``url`` lives: beside it, or ``index_dir/<file name><SUFFIX>``.

    >>> sidecar_path("/d/s-0.tar"), sidecar_path("http://h/d/s-0.tar?x=1", "/idx")
    ('/d/s-0.tar.prealign-index.npz', '/idx/s-0.tar.prealign-index.npz')
    """
    if index_dir:
        return os.path.join(index_dir, shard_name(url) + SUFFIX)
    if url.startswith("file://"):
        url = url[len("file://"):]
    base, sep, query = url.partition("?")
    return base + SUFFIX + (sep + query if sep else "")


def check_index_dir_names(urls: Iterable[str]) -> None:
    """An index folder names each sidecar by its shard's file name: two shards of one name (``train/s-0.tar``
    and ``val/s-0.tar``) would share one sidecar, so they are a :class:`ConfigError` naming both."""
    seen: dict[str, str] = {}
    for url in urls:
        other = seen.setdefault(shard_name(url), url)
        if other != url:
            raise ConfigError(f"index_dir: shards {other} and {url} have the same file name {shard_name(url)!r}, "
                              f"so their sidecars would overwrite each other; index them into separate folders "
                              f"or beside the shards")


def shard_name(url: str) -> str:
    """The file name of a shard path or URL (query string dropped)."""
    return os.path.basename(url.split("?", 1)[0].rstrip("/")) or "shard"
