"""Each sample's media processed once per CP group: a transform wrapper sharing results through a
node-local cache.

The CP ranks of one DP group load the same micro-batches (each keeps its own CP shard of them), so
without sharing every rank decodes and processes every image. :class:`SharedMediaTransform` wraps
the sample transform (e.g. :class:`~prealign.loaders.media.vlm.VLMSampleTransform`); for each sample
the first process of the group to get there *claims* it, transforms it and publishes the result; the
others read the result instead of computing it (the folder protocol is
:mod:`prealign.loaders.handoff.share_folder`'s, shared with
:class:`~prealign.loaders.handoff.batch_share.BatchShare`, which shares whole collated micro-batches
and also saves the shard reads and collation):

    cache dir (node-local, e.g. /dev/shm/prealign-media-<digest of run>)
    <h>.claim   the claimer's, flock-ed by it until it publishes        (who is computing)
    <h>.bin     the transformed sample: a JSON header + raw tensor      (the result; never
                bytes, written to a temporary name then renamed (atomic) pickled, read by mmap)
    <h>.err     the claimer's transform failed: every rank runs it      (bad samples raise locally)
    <h>.r<k>    CP rank k has read the result; the last reader deletes  (clean-up)

``h`` is a digest of ``run``, the wrapped transform's configuration (its fingerprint,
:mod:`~prealign.loaders.handoff.fingerprint`: its code, the globals it reads and its state, or
``transform_key``; a transform holding what has no stable form is refused) and the raw sample (its
``__key__``, ``__url__`` and every member's bytes): a changed file never reuses a stale result. It
holds no epoch: a result is deleted once every peer has read it, so each epoch computes afresh, and
a peer far behind still finds it (or computes it). A transform with ``compact``/``expand``
(``VLMSampleTransform``: uint8 resized patches instead of float32 ``pixel_values``, 1/8 of the
bytes) publishes the compact form; every rank expands it itself.

No deadlock: a waiter polls with a short backoff and computes the sample itself when the claimer's
process is gone (nobody holds the claim's lock: a killed or restarted worker), when the claim is
older than ``timeout`` seconds (a slow rank), or when the cache cannot be written. Outputs never
depend on who computed them (the transform is deterministic), so batches are the same as without
sharing on every rank and resuming is exactly the loader's own. Results nobody read (a peer that
died, or an index pass split over ranks) are deleted after ``ttl`` seconds by the next sweep.

Limits:
- node-local (``/dev/shm``): a CP group spanning nodes shares within each node (each node's part of
  the group computes each sample once; correctness is unaffected).
- the peers must wrap the same transform configuration and agree on ``run`` and ``cp_size`` (``run``
  should name the job and the DP rank: DP peers load other samples, sharing with them only wastes
  writes).
- the peers must share the cache's file system (one ``/dev/shm``); PID namespaces do not matter (the
  liveness check is a ``flock``, see ``PROTOCOL.md``).
- workers of one rank never share with each other (they load different micro-batches); the CPU saved
  is the transform's: reading the shards, collation and the worker hand-off stay per rank.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from prealign.loaders.handoff.fingerprint import transform_fingerprint
from prealign.loaders.handoff.identity import identity_fields
from prealign.loaders.handoff.share_folder import CLAIMED, HIT, SharedFolder, ShareStats
from prealign.loaders.handoff.share_folder import decode_record as decode_sample
from prealign.loaders.handoff.share_folder import encode_record as encode_sample
from prealign.schemas.checks import int_at_least
from prealign.schemas.errors import ConfigError

__all__ = ["SharedMediaTransform", "ShareStats", "decode_sample", "encode_sample"]


@dataclass(frozen=True, kw_only=True)
class SharedMediaTransform:
    """``transform`` with its results shared by the ``cp_size`` CP ranks of a group on one node.

    Args:
        transform: the sample transform (deterministic: the same raw sample gives the same output).
        run: a name the CP peers agree on (e.g. the job id plus the DP rank); part of every cache
        key. cp_rank, cp_size: this rank's place in its CP group (``cp_size == 1``: no sharing at
        all). cache_dir: node-local directory (default ``/dev/shm`` when present, else the temp
        dir). timeout: seconds a claim is honoured before a waiter computes the sample itself.
        ttl: seconds after which unread results and stale claims are swept.
        transform_key: names ``transform``'s configuration in the keys instead of its fingerprint
            (needed only for a transform holding what has no stable form: an open file, a socket).

    Use it as the source's transform; nothing else changes::

        transform = SharedMediaTransform(transform=VLMSampleTransform(tokenizer=tok),
                                         run=f"{job}-dp{dp_rank}", cp_rank=cp_rank, cp_size=cp_size)
    """

    transform: Callable[[dict], dict]
    run: str
    cp_rank: int
    cp_size: int
    cache_dir: str | None = None
    timeout: float = 30.0
    ttl: float = 300.0
    transform_key: str | None = None
    stats: ShareStats = field(default_factory=ShareStats, compare=False, repr=False)
    _config: str = field(default="", init=False, compare=False, repr=False)

    def __post_init__(self):
        for name in ("cp_rank", "cp_size"):
            value = getattr(self, name)
            value = int_at_least(f"SharedMediaTransform.{name}", value, 0, ConfigError)
            object.__setattr__(self, name, value)
        if self.cp_size < 1 or self.cp_rank >= self.cp_size:
            raise ConfigError(
                f"SharedMediaTransform: expected 0 <= cp_rank < cp_size, got "
                f"cp_rank={self.cp_rank}, cp_size={self.cp_size}"
            )
        if not isinstance(self.run, str) or not self.run:
            raise ConfigError(
                f"SharedMediaTransform.run: expected a non-empty str, got {self.run!r}"
            )
        if not (self.timeout > 0 and self.ttl > self.timeout):
            raise ConfigError(
                f"SharedMediaTransform: expected timeout > 0 and ttl > timeout, got timeout="
                f"{self.timeout}, ttl={self.ttl}"
            )
        if self.cp_size > 1:  # taken once, here: the workers get it as a string
            object.__setattr__(
                self,
                "_config",
                transform_fingerprint(
                    self.transform, owner="SharedMediaTransform", key=self.transform_key
                ),
            )

    def identity_fields(self) -> dict[str, str]:
        """The wrapped transform's (:mod:`~prealign.loaders.handoff.identity`): sharing changes no
        result."""
        return identity_fields(self.transform)

    # public attributes of the wrapped transform (processor, vision, spatial_merge_size, ...) stay
    # reachable
    def __getattr__(self, name: str):
        if name.startswith("__") or name == "transform":
            raise AttributeError(name)
        return getattr(self.transform, name)

    @property
    def directory(self) -> str:
        """The cache directory of this run (created on first use)."""
        base = self.cache_dir or (
            "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        )
        run = hashlib.blake2b(self.run.encode(), digest_size=8).hexdigest()
        return os.path.join(base, f"prealign-media-{run}")

    def key(self, raw: dict) -> str:
        """Digest of the run, the transform's configuration, the sample's name and every member's
        bytes (same input and configuration -> same key)."""
        h = hashlib.blake2b(
            self.run.encode() + b"\0" + self._config.encode() + b"\0", digest_size=16
        )
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

    def _folder(self) -> SharedFolder:
        return SharedFolder(
            self.directory,
            self.cp_rank,
            self.cp_size,
            timeout=self.timeout,
            ttl=self.ttl,
            stats=self.stats,
            owner="SharedMediaTransform",
        )

    def __call__(self, raw: dict) -> dict:
        if self.cp_size == 1:
            return self.transform(raw)
        folder = self._folder()
        key = self.key(raw)
        state, record = folder.acquire(key)
        if state == HIT:
            return self._finish(record)
        if state != CLAIMED:
            return self._finish(self._compute(raw))
        try:
            out = self._compute(raw)
        except BaseException:
            folder.failed(key)
            raise
        folder.publish(key, out)
        return self._finish(out)

    def _compute(self, raw: dict) -> dict:
        """The wrapped transform's result in its shared form (``compact`` when it has one)."""
        self.stats.computed += 1
        compact = getattr(self.transform, "compact", None)
        return compact(raw) if compact is not None else self.transform(raw)

    def _finish(self, out: dict) -> dict:
        expand = getattr(self.transform, "expand", None)
        return expand(out) if expand is not None else out
