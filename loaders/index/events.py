"""Scan events: what the index pass records of each sample of a shard, in stream order.

An event is None for an accepted sample, else the :class:`~prealign.loaders.policy.BadRecord` of a
bad sample, a corrupt shard or an ignored member. Sidecars and merged indexes keep the bad ones as
``[position, record.to_json()]``; :func:`parse_event` reads that form back, and also the form
sidecars and merged indexes of the same format version wrote before records were typed (``["skip",
reason, where, message]``, ``["bad", where, error record]``), so no file needs rebuilding.
"""

from __future__ import annotations

from prealign.loaders.errors import checked_error, error_from_record, record_reason
from prealign.loaders.policy import BadRecord


def parse_event(obj) -> BadRecord:
    """The record of a stored event (:meth:`BadRecord.to_json`'s form, or the older lists), every
    key and type checked: a ``ValueError`` for anything else (events are read from files)."""
    if isinstance(obj, dict):
        return BadRecord.from_json(obj)
    if (
        isinstance(obj, list)
        and len(obj) == 4
        and obj[0] == "skip"
        and all(isinstance(x, str) for x in obj)
    ):
        return BadRecord(obj[1], obj[2], obj[3])
    if isinstance(obj, list) and len(obj) == 3 and obj[0] == "bad" and isinstance(obj[1], str):
        rec = checked_error(obj[2])
        if rec is not None:
            message = rec.get("message")
            if not isinstance(message, str) or not message:
                message = str(error_from_record(rec))
            return BadRecord(record_reason(rec), obj[1], message, rec)
    raise ValueError(f"a scan event: expected a bad-data record, got {str(obj)[:80]}")
