"""One numeric brace range (``"/d/shard-{000000..099999}.tar"``) expanded with numpy.

The common way to name many webdataset shards: ``prefix{A..B}suffix``. :func:`range_text` makes
the names' :func:`~prealign.loaders.sources.shard_files.url_text` directly (the digits as uint8
columns, prefix, suffix and newline broadcast: a few numpy calls per digit, no Python string per
name), the same text ``braceexpand`` gives, a name a line; any other pattern is left to it.
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np

_RANGE = re.compile(r"([^{}\\,\n]*)\{([0-9]+)\.\.([0-9]+)\}([^{}\\,\n]*)")
"""``prefix{A..B}suffix``: decimal ends, and no brace, backslash, comma or newline around them."""
_MAX_DIGITS = 18
"""Wider numbers are left to braceexpand (int64 holds 18 decimal digits)."""


def range_digits(a: str, b: str) -> int | None:
    """How many digits each name of the range ``{a..b}`` (decimal, ``int(a) <= int(b)``) has, when
    they all have one width; None otherwise. braceexpand's rule: an end (other than ``"0"``) with
    a leading zero pads every number to the wider end's length; else no padding, so the names have
    one width only when both ends have the same number of digits.

    >>> range_digits("000", "099"), range_digits("7", "10"), range_digits("0", "9")
    (3, None, 1)
    >>> range_digits("07", "100"), range_digits("10", "99")
    (3, 2)
    """
    if any(s != "0" and s.startswith("0") for s in (a, b)):
        return max(len(a), len(b))
    return len(a) if len(a) == len(b) else None


def one_range(pattern: str) -> tuple[str, int, int, int, str] | None:
    """``(prefix, A, B, digits, suffix)`` when ``pattern`` is one ascending numeric range
    ``prefix{A..B}suffix`` of names of one width (:func:`range_digits`; ASCII, at most 18 digits);
    None for any other pattern (several groups, letters, steps, a descending range, escapes,
    names of other widths): braceexpand expands those.

    >>> one_range("s3://b/s-{08..10}.tar"), one_range("s-{8..10}.tar")
    (('s3://b/s-', 8, 10, 2, '.tar'), None)
    >>> one_range("s-{0..4..2}.tar"), one_range("{2..1}"), one_range("{0..1}{0..1}")
    (None, None, None)
    """
    m = _RANGE.fullmatch(pattern)
    if m is None or not pattern.isascii():
        return None
    prefix, a, b, suffix = m.groups()
    lo, hi, digits = int(a), int(b), range_digits(a, b)
    if lo > hi or digits is None or digits > _MAX_DIGITS:
        return None
    return prefix, lo, hi, digits, suffix


def range_text(prefix: str, lo: int, hi: int, digits: int, suffix: str) -> tuple[str, int]:
    """``(text, width)``: the names ``prefix + f"{n:0{digits}d}" + suffix`` for ``n`` in
    ``lo..hi`` (:func:`one_range`'s answer) as one text, each name followed by a newline
    (``width`` characters a line, its newline included): what ``url_text(list(braceexpand(
    pattern)))`` gives. ``uint8 [names, width]`` rows filled a column at a time: prefix and suffix
    broadcast, a ``divmod`` per digit.

    >>> range_text("s3://b/s-", 8, 10, 2, ".tar")
    ('s3://b/s-08.tar\\ns3://b/s-09.tar\\ns3://b/s-10.tar\\n', 16)
    """
    head, tail = prefix.encode(), suffix.encode() + b"\n"
    width = len(head) + digits + len(tail)
    rows = np.empty((hi - lo + 1, width), np.uint8)
    rows[:, : len(head)] = np.frombuffer(head, np.uint8)
    rows[:, len(head) + digits :] = np.frombuffer(tail, np.uint8)
    numbers = np.arange(lo, hi + 1, dtype=np.int64)
    for k in range(digits):  # (the last digit first: a column per digit)
        numbers, digit = np.divmod(numbers, 10)
        rows[:, len(head) + digits - 1 - k] = digit + ord("0")
    return rows.tobytes().decode("ascii"), width


def keeps_digits(name: Callable[[str], str], prefix: str, digits: int, suffix: str) -> bool:
    """``name(prefix + D + suffix)`` holds the ``digits`` digits ``D`` in order at one place
    whatever they are, so that names of distinct ``D`` are distinct: shown on ``"000..."`` and
    ``"123..."``. Sound for a ``name`` that treats every decimal digit alike (none is a separator
    it splits at, a character it drops, or one it changes: ``shard_identity``'s ``normpath``,
    ``abspath``, ``urlsplit`` and ``lower``): its answer is then one template of copied digits,
    and two digit strings that differ everywhere show where the template copies them.

    >>> keeps_digits(str.upper, "s3://b/s-", 3, ".tar"), keeps_digits(len, "s-", 3, "")
    (True, False)
    """
    zeros, other = "0" * digits, ("123456789" * (digits // 9 + 1))[:digits]
    a, b = name(prefix + zeros + suffix), name(prefix + other + suffix)
    if not (isinstance(a, str) and isinstance(b, str)) or len(a) != len(b):
        return False
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return a[at : at + digits] == zeros and b == a[:at] + other + a[at + digits :]
