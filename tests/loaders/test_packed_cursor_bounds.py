"""A packed reader cursor (state version 6) is untrusted input: its declared shape is bounded before
anything is inflated or a Python object made per row (review of issue #28)."""

from __future__ import annotations

import base64
import zlib

import pytest

from prealign.loaders.errors import ResumeError
from prealign.loaders.state import pack_cursor, unpack_cursor


def _packed(rows: int, width: int, payload: bytes = b"") -> dict:
    ints = base64.b64encode(zlib.compress(payload)).decode("ascii")
    return {"k": 0, "packed": {"rows": rows, "width": width, "split": [rows], "ints": ints}}


def test_rows_of_width_zero_are_refused_not_made():
    """``rows x width`` bounds the ints, not the rows: width 0 let a 60-byte cursor ask for a list
    of millions of empty records (10**12 of them: the process runs out of memory)."""
    with pytest.raises(ResumeError, match="packed"):
        unpack_cursor(_packed(10**7, 0), "stream.ranks[0].readers[0]")


def test_an_empty_cursor_still_round_trips():
    c = {"k": 3, "buffer": [], "bins": [[], []]}
    assert unpack_cursor(pack_cursor(c), "readers[0]") == c
