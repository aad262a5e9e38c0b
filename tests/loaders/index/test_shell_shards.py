"""The shard list of a fix command (``shell_shards``): a numbered run is found by spelling out the
run the first name starts (one format a name; issue #28: a regex match a name cost a start over
2,000 per-shard sidecars 15 ms of its merge advice), with the answer of matching every name."""

from __future__ import annotations

import re
import shlex

from hypothesis import given
from hypothesis import strategies as st

from prealign.loaders.index.hints import shell_shards


def _matching_every_name(urls: list[str]) -> str:
    """The reference: each name matched, the run accepted when heads, tails and widths agree."""
    parts = [re.fullmatch(r"(.*?)(\d+)(\D*)", u) for u in urls]
    if len(urls) > 2 and all(parts):
        heads = {(m.group(1), m.group(3), len(m.group(2))) for m in parts}
        nums = [int(m.group(2)) for m in parts]
        if len(heads) == 1 and nums == list(range(nums[0], nums[0] + len(nums))):
            head, tail, width = heads.pop()
            return shlex.quote(f"{head}{{{nums[0]:0{width}d}..{nums[-1]:0{width}d}}}{tail}")
    return " ".join(shlex.quote(u) for u in urls)


_TEXT = st.text(alphabet="ab/-_. 0123456789", max_size=6)


@st.composite
def _names(draw):
    head, tail = draw(_TEXT), draw(st.text(alphabet="ab/-_. ", max_size=4))
    width, start = draw(st.integers(1, 4)), draw(st.integers(0, 120))
    urls = [f"{head}{n:0{width}d}{tail}" for n in range(start, start + draw(st.integers(0, 14)))]
    if urls and draw(st.booleans()):  # one name changed, dropped or given twice
        i = draw(st.integers(0, len(urls) - 1))
        how = draw(st.sampled_from(["edit", "drop", "twice", "unpadded"]))
        if how == "edit":
            urls[i] = draw(_TEXT)
        elif how == "drop":
            del urls[i]
        elif how == "twice":
            urls.insert(i, urls[i])
        else:
            urls[i] = f"{head}{start + i}{tail}"
    return urls


@given(_names())
def test_shell_shards_gives_what_matching_every_name_gives(urls):
    assert shell_shards(urls) == _matching_every_name(urls)


def test_a_run_past_its_width_is_not_a_range():
    urls = ["d/s-8.tar", "d/s-9.tar", "d/s-10.tar"]
    assert shell_shards(urls) == _matching_every_name(urls) == "d/s-8.tar d/s-9.tar d/s-10.tar"
    assert shell_shards(["d/s-008.tar", "d/s-009.tar", "d/s-010.tar"]) == "'d/s-{008..010}.tar'"
