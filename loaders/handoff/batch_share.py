"""Each micro-batch loaded, transformed and collated once per CP group: ``PackedLoader(...,
share=BatchShare(run=...))``.

The CP ranks of one DP group follow the same plan and load the same micro-batches; they differ only
in the CP shard they keep. With :class:`BatchShare`, the first rank (one of its DataLoader workers)
to reach micro-batch ``(epoch, position)`` loads it, collates it *unsharded* and publishes the
collated tensors once in a node-local folder (:mod:`prealign.loaders.handoff.share_folder`: raw
bytes behind a JSON header, never pickled, atomic rename, private folder); the other ranks map it
and apply only their CP shard: one ``index_select`` per CP-sharded token field (the rows of
:func:`~prealign.collate.indices.global_slots`). Each rank's batch is equal, field for field, to
what it gets without sharing.

No deadlock, same batches: a rank whose peer died (SIGKILLed worker), stalls past ``timeout``,
failed on the batch (a bad sample raises on every rank) or cannot write the folder, loads the
micro-batch itself. The key is a digest of ``run``, the DP rank, the loader's configuration (seed,
budget, layout, schema, planner...), the index digest, the source transform's identity (its
fingerprint, :mod:`~prealign.loaders.handoff.fingerprint`: its code, the module globals it reads and
its state; a transform holding what has no stable form, e.g. an open file, is refused unless
``transform_key`` names it), the epoch, the
position and the request's sample ids: DP peers, another run, another plan or another transform
configuration never read it, and resuming replays the same keys.

Limits:
- node-local (``/dev/shm``), for CP groups within one node: a record is deleted once every CP rank
  has read it, else by its claimer's process at exit (a worker's exit: the end of an epoch without
  ``persistent_workers``), else swept after ``ttl``; with a CP group spanning nodes records wait for
  that: do not use it across nodes.
- ``run`` must name the job (the same on the CP peers, another one for another job sharing the
  node); the peers must share the folder's file system (one ``/dev/shm``); PID namespaces do not
  matter (a claimer's liveness is its claim's ``flock``, see ``PROTOCOL.md``).
- the collator must be a :class:`~prealign.collate.THDCollator` (optionally inside
  :class:`~prealign.collate.mrope.MRoPECollator`); the shared batch holds the whole micro-batch, so
  ``/dev/shm`` briefly holds about one unsharded micro-batch per worker and rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Callable

import torch

from prealign.collate.indices import cp_chunks, global_slots
from prealign.collate.mrope import MRoPECollator
from prealign.collate.thd import THDCollator
from prealign.loaders.handoff import slots
from prealign.loaders.handoff.fetched import Fetched
from prealign.loaders.handoff.fingerprint import transform_fingerprint
from prealign.loaders.handoff.share_folder import (
    CLAIMED,
    HIT,
    SharedFolder,
    ShareStats,
    decode_record,
    encode_record,
)
from prealign.loaders.handoff.transport import own_small, pack_batch
from prealign.schemas.errors import ConfigError, PrealignError
from prealign.schemas.schema import Role


@dataclass(frozen=True, kw_only=True)
class BatchShare:
    """Share collated micro-batches between the CP ranks of a DP group on one node (opt-in).

    Args:
        run: a name the CP peers agree on and no other job uses (e.g. the job id); part of every
        key. cache_dir: node-local folder (default ``/dev/shm`` when present, else the temp dir).
        timeout: seconds a claim is honoured before a waiting rank loads the micro-batch itself.
        ttl: seconds after which results nobody read, and stale claims, are swept.
        transform_key: names the source transform's configuration in the keys instead of its
            fingerprint (:mod:`~prealign.loaders.handoff.fingerprint`: its code, the globals it
            reads, its state); needed only for a transform holding what has no stable form (an open
            file, a socket).

    ``PackedLoader(source, ..., cp_rank=cp_rank, share=BatchShare(run=os.environ["SLURM_JOB_ID"]))``
    """

    run: str
    cache_dir: str | None = None
    timeout: float = 30.0
    ttl: float = 300.0
    transform_key: str | None = None

    def __post_init__(self):
        if self.transform_key is not None and (
            not isinstance(self.transform_key, str) or not self.transform_key
        ):
            raise ConfigError(
                f"BatchShare.transform_key: expected a non-empty str or None, got "
                f"{self.transform_key!r}"
            )
        if not isinstance(self.run, str) or not self.run:
            raise ConfigError(f"BatchShare.run: expected a non-empty str, got {self.run!r}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, str):
            raise ConfigError(
                f"BatchShare.cache_dir: expected a str or None, got {self.cache_dir!r}"
            )
        for name in ("timeout", "ttl"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"BatchShare.{name}: expected seconds, got {value!r}")
        if not (self.timeout > 0 and self.ttl > self.timeout):
            raise ConfigError(
                f"BatchShare: expected timeout > 0 and ttl > timeout, got timeout={self.timeout}, "
                f"ttl={self.ttl}"
            )

    def directory(self) -> str:
        """The folder of this run (created on first use, mode 0o700)."""
        base = self.cache_dir or (
            "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        )
        return os.path.join(
            base, f"prealign-batch-{hashlib.blake2b(self.run.encode(), digest_size=8).hexdigest()}"
        )

    def attach(
        self,
        planned,
        collate: Callable,
        *,
        collator: Callable,
        cp_rank: int | None,
        scope: dict,
        transform=None,
    ):
        """``(dataset, collate_fn)`` for the DataLoader: ``planned`` (``__getitems__(request)``) and
        ``collate`` (the loader's collate_fn) wrapped so that a micro-batch published by a CP peer
        is read instead of loaded. ``scope``: plain data naming the plan (DP rank, configuration,
        index digest); ``transform``: the source's transform, whose configuration's fingerprint
        joins the key (a :class:`~prealign.schemas.errors.ConfigError` when it has none: see
        ``transform_key``). Without CP (``cp == 1``) they are returned as they are."""
        layout = getattr(collator, "layout", None)
        if layout is None or layout.cp == 1:
            return planned, collate
        whole = _unsharded(collator)
        rank = _inner(
            collator
        ).cp_rank  # the shard the collator makes is the one this rank must get
        if rank is None or (cp_rank is not None and cp_rank != rank):
            raise ConfigError(
                f"BatchShare: the collator's cp_rank is {rank}, the loader's {cp_rank}: sharing "
                f"needs each CP rank's own cp_rank (the same on the loader and its collator)"
            )
        cp_rank = rank
        scope = {
            **scope,
            "transform_config": transform_fingerprint(
                transform, owner="BatchShare", key=self.transform_key
            ),
        }
        digest = hashlib.blake2b(
            json.dumps([self.run, scope, repr(whole)], sort_keys=True, default=str).encode(),
            digest_size=16,
        ).hexdigest()
        folder = SharedFolder(
            self.directory(),
            cp_rank,
            layout.cp,
            timeout=self.timeout,
            ttl=self.ttl,
            owner="BatchShare",
        )
        shard = CPShard(
            schema=collator.schema,
            layout=layout,
            cp_rank=cp_rank,
            deferred=_inner(collator).defer_cp_shard,
        )
        pack = getattr(collate, "pack", False)
        by_fd = (
            pack and slots.available() and layout.cp <= slots.MAX_HOLDERS
        )  # records reach the main process as slot files
        return (
            _SharedPlanned(planned, folder, digest, by_fd),
            _SharedCollate(
                plain=collate,
                whole=dataclasses.replace(collate, collator=whole, pack=False),
                shard=shard,
                folder=folder,
                pack=pack,
                by_fd=by_fd,
            ),
        )


def _inner(collator) -> THDCollator:
    return collator.collator if isinstance(collator, MRoPECollator) else collator


def _unsharded(collator) -> Callable:
    """The same collator producing the whole micro-batch (``cp_rank=None``)."""
    inner = _inner(collator)
    if not isinstance(inner, THDCollator):
        raise ConfigError(
            f"BatchShare: the collator must be a THDCollator (optionally inside MRoPECollator), "
            f"got {type(inner).__name__}"
        )
    whole = dataclasses.replace(inner, cp_rank=None, defer_cp_shard=False)
    return (
        dataclasses.replace(collator, collator=whole)
        if isinstance(collator, MRoPECollator)
        else whole
    )


@dataclass(frozen=True, kw_only=True)
class CPShard:
    """Whole THD batch (a ``cp_rank=None`` collator's output) -> this rank's batch, as the collator
    with ``cp_rank`` (and ``defer_cp_shard``) would have built it: every CP-sharded token field
    ``[*leading, 1, T]`` -> ``[*leading, 1, T/cp]`` by one ``index_select`` of the rank's global
    slots (``deferred``: the fields stay whole and ``cp_gather_index`` int64 ``[T/cp]`` is added),
    ``cp_rank`` set."""

    schema: object
    layout: object
    cp_rank: int | None
    deferred: bool = False

    def __call__(self, whole: dict) -> dict:
        if self.cp_rank is None:
            return dict(whole)
        cu_padded = whole["cu_seqlens_padded"]
        slots = global_slots(
            cp_chunks(cu_padded.diff().to(torch.int64), self.layout, self.cp_rank), cu_padded
        )
        sharded = {
            spec.name: spec.token_dim + 1
            for spec in self.schema.of_role(Role.TOKEN)
            if spec.cp_sharded and spec.name in whole
        }
        out = {}
        for name, value in whole.items():
            if name == "cp_rank" and not self.deferred:  # a deferred batch keeps -1 (whole rows)
                value = self.cp_rank
            elif name in sharded and not self.deferred:
                value = value.index_select(sharded[name], slots)
            out[name] = value
            if name == "max_seqlen" and self.deferred:
                out["cp_gather_index"] = slots
        return out


class _Token:
    """What the dataset wrapper tells the collate wrapper: the key and how it was acquired."""

    __slots__ = ("key", "state", "record")

    def __init__(self, key: str, state: str, record: dict | None = None):
        self.key, self.state, self.record = key, state, record


class _SharedPlanned:
    """The DataLoader dataset: a published micro-batch is read, not loaded (else the loader's
    own)."""

    def __init__(self, planned, folder: SharedFolder, digest: str, by_fd: bool = False):
        self.planned, self.folder, self.digest, self.by_fd = planned, folder, digest, by_fd

    def __len__(self) -> int:
        return len(self.planned)

    def key(self, request) -> str:
        ids = ",".join(map(str, request.indices))
        text = f"{self.digest}|{request.epoch}|{request.position}|{request.filler_of}|{ids}"
        digest = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        return f"e{request.epoch}-p{request.position}-{digest}"

    def __getitems__(self, request):
        key = self.key(request)
        state, record = self.folder.acquire(key, by_fd=self.by_fd)
        if state == HIT:
            return Fetched(request, None, self.planned.where, share=_Token(key, state, record))
        try:
            fetched = self.planned.__getitems__(request)
        except BaseException:
            if (
                state == CLAIMED
            ):  # the peers load it themselves at once instead of waiting out the claim
                self.folder.failed(key)
            raise
        return dataclasses.replace(fetched, share=_Token(key, state))


@dataclass(frozen=True, kw_only=True)
class _SharedCollate:
    """The collate_fn: a read batch is sharded; a claimed one is collated whole, published, then
    sharded; otherwise the loader's own collate_fn runs. ``by_fd`` (in workers): the whole record
    goes to the main process as its slot file (:mod:`~prealign.loaders.handoff.slots`), sharded
    there on arrival, so neither a reading nor the claiming rank copies the pixels again."""

    plain: Callable
    whole: Callable
    shard: CPShard
    folder: SharedFolder
    pack: bool
    by_fd: bool = False

    @property
    def stats(self) -> ShareStats:
        return self.folder.stats

    def __call__(self, fetched: Fetched):
        token, fetched = fetched.share, dataclasses.replace(fetched, share=None)
        if token.state == HIT:
            if isinstance(token.record, tuple):  # (fd, nbytes): the record file, handed on as it is
                fd, nbytes = token.record
                try:
                    return self._send(fd, nbytes)
                finally:
                    os.close(fd)
            return self._out(self.shard(token.record))
        if token.state != CLAIMED:
            return self.plain(fetched)
        if isinstance(fetched.samples, PrealignError):
            self.folder.failed(token.key)
            return fetched.samples
        try:
            whole = self.whole(fetched)
        except PrealignError as exc:
            self.folder.failed(token.key)
            if self.pack:
                return exc
            raise
        except BaseException:
            self.folder.failed(token.key)
            raise
        self.folder.stats.computed += 1
        if self.by_fd:
            sent = self._publish_slot(token.key, whole)
            if sent is not None:
                return sent
        self.folder.publish(token.key, whole)
        return self._out(self.shard(whole))

    def _publish_slot(self, key: str, whole: dict):
        """Write the whole record once into a pooled slot file of the folder, publish that file and
        send it to this rank's main process; None when no slot can hold it (then the plain way)."""
        try:
            parts = encode_record(whole)
            slot = slots.pool(
                ("share", self.folder.directory),
                slots.named_in(self.folder.directory),
                cap=_SHARED_SLOTS,
            ).take(sum(memoryview(p).nbytes for p in parts))
            nbytes = slot.write(parts)
            slot.hold(
                range(self.folder.cp_size)
            )  # every rank's main process will map it and let go of it
            slot.set_key(key)
        except (OSError, TypeError, ValueError):  # a full /dev/shm, a value JSON cannot hold
            return None
        if not self.folder.publish_slot(key, slot):  # the peers compute it; only this rank maps it
            slot.hold([self.folder.cp_rank])
        return self._send(slot, nbytes)

    def _send(self, slot, nbytes: int):
        """A record file (a slot or an fd) to this rank's main process, sharded there on arrival."""
        return slots.send(slot, nbytes, self.folder.cp_rank, ShardOnArrival(self.shard))

    def _out(self, batch: dict):
        return pack_batch(batch) if self.pack else batch


@dataclass(frozen=True)
class ShardOnArrival:
    """Builds a rank's batch in its main process from a received record (uint8 ``[nbytes]``, a
    private map of the slot file): decoded in place (the pixels are never copied) and CP-sharded;
    small fields are copied out (:func:`~prealign.loaders.handoff.transport.own_small`: a kept
    ``cu_seqlens`` pins no file)."""

    shard: CPShard

    def __call__(self, buffer: torch.Tensor) -> dict:
        return own_small(self.shard(decode_record(buffer.numpy())))


_SHARED_SLOTS = 12
"""Pooled slots per claiming worker: a published record is reused only once every CP rank dropped
it, so the pool spans the ranks' drift (a smaller pool makes fresh memory for each batch while a
rank lags)."""
