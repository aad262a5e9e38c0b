"""Typed errors of the loader layer. All subclass :class:`prealign.schemas.errors.PrealignError` (a ``ValueError``);
per-sample problems subclass :class:`~prealign.schemas.errors.SampleError` and name the sample, the field,
what was expected and what came."""
from __future__ import annotations

from prealign.schemas.errors import ConfigError, PrealignError, SampleError


class PlanError(ConfigError):
    """Invalid planner input or configuration (lengths, budget, dp size, buffer)."""


class OversizeSampleError(SampleError):
    """A sample does not fit a micro-batch of the token budget even alone (``Oversize.ERROR``)."""


class BadSampleError(SampleError):
    """A sample could not be decoded, transformed or validated against the schema.

    ``reason`` is the key a skipped sample is counted under in the
    :class:`~prealign.loaders.policy.BadDataReport` (``"bad_sample"`` unless a subclass or the caller says
    more, e.g. ``"corrupt_image"``); an explicit ``reason`` also prefixes the message, so the cause
    survives being reported as text.
    """

    reason: str = "bad_sample"

    def __init__(self, *, sample, field: str | None, expected: str, actual: str, hint: str = "",
                 reason: str | None = None):
        super().__init__(sample=sample, field=field, expected=expected, actual=actual, hint=hint)
        if reason is not None and reason != type(self).reason:
            self.reason = reason
            self.args = (f"{reason}: {self.args[0]}",)


class UnsafeMemberError(BadSampleError):
    """A webdataset member whose format can execute code when loaded (pickle, ``.pth``): refused."""

    reason = "unsafe_member"


class MissingMemberError(BadSampleError):
    """A webdataset sample lacks a member the source declares as required."""

    reason = "missing_member"


def reason_of(exc: BaseException) -> str:
    """The cause a bad sample is counted under: a :class:`~prealign.schemas.errors.SampleError`'s ``reason``
    (a non-empty ``str`` or an enum with such a value, e.g. :class:`prealign.loaders.vlm.MediaError`'s
    :class:`~prealign.loaders.vlm.MediaProblem`), else ``"bad_sample"``.

    >>> reason_of(MissingMemberError(sample="k", field="jpg", expected="a member", actual="none"))
    'missing_member'
    >>> reason_of(KeyError("text")), reason_of(BadSampleError(sample=1, field=None, expected="x", actual="y"))
    ('bad_sample', 'bad_sample')
    """
    reason = getattr(exc, "reason", None) if isinstance(exc, SampleError) else None
    reason = getattr(reason, "value", reason)  # an enum member -> its value
    return reason if isinstance(reason, str) and reason else BadSampleError.reason


class CorruptShardError(PrealignError):
    """A shard could not be read past some byte offset (truncated or corrupt tar, a member larger than
    the file, unreadable URL); counted under ``reason`` (``corrupt_shard``) by the bad-data policy."""

    reason = "corrupt_shard"

    def __init__(self, shard: str, offset: int, cause: str):
        self.shard, self.offset, self.cause = shard, offset, cause
        super().__init__(f"shard {shard}: unreadable at byte {offset}: {cause}")


class ShardTimeoutError(CorruptShardError):
    """A shard read made no progress within the source's ``read_timeout`` (a FIFO, a hung mount):
    counted as ``shard_timeout`` under ``skip``, raised under ``raise``."""

    reason = "shard_timeout"


class MissingShardError(ConfigError):
    """Shard files given explicitly (or by a brace range) that do not exist: a configuration
    mistake, raised before the index pass, never counted as bad data."""


class IndexFileError(ConfigError):
    """A saved :class:`~prealign.loaders.index.SampleIndex` file that is not one (missing or extra keys,
    wrong dtype or shape, inconsistent lengths, undecodable report)."""


class WorkerError(PrealignError):
    """A DataLoader worker died (killed by a signal, out of memory) or timed out. The loader stays
    usable: iterate again to continue from its state (the position of the last batch yielded)."""


class LoaderUsageError(ConfigError):
    """The loader was used in a way it does not support (two iterators at once)."""


class TooManyBadSamplesError(PrealignError):
    """More consecutive bad samples than ``BadDataPolicy.max_consecutive`` allows."""


class ResumeError(ConfigError):
    """A loader state that cannot be resumed here (other version, dp size, layout, schema, data)."""


class SourceChangedError(PrealignError):
    """A sample read for a batch no longer matches what the index recorded (data changed on disk)."""
