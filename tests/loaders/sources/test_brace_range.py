"""Numeric brace ranges expanded by numpy (issue #28): one range or several (a folder level each),
the same names, text, lines, folder and rows as braceexpand and the path every other pattern takes,
and no work per name in Python."""

from __future__ import annotations

import re
import sys
from unittest import mock

import braceexpand
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prealign.loaders.sources import webdataset
from prealign.loaders.sources.brace_range import numeric_ranges, range_digits
from prealign.loaders.sources.shard_files import Lines
from prealign.schemas.errors import ConfigError

PIECES = ["/", ".", "..", "#", "?", "=", "a", "B", "0", "7", "-", "_", " ", "//", "/../", "/./"]
STARTS = [
    "",
    "/",
    "/data/",
    "s3://bkt/",
    "S3://Bkt/d/",
    "file:///d/",
    "file://",
    "http://h:8/",
    "rel/",
    "./",
    "../",
    "pipe:cat ",
]


def _outcome(urls):
    """``webdataset._expanded(urls)`` as comparable values, or the error it raised."""
    try:
        out, text, folder, rows = webdataset._expanded(urls)
    except (ConfigError, ValueError) as e:
        return ("raised", type(e), str(e))
    return (
        type(out),
        list(out),
        text,
        folder,
        None if rows is None else rows.tobytes(),
        None if rows is None else rows.shape,
    )


def _slow(urls):
    """What ``_expanded`` answers without the range path (braceexpand for every pattern)."""
    with mock.patch.object(webdataset, "numeric_ranges", lambda pattern: None):
        return _outcome(urls)


@st.composite
def ranges(draw, most: int) -> str:
    lo = draw(st.integers(0, 200) | st.integers(0, 10**8 - most - 1))  # (8 digits at most)
    hi = lo + draw(st.integers(0, most))
    a, b = (
        s.zfill(draw(st.integers(len(s), 8)) if draw(st.booleans()) else len(s))
        for s in (str(lo), str(hi))
    )
    return f"{{{a}..{b}}}"


@st.composite
def patterns(draw):
    prefix = draw(st.sampled_from(STARTS)) + "".join(
        draw(st.lists(st.sampled_from(PIECES), max_size=5))
    )
    groups = draw(st.integers(1, 3))
    pieces = [prefix]
    for _ in range(groups):  # (at most ~300 names in all)
        pieces.append(draw(ranges(300 if groups == 1 else 16 if groups == 2 else 5)))
        pieces.append("".join(draw(st.lists(st.sampled_from(PIECES + [".tar"]), max_size=4))))
    return "".join(pieces)


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(patterns())
def test_range_is_braceexpand_and_the_slow_path(pattern):
    names = list(braceexpand.braceexpand(pattern))
    one_width = all(
        range_digits(a, b) is not None for a, b in re.findall(r"\{([0-9]+)\.\.([0-9]+)\}", pattern)
    )
    assert (numeric_ranges(pattern) is not None) == one_width, (pattern, names[:3])
    got = _outcome(pattern)
    assert got == _slow(pattern)
    if got[0] != "raised":
        assert got[1] == names
        if one_width:
            assert got[0] is Lines and got[2] == "".join(n + "\n" for n in names)


@given(st.integers(0, 99999), st.integers(0, 50), st.integers(1, 8), st.integers(1, 8))
@settings(max_examples=300, deadline=None)
def test_width_rule_is_braceexpands(lo, span, wa, wb):
    a, b = str(lo).zfill(wa), str(lo + span).zfill(wb)
    names = list(braceexpand.braceexpand(f"{{{a}..{b}}}"))
    widths = {len(n) for n in names}
    assert range_digits(a, b) == (widths.pop() if len(widths) == 1 else None)


@pytest.mark.parametrize(
    "pattern, names",
    [
        ("/data/shard-{000000..000002}.tar", [f"/data/shard-00000{i}.tar" for i in range(3)]),
        ("{07..10}", ["07", "08", "09", "10"]),
        ("{7..9}", ["7", "8", "9"]),
        ("s-{0..3}", ["s-0", "s-1", "s-2", "s-3"]),
        ("{0..0}", ["0"]),
        ("a{5..5}b", ["a5b"]),
        ("{09..10}", ["09", "10"]),
        ("{007..9}", ["007", "008", "009"]),
        ("s3://b/p/{98..99}.tar", ["s3://b/p/98.tar", "s3://b/p/99.tar"]),
        ("s-{0..1}-{0..1}.tar", ["s-0-0.tar", "s-0-1.tar", "s-1-0.tar", "s-1-1.tar"]),
        ("s-{0..9}{0..1}", [f"s-{i}{j}" for i in range(10) for j in range(2)]),
        ("/d/p{08..10}/s-{00..01}", [f"/d/p{i:02d}/s-{j:02d}" for i in (8, 9, 10) for j in (0, 1)]),
        ("{1..2}{3..3}{4..5}", ["134", "135", "234", "235"]),
    ],
)
def test_golden(pattern, names):
    assert numeric_ranges(pattern) is not None
    out, text, _, rows = webdataset._expanded(pattern)
    assert isinstance(out, Lines) and list(out) == names
    assert text == "".join(n + "\n" for n in names)
    assert rows.shape == (len(names), len(names[0]) + 1)
    assert webdataset.expand_urls(pattern) == names


def _counting(monkeypatch) -> list:
    calls = []
    real = braceexpand.braceexpand

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(braceexpand, "braceexpand", counted)
    return calls


@pytest.mark.parametrize(
    "urls",
    [
        "s-{0..10..2}.tar",  # a step
        "s-{a..c}.tar",  # letters
        "s-{3..1}.tar",  # descending
        "s-{0..1}-{8..10}.tar",  # two groups, one of names of other widths
        "s-{0..1}-{a..b}",
        "s-{1,2}.tar",  # a list
        "s-{x{0..2}}.tar",  # nested
        r"s\{-{0..2}.tar",  # an escape
        "s-{8..10}.tar",  # names of other widths
        "s,{0..2}.tar",
        "s\n{0..2}",
        "s-{0..2}.tär",
        ["a-{0..1}.tar", "b-{0..1}.tar"],  # a list of patterns
        ["a-{0..1}.tar"],
    ],
)
def test_other_patterns_still_go_to_braceexpand(monkeypatch, urls):
    expected = _slow(urls)
    calls = _counting(monkeypatch)
    assert _outcome(urls) == expected
    assert calls


@pytest.mark.parametrize(
    "pattern",
    ["/d/{0..1}/../x.tar", "s3://b/x.tar#{0..1}", "{0..1}/.."]
    + ["/d/{0..1}/../{0..1}", "s3://b/{0..1}#{0..1}"],
)
def test_one_shard_twice_is_still_refused(pattern):
    with pytest.raises(ConfigError, match="are one shard"):
        webdataset._expanded(pattern)
    assert _slow(pattern) == _outcome(pattern)


def _python_calls(fn, *args) -> int:
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        count += event == "call"

    sys.setprofile(profile)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return count


@pytest.mark.parametrize("start", ["/data/shard-", "s3://bkt/d/shard-", "rel/shard-"])
def test_work_does_not_grow_with_the_names(monkeypatch, start):
    calls = _counting(monkeypatch)
    work = {}
    for n in (1_000, 100_000):
        pattern = f"{start}{{000000..{n - 1:06d}}}.tar"
        work[n] = _python_calls(webdataset._expanded, pattern)
        out, text, _, rows = webdataset._expanded(pattern)
        assert len(out) == n and out[n - 1] == f"{start}{n - 1:06d}.tar" and rows.shape[0] == n
    assert not calls  # (braceexpand never asked)
    # (Python calls: a few hundred, none per name; the text's bytes counted a 256 KiB slice at a
    # time, byte_counts, add 4 calls a slice: 32 at 100,000 names, where one call a name is 99,000)
    assert work[1_000] < 300 and work[100_000] - work[1_000] < 99_000 // 1_000, work


def test_rows_are_the_texts_bytes():
    out, text, folder, rows = webdataset._expanded("/d/s-{0098..0101}.tar")
    assert folder == "/d/" and rows.tobytes() == text.encode()
    assert np.array_equal(rows[:, -1], np.full(4, 10, np.uint8))


@pytest.mark.parametrize("start", ["/data/part-", "s3://bkt/d/part-", "rel/part-"])
def test_work_does_not_grow_with_the_names_of_nested_ranges(monkeypatch, start):
    calls = _counting(monkeypatch)
    work = {}
    for parts in (1, 100):  # 1,000 and 100,000 names, a folder of 1,000 each
        pattern = f"{start}{{00..{parts - 1:02d}}}/shard-{{000..999}}.tar"
        work[parts] = _python_calls(webdataset._expanded, pattern)
        out, text, folder, rows = webdataset._expanded(pattern)
        last = f"{start}{parts - 1:02d}/shard-999.tar"
        assert len(out) == 1_000 * parts and out[-1] == last and rows.shape[0] == len(out)
        assert folder == (f"{start}00/" if parts == 1 else None)
    assert not calls  # (braceexpand never asked)
    assert work[1] < 300 and work[100] - work[1] < 99_000 // 1_000, work
