"""DataLoader worker plumbing: typed errors across the process boundary, and recovery from a worker
that died.

torch re-raises a worker's exception as ``exc_type(message)`` or, when that constructor call fails
(our :class:`~prealign.schemas.errors.SampleError` takes keyword arguments), as a ``RuntimeError``. A
worker therefore returns its :class:`~prealign.schemas.errors.PrealignError` as a :class:`Carried`
record (class path, attributes, message: plain data) and the main process raises the same type,
with the same attributes, again.

A worker killed by a signal (OOM killer, ``kill -9``) leaves torch's iterator broken for good when
``persistent_workers=True`` (every later epoch waits on the dead worker). :func:`discard_if_broken`
drops such an iterator, so the next iteration starts fresh workers.

>>> from prealign.loaders.errors import BadSampleError
>>> err = BadSampleError(sample="s/0", field="jpg", expected="an image", actual="bytes", reason="corrupt_image")
>>> back = carry(err).rebuild()
>>> type(back).__name__, back.sample, back.reason, str(back) == str(err)
('BadSampleError', 's/0', 'corrupt_image', True)
"""
from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass

from prealign.schemas.errors import PrealignError

from .errors import WorkerError


@dataclass(frozen=True)
class Carried:
    """A :class:`~prealign.schemas.errors.PrealignError` as plain data: ``module``, ``qualname`` of its
    class, ``attrs`` (its ``__dict__``, enum members as ``(enum path, value)``) and ``args``."""

    module: str
    qualname: str
    attrs: dict
    args: tuple

    def rebuild(self) -> PrealignError:
        """The exception again: same class (a :class:`PrealignError` subclass, else refused), same
        attributes and message. The constructor is not called (subclasses take other arguments)."""
        cls = _resolve(self.module, self.qualname)
        if not (isinstance(cls, type) and issubclass(cls, PrealignError)):
            return PrealignError(f"{self.module}.{self.qualname}: {self.args[0] if self.args else ''}")
        exc = cls.__new__(cls)
        exc.args = self.args
        exc.__dict__.update({k: _thaw(v) for k, v in self.attrs.items()})
        return exc


def _resolve(module: str, qualname: str):
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj


def _freeze(value):
    if isinstance(value, enum.Enum):
        return ("__enum__", type(value).__module__, type(value).__qualname__, value.value)
    return value


def _thaw(value):
    if isinstance(value, tuple) and len(value) == 4 and value[0] == "__enum__":
        cls = _resolve(value[1], value[2])
        if isinstance(cls, type) and issubclass(cls, enum.Enum):
            return cls(value[3])
        return value[3]
    return value


def carry(exc: PrealignError) -> Carried:
    """``exc`` as a :class:`Carried` record (attribute values kept when they are plain data)."""
    plain = (str, int, float, bool, type(None), tuple, list, dict)
    attrs = {k: _freeze(v) for k, v in vars(exc).items()
             if isinstance(v, plain) or isinstance(v, enum.Enum)}
    args = tuple(a if isinstance(a, plain) else str(a) for a in exc.args)
    return Carried(type(exc).__module__, type(exc).__qualname__, attrs, args)


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
    """Iterate the torch ``loader``: a :class:`Carried` error from a worker is raised as its own type; a
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
        if isinstance(batch, Carried):
            raise batch.rebuild()
        yield batch
