"""Scan events: what the index pass records of each sample, in a JSON-safe form.

An event is ``["ok"]``, ``["bad", where, record]`` or ``["skip", reason, where, message]``. A bad
sample's ``record`` (:func:`error_record`) is plain data because events are written into sidecars
(:mod:`prealign.loaders.index.sidecar`) and read back by other processes and other runs;
:func:`error_from_record` turns one back into the typed error, and :func:`record_reason` gives the
cause it is counted under.
"""
from __future__ import annotations

from prealign.loaders.errors import BadSampleError, CorruptShardError, reason_of
from prealign.schemas.errors import PrealignError, SampleError


def error_record(exc: Exception) -> dict:
    """An exception as JSON-safe data (events are written into sidecars, read by other runs); a sample's
    keeps its cause (:func:`~prealign.loaders.errors.reason_of`) and its message."""
    if isinstance(exc, CorruptShardError):
        return {"type": "shard", "cls": type(exc).__name__, "shard": exc.shard, "offset": exc.offset,
                "cause": exc.cause, "reason": exc.reason}
    if not isinstance(exc, SampleError):  # sources yield typed errors only; anything else is a bug of ours
        raise TypeError(f"a scan record holds {type(exc).__name__}: {exc}") from exc
    return {"type": "sample", "cls": type(exc).__name__, "sample": exc.sample, "field": exc.field,
            "expected": exc.expected, "actual": exc.actual, "reason": reason_of(exc), "message": str(exc)}


def error_from_record(rec: dict) -> PrealignError:
    from prealign.loaders import errors

    if rec["type"] == "shard":
        shard_cls = getattr(errors, rec.get("cls", ""), None)
        if not (isinstance(shard_cls, type) and issubclass(shard_cls, CorruptShardError)):
            shard_cls = CorruptShardError
        return shard_cls(rec["shard"], rec["offset"], rec["cause"])
    cls = getattr(errors, rec["cls"], None)
    if not (isinstance(cls, type) and issubclass(cls, SampleError)):
        cls = SampleError if rec["cls"] == "SampleError" else BadSampleError
    err = cls(sample=rec["sample"], field=rec["field"], expected=rec["expected"], actual=rec["actual"])
    err.reason = record_reason(rec)
    if rec.get("message"):
        err.args = (rec["message"],)
    return err


def record_reason(rec: dict) -> str:
    """The cause a record is counted under in the bad-data report."""
    if rec["type"] == "shard":
        return rec.get("reason") or CorruptShardError.reason
    return rec.get("reason") or BadSampleError.reason
