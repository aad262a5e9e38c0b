"""``folder_rows``' word-wise folder check and chunked byte counts (issue #28, 100k shards): the
folder columns compared 8 bytes a row at a time (the last word overlapping), a newline or ``/`` in a
name found by counting bytes a chunk at a time; the answer is the one ``line_rows`` then
``one_folder`` give, whatever byte of whichever row differs."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from prealign.loaders.sources import shard_files
from prealign.loaders.sources.shard_files import folder_rows, url_text
from tests.conftest import examples
from tests.loaders.sources.test_folder_rows import agrees


@examples(400)
@given(
    st.integers(1, 23),  # folder length past its leading "/": words, a tail word, or none
    st.integers(1, 9),  # shards
    st.data(),
)
def test_one_changed_byte_anywhere_is_found(depth, count, data):
    parts = data.draw(st.lists(st.sampled_from("ab/"), min_size=depth, max_size=depth))
    folder = "/" + "".join(parts).rstrip("/") + "/"
    urls = [f"{folder}s-{i}.tar" for i in range(count)]
    found = agrees(urls)
    assert found == folder or "//" in folder
    row = data.draw(st.integers(0, count - 1))
    col = data.draw(st.integers(0, len(urls[row]) - 1))
    byte = data.draw(st.sampled_from("c/\n?"))
    urls[row] = urls[row][:col] + byte + urls[row][col + 1 :]
    agrees(urls)


def test_a_slash_or_newline_in_a_name_past_the_first_chunk_is_found():
    count = 2 * shard_files._CHUNK // 20 + 7  # (more than two chunks of text)
    urls = [f"/data/sets/s-{i:07d}.tar" for i in range(count)]
    assert agrees(urls) == "/data/sets/"
    for byte in "/\n":
        bad = list(urls)
        bad[-3] = bad[-3][:-6] + byte + bad[-3][-5:]
        assert agrees(bad) is None


def test_a_long_clean_list_takes_the_fast_path(monkeypatch):
    """More than two chunks of text: the counts add up over every chunk, so the columns are taken
    without the slower search (``line_rows`` not called)."""
    urls = [f"/data/sets/s-{i:07d}.tar" for i in range(2 * shard_files._CHUNK // 20 + 7)]
    text = url_text(urls)
    monkeypatch.setattr(shard_files, "line_rows", None)
    rows, folder = folder_rows(text, len(urls))
    assert folder == "/data/sets/" and rows.shape == (len(urls), len(urls[0]) + 1)


@examples(200)
@given(st.integers(0, 3 * shard_files._CHUNK), st.integers(0, 2**32 - 1))
def test_byte_counts_are_those_of_the_whole_array(size, seed):
    flat = np.random.default_rng(seed).integers(0, 64, size, dtype=np.uint8)
    want = [int(np.count_nonzero(flat == v)) for v in (10, 47)]
    assert shard_files.byte_counts(flat, (10, 47)) == want


@examples(500)
@given(st.sampled_from([8, 9, 12, 15, 16, 17]), st.data())
def test_all_distinct_of_long_names_agrees_with_a_set(width, data):
    """Names of 8 bytes or more (compared as big-endian words, the last overlapping): in any order,
    with repeats, differing in any word; the answer is a set's."""
    name = st.text("ab", min_size=width, max_size=width)
    urls = ["/d/" + n for n in data.draw(st.lists(name, min_size=2, max_size=6))]
    text = url_text(urls)
    rows, folder = folder_rows(text, len(urls))
    assert folder == "/d/"
    assert shard_files.all_distinct(urls, text, rows, folder) == (len(set(urls)) == len(urls))


def test_a_sorted_list_of_long_names_is_found_distinct_by_its_words(monkeypatch):
    urls = [f"/data/s-{i:09d}.tar" for i in range(500)]
    text = url_text(urls)
    rows, folder = folder_rows(text, len(urls))
    answers = []
    words = shard_files._rows_increase
    monkeypatch.setattr(shard_files, "_rows_increase", lambda w: answers.append(words(w)) or True)
    assert shard_files.all_distinct(urls, text, rows, folder) and answers == [True]
