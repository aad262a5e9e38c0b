"""Each sample's media processed once per CP group: a transform wrapper sharing results through a
node-local cache.

The CP ranks of one DP group load the same micro-batches (each keeps its own CP shard of them), so
without sharing every rank decodes and processes every image. :class:`SharedMediaTransform` wraps the
sample transform (e.g. :class:`~prealign.loaders.vlm.VLMSampleTransform`); for each sample the first
process of the group to get there *claims* it, transforms it and publishes the result; the others
read the result instead of computing it:

    cache dir (node-local, e.g. /dev/shm/prealign-media-<digest of run>)
    <h>.claim   created with O_EXCL by the claimer; holds its pid       (who is computing)
    <h>.bin     the transformed sample: a JSON header + raw tensor      (the result; never
                bytes, written to a temporary name then renamed (atomic) pickled, read by mmap)
    <h>.err     the claimer's transform failed: every rank runs it      (bad samples raise locally)
    <h>.r<k>    CP rank k has read the result; the last reader deletes  (clean-up)

``h`` is a digest of ``run`` and the raw sample (its ``__key__``, ``__url__`` and every member's bytes):
a changed file never reuses a stale result. It holds no epoch: a result is deleted once every peer has
read it, so each epoch computes afresh, and a peer far behind still finds it (or computes it). A
transform with ``compact``/``expand`` (``VLMSampleTransform``: uint8 resized patches instead of float32
``pixel_values``, 1/8 of the bytes) publishes the compact form; every rank expands it itself.

No deadlock: a waiter polls with a short backoff and computes the sample itself when the claimer's
process is gone (``os.kill(pid, 0)``: a killed or restarted worker), when the claim is older than
``timeout`` seconds (a slow rank), or when the cache cannot be written. Outputs never depend on who
computed them (the transform is deterministic), so batches are the same as without sharing on every
rank and resuming is exactly the loader's own. Results nobody read (a peer that died, or an index pass
split over ranks) are deleted after ``ttl`` seconds by the next sweep.

Limits:
- node-local (``/dev/shm``): a CP group spanning nodes shares within each node (each node's part of
  the group computes each sample once; correctness is unaffected).
- the peers must wrap the same transform configuration and agree on ``run`` and ``cp_size`` (``run``
  should name the job and the DP rank: DP peers load other samples, sharing with them only wastes writes).
- the liveness check needs the peers in one PID namespace (one container per node); otherwise a dead
  claimer is noticed after ``timeout`` only.
- workers of one rank never share with each other (they load different micro-batches); the CPU saved
  is the transform's: reading the shards, collation and the worker hand-off stay per rank.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import stat
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from prealign.schemas.errors import ConfigError

_MAGIC = b"PRMS1\n"


def encode_sample(sample: dict) -> list:
    """Sample dict -> the buffers of one record (write them in order, e.g. ``os.writev``): ``PRMS1\n``,
    a uint32 header length, a JSON header (each tensor's dtype, shape and byte offset; the other values:
    key, ints, strings), then the raw tensor bytes. Never pickled: a value JSON cannot hold raises
    ``TypeError``."""
    header: dict[str, Any] = {"tensors": {}, "values": {}}
    blobs, offset = [], 0
    for name, value in sample.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().contiguous()
            dtype = str(value.dtype).removeprefix("torch.")
            data = (value.view(torch.int16) if value.dtype == torch.bfloat16 else value).numpy()
            header["tensors"][name] = [dtype, list(value.shape), offset, data.nbytes]
            if data.nbytes:
                blobs.append(data.reshape(-1).view(np.uint8))
            offset += data.nbytes
        else:
            header["values"][name] = value
    head = json.dumps(header).encode()
    return [_MAGIC + len(head).to_bytes(4, "little") + head, *blobs]


def decode_sample(buf) -> dict:
    """Inverse of :func:`encode_sample` (``buf``: the joined record, e.g. a private mmap of the file);
    the tensors share ``buf``'s memory (a writable buffer gives writable tensors)."""
    if bytes(buf[:len(_MAGIC)]) != _MAGIC:
        raise ValueError("not a prealign media-share buffer")
    n = int.from_bytes(buf[len(_MAGIC):len(_MAGIC) + 4], "little")
    start = len(_MAGIC) + 4
    header = json.loads(bytes(buf[start:start + n]))
    base = start + n
    out: dict[str, Any] = dict(header["values"])
    for name, (dtype, shape, offset, nbytes) in header["tensors"].items():
        np_dtype = np.int16 if dtype == "bfloat16" else np.dtype(dtype)
        if np.dtype(np_dtype).hasobject:
            raise ValueError(f"refused dtype {dtype}")
        itemsize = np.dtype(np_dtype).itemsize
        if (offset < 0 or nbytes != int(np.prod(shape, dtype=np.int64)) * itemsize
                or base + offset + nbytes > len(buf)):
            raise ValueError(f"tensor {name!r}: {nbytes} bytes at {offset} do not hold {dtype} {shape}")
        arr = np.frombuffer(buf, dtype=np_dtype, count=nbytes // itemsize, offset=base + offset)
        t = torch.from_numpy(arr).reshape(shape)
        out[name] = t.view(torch.bfloat16) if dtype == "bfloat16" else t
    return out


@dataclass
class ShareStats:
    """Per-process counts: samples computed here, read from a peer, and why a wait ended in computing."""

    computed: int = 0
    shared: int = 0
    took_over_dead: int = 0
    took_over_timeout: int = 0
    write_failed: int = 0


@dataclass(frozen=True, kw_only=True)
class SharedMediaTransform:
    """``transform`` with its results shared by the ``cp_size`` CP ranks of a group on one node.

    Args:
        transform: the sample transform (deterministic: the same raw sample gives the same output).
        run: a name the CP peers agree on (e.g. the job id plus the DP rank); part of every cache key.
        cp_rank, cp_size: this rank's place in its CP group (``cp_size == 1``: no sharing at all).
        cache_dir: node-local directory (default ``/dev/shm`` when present, else the temp dir).
        timeout: seconds a claim is honoured before a waiter computes the sample itself.
        ttl: seconds after which unread results and stale claims are swept.

    Use it as the source's transform; nothing else changes::

        transform = SharedMediaTransform(transform=VLMSampleTransform(tokenizer=tok), run=f"{job}-dp{dp_rank}",
                                         cp_rank=cp_rank, cp_size=cp_size)
    """

    transform: Callable[[dict], dict]
    run: str
    cp_rank: int
    cp_size: int
    cache_dir: str | None = None
    timeout: float = 30.0
    ttl: float = 300.0
    stats: ShareStats = field(default_factory=ShareStats, compare=False, repr=False)

    def __post_init__(self):
        for name in ("cp_rank", "cp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"SharedMediaTransform.{name}: expected an int >= 0, got {value!r}")
        if self.cp_size < 1 or self.cp_rank >= self.cp_size:
            raise ConfigError(f"SharedMediaTransform: expected 0 <= cp_rank < cp_size, got cp_rank={self.cp_rank}, "
                              f"cp_size={self.cp_size}")
        if not isinstance(self.run, str) or not self.run:
            raise ConfigError(f"SharedMediaTransform.run: expected a non-empty str, got {self.run!r}")
        if not (self.timeout > 0 and self.ttl > self.timeout):
            raise ConfigError(f"SharedMediaTransform: expected timeout > 0 and ttl > timeout, got timeout="
                              f"{self.timeout}, ttl={self.ttl}")

    # public attributes of the wrapped transform (processor, vision, spatial_merge_size, ...) stay reachable
    def __getattr__(self, name: str):
        if name.startswith("__") or name == "transform":
            raise AttributeError(name)
        return getattr(self.transform, name)

    @property
    def directory(self) -> str:
        """The cache directory of this run (created on first use)."""
        base = self.cache_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        run = hashlib.blake2b(self.run.encode(), digest_size=8).hexdigest()
        return os.path.join(base, f"prealign-media-{run}")

    def key(self, raw: dict) -> str:
        """Digest of the run, the sample's name and every member's bytes (same input -> same key)."""
        h = hashlib.blake2b(self.run.encode(), digest_size=16)
        for name in sorted(raw):
            value = raw[name]
            h.update(name.encode() + b"\0")
            if isinstance(value, (bytes, bytearray, memoryview)):
                h.update(value)
            elif isinstance(value, str):
                h.update(value.encode())
            elif isinstance(value, np.ndarray) and not value.dtype.hasobject:
                h.update(str(value.dtype).encode() + str(value.shape).encode() + value.tobytes())
            else:
                h.update(repr(value).encode())
            h.update(b"\1")
        return h.hexdigest()

    def __call__(self, raw: dict) -> dict:
        if self.cp_size == 1:
            return self.transform(raw)
        d = self.directory
        h = self.key(raw)
        path = os.path.join(d, h)
        try:
            _private_dir(d)
            fd = os.open(path + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY | _NOFOLLOW, 0o600)
        except FileExistsError:
            return self._wait(raw, path)
        except OSError:
            self.stats.write_failed += 1
            return self._finish(self._compute(raw))
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        self._sweep(d)
        return self._compute_and_publish(raw, path)

    # ---- the claimer ----
    def _compute(self, raw: dict) -> dict:
        """The wrapped transform's result in its shared form (``compact`` when it has one)."""
        self.stats.computed += 1
        compact = getattr(self.transform, "compact", None)
        return compact(raw) if compact is not None else self.transform(raw)

    def _finish(self, out: dict) -> dict:
        expand = getattr(self.transform, "expand", None)
        return expand(out) if expand is not None else out

    def _compute_and_publish(self, raw: dict, path: str) -> dict:
        try:
            out = self._compute(raw)
        except BaseException:
            _touch(path + ".err")
            raise
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            parts = encode_sample(out)
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | _NOFOLLOW, 0o600)
            try:
                _write_all(fd, parts)
            finally:
                os.close(fd)
            os.replace(tmp, path + ".bin")
        except (OSError, TypeError, ValueError) as exc:  # a full /dev/shm, a value JSON cannot hold
            self.stats.write_failed += 1
            _unlink(tmp)
            _touch(path + ".err")
            if self.stats.write_failed == 1:
                warnings.warn(f"SharedMediaTransform: cannot publish results in {os.path.dirname(path)} "
                              f"({type(exc).__name__}: {exc}); CP peers compute these samples themselves",
                              stacklevel=2)
        return self._finish(out)

    # ---- the others ----
    def _wait(self, raw: dict, path: str) -> dict:
        delay = 0.0005
        while True:
            try:
                out = decode_sample(_map(path + ".bin"))
            except (OSError, ValueError):
                out = None
            if out is not None:
                self.stats.shared += 1
                self._mark_read(path)
                return self._finish(out)
            if os.path.exists(path + ".err"):
                return self._finish(self._compute(raw))
            owner, age = _claim(path + ".claim")
            if owner is None and age is None:  # claim gone: the result was read by all and deleted, or swept
                return self._finish(self._compute(raw))
            if owner is not None and not _alive(owner):
                self.stats.took_over_dead += 1
                return self._retake(raw, path)
            if age is not None and age > self.timeout:
                self.stats.took_over_timeout += 1
                return self._finish(self._compute(raw))
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def _retake(self, raw: dict, path: str) -> dict:
        """The claimer died: claim again (the pid in the file is replaced) and publish for the others."""
        try:
            with open(path + ".claim", "w") as f:
                f.write(str(os.getpid()))
        except OSError:
            return self._finish(self._compute(raw))
        return self._compute_and_publish(raw, path)

    def _mark_read(self, path: str) -> None:
        _touch(f"{path}.r{self.cp_rank}")
        readers = [f"{path}.r{k}" for k in range(self.cp_size)]
        if sum(os.path.exists(r) for r in readers) >= self.cp_size - 1:  # every other rank has it
            for p in (path + ".bin", path + ".err", *readers, path + ".claim"):
                _unlink(p)

    def _sweep(self, d: str, _last: dict = {}) -> None:
        """Delete entries older than ``ttl`` (at most once per ``ttl / 4`` seconds per process)."""
        now = time.time()
        if now - _last.get(d, 0.0) < self.ttl / 4:
            return
        _last[d] = now
        try:
            with os.scandir(d) as it:
                for entry in it:
                    try:
                        if now - entry.stat().st_mtime > self.ttl:
                            _unlink(entry.path)
                    except OSError:
                        pass
        except OSError:
            pass


def _write_all(fd: int, parts: list) -> None:
    total = sum(memoryview(p).nbytes for p in parts)
    written = os.writev(fd, parts)
    if written != total:  # a short write (rare): the rest one buffer at a time
        rest = b"".join(bytes(memoryview(p).cast("B")) for p in parts)[written:]
        while rest:
            rest = rest[os.write(fd, rest):]


def _map(path: str):
    """The file as a private (copy-on-write) mapping: its tensors cost no copy and stay valid after
    the file is deleted."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ValueError("empty")
        return mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _private_dir(d: str) -> None:
    """Create ``d`` (mode 0o700) or accept it only when it is a folder of this user that no one else can
    write, never a link: another local user could otherwise plant results or links in a shared
    ``/dev/shm``. An ``OSError`` here makes the caller compute the sample itself."""
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"{d}: not a folder only this user can write (mode {oct(st.st_mode)}, "
                              f"uid {st.st_uid})")


def _touch(path: str) -> None:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY | _NOFOLLOW, 0o600))
    except OSError:
        pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _claim(path: str) -> tuple[int | None, float | None]:
    """(pid, age in seconds) of a claim file; (None, None) when there is none."""
    try:
        with open(path) as f:
            text = f.read()
        age = time.time() - os.stat(path).st_mtime
    except OSError:
        return None, None
    try:
        return int(text), age
    except ValueError:  # being written right now
        return None, age


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
