"""The shard list checked as one text (issue #28: a start over 100k shards makes no step per shard
name): each fast path agrees with the per-name definition it replaces, on lists built to hit its
edges (one folder or several, names of one length or not, sorted or not, duplicates, ``.``/``..``,
trailing slashes, queries, URLs)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prealign.loaders.errors import ConfigError
from prealign.loaders.sources.shard_files import (
    all_distinct,
    any_line_ends,
    line_rows,
    one_folder,
    shard_name,
    shard_names,
    url_text,
)
from prealign.loaders.sources.webdataset import WebDatasetSource, check_unique, shard_identity

_FOLDERS = ["/d/", "/d/e/", "/", "//d/", "/d/./", "/d/../e/", "d/", "s3://b/k/", "http://h/x/", ""]
_NAMES = ["a.tar", "b.tar", "a.tar?x=1", ".", "..", "", "sub/c.tar", "0001.tar", "0002.tar"]
_NAMES += ["c.tgz", "d.tar.gz"]


@st.composite
def _url_lists(draw, folders=_FOLDERS, names=_NAMES) -> list[str]:
    folders = draw(st.lists(st.sampled_from(folders), min_size=1, max_size=2))
    names = draw(st.lists(st.sampled_from(names), min_size=1, max_size=6))
    return [draw(st.sampled_from(folders)) + n for n in names]


@settings(max_examples=400, deadline=None)
@given(_url_lists())
def test_shard_names_and_one_folder_agree_with_the_per_name_definition(urls):
    assert shard_names(urls) == [shard_name(u) for u in urls]
    folder = one_folder(url_text(urls), len(urls))
    if folder is not None:  # each url is the folder, then its shard name
        assert all(u == folder + shard_name(u) for u in urls), (folder, urls)


@settings(max_examples=400, deadline=None)
@given(_url_lists(), st.booleans())
def test_all_distinct_and_check_unique_agree_with_a_set(urls, ordered):
    urls = sorted(urls) if ordered else urls
    assert all_distinct(urls, url_text(urls)) == (len(set(urls)) == len(urls))
    identities = [shard_identity(u) for u in urls]
    if len(set(identities)) == len(identities):
        check_unique(urls)
    else:
        with pytest.raises(ConfigError, match="are one shard"):
            check_unique(urls)


# lines of one length (what the fixed-column checks take): folders of one length, names of one
# length, with a "/" inside, ".", "..", an empty name, a query, gzip endings
_SAME_FOLDERS = ["/d/", "/e/", "//d", "/d/x/", "/./", "d/e/", "a:/b"]
_SAME_NAMES = ["a.tar", "b.tar", "c/tar", "b.tgz", "a?tar", "/.tar", "..", ".", "", "ar.gz"]


@settings(max_examples=600, deadline=None)
@given(_url_lists(_SAME_FOLDERS, _SAME_NAMES), st.booleans())
def test_fixed_columns_agree_with_the_searches_of_the_text(urls, ordered):
    urls = sorted(urls) if ordered else urls
    text, n = url_text(urls), len(urls)
    rows = line_rows(text, n)
    assert (rows is not None) == (len({len(u) for u in urls}) == 1)
    fixed = False if rows is None else rows
    folder = one_folder(text, n, fixed)
    assert folder == one_folder(text, n, False)  # (False: the searches of the text)
    distinct = len(set(urls)) == n
    assert all_distinct(urls, text, fixed, folder or "") == distinct
    identities = [shard_identity(u) for u in urls]  # (the path of fixed columns: "." and "..")
    if len(set(identities)) == len(identities):
        check_unique(urls)
    else:
        with pytest.raises(ConfigError, match="are one shard"):
            check_unique(urls)
    for end in (".tar.gz", ".tgz", "gz", "ar.gz"):
        assert any_line_ends(text, end, rows) == (end + "\n" in text), end


def test_fixed_width_rows_see_a_duplicate_and_an_unsorted_list():
    urls = [f"/data/s-{i:05d}.tar" for i in range(1000)]
    assert all_distinct(urls, url_text(urls))
    for bad in (urls + [urls[500]], sorted(urls + [urls[500]]), urls[::-1] + [urls[3]]):
        assert not all_distinct(bad, url_text(bad))
    shuffled = urls[::-1]  # unsorted and distinct: the set says so
    assert all_distinct(shuffled, url_text(shuffled))
    ragged = ["/data/s-1.tar", "/data/s-10.tar", "/data/s-10.tar"]  # of other lengths
    assert not all_distinct(ragged, url_text(ragged))


def test_a_source_over_one_folder_refuses_a_shard_twice_and_keeps_the_folder(tmp_path):
    urls = [os.path.join(str(tmp_path), f"s-{i:03d}.tar") for i in range(50)]
    source = WebDatasetSource(urls, index_dir=str(tmp_path / "idx"))
    assert source.folder == str(tmp_path) + "/"
    assert source.url_text() == url_text(urls)
    for twice in (urls + [urls[7]], urls[:3] + [str(tmp_path) + "/./s-001.tar"]):
        with pytest.raises(ConfigError, match="are one shard"):
            WebDatasetSource(twice, index_dir=str(tmp_path / "idx"))
    # two folders, one file name: an index folder would hold one sidecar for both
    other = [str(tmp_path / "a" / "s.tar"), str(tmp_path / "b" / "s.tar")]
    with pytest.raises(ConfigError, match="same file name"):
        WebDatasetSource(other, index_dir=str(tmp_path / "idx"))
    assert WebDatasetSource(other).folder is None


def test_stream_only_is_found_once_from_the_text(tmp_path):
    folder = str(tmp_path)
    for names, stream in (
        (["a.tar", "b.tar"], False),
        (["a.tar", "b.tar.gz"], True),
        (["a.tgz"], True),
        (["a.gz.tar"], False),
    ):
        source = WebDatasetSource([os.path.join(folder, n) for n in names])
        assert source.stream_only is stream, names
