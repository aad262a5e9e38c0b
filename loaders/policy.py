"""Declared policies of the loader layer: enums, and the bad-data bookkeeping every skip goes through.

Nothing is dropped silently: a skipped or truncated sample is counted in a :class:`BadDataReport`
(by reason, with the first few samples named) and announced by a :class:`BadSampleWarning`.
"""
from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass, field

from prealign.loaders.errors import PlanError, TooManyBadSamplesError


class PackStrategy(enum.Enum):
    """How the planner fills micro-batches.

    BFD: best-fit decreasing inside the streaming buffer (each sample, largest first, goes to the
    open micro-batch it leaves the least room in). FIRST_FIT: arrival order, first open micro-batch
    that fits. IN_ORDER: next-fit in stream order (a micro-batch closes at the first sample that
    does not fit); the baselines exist for comparison. STEP_FIT: each global step takes the next stretch
    of the stream, first-fit decreasing into its micro-batches (what a mixture plans with: each step holds
    the mixture's shares, :func:`~prealign.loaders.plan.mixing.step_fit`).
    """

    BFD = "bfd"
    FIRST_FIT = "first_fit"
    IN_ORDER = "in_order"
    STEP_FIT = "step_fit"


class Oversize(enum.Enum):
    """A sample that cannot fit the token budget even alone: raise, cut it to fit, or leave it out."""

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
    """``"bfd"`` / ``PackStrategy.BFD`` -> ``PackStrategy.BFD``; anything else -> :class:`PlanError`."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value.lower() if isinstance(value, str) else value)
    except ValueError:
        raise PlanError(f"{name}: expected one of {[m.value for m in cls]}, got {value!r}") from None


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
        if isinstance(self.max_consecutive, bool) or not isinstance(self.max_consecutive, int) \
                or self.max_consecutive < 1:
            raise PlanError(f"max_consecutive: expected an int >= 1, got {self.max_consecutive!r}")

    def to_dict(self) -> dict:
        return {"on_error": self.on_error.value, "max_consecutive": self.max_consecutive}


@dataclass
class BadDataReport:
    """Counts of everything left out or changed, by reason (JSON-friendly via :meth:`to_dict`).

    ``examples`` keeps the first ``keep`` ``(where, reason, message)`` triples.
    """

    counts: dict[str, int] = field(default_factory=dict)
    examples: list[tuple[str, str, str]] = field(default_factory=list)
    keep: int = 20

    def add(self, reason: str, where: str, message: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if len(self.examples) < self.keep:
            self.examples.append((where, reason, message))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict:
        return {"counts": dict(sorted(self.counts.items())), "total": self.total,
                "examples": [list(e) for e in self.examples]}


class BadDataGate:
    """Applies a :class:`BadDataPolicy` to a deterministic sequence of good / bad outcomes."""

    def __init__(self, policy: BadDataPolicy, report: BadDataReport | None = None):
        self.policy = policy
        self.report = report if report is not None else BadDataReport()
        self.consecutive = 0

    def good(self) -> None:
        self.consecutive = 0

    def bad(self, reason: str, where: str, error: Exception) -> None:
        """Raise ``error`` (RAISE: with a note naming the ``skip`` policy that would count it) or count it;
        raise :class:`TooManyBadSamplesError` past the limit. Either carries ``.report``, what was counted."""
        if self.policy.on_error is OnBadSample.RAISE:
            note = (f"BadDataPolicy(on_error='skip') would count this as {reason!r} and leave it out "
                    f"(loader.report)")
            if hasattr(error, "add_note") and note not in getattr(error, "__notes__", ()):  # Python >= 3.11
                error.add_note(note)
            error.report = self.report
            raise error
        self.report.add(reason, where, str(error))
        self.consecutive += 1
        if self.policy.warn:
            warnings.warn(BadSampleWarning(f"skipped {where} ({reason}): {error}"), stacklevel=2)
        if self.consecutive >= self.policy.max_consecutive:
            too_many = TooManyBadSamplesError(
                f"{self.consecutive} bad samples in a row (limit max_consecutive={self.policy.max_consecutive}); "
                f"last: {where}: {error}. Counts so far: {self.report.counts}")
            too_many.report = self.report
            raise too_many from error
