"""Recycled shared-memory slots: how a DataLoader worker hands batches to its main process (and,
through :mod:`~prealign.loaders.handoff.batch_share`, to its CP peers) without fresh memory per
batch.

A fresh shared-memory segment per batch (what torch does for every tensor a worker returns) costs a
page fault per 4 KiB page on both sides: on a VM about 0.7 ms per MB, more than copying the pixels.
A worker instead keeps a small pool of shared files (``memfd``, or ``slot-<pid>-<n>`` in a folder
when the slot is to be published under another name, removed when the process exits and swept once
it is dead: an ``O_TMPFILE`` could be linked only once), allocated up front
(``posix_fallocate``: a full ``/dev/shm`` is an ``OSError``, never a ``SIGBUS``), and writes each
batch into a free one with ``pwrite``:

    slot file   [0, 4096)  header: magic, holder flags (one byte per CP rank), the key it holds
                [4096, ..) data: the batch (``transport.pack_batch`` layout or a share record)

The worker sets the holder flag of every rank that will map the slot; each holder's main process
maps it (private, copy-on-write: its in-place writes never reach the slot) and clears its flag when
the last tensor viewing it is freed. The worker reuses a slot only when every flag is clear, so a
batch still held by a training loop is never overwritten; when every slot is held it makes a new
one. The pool keeps track of the slots it made, held or free (up to ``files``: past that the oldest
held one lives on in its holders' mappings only); their bytes, over all of a process's pools, stay
under :func:`shm_cap`: past it, taking a slot is a :class:`~prealign.loaders.errors.ShmBudgetError`
and the caller copies instead. The whole protocol: ``PROTOCOL.md`` beside this file.

Handing a slot over pickles a duplicate of its file descriptor (as torch does for its own shared
tensors): only file descriptors and plain data cross the process boundary.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import itertools
import mmap
import os
import struct
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from prealign.loaders.errors import ShareRecordError, ShmBudgetError
from prealign.schemas.errors import ConfigError, PrealignError

HEADER = 4096
_MAGIC = b"PRSLOT1\0"
_FLAGS = 64
MAX_HOLDERS = 256
_KEY = _FLAGS + MAX_HOLDERS  # 8-byte length, then the key (at most 1 KiB)
_KEY_MAX = 1024


class Slot:
    """One pooled shared file ``fd`` (named ``path``, or unnamed) with room for ``capacity`` data
    bytes after the header page."""

    def __init__(self, fd: int, path: str | None, capacity: int):
        self.fd, self.path, self.capacity = fd, path, 0
        self.published: str | None = None  # the name it is linked under, if any
        os.pwrite(fd, _MAGIC, 0)
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` data bytes, allocated now (``OSError`` when the file system is
        full)."""
        capacity = pages(capacity)
        if capacity > self.capacity:
            os.posix_fallocate(self.fd, 0, HEADER + capacity)
            self.capacity = capacity

    def write(self, parts: list) -> int:
        """``parts`` written to the data area (see :func:`write_at`); returns the bytes spanned."""
        return write_at(self.fd, parts, HEADER)

    def free(self) -> bool:
        """No holder maps it (read through a syscall: the holders clear their flag in the shared
        page)."""
        return not any(os.pread(self.fd, MAX_HOLDERS, _FLAGS))

    def hold(self, holders) -> None:
        flags = bytearray(MAX_HOLDERS)
        for h in holders:
            flags[h] = 1
        os.pwrite(self.fd, bytes(flags), _FLAGS)

    def unpublish(self) -> None:
        """Remove the name the slot was published under, if that name is still this slot's file."""
        name, self.published = self.published, None
        try:
            if (
                name is not None
                and os.stat(name, follow_symlinks=False).st_ino == os.fstat(self.fd).st_ino
            ):
                os.unlink(name)
        except OSError:
            pass

    def set_key(self, key: str) -> None:
        os.pwrite(self.fd, _key_bytes(key), _KEY)

    def link(self, path: str) -> None:
        """Give the file another name, ``path`` (a hard link: the data is not copied)."""
        if self.path is None:
            raise OSError(errno.EINVAL, "an unnamed slot cannot be published", path)
        os.link(self.path, path, follow_symlinks=False)

    def close(self) -> None:
        """Close; a named slot loses its name (its holders keep their mappings)."""
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        os.close(self.fd)


def pages(nbytes: int) -> int:
    """``nbytes`` (at least 1) rounded up to whole pages: the data room a slot is given."""
    return -(-max(nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE


def write_at(fd: int, parts: list, start: int = 0) -> int:
    """``parts`` (bytes-like: bytes, uint8 arrays, or ``(offset, bytes-like)`` pairs) written to
    file ``fd`` from byte ``start`` in order, or each at ``start + offset``; returns the bytes
    spanned after ``start``."""
    end = 0
    for part in parts:
        offset, part = part if isinstance(part, tuple) else (end, part)
        view, at = memoryview(part).cast("B"), start + offset
        end = max(end, offset + view.nbytes)
        while view.nbytes:  # (a short write: the rest)
            n = os.pwrite(fd, view, at)
            view, at = view[n:], at + n
    return end


def _key_bytes(key: str) -> bytes:
    raw = key.encode()[:_KEY_MAX]
    return len(raw).to_bytes(8, "little") + raw


def header(key: str) -> bytes:
    """The header page of a slot file holding ``key`` with no holder flags (for a record written in
    one go)."""
    out = bytearray(HEADER)
    out[: len(_MAGIC)] = _MAGIC
    raw = _key_bytes(key)
    out[_KEY : _KEY + len(raw)] = raw
    return bytes(out)


def is_slot_file(fd: int) -> bool:
    return os.pread(fd, len(_MAGIC), 0) == _MAGIC


def hold(fd: int, holder: int) -> None:
    """Set holder flag ``holder`` of slot file ``fd`` (before reading its key, inside
    :func:`key_lock`)."""
    os.pwrite(fd, b"\1", _FLAGS + holder)


@contextlib.contextmanager
def key_lock(fd: int, exclusive: bool):
    """Orders a reader's "set my flag, then read the key" (or reading a copy while the key holds)
    against the pool's "clear the key, then test the flags": an open-file-description lock
    (``F_OFD_SETLKW``, shared for readers, exclusive for the pool) on the key's first byte. Without
    it each side's store could pass its own later load (store-load reordering) and both would go
    ahead. Per open file, across processes,
    independent of the ``flock`` of :func:`named_in`; the kernel drops it when a holder dies."""
    op = getattr(fcntl, "F_OFD_SETLKW", None)
    if op is None:  # (not Linux: no slots either; a record is then only ever read as a copy)
        yield
        return
    fcntl.fcntl(fd, op, _flock(fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK))
    try:
        yield
    finally:
        fcntl.fcntl(fd, op, _flock(fcntl.F_UNLCK))


def _flock(kind: int) -> bytes:
    """A ``struct flock`` (LP64 Linux) over byte ``_KEY`` (pid 0, as OFD locks require)."""
    return struct.pack("hhqqi4x", kind, os.SEEK_SET, _KEY, 1, 0)


def key_of(fd: int) -> str:
    """The key a slot file holds (``""`` when none or being rewritten)."""
    head = os.pread(fd, 8 + _KEY_MAX, _KEY)
    n = min(int.from_bytes(head[:8], "little"), _KEY_MAX)
    return head[8 : 8 + n].decode(errors="replace")


class SlotPool:
    """The slots of one process. ``make_fd()`` -> ``(fd, path)``: a new shared file and its name
    (None: unnamed); default a ``memfd``; :func:`named_in` for slots that can be published under
    another name. ``cap``: free slots kept for reuse; ``files``: slots it keeps track of (free or
    held: the oldest held one is let go past that, living on in its holders' mappings); ``limit``:
    bytes of this process's tracked slots (every pool's), default :func:`shm_cap`."""

    def __init__(self, make_fd=None, cap: int = 6, *, files: int = 32, limit: int | None = None):
        self.make_fd = make_fd or (lambda: (os.memfd_create("prealign-slot", os.MFD_CLOEXEC), None))
        self.cap, self.files = cap, files
        self.limit = shm_cap() if limit is None else limit
        self.slots: list[Slot] = []

    def nbytes(self) -> int:
        """Bytes of shared memory its slots hold (header pages included)."""
        return sum(HEADER + s.capacity for s in self.slots)

    def take(self, nbytes: int) -> Slot:
        """A free slot with room for ``nbytes`` (the largest free one, grown; else a new one). A
        reused slot first loses its published name and key, and is given up if a reader took hold of
        it in the meantime (:func:`key_lock`: the reader then sees the key gone). Past the byte cap:
        a :class:`~prealign.loaders.errors.ShmBudgetError`, nothing made."""
        while True:
            free = [s for s in self.slots if s.free()]
            for extra in sorted(free, key=lambda s: s.capacity)[: max(len(free) - self.cap, 0)]:
                free.remove(extra)  # idle beyond what is kept for reuse: the smallest go
                self._drop(extra)
            if not free:
                self._fits(HEADER + pages(nbytes), None)
                fd, path = self.make_fd()
                try:
                    slot = Slot(fd, path, nbytes)
                except BaseException:  # e.g. no room left: nothing of it stays behind
                    os.close(fd)
                    if path is not None:
                        os.unlink(path)
                    raise
                if (
                    len(self.slots) >= self.files
                ):  # the oldest held one lives on in its holders' mappings
                    self._drop(
                        self.slots[0]
                    )  # unpublished too: a peer that never read it (it fell back)
                    # keeps no name of it alive in /dev/shm, uncounted, until the sweep
                break
            slot = max(free, key=lambda s: s.capacity)
            slot.unpublish()
            with key_lock(slot.fd, exclusive=True):
                slot.set_key("")
                still_free = slot.free()
            if (
                still_free
            ):  # (an OSError growing it: it stays pooled, and free, for a smaller batch)
                self._fits(pages(nbytes) - slot.capacity, slot)
                slot.grow(nbytes)
                self.slots.remove(slot)
                break
            self._drop(slot)  # a late reader holds it: leave it to that reader
        self.slots.append(slot)  # most recently used last
        return slot

    def _fits(self, extra: int, keep) -> None:
        """Room for ``extra`` more bytes under the limit, made by dropping free slots (other than
        ``keep``) if need be; else :class:`~prealign.loaders.errors.ShmBudgetError`."""
        if extra <= 0:
            return
        idle = [s for s in self.slots if s is not keep and s.free()]
        while _process_bytes(self) + extra > self.limit:
            if not idle:
                raise ShmBudgetError(
                    f"a slot of {extra} more bytes would take this process past its shared-"
                    f"memory cap of {self.limit} bytes (PREALIGN_SHM_CAP)"
                )
            self._drop(idle.pop())

    def _drop(self, slot: Slot) -> None:
        self.slots.remove(slot)
        slot.unpublish()
        slot.close()

    def close(self) -> None:
        """Close every slot (a held one lives on in its holders' mappings until they let go)."""
        for s in self.slots:
            s.close()
        self.slots.clear()


_pools: dict[tuple[int, object], SlotPool] = {}
_DEFAULT_CAP = 1 << 30
_cap_in_this_process: int | None = None
"""The cap :func:`init_worker` set for this (worker) process; None: :func:`shm_cap`'s default."""


def init_worker(worker_id: int | None = None, *, shm_cap: int | None = None) -> None:
    """The loaders' DataLoader ``worker_init_fn``: :func:`worker_heap`, and this worker's
    shared-memory cap (``LoadingOptions.shm_cap``; None keeps :func:`shm_cap`'s default)."""
    global _cap_in_this_process
    worker_heap(worker_id)
    _cap_in_this_process = shm_cap


def shm_cap() -> int:
    """Bytes of slots one process may hold: the loader's ``LoadingOptions.shm_cap`` in its workers,
    else ``PREALIGN_SHM_CAP`` (bytes) when set, else the smaller of 1 GiB and 1/8 of ``/dev/shm``
    (Docker's default 64 MB gives 8 MB: the rest stays for torch's own hand-off and the peers)."""
    if _cap_in_this_process is not None:
        return _cap_in_this_process
    text = os.environ.get("PREALIGN_SHM_CAP")
    if text is not None:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise ConfigError(f"PREALIGN_SHM_CAP: expected a number of bytes >= 0, got {text!r}")
        return value
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return _DEFAULT_CAP
    return min(_DEFAULT_CAP, st.f_blocks * st.f_frsize // 8)


def _process_bytes(pool: SlotPool) -> int:
    """Bytes held by this process's pools, ``pool`` included (registered or not)."""
    me = os.getpid()
    return pool.nbytes() + sum(
        p.nbytes() for (pid, _), p in _pools.items() if pid == me and p is not pool
    )


def pool(kind: object = None, make_fd=None, cap: int = 6) -> SlotPool:
    """This process's pool for ``kind`` (a fork starts with none of its parent's). Its named slots
    are removed when the process exits (a DataLoader worker exits through multiprocessing, which
    runs ``Finalize`` callbacks, not ``atexit``); those of a killed process by a sweep
    (:func:`abandoned`)."""
    key = (os.getpid(), kind)
    if key not in _pools:
        from multiprocessing.util import Finalize

        _pools[key] = SlotPool(make_fd, cap)
        Finalize(_pools[key], _pools[key].close, exitpriority=10)
    return _pools[key]


def close_pools() -> None:
    """Close this process's pools now (their named slots lose their names), e.g. on ``SIGTERM``."""
    me = os.getpid()
    for (pid, _), p in list(_pools.items()):
        if pid == me:
            p.close()


_SLOT_PREFIX = "slot-"
_numbers = itertools.count()


def named_in(directory: str):
    """``make_fd`` of a pool whose slots are ``slot-<pid>-<n>`` in ``directory`` (publishable
    there), each held with a shared ``flock`` for as long as its process keeps it open: the kernel
    drops the lock when the process dies, which is what a folder's sweep looks for
    (:func:`abandoned`; no pid involved, so
    PID namespaces and reused pids cannot fool it)."""

    def make_fd() -> tuple[int, str]:
        path = os.path.join(directory, f"{_SLOT_PREFIX}{os.getpid()}-{next(_numbers)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | getattr(os, "O_NOFOLLOW", 0), 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd, path

    return make_fd


def is_slot_name(name: str) -> bool:
    """``name`` is that of a pooled slot (``slot-<pid>-<n>``), not a record."""
    return name.startswith(_SLOT_PREFIX)


def abandoned(path: str) -> bool:
    """``path`` names a pooled slot whose process is gone (nobody holds its lock)."""
    if not is_slot_name(os.path.basename(path)):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        return try_lock(fd)
    finally:
        os.close(fd)


def try_lock(fd: int) -> bool:
    """Take an exclusive ``flock`` of ``fd`` if nobody holds one (a holder's lock goes when it
    dies)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def worker_heap(worker_id: int | None = None) -> None:
    """Keep freed heap memory in this (worker) process for the next batch instead of returning it to
    the kernel: a batch's large temporaries (``torch.cat`` of pixels) then reuse pages instead of
    faulting in fresh ones (about 6x faster on a VM). glibc only; elsewhere nothing happens. The
    loaders' DataLoader ``worker_init_fn``."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: large blocks from the heap, not a fresh mmap each
        mallopt(-1, (1 << 31) - 1)  # M_TRIM_THRESHOLD: keep up to 2 GiB of freed heap for reuse
    except (OSError, AttributeError):
        pass


@dataclass(frozen=True)
class SlotRef:
    """A slot as sent to a main process: ``fd`` (its own duplicate, closed with this object;
    duplicated again when pickled), ``nbytes`` of data, the holder flag ``holder`` to clear when
    released, and what to build from it (``build(buffer)`` in the receiver, ``buffer`` uint8
    ``[nbytes]`` privately mapped). Make one with :func:`send`."""

    fd: int
    nbytes: int
    holder: int
    build: object

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _receive, (DupFd(self.fd), self.nbytes, self.holder, self.build)


def send(slot: "Slot | int", nbytes: int, holder: int, build) -> SlotRef:
    """A :class:`SlotRef` for the first ``nbytes`` of ``slot`` (a :class:`Slot` or a slot file's
    fd): it owns a duplicate of the file descriptor, so the pool may drop the slot (or the caller
    close its fd) before the DataLoader's queue thread pickles the reference."""
    fd = os.dup(slot if isinstance(slot, int) else slot.fd)
    ref = SlotRef(fd, nbytes, holder, build)
    weakref.finalize(ref, os.close, fd)
    return ref


def _receive(dup, nbytes: int, holder: int, build):
    """Runs while the DataLoader unpickles a worker's batch: an error mapping or building it is
    returned as a :class:`~prealign.loaders.handoff.share_folder.ShareRecordError` (raised by the
    loader with its context), never raised inside torch's queue handling (the batch and the iterator
    would be lost)."""

    fd = (
        dup.detach()
    )  # fails when the worker died: torch's loader then reports the dead worker itself
    try:
        return build(map_slot(fd, nbytes, holder))
    except (
        OSError,
        ValueError,
        TypeError,
        LookupError,
        PrealignError,
    ) as exc:  # (not torch's RuntimeError, which its
        # SIGCHLD handler raises wherever the main thread is when a worker dies: the loader handles
        # that one)
        return ShareRecordError(
            f"a batch from a DataLoader worker could not be mapped or built in the "
            f"main process ({type(exc).__name__}: {exc})"
        )


def map_slot(fd: int, nbytes: int, holder: int) -> torch.Tensor:
    """uint8 ``[nbytes]``: the data of slot file ``fd`` mapped privately (copy-on-write), plus its
    header page shared; ``fd`` is closed here (a held batch costs two mappings, no open file). When
    the last tensor viewing the data is freed, holder flag ``holder`` is cleared and both are
    unmapped. (mmap through libc: Python's ``mmap`` keeps a duplicate fd open per mapping.)"""
    length = HEADER + nbytes
    try:
        data = _map(fd, length, mmap.MAP_PRIVATE)
        try:
            head = _map(fd, HEADER, mmap.MAP_SHARED)
        except BaseException:
            _libc().munmap(data, length)
            raise
    finally:
        os.close(fd)
    whole = (
        np.frombuffer((ctypes.c_ubyte * nbytes).from_address(data + HEADER), dtype=np.uint8)
        if nbytes
        else np.zeros(0, dtype=np.uint8)
    )
    release = weakref.finalize(whole, _release, os.getpid(), data, length, head, holder)
    release.atexit = (
        False  # at exit the mappings go anyway; a forked child's exit must not clear the flag
    )
    return torch.from_numpy(whole)


def _release(pid: int, data: int, length: int, head: int, holder: int) -> None:
    if os.getpid() != pid:  # a forked child dropping its copy: the parent still holds the slot
        return
    libc = _libc()
    ctypes.memset(head + _FLAGS + holder, 0, 1)
    libc.munmap(head, HEADER)
    libc.munmap(data, length)


def _map(fd: int, length: int, flags: int) -> int:
    addr = _libc().mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of a slot file failed: {os.strerror(err)}")
    return addr


@functools.lru_cache(maxsize=None)
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def available() -> bool:
    """Slots need ``memfd_create`` (Linux); elsewhere batches go through torch's own shared
    memory."""
    return hasattr(os, "memfd_create")
