"""``Lines``: a shard list of one name length read from its text, as the list it was (issue #28:
a source over 100k shards keeps no list of names for the garbage collector to walk)."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prealign.loaders.sources.shard_files import Lines, line_rows, url_text

NAMES = st.integers(1, 12).flatmap(
    lambda width: st.lists(
        st.text("ab/.-_0129", min_size=width, max_size=width), min_size=1, max_size=30
    )
)


@given(NAMES, st.data())
def test_lines_read_as_the_list(names, data):
    text = url_text(names)
    rows = line_rows(text, len(names))
    lines = Lines(text, rows.shape[1])
    assert len(lines) == len(names) and list(lines) == names and lines == names
    i = data.draw(st.integers(-len(names), len(names) - 1))
    assert lines[i] == names[i]
    lo, hi = data.draw(st.integers(0, len(names))), data.draw(st.integers(0, len(names)))
    assert lines[lo:hi] == names[lo:hi]
    assert pickle.loads(pickle.dumps(lines)) == names
    for out in (len(names), -len(names) - 1):
        with pytest.raises(IndexError):
            lines[out]


def test_lines_golden():
    lines = Lines("/d/s-1.tar\n/d/s-2.tar\n", 11)
    assert lines[0] == "/d/s-1.tar" and lines[-1] == "/d/s-2.tar"
    assert lines != ["/d/s-1.tar"] and lines != "/d/s-1.tar\n/d/s-2.tar\n"
    assert repr(lines) == repr(["/d/s-1.tar", "/d/s-2.tar"])
    assert "/d/s-2.tar" in lines and lines.index("/d/s-2.tar") == 1
