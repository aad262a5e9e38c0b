"""Typed errors of the loader layer. All subclass :class:`prealign.schemas.errors.PrealignError`.

Configuration mistakes are :class:`~prealign.schemas.errors.ConfigError`\ s and bad data
:class:`~prealign.schemas.errors.DataError`\ s (both also ``ValueError``); per-sample problems
subclass :class:`~prealign.schemas.errors.SampleError` and name the sample, the field, what was
expected and what came. I/O, timeout and worker errors are ``OSError`` / ``RuntimeError`` subclasses
and never ``ValueError`` (:data:`SYSTEM_ERRORS`): a transform's ``except ValueError`` does not
swallow them, and no bad-data policy counts one as a bad sample (a shard the source itself finds
unreadable is a shard event of the index pass,
``corrupt_shard`` / ``shard_timeout`` under ``skip``). The tree: ``docs/errors.md``."""

from __future__ import annotations

from prealign.schemas.errors import ConfigError, DataError, PrealignError, SampleError


class PlanError(ConfigError):
    """Invalid planner input or configuration (lengths, budget, dp size, buffer)."""


class OversizeSampleError(SampleError):
    """A sample does not fit a micro-batch of the token budget even alone (``Oversize.ERROR``)."""


class BadSampleError(SampleError):
    """A sample could not be decoded, transformed or validated against the schema.

    ``reason`` is the key a skipped sample is counted under in the
    :class:`~prealign.loaders.policy.BadDataReport` (``"bad_sample"`` unless a subclass or the
    caller says more, e.g. ``"corrupt_image"``); an explicit ``reason`` also prefixes the message,
    so the cause survives being reported as text.
    """

    reason: str = "bad_sample"

    def __init__(
        self,
        *,
        sample,
        field: str | None,
        expected: str,
        actual: str,
        hint: str = "",
        reason: str | None = None,
    ):
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
    """The cause a bad sample is counted under: a :class:`~prealign.schemas.errors.SampleError`'s
    ``reason`` (a non-empty ``str`` or an enum with such a value, e.g.
    :class:`prealign.loaders.media.vlm.MediaError`'s
    :class:`~prealign.loaders.media.vlm.MediaProblem`), else ``"bad_sample"``.

    >>> reason_of(MissingMemberError(sample="k", field="jpg", expected="a member", actual="none"))
    'missing_member'
    >>> bad = BadSampleError(sample=1, field=None, expected="x", actual="y")
    >>> reason_of(KeyError("text")), reason_of(bad)
    ('bad_sample', 'bad_sample')
    """
    reason = getattr(exc, "reason", None) if isinstance(exc, SampleError) else None
    reason = getattr(reason, "value", reason)  # an enum member -> its value
    return reason if isinstance(reason, str) and reason else BadSampleError.reason


class CorruptShardError(PrealignError, OSError):
    """A shard could not be read past some byte offset (truncated or corrupt tar, a member larger
    than the file, unreadable URL): an ``OSError``. When the source finds it while scanning, the
    index pass counts it as a shard event under ``reason`` (``corrupt_shard``) with ``skip``; raised
    anywhere else (a transform, a batch read) it propagates."""

    reason = "corrupt_shard"
    shard = offset = cause = None  # when rebuilt from its message alone (see PrealignError)

    def __init__(self, shard: str, offset: int, cause: str):
        self.shard, self.offset, self.cause = shard, offset, cause
        super().__init__(f"shard {shard}: unreadable at byte {offset}: {cause}")


class ShardTimeoutError(CorruptShardError, TimeoutError):
    """A shard read made no progress within the source's ``read_timeout`` (a FIFO, a hung mount): a
    ``TimeoutError`` (an ``OSError``). Found while scanning, it is counted as ``shard_timeout``
    under ``skip`` (the rest of the shard is lost), raised under ``raise``; anywhere else it
    propagates."""

    reason = "shard_timeout"


class ShardGoneError(BadSampleError):
    """A sample read for a batch whose shard is gone since the index was built (deleted, renamed, no
    longer a regular file): ``.shard`` names it. Bad data like any sample that no longer loads:
    counted under ``missing_shard`` by the ``skip`` policy, raised under ``raise``."""

    reason = "missing_shard"
    shard = None  # when rebuilt from its message alone (see PrealignError)

    def __init__(self, shard: str, where: str, problem: str):
        self.shard = shard
        super().__init__(
            sample=where, field=None, expected=f"shard {shard} as indexed", actual=problem
        )


class CollectiveTimeoutError(PrealignError, TimeoutError):
    """A collective of the loader (the streaming loader's end-of-epoch ``all_reduce``) did not
    complete within its timeout: a peer rank stopped iterating, died or is stuck. Names the group's
    ranks and the position."""


class WorkerError(PrealignError, RuntimeError):
    """A DataLoader worker died (killed by a signal, out of memory) or timed out. The loader stays
    usable: iterate again to continue from its state (the position of the last batch yielded)."""


class UnsupportedTorchError(ConfigError):
    """The installed torch lacks a ``DataLoader`` internal that dead-worker recovery relies on (its
    iterator's worker processes, its shutdown): raised at first use with workers, naming the torch
    version and the attribute, instead of silently not recovering."""


class ShareRecordError(DataError):
    """A shared record or slot (:mod:`prealign.loaders.handoff`) that is malformed or not trusted:
    never served, the rank computes the batch for itself."""


class ShmBudgetError(PrealignError, OSError):
    """A slot would take this process past its shared-memory cap
    (:func:`~prealign.loaders.handoff.slots.shm_cap`): an ``OSError`` too, so every hand-off that
    cannot have a slot (a full ``/dev/shm`` alike) falls back to its copying path."""


class LoaderUsageError(ConfigError):
    """The loader was used in a way it does not support (two iterators at once)."""


class TooManyBadSamplesError(DataError):
    """More consecutive bad samples than ``BadDataPolicy.max_consecutive`` allows."""


class ResumeError(ConfigError):
    """A loader state that cannot be resumed here (other version, dp size, layout, schema, data)."""


class SourceChangedError(DataError):
    """A sample read for a batch no longer matches what the index recorded (data changed on
    disk)."""


class IndexMismatchError(ConfigError):
    """A reused index (sidecars, a saved :class:`~prealign.loaders.index.sample_index.SampleIndex`)
    does not describe the data the loader was given: ``.shard`` names the shard, ``.difference``
    says what differs. Raised when the loader prepares
    (:meth:`~prealign.loaders.loader.PackedLoader.prepare` or first use), before any batch, under
    every bad-data policy (never counted as bad data)."""

    shard = difference = None  # when rebuilt from its message alone (see PrealignError)

    def __init__(self, shard: str | None, difference: str, hint: str = ""):
        self.shard, self.difference = shard, difference
        head = "" if shard is None else f"shard {shard}: "
        super().__init__(f"{head}{difference}" + (f" ({hint})" if hint else ""))


class MissingShardError(IndexMismatchError):
    """A shard named by the source (a path, a URL, a brace range) does not exist or cannot be
    reached: a configuration mistake, raised before the index pass (by
    :func:`~prealign.loaders.index.sidecar.check_source`, with every missing local shard listed),
    never counted as bad data. ``.shard`` is None when several are listed."""


class NotRegularFileError(MissingShardError):
    """A local shard (to index) or sidecar path that is not a regular file: a device such as
    ``/dev/zero``, a FIFO, a socket. The index pass never reads one (it could be endless, or block
    forever)."""


class ChangedShardError(IndexMismatchError):
    """A shard's size or content differs from what its index recorded (re-run ``prealign
    index``)."""


class StaleIndexError(IndexMismatchError):
    """A sidecar index of another format version or transform (the field that differs and the
    ``prealign index`` command that rebuilds it are named), or a malformed one. Never raised for
    another schema: a sidecar describes the data, and any schema reads it."""


class IndexFileError(StaleIndexError):
    """A saved :class:`~prealign.loaders.index.sample_index.SampleIndex` file that is not one (no
    such file, missing or extra keys, wrong dtype or shape, inconsistent lengths, undecodable
    report), or one of other data. Raised with one message (``IndexFileError(message)``; ``.shard``
    is None)."""

    def __init__(self, message: str, difference: str | None = None, hint: str = ""):
        if difference is None:
            super().__init__(None, message, hint)
        else:  # (shard, difference, hint), as the other IndexMismatchError subclasses take
            super().__init__(message, difference, hint)


class ExtraShardError(IndexFileError):
    """The index names a shard the source does not have, or the source a shard the index lacks (an
    index of other data: also an :class:`IndexFileError`)."""


class RemoteReadError(PrealignError, OSError):
    """A remote shard could not be read (after the retries): ``.url`` names it."""

    url = None  # when rebuilt from its message alone (see PrealignError)

    def __init__(self, url: str, message: str):
        self.url = url
        super().__init__(f"{url}: {message}")


class RemoteStallError(RemoteReadError, TimeoutError):
    """A remote read received no byte for longer than ``RemoteOptions.timeout`` seconds (after the
    retries)."""


class RemotePermissionError(ConfigError):
    """The server refused to serve a remote shard (HTTP 401/403, an object store's access denied):
    credentials or permissions, not a missing shard. ``.url``, ``.status`` (None when the client
    gives no HTTP status). A configuration error: raised whatever the bad-data policy, never
    retried."""

    url = status = None  # when rebuilt from its message alone (see PrealignError)

    def __init__(self, url: str, status: int | None, answer: str):
        self.url, self.status = url, status
        super().__init__(
            f"{url}: permission denied: expected the object, the server answered {answer}; check "
            f"the "
            f"credentials (storage_options, a token in the URL) and the object's permissions (S3 "
            f"also answers 403 for an absent object of a bucket the caller cannot list)"
        )


class RangeIgnoredWarning(UserWarning):
    """A server answered a ranged read with the whole object (it ignores ``Range``): emitted once
    per server and process; each object is then downloaded whole once and kept
    (``RemoteOptions.cache_dir``, else a private temporary folder), bounded by
    ``RemoteOptions.cache_limit``."""


SYSTEM_ERRORS: tuple[type[BaseException], ...] = (OSError, RuntimeError)
"""The system errors (I/O, timeouts, dead workers): what no bad-data policy counts as a bad sample,
and what no ``except ValueError`` catches (``issubclass(e, ValueError)`` is False for every prealign
error among them).

>>> issubclass(RemoteStallError, SYSTEM_ERRORS), issubclass(RemoteStallError, ValueError)
(True, False)
"""


# ---- errors as data (a BadRecord's error: written into files, read back by other runs) ----------
_STR = (str, type(None))
_INT = (int, type(None))
_ERROR_KEYS = {
    "shard": {"shard": _STR, "offset": _INT, "cause": _STR},
    "sample": {
        "cls": str,
        "sample": (str, int, type(None)),
        "field": _STR,
        "expected": _STR,
        "actual": _STR,
    },
}
"""The keys an :func:`error_record` of each ``type`` must have, with the types each may hold (None
where an error rebuilt from its message alone has none); ``reason`` and ``message`` (a ``str`` or
None) are optional, and so is a shard's ``cls`` (a ``str``); no other key is allowed."""
_OPTIONAL_KEYS = {"type": str, "cls": str, "reason": _STR, "message": _STR}


def checked_error(rec) -> dict | None:
    """``rec`` when it is None or an :func:`error_record` with the keys its ``type`` needs, each of
    its type (an ``offset`` an ``int``, never a ``bool``), and no other; else a ``ValueError``
    (records are read from files)."""
    if rec is None:
        return None
    kind = rec.get("type") if isinstance(rec, dict) else None
    keys = _ERROR_KEYS.get(kind) if isinstance(kind, str) else None
    if keys is None or not keys.keys() <= rec.keys():
        raise ValueError(
            f"a bad-data record's error: expected a sample or shard error record, got {rec!r:.80}"
        )
    for key, value in rec.items():
        want = keys.get(key, _OPTIONAL_KEYS.get(key))
        if want is None or isinstance(value, bool) or not isinstance(value, want):
            raise ValueError(
                f"a bad-data record's error: key {key!r:.40} of a {kind} error record: expected "
                f"{_type_names(want)}, got {type(value).__name__} {value!r:.40}"
            )
    return rec


def _type_names(want) -> str:
    if want is None:
        return "no such key"
    return " or ".join(t.__name__ for t in (want if isinstance(want, tuple) else (want,)))


def error_record(exc: Exception) -> dict:
    """An exception as JSON-safe data (records are written into sidecars, read by other runs); a
    sample's keeps its cause (:func:`~prealign.loaders.errors.reason_of`) and its message, its
    fields as :func:`checked_error` reads them back (a ``field``, ``expected`` or ``actual`` that is
    not a ``str``, or a sample that is neither ``str`` nor ``int``, as its ``str``)."""
    if isinstance(exc, CorruptShardError):
        return {
            "type": "shard",
            "cls": type(exc).__name__,
            "shard": exc.shard,
            "offset": exc.offset,
            "cause": exc.cause,
            "reason": exc.reason,
        }
    if not isinstance(exc, SampleError):  # sources yield typed errors only; anything else: our bug
        raise TypeError(f"a scan record holds {type(exc).__name__}: {exc}") from exc
    return {
        "type": "sample",
        "cls": type(exc).__name__,
        "sample": exc.sample if type(exc.sample) in (str, int, type(None)) else str(exc.sample),
        "field": _str_or_none(exc.field),
        "expected": _str_or_none(exc.expected),
        "actual": _str_or_none(exc.actual),
        "reason": reason_of(exc),
        "message": str(exc),
    }


def _str_or_none(value) -> str | None:
    return value if value is None or isinstance(value, str) else str(value)


def error_from_record(rec: dict) -> PrealignError:
    """The typed error of an :func:`error_record`: its class when the loader layer defines it (else
    :class:`~prealign.loaders.errors.BadSampleError` /
    :class:`~prealign.loaders.errors.CorruptShardError`), its fields, cause and message; a
    ``ValueError`` for a malformed record (:func:`checked_error`)."""
    checked_error(rec)
    if rec["type"] == "shard":
        shard_cls = globals().get(rec.get("cls", ""))
        if not (isinstance(shard_cls, type) and issubclass(shard_cls, CorruptShardError)):
            shard_cls = CorruptShardError
        return shard_cls(rec["shard"], rec["offset"], rec["cause"])
    cls = globals().get(rec["cls"])
    if not (isinstance(cls, type) and issubclass(cls, SampleError)):
        cls = SampleError if rec["cls"] == "SampleError" else BadSampleError
    fields = {k: rec[k] for k in ("sample", "field", "expected", "actual")}
    try:
        err = cls(**fields)
    except TypeError:  # a class with its own constructor (ShardGoneError): the general one
        err = BadSampleError(**fields)
    err.reason = record_reason(rec)
    if rec.get("message"):
        err.args = (rec["message"],)
    return err


def record_reason(rec: dict) -> str:
    """The cause an :func:`error_record` is counted under in the bad-data report."""
    if rec["type"] == "shard":
        return rec.get("reason") or CorruptShardError.reason
    return rec.get("reason") or BadSampleError.reason
