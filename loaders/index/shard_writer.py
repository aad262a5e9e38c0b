"""``ShardWriter``: samples to webdataset shards of a target size, each with its sidecar index.

    {"__key__": "s0", "input_ids": int array [L], "json": {...}, "0.png": PIL image, ...}
        ─► out/shard-000000.tar  (members  s0.input_ids.npy  s0.json  s0.0.png ...)
        ─► out/shard-000000.tar.prealign-index.npz
           (written as the shard closes: no `prealign index` run)

A sample is a dict: ``__key__`` (optional; ``000000042`` by position) and one entry per member. The
entry's name is the member's extension (``input_ids`` -> ``<key>.input_ids.npy``) and its value says
how it is stored:

=========================================  =========================================================
value                                      member
=========================================  =========================================================
numpy array / torch tensor (numeric)       ``.npy`` (``allow_pickle=False``; object arrays refused)
``dict`` / ``list``                        JSON (name it ``json``, or ``<anything>.json``)
``str``                                    UTF-8 text (``txt``, ``json`` taken as written, ...)
``bytes``                                  as given (the name carries the extension: ``jpg``,
                                           ``0.png``)
PIL image                                  PNG (the name's extension, ``png`` when it has none)
``{"frames": uint8 [T,H,W,3], "fps": f}``  a video file (name ``clip.mp4``/``.webm``/``.mkv``: PyAV
                                           encodes it)
=========================================  =========================================================

A video is a video file member (``clip.mp4``: its ``bytes``, or ``{"frames": uint8 [T, H, W, 3],
"fps": f}`` encoded to that container with PyAV) or one image member per frame; teacher top-k are
the arrays ``teacher_topk_log_probs`` / ``teacher_topk_ids`` (``[L, K]``). The format is documented
in ``docs/shard_format.md``. Keys and member names are refused
(:class:`~prealign.schemas.errors.ConfigError`) unless they are plain names: letters, digits, ``_``,
``-`` (and ``.`` inside a member name); never a path, ``..``, a leading dot or a control character.

The sidecar is the one ``prealign index`` writes
(:func:`~prealign.loaders.index.header_pass.index_one`), built when the shard is closed from the
bytes just written (one read of the new file, from the page cache).

A shard is written as ``<name>.part`` and renamed to its name when it is complete, so a killed
writer never leaves a truncated shard under a shard's name. When the ``with`` block ends in an
exception, the shard being written is left as ``<name>.part``, with no sidecar (the samples before
it are in the shards already closed): delete it, or look at it, but no loader reads it. A sample is
checked whole before any of its members is written (member names, duplicate members, value types,
the tar name limit): a bad one raises :class:`~prealign.schemas.errors.ConfigError` naming the
sample and the member, and the shard stays as it was.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile

import numpy as np

from prealign.loaders.index.header_pass import index_one
from prealign.loaders.media.video_file import encode_video
from prealign.loaders.media.vlm import is_video_file
from prealign.loaders.sources.shard_files import sidecar_path
from prealign.loaders.sources.webdataset import WebDatasetSource, numpy_fields
from prealign.schemas.checks import int_at_least
from prealign.schemas.errors import ConfigError

_KEY = re.compile(r"[A-Za-z0-9_-]{1,200}")
_TAR_NAME = 100
"""Bytes of a tar (USTAR) member name with no folder: ``<key>.<extension>`` must fit."""
_MEMBER = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,100}")


def member_bytes(name: str, value, *, sample: str) -> tuple[str, bytes]:
    """``(extension, bytes)`` of one sample entry (see the module's table); anything that could not
    be read back as written is a :class:`ConfigError` naming the sample and the entry."""
    if (
        not isinstance(name, str)
        or not _MEMBER.fullmatch(name)
        or ".." in name
        or name.endswith(".")
    ):
        raise ConfigError(
            f"sample {sample!r}: member name {name!r} is not a plain name (letters, digits, _ - .)"
        )
    if name.startswith(
        "__"
    ):  # the loader's own keys (__url__, __shard__, __key__): a member would be lost
        raise ConfigError(
            f"sample {sample!r}: member name {name!r} is reserved (names starting with '__' are "
            f"the loader's: __key__, __url__, __shard__)"
        )
    if (
        is_video_file(name) and isinstance(value, dict) and "frames" in value
    ):  # frames to encode as a video file
        try:
            return name, encode_video(
                np.asarray(value["frames"]), value.get("fps"), container=name.rsplit(".")[-1]
            )
        except ValueError as exc:
            raise ConfigError(
                f"sample {sample!r}: video member {name!r}: {exc} (give {{'frames': uint8 [T, H, "
                f"W, 3], 'fps': float}})"
            ) from None
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise ConfigError(
                f"sample {sample!r}: member {name!r} has dtype {value.dtype}; only numeric arrays "
                f"are stored (never pickled)"
            )
        if name.split(".", 1)[0] == "input_ids" and value.ndim != 1:
            raise ConfigError(
                f"sample {sample!r}: member {name!r} has shape {value.shape}; token ids are 1-D"
            )
        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(value), allow_pickle=False)
        return (name if name.endswith(".npy") else f"{name}.npy"), buf.getvalue()
    if isinstance(value, (dict, list)):
        try:
            text = json.dumps(value, allow_nan=False)
        except (TypeError, ValueError, OverflowError, RecursionError) as exc:
            raise ConfigError(
                f"sample {sample!r}: member {name!r} is not JSON ({type(exc).__name__}: {exc})"
            ) from None
        return (name if name == "json" or name.endswith(".json") else f"{name}.json"), text.encode()
    if isinstance(value, str):
        return name, value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return name, bytes(value)
    if hasattr(value, "save") and hasattr(value, "size") and hasattr(value, "mode"):  # a PIL image
        ext = (
            name.rsplit(".", 1)[-1].lower()
            if "." in name or name in ("png", "jpg", "jpeg", "webp")
            else "png"
        )
        fmt = {"jpg": "JPEG", "jpeg": "JPEG", "webp": "WEBP"}.get(ext, "PNG")
        buf = io.BytesIO()
        try:
            value.save(buf, format=fmt)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # (e.g. an RGBA image as JPEG)
            raise ConfigError(
                f"sample {sample!r}: member {name!r}: a {value.mode} image cannot be written as "
                f"{fmt} ({type(exc).__name__}: {exc})"
            ) from None
        return (name if name.rsplit(".", 1)[-1].lower() == ext else f"{name}.{ext}"), buf.getvalue()
    raise ConfigError(
        f"sample {sample!r}: member {name!r} is a {type(value).__name__}; expected an array, a "
        f"dict or list (JSON), str, bytes or a PIL image"
    )


class ShardWriter:
    """Write samples to ``pattern % shard_number`` tar shards of about ``max_bytes`` each (a shard
    closes before a sample that would take it past; a sample larger than ``max_bytes`` gets a shard
    of its own), and the sidecar index of each as it closes. Use as a context manager (or call
    :meth:`close`); ``shards`` lists the paths written.

    ``transform``: what turns a sample's members into tokens, as the loader will read them (default
    :func:`~prealign.loaders.sources.webdataset.numpy_fields`, pre-tokenized arrays; a
    :class:`~prealign.loaders.media.vlm.VLMSampleTransform` for chat + images). ``index_dir``: write
    the sidecars there instead of beside the shards; ``sidecars=False``: none. An existing shard is
    never overwritten (``ConfigError``): the writer deletes nothing it did not create.

    >>> import tempfile, numpy as np
    >>> with tempfile.TemporaryDirectory() as out:
    ...     with ShardWriter(f"{out}/shard-%06d.tar", max_bytes=1 << 20) as w:
    ...         w.write({"__key__": "a", "input_ids": np.arange(1, 9)})
    ...     sidecar = w.shards[0] + ".prealign-index.npz"
    ...     [os.path.basename(p) for p in w.shards], w.count, os.path.exists(sidecar)
    (['shard-000000.tar'], 1, True)
    """

    def __init__(
        self,
        pattern: str,
        *,
        max_bytes: int = 256 << 20,
        max_samples: int | None = None,
        transform=numpy_fields,
        index_dir: str | None = None,
        sidecars: bool = True,
    ):
        try:
            pattern % 0
        except (TypeError, ValueError):
            raise ConfigError(
                f"pattern: expected a path with one %d-style field (shard-%06d.tar), got "
                f"{pattern!r}"
            ) from None
        max_bytes = int_at_least("max_bytes", max_bytes, 1024, ConfigError)
        if max_samples is not None:
            want = "None or an int >= 1"
            max_samples = int_at_least("max_samples", max_samples, 1, ConfigError, expected=want)
        self.pattern, self.max_bytes, self.max_samples = pattern, max_bytes, max_samples
        self.transform, self.index_dir, self.sidecars = transform, index_dir, sidecars
        self.shards: list[str] = []
        self.count = 0
        self._tar = self._file = self._path = None
        self._in_shard = 0
        self._keys: set[str] = set()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        # the shard being written stays <name>.part, with no sidecar (see the module's docstring)
        else:
            self._abandon()

    def write(self, sample: dict) -> None:
        """Append one sample (see the module's table of member values)."""
        if not isinstance(sample, dict):
            raise ConfigError(f"sample: expected a dict of members, got {type(sample).__name__}")
        key = str(sample.get("__key__", f"{self.count:09d}"))
        if not _KEY.fullmatch(key):
            raise ConfigError(
                f"sample key {key!r}: expected letters, digits, _ or - (no dots, slashes or '..')"
            )
        if key in self._keys:
            raise ConfigError(f"sample key {key!r}: written twice in one shard (keys name samples)")
        members = [
            member_bytes(name, value, sample=key)
            for name, value in sample.items()
            if name != "__key__"
        ]
        if not members:
            raise ConfigError(f"sample {key!r}: no members")
        seen: dict[str, str] = {}
        for (ext, _), name in zip(members, (n for n in sample if n != "__key__")):
            if (
                ext.lower() in seen
            ):  # (one member on a case-insensitive file system or object store mirror)
                raise ConfigError(
                    f"sample {key!r}: entries {seen[ext.lower()]!r} and {name!r} are both member "
                    f"{key}.{ext} (member names must differ in more than case)"
                )
            seen[ext.lower()] = name
            if len(f"{key}.{ext}".encode()) > _TAR_NAME:
                raise ConfigError(
                    f"sample {key!r}: member name {key}.{ext} is {len(f'{key}.{ext}'.encode())} "
                    f"bytes; "
                    f"a tar member name holds at most {_TAR_NAME} (shorten the key or the entry "
                    f"{name!r})"
                )
        size = sum(512 + -(-len(data) // 512) * 512 for _, data in members)
        full = self._in_shard and (
            self._file.tell() + size > self.max_bytes
            or (self.max_samples is not None and self._in_shard >= self.max_samples)
        )
        if self._tar is None or full:
            self._next_shard()
        for ext, data in members:
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            self._tar.addfile(info, io.BytesIO(data))
        self._keys.add(key)
        self._in_shard += 1
        self.count += 1

    def _next_shard(self) -> None:
        self._close_shard()
        path = self.pattern % len(self.shards)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        side = sidecar_path(path, self.index_dir)
        if self.sidecars and os.path.lexists(side):
            raise ConfigError(
                f"{side}: a sidecar is there already (another data set's, in a shared index_dir?); "
                f"the writer never overwrites a file it did not create: write to another pattern "
                f"or index_dir"
            )
        if os.path.lexists(path):
            raise ConfigError(f"{path}: exists; write the shards to a new folder or pattern")
        try:
            self._file = open(f"{path}.part", "xb")  # never over a file the writer did not create
        except FileExistsError:
            raise ConfigError(
                f"{path}.part: exists (a writer's unfinished shard?); delete it or write the "
                f"shards to a new folder or pattern"
            ) from None
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.USTAR_FORMAT)
        self._path = path
        self._in_shard, self._keys = 0, set()

    def _close_shard(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        self._file.close()
        path, self._tar, self._file, self._path = self._path, None, None, None
        if os.path.lexists(path):
            raise ConfigError(f"{path}: appeared while it was written; the shard stays {path}.part")
        os.rename(f"{path}.part", path)
        self.shards.append(path)
        if self.sidecars:
            if self.index_dir:
                os.makedirs(self.index_dir, exist_ok=True)
            if os.path.lexists(sidecar_path(path, self.index_dir)):
                raise ConfigError(
                    f"{sidecar_path(path, self.index_dir)}: appeared while {path} was written; the "
                    f"writer never overwrites a sidecar it did not create (run `prealign index` "
                    f"on it)"
                )
            source = WebDatasetSource(
                [path], transform=self.transform, image="bytes", index_dir=self.index_dir
            )
            index_one(source, None, 0, out_dir=self.index_dir, force=True)

    def _abandon(self) -> None:
        if self._tar is not None:
            # (the tar is not closed: no end marker, and no name or sidecar for it)
            self._file.close()
            self._tar = self._file = self._path = None

    def close(self) -> list[str]:
        """Close the last shard (renamed from ``.part``, then its sidecar written); returns
        :attr:`shards`."""
        self._close_shard()
        return self.shards
