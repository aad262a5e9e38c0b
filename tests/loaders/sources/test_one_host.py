"""A list of object-store URLs on one host checked as one text (issue #28: a start over 100k
remote shards makes no ``urlsplit`` per URL): the fast path refuses exactly the lists that the
per-URL definition (:func:`shard_identity`) refuses, on lists built to hit what ``urlsplit``
drops or moves (fragments, tabs, carriage returns, empty queries, host case), and its work does
not grow with the list."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prealign.loaders.errors import ConfigError
from prealign.loaders.sources import remote, webdataset
from prealign.loaders.sources.webdataset import check_unique, shard_identity

_STARTS = ["s3://b/", "S3://B/", "s3://b/k/", "http://h:8/", "HTTP://h:8/", "gs://b/p/", "s3://b?/"]
_PIECES = ["a", "A", "0", "1", ".tar", "/", "//", "#", "#x", "?", "?q=1", "\t", "\r", " ", ".."]
_PIECES += ["%2F"]


@st.composite
def _url_lists(draw) -> list[str]:
    starts = draw(st.lists(st.sampled_from(_STARTS), min_size=1, max_size=2))
    urls = []
    for _ in range(draw(st.integers(1, 6))):
        tail = "".join(draw(st.lists(st.sampled_from(_PIECES), min_size=1, max_size=4)))
        urls.append(draw(st.sampled_from(starts)) + tail)
    if draw(st.booleans()):  # (a url twice, maybe written otherwise)
        urls.append(draw(st.sampled_from(urls)))
    return sorted(urls) if draw(st.booleans()) else urls


def _per_url(urls: list[str]) -> bool:
    """The definition: no two urls have one identity."""
    identities = [shard_identity(u) for u in urls]
    return len(set(identities)) == len(identities)


@settings(max_examples=600, deadline=None)
@given(_url_lists())
def test_one_host_refuses_what_the_per_url_definition_refuses(urls):
    if _per_url(urls):
        check_unique(urls)
    else:
        with pytest.raises(ConfigError, match="are one shard"):
            check_unique(urls)


@pytest.mark.parametrize(
    "urls, start",
    [
        (["s3://b/0.tar", "s3://b/d/1.tar"], "s3://b/"),
        (["https://h:9/a?sig=1", "https://h:9/a?sig=2"], "https://h:9/"),
        (["s3://b/0.tar", "S3://b/1.tar"], None),  # (two spellings of one host)
        (["s3://b/0.tar#a", "s3://b/0.tar#b"], None),  # (fragments: dropped)
        (["s3://b/0.tar?", "s3://b/0.tar"], None),  # (an empty query: dropped)
        (["s3://b/0\t.tar", "s3://b/0.tar"], None),  # (a tab: dropped)
        (["/d/0.tar", "/d/1.tar"], None),  # (local paths: their own check)
        (["pipe:cat /d/0.tar", "pipe:cat /d/1.tar"], None),
        (["s3://b"], None),
    ],
)
def test_golden(urls, start):
    text = "".join(u + "\n" for u in urls)
    assert webdataset._one_host(urls, text) == start


def test_a_url_twice_is_named_with_both_positions():
    urls = [f"s3://b/d/s-{i:05d}.tar" for i in range(1000)] + ["s3://b/d/s-00007.tar"]
    with pytest.raises(ConfigError, match=r"position 7\).*position 1000\)"):
        check_unique(urls)


@pytest.mark.parametrize("start", ["s3://bkt/d/", "https://h:8443/p/", "s3://bkt/"])
def test_work_does_not_grow_with_the_list(monkeypatch, start):
    calls = []
    real = webdataset.shard_identity
    monkeypatch.setattr(webdataset, "shard_identity", lambda u: calls.append(u) or real(u))
    for n in (1_000, 100_000):  # nested folders, names of two lengths
        urls = [f"{start}part-{i // 1000}/s-{i % 1000}.tar?v=1" for i in range(n)]
        calls.clear()
        out = webdataset._expanded(urls)[0]
        assert list(out) == urls and len(calls) <= 1, len(calls)


_SCHEMES = ["s3://b/", "S3://b/", "http://h/", "pipe:cat ", "file:///d/", "/d/", "c:/d/", "s3:x/"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_SCHEMES), min_size=1, max_size=5), st.data())
def test_url_schemes_and_sequential_agree_with_each_url(starts, data):
    ends = st.sampled_from(["a.tar", "b.tgz", "c.tar.gz?x", "d?e.tgz"])
    urls = [f"{s}{i}{data.draw(ends)}" for i, s in enumerate(starts)]  # (each shard once)
    text = "".join(u + "\n" for u in urls)
    assert webdataset.url_schemes(urls, text) == {remote.scheme(u) for u in urls}
    source = webdataset.WebDatasetSource(urls)
    assert source.stream_only == any(remote.is_sequential(u) for u in urls)


def test_a_start_over_urls_on_one_store_asks_no_question_of_each(monkeypatch):
    calls = []
    for name in ("scheme", "is_sequential"):
        real = getattr(remote, name)
        monkeypatch.setattr(remote, name, lambda u, real=real: calls.append(u) or real(u))
    for n in (1_000, 100_000):
        calls.clear()
        source = webdataset.WebDatasetSource([f"s3://b/d/s-{i:06d}.tar" for i in range(n)])
        assert source.schemes == {"s3"} and not source.stream_only and len(calls) <= 3, len(calls)


@pytest.mark.parametrize(
    "urls",
    [
        ["s3://b/a.tar", "pipe:cat x\ns3://b/c.tar"],  # (a pipe command of two lines)
        ["http://h/a.tar", "x\nhttp://h/c.tar"],  # (a local path holding a newline)
    ],
)
def test_a_url_holding_a_newline_is_asked_its_own_scheme(urls):
    """Review: the fast path counted lines starting with the first's scheme, so a URL holding a
    newline followed by that scheme passed as one of it: the pipe command was not stream-only."""
    text = "".join(u + "\n" for u in urls)
    assert webdataset.url_schemes(urls, text) == {remote.scheme(u) for u in urls}
    source = webdataset.WebDatasetSource(urls)
    assert source.stream_only == any(remote.is_sequential(u) for u in urls)
