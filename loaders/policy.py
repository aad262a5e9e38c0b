"""Declared policies of the loader layer: enums, and the bad-data bookkeeping every skip goes
through.

Nothing is dropped silently: a skipped or truncated sample is counted in a :class:`BadDataReport`
(by reason, with the first few records kept) and announced by a :class:`BadSampleWarning`.

A :class:`BadRecord` is the one type of a sample or shard left out, wherever it was found: what the
index pass records of a bad sample, a corrupt shard or an ignored tar member (kept in sidecars and
merged indexes), what a streaming reader hands over, what a loader counts when a sample fails only
at load time, and what a report keeps as its examples.

    BadRecord.of_error(exc, where) ─► BadDataGate: to_error() raised (raise) or counted (skip)
    BadRecord(reason, where, message) (an ignored member, an oversize sample) ─► only counted
    to_json() / from_json(): plain JSON, read back exactly (sidecars, merged and saved indexes)
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass, field

from prealign.loaders.errors import (
    PlanError,
    TooManyBadSamplesError,
    checked_error,
    error_from_record,
    error_record,
)
from prealign.schemas.checks import int_at_least
from prealign.schemas.errors import PrealignError


class PackStrategy(enum.Enum):
    """How the planner fills micro-batches.

    BFD: best-fit decreasing inside the streaming buffer (each sample, largest first, goes to the
    open micro-batch it leaves the least room in). FIRST_FIT: arrival order, first open micro-batch
    that fits. IN_ORDER: next-fit in stream order (a micro-batch closes at the first sample that
    does not fit); the baselines exist for comparison. STEP_FIT: each global step takes the next
    stretch of the stream, first-fit decreasing into its micro-batches (what a mixture plans with:
    each step holds the mixture's shares, :func:`~prealign.loaders.plan.mixing.step_fit`).
    """

    BFD = "bfd"
    FIRST_FIT = "first_fit"
    IN_ORDER = "in_order"
    STEP_FIT = "step_fit"


class Oversize(enum.Enum):
    """A sample that cannot fit the token budget even alone: raise, cut it to fit, or leave it
    out."""

    ERROR = "error"
    TRUNCATE = "truncate"
    SKIP = "skip"


class OnBadSample(enum.Enum):
    """A sample that cannot be decoded / transformed / validated: raise, or skip it and count it."""

    RAISE = "raise"
    SKIP = "skip"


class BadSampleWarning(UserWarning):
    """Emitted once per skipped sample (filter it with the ``warnings`` module if too chatty)."""


def coerce_enum(cls: type[enum.Enum], value, name: str):
    """``"bfd"`` / ``PackStrategy.BFD`` -> ``PackStrategy.BFD``; anything else ->
    :class:`PlanError`."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value.lower() if isinstance(value, str) else value)
    except ValueError:
        raise PlanError(
            f"{name}: expected one of {[m.value for m in cls]}, got {value!r}"
        ) from None


@dataclass(frozen=True, kw_only=True)
class BadDataPolicy:
    """What to do with a bad sample or a corrupt shard.

    >>> BadDataPolicy(on_error="skip", max_consecutive=8).on_error
    <OnBadSample.SKIP: 'skip'>
    """

    on_error: OnBadSample = OnBadSample.RAISE
    max_consecutive: int = 16
    """With SKIP: this many bad samples in a row is fatal (:class:`TooManyBadSamplesError`)."""
    warn: bool = True
    """With SKIP: emit a :class:`BadSampleWarning` per skipped sample."""

    def __post_init__(self):
        object.__setattr__(self, "on_error", coerce_enum(OnBadSample, self.on_error, "on_error"))
        count = int_at_least("max_consecutive", self.max_consecutive, 1, PlanError)
        object.__setattr__(self, "max_consecutive", count)

    def to_dict(self) -> dict:
        return {"on_error": self.on_error.value, "max_consecutive": self.max_consecutive}


_RECORD_KEYS = frozenset({"reason", "where", "message"})
_RECORD_KEYS_ERROR = _RECORD_KEYS | {"error"}


@dataclass(frozen=True)
class BadRecord:
    """One sample or shard left out (or changed), and why.

    >>> from prealign.loaders.errors import BadSampleError
    >>> rec = BadRecord.of_error(BadSampleError(sample="s.tar:7", field="input_ids", expected="ids",
    ...                                         actual="none"))
    >>> rec.reason, rec.where, rec.is_error, BadRecord.from_json(rec.to_json()) == rec
    ('bad_sample', 's.tar:7', True, True)
    >>> BadRecord("ignored_member", "s.tar:README", "no extension").is_error
    False
    """

    reason: str
    """The cause it is counted under in the report (``bad_sample``, ``corrupt_shard``,
    ``dim_mismatch``, ...)."""
    where: str
    """The sample or shard it names (``s.tar:000007``, ``shard 3``, ``hf[12] (index row 40)``)."""
    message: str
    """What happened, for a person (the typed error's message when it is one)."""
    error: dict | None = field(default=None, hash=False, repr=False)
    """The typed error as data (:func:`~prealign.loaders.errors.error_record`) when the record is
    an error (one the ``raise`` policy raises: :meth:`to_error`); None for a record that is only
    counted (a tar member without an extension, an oversize sample the planner leaves out)."""

    def __post_init__(self):
        if not (
            isinstance(self.reason, str)
            and isinstance(self.where, str)
            and isinstance(self.message, str)
        ):
            raise TypeError(f"BadRecord: reason, where and message must be str, got {self!r}")

    @classmethod
    def of_error(cls, exc: Exception, where: str | None = None) -> "BadRecord":
        """The record of a typed bad-data error (a :class:`~prealign.schemas.errors.SampleError`, or
        a :class:`~prealign.loaders.errors.CorruptShardError` found while scanning); ``where``
        defaults to the sample the error names (the shard, for a shard's)."""
        rec = error_record(exc)
        if where is None:
            where = str(exc.sample) if rec["type"] == "sample" else f"shard {exc.shard}"
        return cls(reason=rec["reason"], where=where, message=str(exc), error=rec)

    @property
    def is_error(self) -> bool:
        """True for an error (the ``raise`` policy raises it), False for a record that is only
        counted."""
        return self.error is not None

    @property
    def is_shard(self) -> bool:
        """True for a shard's record (the rest of a shard lost: ``corrupt_shard``,
        ``shard_timeout``)."""
        return self.error is not None and self.error["type"] == "shard"

    def to_error(self) -> PrealignError:
        """The typed error of an error record
        (:func:`~prealign.loaders.errors.error_from_record`)."""
        if self.error is None:
            raise ValueError(f"BadRecord {self.where} ({self.reason}): not an error, only counted")
        return error_from_record(self.error)

    def to_json(self) -> dict:
        """Plain JSON: ``{"reason", "where", "message"}`` and, for an error, ``"error"``."""
        out = {"reason": self.reason, "where": self.where, "message": self.message}
        if self.error is not None:
            out["error"] = dict(self.error)
        return out

    @classmethod
    def from_json(cls, obj) -> "BadRecord":
        """The record of :meth:`to_json`'s form, every key and type checked (a ``ValueError`` naming
        what is wrong otherwise: records are read from files)."""
        if not isinstance(obj, dict) or not _RECORD_KEYS <= obj.keys() <= _RECORD_KEYS_ERROR:
            raise ValueError(
                f"a bad-data record: expected keys reason, where, message (+ error), "
                f"got {obj!r:.80}"
            )
        reason, where, message = obj["reason"], obj["where"], obj["message"]
        if not (isinstance(reason, str) and isinstance(where, str) and isinstance(message, str)):
            raise ValueError(
                f"a bad-data record: reason, where and message must be str, got {obj!r:.80}"
            )
        return cls(reason, where, message, checked_error(obj.get("error")))


@dataclass
class BadDataReport:
    """Counts of everything left out or changed, by reason (JSON via :meth:`to_dict`, read back by
    :meth:`from_dict`).

    ``examples`` keeps the first ``keep`` records (:class:`BadRecord`).

    >>> rep = BadDataReport()
    >>> rep.add(BadRecord("ignored_member", "s.tar:README", "no extension"))
    >>> rep.counts, BadDataReport.from_dict(rep.to_dict()) == rep
    ({'ignored_member': 1}, True)
    """

    counts: dict[str, int] = field(default_factory=dict)
    examples: list[BadRecord] = field(default_factory=list)
    keep: int = 20

    def add(self, record: BadRecord) -> None:
        """Count ``record`` under its reason (and keep it, while fewer than ``keep`` are kept)."""
        self.counts[record.reason] = self.counts.get(record.reason, 0) + 1
        if len(self.examples) < self.keep:
            self.examples.append(record)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict:
        return {
            "counts": dict(sorted(self.counts.items())),
            "total": self.total,
            "examples": [e.to_json() for e in self.examples],
        }

    @classmethod
    def from_dict(cls, d) -> "BadDataReport":
        """The report of :meth:`to_dict` (examples as records, or as the ``[where, reason,
        message]`` lists reports saved before records were typed), every key and type checked: a
        ``ValueError`` otherwise."""
        if not (
            isinstance(d, dict)
            and isinstance(d.get("counts"), dict)
            and isinstance(d.get("examples"), list)
            and all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in d["counts"].items()
            )
        ):
            raise ValueError(
                "a bad-data report: expected {'counts': {reason: int}, 'examples': [...]}"
            )
        examples = []
        for e in d["examples"]:
            if isinstance(e, list) and len(e) == 3 and all(isinstance(x, str) for x in e):
                examples.append(BadRecord(reason=e[1], where=e[0], message=e[2]))
            else:
                examples.append(BadRecord.from_json(e))
        return cls(counts=dict(d["counts"]), examples=examples)


class BadDataGate:
    """Applies a :class:`BadDataPolicy` to a deterministic sequence of good / bad outcomes."""

    def __init__(self, policy: BadDataPolicy, report: BadDataReport | None = None):
        self.policy = policy
        self.report = report if report is not None else BadDataReport()
        self.consecutive = 0

    def good(self) -> None:
        self.consecutive = 0

    def bad(self, record: BadRecord, error: Exception | None = None) -> None:
        """An error record: raise ``error`` (default: the record's typed error,
        :meth:`BadRecord.to_error`; RAISE: with a note naming the ``skip`` policy that would count
        it) or count ``record``; raise :class:`TooManyBadSamplesError` past the limit. Either
        carries ``.report``, what was counted."""
        reason, where = record.reason, record.where
        if self.policy.on_error is OnBadSample.RAISE:
            error = error if error is not None else record.to_error()
            note = (
                f"BadDataPolicy(on_error='skip') would count this as {reason!r} and leave it out "
                f"(loader.report)"
            )
            if hasattr(error, "add_note") and note not in getattr(
                error, "__notes__", ()
            ):  # Python >= 3.11
                error.add_note(note)
            error.report = self.report
            raise error
        self.report.add(record)
        self.consecutive += 1
        if self.policy.warn:
            warnings.warn(
                BadSampleWarning(f"skipped {where} ({reason}): {record.message}"), stacklevel=2
            )
        if self.consecutive >= self.policy.max_consecutive:
            too_many = TooManyBadSamplesError(
                f"{self.consecutive} bad samples in a row (limit "
                f"max_consecutive={self.policy.max_consecutive}); "
                f"last: {where}: {record.message}. Counts so far: {self.report.counts}"
            )
            too_many.report = self.report
            raise too_many from (error if error is not None else record.to_error())
