"""Numeric brace ranges (``"/d/shard-{000000..099999}.tar"``,
``"s3://b/part-{00..99}/s-{0000..0999}.tar"``) expanded with numpy.

The common way to name many webdataset shards: ``prefix{A..B}suffix``, or several such ranges, one
per folder level. :func:`ranges_text` makes the names'
:func:`~prealign.loaders.sources.shard_files.url_text` directly (the digits as uint8 columns, the
text between the ranges and the newline broadcast: a few numpy calls per digit, no Python string per
name), the same text ``braceexpand`` gives, a name a line, in its order (the first range varies
slowest); any other pattern is left to it.
"""

from __future__ import annotations

import math
import re
from typing import Callable

import numpy as np

_RANGE = re.compile(r"\{([0-9]+)\.\.([0-9]+)\}")
"""``{A..B}``: decimal ends."""
_LITERAL = re.compile(r"[^{}\\,\n]*")
"""The text around the ranges: no brace, backslash, comma or newline."""
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


Ranges = tuple[tuple[int, int, int], ...]
"""Each range's ``(A, B, digits)``."""


def numeric_ranges(pattern: str) -> tuple[tuple[str, ...], Ranges] | None:
    """``(literals, ranges)`` when ``pattern`` is ``literals[0]{A..B}literals[1]{C..D}...`` with
    each range ascending, decimal and of names of one width (:func:`range_digits`; at most 18
    digits), ASCII, and no other brace, backslash, comma or newline: ``ranges`` holds each one's
    ``(A, B, digits)``. None for any other pattern (letters, steps, a descending range, lists,
    nesting, escapes, names of other widths): braceexpand expands those.

    >>> numeric_ranges("s3://b/s-{08..10}.tar"), numeric_ranges("s-{8..10}.tar")
    ((('s3://b/s-', '.tar'), ((8, 10, 2),)), None)
    >>> numeric_ranges("p{0..1}/s-{00..09}"), numeric_ranges("s-{0..4..2}.tar")
    ((('p', '/s-', ''), ((0, 1, 1), (0, 9, 2))), None)
    >>> numeric_ranges("{2..1}"), numeric_ranges("s-{a..c}"), numeric_ranges("s.tar")
    (None, None, None)
    """
    if not pattern.isascii():
        return None
    pieces = _RANGE.split(pattern)  # literal, A, B, literal, A, B, ..., literal
    literals = tuple(pieces[::3])
    if len(pieces) < 4 or not all(_LITERAL.fullmatch(t) for t in literals):
        return None
    ranges = []
    for a, b in zip(pieces[1::3], pieces[2::3]):
        lo, hi, digits = int(a), int(b), range_digits(a, b)
        if lo > hi or digits is None or digits > _MAX_DIGITS:
            return None
        ranges.append((lo, hi, digits))
    return literals, tuple(ranges)


def ranges_text(literals: tuple[str, ...], ranges: Ranges) -> tuple[str, int]:
    """``(text, width)``: the names of :func:`numeric_ranges`' answer, the first range varying
    slowest (braceexpand's order), as one text, each name followed by a newline (``width``
    characters a line, its newline included): what ``url_text(list(braceexpand(pattern)))``
    gives. ``uint8 [names, width]`` rows filled a column at a time: the literals broadcast, a
    ``divmod`` per digit.

    >>> ranges_text(("s3://b/s-", ".tar"), ((8, 10, 2),))
    ('s3://b/s-08.tar\\ns3://b/s-09.tar\\ns3://b/s-10.tar\\n', 16)
    >>> ranges_text(("p", "/", ""), ((0, 1, 1), (8, 9, 1)))[0].split()
    ['p0/8', 'p0/9', 'p1/8', 'p1/9']
    """
    counts = [hi - lo + 1 for lo, hi, _ in ranges]
    total = math.prod(counts)
    parts = [t.encode() for t in literals[:-1]] + [literals[-1].encode() + b"\n"]
    width = sum(map(len, parts)) + sum(d for _, _, d in ranges)
    rows = np.empty((total, width), np.uint8)
    at, index, stride = 0, np.arange(total, dtype=np.int64), total
    for part, (lo, _, digits), count in zip(parts, ranges + ((0, 0, 0),), counts + [1]):
        rows[:, at : at + len(part)] = np.frombuffer(part, np.uint8)
        at += len(part)
        if not digits:
            break
        stride //= count
        numbers = index // stride % count + lo
        for k in range(digits):  # (the last digit first: a column per digit)
            numbers, digit = np.divmod(numbers, 10)
            rows[:, at + digits - 1 - k] = digit + ord("0")
        at += digits
    return rows.tobytes().decode("ascii"), width


def keeps_digits(
    name: Callable[[str], str], literals: tuple[str, ...], widths: tuple[int, ...]
) -> bool:
    """``name(literals[0] + D1 + literals[1] + D2 + ...)`` holds the digits ``D1``, ``D2``, ...
    (``widths`` digits each) in order at fixed places whatever they are, so that names of distinct
    digits are distinct: shown on all ``"0"`` and on ``"123..."``. Sound for a ``name`` that
    treats every decimal digit alike (none is a separator it splits at, a character it drops, or
    one it changes: ``shard_identity``'s ``normpath``, ``abspath``, ``urlsplit`` and ``lower``): its
    answer is then one template of copied digits, and two digit strings that differ everywhere
    show where the template copies them.

    >>> keeps_digits(str.upper, ("s3://b/s-", ".tar"), (3,)), keeps_digits(len, ("s-", ""), (3,))
    (True, False)
    >>> keeps_digits(str.upper, ("p", "/s", ""), (1, 2))
    True
    """
    ones = ("123456789" * (sum(widths) // 9 + 1))[: sum(widths)]
    others = [ones[sum(widths[:i]) : sum(widths[: i + 1])] for i in range(len(widths))]

    def filled(holes: list[str]) -> str:
        return "".join(t + d for t, d in zip(literals, holes + [""]))

    a, b = name(filled(["0" * w for w in widths])), name(filled(others))
    if not (isinstance(a, str) and isinstance(b, str)) or len(a) != len(b):
        return False
    moved = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return "".join(a[i] for i in moved) == "0" * len(ones) and "".join(b[i] for i in moved) == ones
