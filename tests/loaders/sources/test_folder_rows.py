"""``folder_rows`` (issue #28: a 100k-shard list's fixed columns and one folder in fewer passes)
gives what ``line_rows`` then ``one_folder`` give, for any shard list: lines of one length or not,
one folder or several, names with a ``/``, a newline, a query, non-ASCII."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from prealign.loaders.sources.shard_files import folder_rows, line_rows, one_folder, url_text

_FOLDERS = ["/d/", "/e/", "//d", "/d/x/", "/./", "d/e/", "a:/b", "/", "", "/é/", "/d\n"]
_NAMES = ["a.tar", "b.tar", "c/tar", "a?tar", "..", ".", "", "ar.gz", "a\nb", "é.ta", "/a"]


@settings(max_examples=800, deadline=None)
@given(
    st.lists(st.sampled_from(_FOLDERS), min_size=1, max_size=2),
    st.lists(st.sampled_from(_NAMES), min_size=1, max_size=6),
    st.data(),
)
def test_folder_rows_is_line_rows_then_one_folder(folders, names, data):
    agrees([data.draw(st.sampled_from(folders)) + n for n in names])


def agrees(urls: list[str]) -> str | None:
    """``folder_rows`` of ``urls`` is ``line_rows`` then ``one_folder``; returns the folder."""
    text, n = url_text(urls), len(urls)
    rows, folder = folder_rows(text, n)
    expected = line_rows(text, n)
    assert (rows is None) == (expected is None)
    if rows is not None:
        np.testing.assert_array_equal(rows, expected)
    assert folder == one_folder(text, n, False if expected is None else expected)
    return folder


def test_a_zero_padded_list_takes_the_columns():
    urls = [f"/data/s-{i:06d}.tar" for i in range(1000)]
    rows, folder = folder_rows(url_text(urls), len(urls))
    assert folder == "/data/" and rows.shape == (1000, len(urls[0]) + 1)
    urls[500] = "/dota/s-000500.tar"  # (one folder of the same length differs)
    assert folder_rows(url_text(urls), len(urls))[1] is None
