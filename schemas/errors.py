"""Typed errors, split as Energon splits them (the tree: ``docs/errors.md``).

:class:`PrealignError` (an ``Exception``) is the base of every one. Configuration mistakes
(:class:`ConfigError`) and bad data (:class:`DataError`: a sample, a batch) are also
``ValueError``s, so an ``except ValueError`` around bad data keeps working. System errors (I/O, a
timeout, a dead worker, in :mod:`prealign.loaders.errors`) are ``OSError`` / ``RuntimeError``
subclasses, never ``ValueError``: a transform's ``except ValueError`` does not swallow a stalled
read, and no bad-data policy counts one as a
bad sample."""

from __future__ import annotations

import functools
import inspect


def _rebuilt(cls: type, args: tuple, state: dict) -> "PrealignError":
    """``cls`` with ``args`` and attributes ``state``, its constructor not called (subclasses take
    other arguments). Built by the first built-in base whose memory layout fits (one that is also an
    ``OSError`` needs OSError's)."""
    for base in cls.__mro__:
        if base.__module__ == "builtins":
            try:
                exc = base.__new__(cls)
                break
            except TypeError:
                continue
    exc.args = args
    exc.__dict__.update(state)
    return exc


class PrealignError(Exception):
    """Base class of every error prealign raises (configuration, bad data, I/O, workers).

    Pickles as itself (same class, attributes and message), so it crosses process boundaries
    (DataLoader workers, ``all_gather_object``) with its type, although subclasses take keyword-only
    arguments:

    >>> import pickle
    >>> err = SampleError(sample=3, field="labels", expected="int64", actual="float32")
    >>> err = pickle.loads(pickle.dumps(err))
    >>> type(err).__name__, err.sample, err.field, str(err)
    ('SampleError', 3, 'labels', "sample 3, field 'labels': expected int64, got float32")
    """

    def __reduce__(self):
        return _rebuilt, (type(self), self.args, self.__dict__)

    def __init_subclass__(cls, **kwargs):
        """A subclass whose own constructor cannot take a lone message (as
        ``SampleError(sample=..., ...)``) is also built by ``cls(message)``: torch's DataLoader
        re-raises an exception raised in a worker as ``type(exc)(message)``, so a plain
        ``DataLoader(collate_fn=THDCollator(...), num_workers=2)`` keeps the error's type (its
        attributes are then None, the message names them)."""
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return
        signature = inspect.signature(init)

        @functools.wraps(init)
        def init_or_message(self, *args, **kw):
            if len(args) == 1 and not kw and isinstance(args[0], str):
                try:
                    signature.bind(self, *args)
                except TypeError:  # a message alone: what torch passes when it re-raises
                    BaseException.__init__(self, args[0])
                    return
            init(self, *args, **kw)

        cls.__init__ = init_or_message


class ConfigError(PrealignError, ValueError):
    """A configuration mistake (layout, schema, arguments, paths, a state or index of another run).

    Never bad data: no bad-data policy counts or skips it; it is raised before any batch where
    possible.
    """


class PackingUnsupportedError(ConfigError):
    """The model cannot keep packed sequences apart in this environment (e.g. Gated DeltaNet layers
    without the fast kernels, whose pure-torch fallback lets the recurrent state run across sequence
    boundaries)."""


class LayoutError(ConfigError):
    """An invalid :class:`~prealign.schemas.ParallelLayout` (tp/cp sizes, FP8 recipe, length
    buckets)."""


class ArgumentError(ConfigError):
    """A function was called with arguments that do not fit together: a ``cp_rank`` outside the CP
    group, shards of another CP size, offsets that do not describe the tensor, a batch missing a
    key."""


class BackendVersionError(ConfigError):
    """The installed backend (megatron-core, TE) lacks what a batch needs, e.g. ``PackedSeqParams``
    fields for hybrid CP in megatron-core 0.14: the message names the installed version."""


class OffsetOverflowError(ConfigError):
    """A packed length or offset does not fit the int32 ``cu_seqlens`` megatron-core and TE take
    (``T >= 2**31``): lower the token budget or the length buckets."""


class SchemaError(ConfigError):
    """An invalid schema declaration (duplicate field, unknown dtype, bad dense dim)."""


class DataError(PrealignError, ValueError):
    """Bad data: a sample, a batch or a record that does not satisfy the declared contract. A
    bad-data policy may count the per-sample ones (:class:`SampleError`); everything else of this
    family is raised."""


class SampleError(DataError):
    """One sample of a batch is malformed.

    Attributes name the sample index, the field, what was expected and what came, so a data
    pipeline can log or skip exactly that sample.
    """

    sample = field = expected = actual = (
        None  # when rebuilt from its message alone (see PrealignError)
    )

    def __init__(
        self, *, sample: int | None, field: str | None, expected: str, actual: str, hint: str = ""
    ):
        self.sample, self.field, self.expected, self.actual = sample, field, expected, actual
        where = "batch" if sample is None else f"sample {sample}"
        what = f"{where}, field {field!r}" if field else where
        msg = f"{what}: expected {expected}, got {actual}"
        super().__init__(f"{msg}. {hint}" if hint else msg)


class BucketOverflowError(DataError):
    """A batch's aligned length exceeds the largest configured length bucket."""


class BatchValidationError(DataError):
    """``validate_batch`` found violations; ``.violations`` lists every one."""

    def __init__(self, violations):
        if isinstance(violations, str):  # rebuilt from its message alone (see PrealignError)
            self.violations = []
            super().__init__(violations)
            return
        self.violations = list(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"{len(self.violations)} batch schema violation(s):\n{lines}")


class StartupMismatchError(PrealignError, ValueError):
    """Ranks disagree on schema/layout fingerprints, or some rank's batch failed validation."""
