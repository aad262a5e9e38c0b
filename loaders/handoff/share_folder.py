"""A node-local folder through which the CP ranks of one group share results: the first to get to a
key computes, the others read (no pickle, no deadlock). Used by
:class:`~prealign.loaders.handoff.media_share.SharedMediaTransform` (per sample) and
:class:`~prealign.loaders.handoff.batch_share.BatchShare` (per micro-batch).

    folder (node-local, private: mode 0o700, this user's, never a link)
    <key>.claim   the claimer's, locked (flock) by it until it publishes   (who is computing)
                  or fails: made under a temporary name, locked, then linked
                  here (O_EXCL-like); its pid inside is for people only
    <key>.bin     the result: a slot header page (:mod:`~prealign.loaders.handoff.slots`: holder
                  flags, the key), then ``PRMS1\\n``, a JSON header, raw tensor bytes (never
                  pickled, read by mmap);
                  written to ``<key>.<pid>.tmp`` (O_EXCL|O_NOFOLLOW), or a pooled slot file linked
                  there (:meth:`SharedFolder.publish_slot`: no copy), then renamed (atomic)
    <key>.err     the claimer failed: every rank computes for itself  (bad data raises locally)
    <key>.r<k>    CP rank k has the result (the claimer's rank marks itself; a second request of
                  that rank, e.g. its worker after its index pass, reads without using up the
                  peers' turn); the last rank to read deletes  (clean-up)

:meth:`SharedFolder.acquire` answers ``CLAIMED`` (compute, then :meth:`~SharedFolder.publish` or
:meth:`~SharedFolder.failed`), ``HIT`` with the record, or ``LOCAL`` (compute without publishing). A
waiter polls with a short backoff and stops waiting when nobody holds the claim's lock (its claimer
died: the waiter takes the lock and so the claim, a SIGKILLed worker's batch is then computed once
more; no pid is looked at, so PID namespaces and reused pids cannot fool it), when the claim is
older than ``timeout`` (a slow peer), when the claimer failed, or when the record is refused (not a
regular file of this user that no one else can write, a malformed header, sizes that do not add up).
Results nobody read are removed by their claimer at its exit (:func:`clean_up`), else swept after
``ttl``; the folders of runs that are over are swept too (:func:`sweep_dead_runs`). Only the
protocol's own names are ever deleted. The protocol and its invariants: ``PROTOCOL.md`` beside this
file.

>>> parts = encode_record({"a": torch.arange(3), "n": 2})
>>> rec = decode_record(bytearray(b"".join(bytes(p) for p in parts)))
>>> rec["a"].tolist(), rec["n"]
([0, 1, 2], 2)
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import re
import stat
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from prealign.loaders.errors import ShareRecordError
from prealign.loaders.handoff import slots

_MAGIC = b"PRMS1\n"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_LAST_SWEEP: dict[str, float] = {}
"""When each share folder was last swept by this process (``time.time()``)."""
_HELD: dict[str, int] = {}
"""The claims this process holds: ``<folder>/<key>`` -> the fd whose ``flock`` keeps the claim
alive."""

CLAIMED, HIT, LOCAL = "claimed", "hit", "local"
_TORCH_DTYPES = frozenset(
    {
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    }
)
"""numpy dtypes ``torch.from_numpy`` takes (bfloat16 travels as int16); anything else is refused."""


def encode_record(record: dict) -> list:
    """dict -> the buffers of one record (write them in order, e.g. ``os.writev``): ``PRMS1\\n``, a
    uint32 header length, a JSON header (each tensor's dtype, shape, byte offset and size; the other
    values as JSON), then the raw tensor bytes. Never pickled: a value JSON cannot hold raises
    ``TypeError``."""
    header: dict[str, Any] = {"order": list(record), "tensors": {}, "values": {}}
    blobs, offset = [], 0
    for name, value in record.items():
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


def decode_record(buf, start: int = 0) -> dict:
    """Inverse of :func:`encode_record` (``buf``: the joined record from byte ``start``, e.g. a
    private mmap of a record file), keys in their written order; the tensors share ``buf``'s memory.
    A malformed record is a :class:`ShareRecordError`."""
    if bytes(buf[start : start + len(_MAGIC)]) != _MAGIC:
        raise ShareRecordError("not a prealign share record")
    n = int.from_bytes(buf[start + len(_MAGIC) : start + len(_MAGIC) + 4], "little")
    start += len(_MAGIC) + 4
    try:
        header = json.loads(bytes(buf[start : start + n]))
        tensors, values = dict(header["tensors"]), dict(header["values"])
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise ShareRecordError(f"unreadable share record header ({exc})") from None
    if start + n > len(buf):
        raise ShareRecordError(f"share record header of {n} bytes past the end ({len(buf)} bytes)")
    base = start + n
    out: dict[str, Any] = dict(values)
    for name, spec in tensors.items():
        try:
            dtype, shape, offset, nbytes = spec
            np_dtype = np.dtype(np.int16 if dtype == "bfloat16" else dtype)
            shape = list(shape)
        except (ValueError, TypeError) as exc:
            raise ShareRecordError(f"tensor {name!r}: bad header entry {spec!r} ({exc})") from None
        if (
            np_dtype.name not in _TORCH_DTYPES
            or not np_dtype.isnative
            or len(shape) > 32
            or not all(type(d) is int and 0 <= d < 2**62 for d in shape)
        ):
            raise ShareRecordError(f"tensor {name!r}: refused dtype {dtype} / shape {shape}")
        itemsize = np_dtype.itemsize
        count = bound = 1
        for d in shape:  # Python ints: no int64 overflow can make a huge shape look small
            count *= d
            bound *= max(d, 1)
        if (
            type(offset) is not int
            or type(nbytes) is not int
            or offset < 0
            or bound >= 2**62
            or nbytes != count * itemsize
            or base + offset + nbytes > len(buf)
        ):
            raise ShareRecordError(
                f"tensor {name!r}: {nbytes} bytes at {offset} do not hold {dtype} {shape}"
            )
        arr = np.frombuffer(
            buf, dtype=np.dtype(np_dtype.name), count=nbytes // itemsize, offset=base + offset
        )
        try:  # (the canonical dtype of its name: numpy's aliases such as "Q" are not all torch's)
            t = torch.from_numpy(arr).reshape(shape)
        except (TypeError, RuntimeError) as exc:
            raise ShareRecordError(
                f"tensor {name!r}: {dtype} {shape} refused by torch ({exc})"
            ) from None
        out[name] = t.view(torch.bfloat16) if dtype == "bfloat16" else t
    order = header.get("order")
    if (
        isinstance(order, list)
        and all(type(k) is str for k in order)
        and len(order) == len(out)
        and set(order) == out.keys()
    ):
        out = {k: out[k] for k in order}
    return out


@dataclass
class ShareStats:
    """Per-process counts: results computed here, read from a peer, and why a wait ended in
    computing."""

    computed: int = 0
    shared: int = 0
    took_over_dead: int = 0
    took_over_timeout: int = 0
    write_failed: int = 0
    refused: int = 0


@dataclass
class SharedFolder:
    """The claim / publish / read protocol over one folder (see the module docstring)."""

    directory: str
    cp_rank: int
    cp_size: int
    timeout: float = 30.0
    ttl: float = 300.0
    stats: ShareStats = field(default_factory=ShareStats)
    owner: str = "SharedFolder"
    """Name used in the one warning about an unwritable folder."""

    def acquire(self, key: str, *, by_fd: bool = False) -> tuple[str, Any]:
        """``(CLAIMED, None)``: compute and publish; ``(HIT, record)``; ``(LOCAL, None)``: compute
        only. ``by_fd``: a hit is ``(fd, nbytes)`` of the record's slot file instead, with this
        rank's holder flag set (hand it on with :func:`~prealign.loaders.handoff.slots.send`; the
        receiver clears the flag)."""
        path = os.path.join(self.directory, key)
        for attempt in (0, 1):
            try:
                private_dir(self.directory)
                claimed = _claim(path)
                break
            except (
                FileNotFoundError
            ):  # the folder went between the two (an exiting peer removed it, empty)
                if attempt:
                    self.stats.write_failed += 1
                    return LOCAL, None
            except OSError:
                self.stats.write_failed += 1
                return LOCAL, None
        if not claimed:
            return self._wait(path, key, by_fd)
        _own(path, self.cp_rank, self.cp_size, _HELD[path])
        self._sweep()
        return CLAIMED, None

    def publish(self, key: str, record: dict) -> bool:
        """Write ``record`` for the peers (atomic rename); on failure mark the key failed (peers
        compute)."""
        path = os.path.join(self.directory, key)
        tmp = f"{path}.{_me()}.tmp"
        try:
            parts = [slots.header(key), *encode_record(record)]
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | _NOFOLLOW, 0o600)
            try:
                slots.write_at(fd, parts)
            finally:
                os.close(fd)
            self._appear(path, tmp)
            _let_go(path)
            return True
        except (OSError, TypeError, ValueError) as exc:  # a full /dev/shm, a value JSON cannot hold
            return self._cannot_publish(path, tmp, exc)

    def publish_slot(self, key: str, slot) -> bool:
        """Publish the record already written in ``slot`` (a named pooled slot file in this folder,
        its key set) under ``key`` without copying it: the slot's file is linked to the record's
        name."""
        path = os.path.join(self.directory, key)
        tmp = f"{path}.{_me()}.tmp"
        try:
            slot.link(tmp)
            self._appear(path, tmp)
            slot.published = path + ".bin"
            _let_go(path)
            return True
        except OSError as exc:
            return self._cannot_publish(path, tmp, exc)

    def _appear(self, path: str, tmp: str) -> None:
        _touch(
            f"{path}.r{self.cp_rank}"
        )  # this rank has it (before the peers can see it: a peer's read
        os.replace(
            tmp, path + ".bin"
        )  # then finds every marker) and its own later request never frees it

    def _cannot_publish(self, path: str, tmp: str, exc: Exception) -> bool:
        self.stats.write_failed += 1
        _unlink(tmp)
        _touch(path + ".err")
        _let_go(path)
        if self.stats.write_failed == 1:
            warnings.warn(
                f"{self.owner}: cannot publish results in {self.directory} ({type(exc).__name__}: "
                f"{exc}); CP peers compute them themselves",
                stacklevel=4,
            )
        return False

    def failed(self, key: str) -> None:
        """The claimer could not compute ``key``: every peer computes it itself (and meets the same
        error)."""
        path = os.path.join(self.directory, key)
        _touch(path + ".err")
        _let_go(path)

    # ---- waiting -------------------------------------------------------------------------------
    def _read(self, path: str, key: str, by_fd: bool):
        """The published record of ``key`` (see :meth:`acquire`), or None when it is not (or no
        longer) there. ``by_fd`` is honoured for this rank's first turn only (one holder flag per
        rank: a second request, e.g. the claimer's own rank asking again, gets a copy read into
        private memory)."""
        fd = open_record(path + ".bin")  # (the common case while waiting: not there yet, OSError)
        try:
            if not slots.is_slot_file(fd):
                raise ShareRecordError(f"{path}.bin: not a prealign record file")
            marker = f"{path}.r{self.cp_rank}"
            if by_fd and _first_turn(marker):
                _own(path, self.cp_rank, self.cp_size)
                with slots.key_lock(
                    fd, exclusive=False
                ):  # the flag, then the key: a reused slot shows another
                    slots.hold(fd, self.cp_rank)
                    mine = slots.key_of(fd) == key
                if not mine:
                    _unlink(marker)
                    os.close(fd)
                    return None
                size = os.fstat(fd).st_size
                decode_record(
                    _map_private(fd, size), start=slots.HEADER
                )  # checks the header and sizes
                return fd, size - slots.HEADER
            with slots.key_lock(
                fd, exclusive=False
            ):  # a slot is not reused while its key is read and copied
                data = _read_all(fd) if slots.key_of(fd) == key else None
            if data is None:
                os.close(fd)
                return None
            record = decode_record(data, start=slots.HEADER)
        except BaseException:
            os.close(fd)  # (a flag it set stays set: the slot is then never reused, only dropped)
            raise
        os.close(fd)
        return record

    def _wait(self, path: str, key: str, by_fd: bool) -> tuple[str, Any]:
        """Poll for the record with a short backoff (0.5 ms doubling to 20 ms); the claim (failed,
        gone, dead, too old) is looked at every 50 ms only: a poll is then one failed ``open``."""
        delay, check, started = 0.0005, 0.0, time.monotonic()
        while True:
            try:
                record = self._read(path, key, by_fd)
            except OSError:
                record = None
            except ShareRecordError:
                self.stats.refused += 1
                return LOCAL, None
            if record is not None:
                self.stats.shared += 1
                self._mark_read(path)
                return HIT, record
            now = time.monotonic()
            if now < check:
                time.sleep(delay)
                delay = min(delay * 2, 0.02)
                continue
            check = now + 0.05
            if os.path.exists(path + ".err"):
                return LOCAL, None
            try:
                fd = os.open(path + ".claim", os.O_RDWR | _NOFOLLOW | os.O_CLOEXEC)
            except OSError:  # claim gone: read by all and deleted, or swept
                return LOCAL, None
            try:
                if slots.try_lock(fd):
                    if os.path.exists(
                        path + ".bin"
                    ):  # published, then its claimer let go (or exited)
                        if (
                            now - started > self.timeout
                        ):  # yet unreadable all this while: load it here
                            self.stats.took_over_timeout += 1
                            return LOCAL, None
                        continue
                    if _retake(path, fd):
                        _own(path, self.cp_rank, self.cp_size, fd)
                        self.stats.took_over_dead += 1
                        fd = None  # held, as this process's claim now
                        return CLAIMED, None
                    return LOCAL, None  # (the name went meanwhile: read by all, or swept)
                if time.time() - os.fstat(fd).st_mtime > self.timeout:
                    self.stats.took_over_timeout += 1
                    return LOCAL, None
            finally:
                if fd is not None:
                    os.close(fd)
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def _mark_read(self, path: str) -> None:
        _touch(f"{path}.r{self.cp_rank}")
        _own(path, self.cp_rank, self.cp_size)
        readers = [f"{path}.r{k}" for k in range(self.cp_size)]
        if all(
            os.path.exists(r) for r in readers
        ):  # every rank has it (the claimer marked itself); the claim
            for p in (
                path + ".claim",
                path + ".bin",
                path + ".err",
                *readers,
            ):  # first: with the record still
                _unlink(p)  # there, a waiter reads it rather than taking a claim it finds unlocked

    def _sweep(self, last: dict[str, float] | None = None) -> None:
        """Delete entries older than ``ttl`` (at most once per ``ttl / 4`` seconds per process, by
        ``last``: when each folder was last swept, this process's record by default)."""
        last = _LAST_SWEEP if last is None else last
        now, d = time.time(), self.directory
        if now - last.get(d, 0.0) < self.ttl / 4:
            return
        last[d] = now
        try:
            with os.scandir(d) as it:
                for entry in it:
                    try:
                        if slots.is_slot_name(
                            entry.name
                        ):  # a pooled slot: kept while its process lives
                            if slots.abandoned(entry.path):
                                _unlink(entry.path)
                        elif (
                            is_entry_name(entry.name)
                            and now - entry.stat(follow_symlinks=False).st_mtime > self.ttl
                        ):
                            _unlink(entry.path)
                    except OSError:
                        pass
        except OSError:
            pass
        sweep_dead_runs(os.path.dirname(d), self.ttl, keep=d)


def _me() -> str:
    """This process and thread, for names no other writer uses at the same time."""
    return f"{os.getpid()}-{threading.get_ident()}"


def open_record(path: str) -> int:
    """A read-write fd of the record file ``path``: only a regular file of this user that no one
    else can write, opened without following a link; anything else is a :class:`ShareRecordError` (a
    missing file: ``OSError``). Read-write so that a reader can set its holder flag
    (:mod:`~prealign.loaders.handoff.slots`)."""
    try:
        fd = os.open(path, os.O_RDWR | _NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the name is a link
            raise ShareRecordError(f"{path}: a link, not a record") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise ShareRecordError(
                f"{path}: not a regular file only this user can write (mode {oct(st.st_mode)}, "
                f"uid {st.st_uid})"
            )
        if st.st_size <= slots.HEADER:
            raise ShareRecordError(f"{path}: {st.st_size} bytes, too short for a record")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _first_turn(marker: str) -> bool:
    """Create this rank's read marker; False when it exists (the rank has the record already)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY | _NOFOLLOW, 0o600))
    except OSError:
        return False
    return True


def _read_all(fd: int) -> bytearray:
    """The whole file in private memory (a copy no later write to the file can reach)."""
    data = bytearray(os.fstat(fd).st_size)
    view, done = memoryview(data), 0
    while done < len(data):
        n = os.preadv(fd, [view[done:]], done)
        if n == 0:
            raise ShareRecordError(f"record file shrank while read ({done} of {len(data)} bytes)")
        done += n
    return data


def _map_private(fd: int, size: int):
    """The file as a private (copy-on-write) mapping: its tensors cost no copy and stay valid after
    the file is deleted or the fd closed."""
    return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def private_dir(d: str) -> None:
    """Create ``d`` (mode 0o700) or accept it only when it is a folder of this user that no one else
    can write, never a link: another local user could otherwise plant results or links in a shared
    ``/dev/shm``. An ``OSError`` here makes the caller compute for itself."""
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(
            f"{d}: not a folder only this user can write (mode {oct(st.st_mode)}, uid {st.st_uid})"
        )


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


def _claim(path: str) -> bool:
    """Claim ``path`` (``<folder>/<key>``): a file made under a temporary name, ``flock``-ed, then
    linked to ``<key>.claim`` (so no one ever sees it unlocked while its claimer lives); False when
    a claim is there. The lock is held (:data:`_HELD`) until :func:`_let_go` or the process dies."""
    tmp = f"{path}.{_me()}.claiming"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | _NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, str(os.getpid()).encode())  # (for people; the protocol never reads it)
        os.link(tmp, path + ".claim", follow_symlinks=False)
    except FileExistsError:
        os.close(fd)
        return False
    except BaseException:
        os.close(fd)
        raise
    finally:
        _unlink(tmp)
    _HELD[path] = fd
    return True


def _retake(path: str, fd: int) -> bool:
    """The claim ``fd`` of ``path``, whose lock this waiter just took (its claimer died), becomes
    this process's, if ``<key>.claim`` still names that file: its age restarts and it is held like a
    new one."""
    try:
        st, now = os.fstat(fd), os.stat(path + ".claim", follow_symlinks=False)
        if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        os.utime(fd)
    except OSError:
        return False
    _HELD[path] = fd
    return True


def _let_go(path: str) -> None:
    """Release this process's claim of ``path`` (published or failed: the waiters no longer need
    it)."""
    fd = _HELD.pop(path, None)
    if fd is not None:
        os.close(fd)


def _forget_claims() -> None:
    """In a forked child: the parent's claims are not the child's (closing its copies keeps the
    parent's locks, which belong to the open files, not to the descriptors), nor are its files to
    remove at exit."""
    for fd in _HELD.values():
        os.close(fd)
    _HELD.clear()
    _OWN.clear()
    _DIRS.clear()
    _EXIT_HOOK[0] = 0


# ---- what this process made, removed at its exit
# ----------------------------------------------------------
_ENTRY = re.compile(
    r"[A-Za-z0-9][A-Za-z0-9-]*\.(claim|bin|err|r[0-9]+|[0-9]+-[0-9]+\.(tmp|claiming))"
)
_RUN_FOLDER = re.compile(r"prealign-(batch|media)-[0-9a-f]{16}")
_OWN: dict[str, tuple[int, int, tuple[int, int] | None]] = {}
"""``<folder>/<key>`` -> (cp_rank, cp_size, the claim's (st_dev, st_ino)): keys this process claimed
(or, claim None, read: its ``.r<k>`` marker only). Pruned of keys whose files are all gone."""
_DIRS: set[str] = set()
_EXIT_HOOK = [0]  # the pid whose exit hook is registered
_PRUNE_AT = [4096]


def is_entry_name(name: str) -> bool:
    """``name`` is one the protocol makes in a share folder (a key's file or a pooled slot), never a
    user's file: only such names are ever deleted."""
    return _ENTRY.fullmatch(name) is not None or slots.is_slot_name(name)


def _own(path: str, cp_rank: int, cp_size: int, claim_fd: int | None = None) -> None:
    """Remember that this process made files of ``path`` (claimed it, with its claim ``claim_fd``,
    or only read it), to remove them at its exit (:func:`clean_up`)."""
    if _EXIT_HOOK[0] != os.getpid():
        _register_exit_hook()
    if claim_fd is None:
        if path in _OWN:
            return
        ident = None
    else:
        st = os.fstat(claim_fd)
        ident = (st.st_dev, st.st_ino)
    _OWN[path] = (cp_rank, cp_size, ident)
    _DIRS.add(os.path.dirname(path))
    if len(_OWN) >= _PRUNE_AT[0]:
        for p, entry in list(_OWN.items()):
            if not any(os.path.lexists(n) for n in _names(p, entry)):
                del _OWN[p]
        _PRUNE_AT[0] = max(4096, 2 * len(_OWN))


def _names(path: str, entry: tuple) -> list[str]:
    rank, size, ident = entry
    if ident is None:
        return [f"{path}.r{rank}"]
    return [path + ".claim", path + ".bin", path + ".err", *(f"{path}.r{k}" for k in range(size))]


def clean_up() -> None:
    """Remove what this process made in share folders: its claims with their records (read by every
    peer or not), ``.err`` files and read markers, and its own read markers of the peers' records;
    then every folder it used that is left empty. A key claimed anew by another process since (its
    ``.claim`` is another file) is left alone. Run at exit (multiprocessing's exit hook: a
    DataLoader worker exits through it, not through ``atexit``: see :func:`_register_exit_hook`); a
    peer that comes later computes what it finds gone."""
    for fd in _HELD.values():
        os.close(fd)
    _HELD.clear()
    for path, entry in list(_OWN.items()):
        if entry[2] is not None:
            try:
                st = os.stat(path + ".claim", follow_symlinks=False)
                if (st.st_dev, st.st_ino) != entry[2]:
                    continue
            except OSError:
                pass
        for name in _names(path, entry):
            _unlink(name)
    _OWN.clear()
    for d in list(_DIRS):
        try:
            os.rmdir(d)  # only when empty (a peer's files, or a user's, keep it)
        except OSError:
            pass
    _DIRS.clear()


def _register_exit_hook() -> None:
    """:func:`clean_up` at this process's exit, once per process (multiprocessing's exit hook, which
    a DataLoader worker runs when it exits normally: the loaders shut their persistent workers down
    that way when the main process exits, :mod:`prealign.loaders.core`). No ``SIGTERM`` handler: one
    cannot run while a worker is stuck in C code, and would make it unkillable; what a killed worker
    left is swept (``ttl``, :func:`sweep_dead_runs`)."""
    from multiprocessing.util import Finalize

    _EXIT_HOOK[0] = os.getpid()
    Finalize(None, clean_up, exitpriority=5)


def sweep_dead_runs(base: str, ttl: float, keep: str | None = None) -> None:
    """Remove the share folders (``prealign-batch-*``, ``prealign-media-*``, this user's) in
    ``base`` of runs that are over: every claim's lock free, no pooled slot's lock held, and every
    file older than ``ttl``. Only names the protocol makes are deleted (a folder holding anything
    else stays). ``keep``: a folder in use here, never touched."""
    now = time.time()
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        d = os.path.join(base, name)
        if not _RUN_FOLDER.fullmatch(name) or d == keep:
            continue
        try:
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            entries = os.listdir(d)
            if not all(is_entry_name(e) for e in entries) or not all(
                _dead(os.path.join(d, e), now, ttl) for e in entries
            ):
                continue
            for e in entries:
                _unlink(os.path.join(d, e))
            os.rmdir(d)
        except OSError:
            continue


def _dead(path: str, now: float, ttl: float) -> bool:
    """An entry of a run that is over: older than ``ttl``, and no live process's lock on it."""
    st = os.lstat(path)
    if now - st.st_mtime <= ttl or not stat.S_ISREG(st.st_mode):
        return False
    if slots.is_slot_name(os.path.basename(path)):
        return slots.abandoned(path)
    if not path.endswith(".claim"):
        return True
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_CLOEXEC)
    try:
        return slots.try_lock(fd)
    finally:
        os.close(fd)


os.register_at_fork(after_in_child=_forget_claims)
