"""DataLoader worker plumbing: typed errors out of workers, and recovery from a worker that died.

torch re-raises an exception raised in a worker as ``exc_type(message)`` or, when that constructor
call fails (our :class:`~prealign.schemas.errors.SampleError` takes keyword arguments), as a
``RuntimeError``. A worker therefore *returns* its :class:`~prealign.schemas.errors.PrealignError`
in place of the batch (:func:`hand_over`; it pickles as itself: same type and attributes) and
:func:`worker_batches` raises it in the main process.

A dead worker (OOM killer, ``kill -9``) is found by its process, not by torch's message: torch has
no public API for its worker processes, so this reads the multi-process iterator's ``_workers`` (and
stops a broken one with ``_shutdown_workers``; a persistent one is forgotten through
``DataLoader._iterator``). :func:`check_torch_internals` checks they exist at each iteration with
workers and raises :class:`~prealign.loaders.errors.UnsupportedTorchError` naming the torch version
when they do not. A timeout is read from the loader's public ``timeout``: a ``RuntimeError`` after
waiting that long.
"""

from __future__ import annotations

import time

import torch
from torch.utils.data import get_worker_info

from prealign.loaders.errors import UnsupportedTorchError, WorkerError
from prealign.schemas.errors import PrealignError


def hand_over(exc: PrealignError) -> PrealignError:
    """In a DataLoader worker: ``exc``, to return in place of the batch (:func:`worker_batches`
    raises it); in the main process: raise it."""
    if get_worker_info() is None:
        raise exc
    return exc


def check_torch_internals(loader, it=None) -> None:
    """Raise :class:`UnsupportedTorchError` when ``loader`` (with workers) or its iterator ``it``
    lacks an attribute the recovery reads; nothing to check without workers."""
    if not loader.num_workers:
        return
    missing = []
    if loader.persistent_workers and not hasattr(loader, "_iterator"):
        missing.append(f"{type(loader).__name__}._iterator")
    if it is not None:
        workers = getattr(it, "_workers", None)
        if not isinstance(workers, list) or not all(
            hasattr(w, "is_alive") and hasattr(w, "pid") for w in workers
        ):
            missing.append(f"{type(it).__name__}._workers (a list of worker processes)")
        if not callable(getattr(it, "_shutdown_workers", None)):
            missing.append(f"{type(it).__name__}._shutdown_workers()")
    if missing:
        raise UnsupportedTorchError(
            f"torch {torch.__version__}: the DataLoader lacks {', '.join(missing)}, which "
            f"prealign reads to recover from a dead worker (torch 2.x has them); use a "
            f"torch 2.x release"
        )


def dead_workers(it) -> list[int]:
    """Pids of the worker processes of iterator ``it`` that are no longer alive (none without
    workers)."""
    return [w.pid for w in getattr(it, "_workers", ()) if not w.is_alive()]


def discard_iterator(loader, it) -> None:
    """Shut down iterator ``it`` of ``loader`` (its live workers are stopped) and, when it is the
    loader's persistent iterator, forget it: the next iteration starts fresh workers."""
    try:
        it._shutdown_workers()
    except (OSError, RuntimeError, ValueError):  # a dead worker's queues may already be gone
        pass
    # its workers never again count for torch's SIGCHLD check (a later child's exit would raise)
    finally:
        if getattr(it, "_worker_pids_set", False):
            from torch.utils.data._utils import signal_handling

            signal_handling._remove_worker_pids(id(it))
            it._worker_pids_set = False
    if getattr(loader, "_iterator", None) is it:
        loader._iterator = None


def discard_if_broken(loader) -> bool:
    """Drop ``loader``'s persistent iterator when one of its workers died (while idle); True when it
    did."""
    it = (
        getattr(loader, "_iterator", None)
        if loader.num_workers and loader.persistent_workers
        else None
    )
    if it is not None and dead_workers(it):
        discard_iterator(loader, it)
        return True
    return False


def worker_failure(loader, it, exc: BaseException, waited: float) -> WorkerError | None:
    """A :class:`~prealign.loaders.errors.WorkerError` for ``exc``, raised by ``next(it)`` after
    ``waited`` seconds, when a worker of ``it`` died or the wait reached the loader's ``timeout``
    (the broken iterator is discarded), else None (``exc`` is something else)."""
    if not loader.num_workers or not isinstance(exc, (RuntimeError, ConnectionError, EOFError)):
        return None
    dead = dead_workers(it)
    settle = (
        time.monotonic() + 2.0
    )  # a killed worker's broken pipe can come before its process is seen dead
    while not dead and not isinstance(exc, RuntimeError) and time.monotonic() < settle:
        try:
            time.sleep(0.02)
        except RuntimeError:  # torch's SIGCHLD handler reporting that very death
            pass
        dead = dead_workers(it)
    timed_out = (
        not dead
        and type(exc) is RuntimeError
        and loader.timeout > 0
        and waited >= 0.9 * loader.timeout
    )
    if not (dead or timed_out):
        return None
    discard_iterator(loader, it)
    what = f"worker(s) {dead} died" if dead else f"timed out after {loader.timeout} s"
    return WorkerError(
        f"DataLoader {what} ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}); iterate "
        f"the loader again to continue from its state"
    )


def worker_batches(loader, before_each=None):
    """Iterate the torch ``loader``: a :class:`~prealign.schemas.errors.PrealignError` a worker
    returned is raised (as its own type); a dead or timed-out worker raises
    :class:`~prealign.loaders.errors.WorkerError` after discarding the broken iterator, and a
    persistent iterator whose worker died while idle is replaced before the first batch, so the next
    iteration always starts from working workers. ``before_each()`` runs before each batch is asked
    for (it may raise: a superseded loop stops without
    taking a batch meant for the loop that superseded it, with which it shares persistent
    workers)."""
    check_torch_internals(loader)
    discard_if_broken(loader)
    it = iter(loader)
    check_torch_internals(loader, it)
    while True:
        if before_each is not None:
            before_each()
        t0 = time.monotonic()
        try:
            batch = next(it)
        except StopIteration:
            return
        except (
            RuntimeError,
            ConnectionError,
            EOFError,
        ) as exc:  # a killed worker's pipe can break first
            failure = worker_failure(loader, it, exc, time.monotonic() - t0)
            if failure is None:
                raise
            raise failure from exc
        if isinstance(batch, PrealignError):
            raise batch
        yield batch
