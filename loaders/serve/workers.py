"""DataLoader worker plumbing: typed errors out of workers, and recovery from a worker that died.

torch re-raises an exception raised in a worker as ``exc_type(message)`` or, when that constructor call
fails (our :class:`~prealign.schemas.errors.SampleError` takes keyword arguments), as a ``RuntimeError``.
A worker therefore *returns* its :class:`~prealign.schemas.errors.PrealignError` in place of the batch
(it pickles as itself: same type and attributes) and :func:`worker_batches` raises it in the main process.

A worker killed by a signal (OOM killer, ``kill -9``) leaves torch's iterator broken for good when
``persistent_workers=True`` (every later epoch waits on the dead worker). :func:`discard_if_broken`
drops such an iterator, so the next iteration starts fresh workers.

"""
from __future__ import annotations

from prealign.loaders.errors import WorkerError
from prealign.schemas.errors import PrealignError


def _iterator_workers(loader) -> list:
    """The worker processes of ``loader``'s persistent iterator (none when it has none)."""
    it = getattr(loader, "_iterator", None)
    return list(getattr(it, "_workers", ()) or ())


def dead_workers(loader) -> list[int]:
    """Exit codes / pids of ``loader``'s persistent workers that are no longer alive."""
    return [w.pid for w in _iterator_workers(loader) if not w.is_alive()]


def discard_iterator(loader) -> None:
    """Shut down and forget ``loader``'s persistent iterator (its live workers are stopped)."""
    it = getattr(loader, "_iterator", None)
    if it is None:
        return
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        try:
            shutdown()
        except (OSError, RuntimeError, ValueError):  # a dead worker's queues may already be gone
            pass
    loader._iterator = None


def discard_if_broken(loader) -> bool:
    """Drop ``loader``'s persistent iterator when one of its workers died; True when it did."""
    if dead_workers(loader):
        discard_iterator(loader)
        return True
    return False


def worker_failure(loader, exc: BaseException) -> WorkerError | None:
    """A :class:`~prealign.loaders.errors.WorkerError` for ``exc`` raised by iterating ``loader`` when a
    worker died or timed out (the broken iterator is discarded), else None (``exc`` is something else)."""
    dead = dead_workers(loader)
    timed_out = isinstance(exc, RuntimeError) and "DataLoader timed out" in str(exc)
    died = isinstance(exc, RuntimeError) and "DataLoader worker" in str(exc) and (
        "exited unexpectedly" in str(exc) or "killed by signal" in str(exc))
    if not (dead or timed_out or died):
        return None
    discard_iterator(loader)
    what = f"worker(s) {dead} died" if dead else ("timed out" if timed_out else "a worker died")
    return WorkerError(f"DataLoader {what} ({type(exc).__name__}: {str(exc).splitlines()[0]}); iterate the "
                       f"loader again to continue from its state")


def worker_batches(loader):
    """Iterate the torch ``loader``: a :class:`~prealign.schemas.errors.PrealignError` a worker returned is
    raised (as its own type); a
    dead or timed-out worker raises :class:`~prealign.loaders.errors.WorkerError` after discarding the
    broken (persistent) iterator, and a persistent iterator whose worker died while idle is replaced
    before the first batch, so the next iteration always starts from working workers."""
    discard_if_broken(loader)
    it = iter(loader)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except RuntimeError as exc:
            failure = worker_failure(loader, exc)
            if failure is None:
                raise
            raise failure from exc
        if isinstance(batch, PrealignError):
            raise batch
        yield batch
