"""A merged index's shard names against the source's paths (issue #28): where the paths have one
length, the columns past their folder are compared with the names as stored (no list of 100k names,
no text rebuilt); the answer is the one the text comparison gives, for any names; the names and
sizes the index records are made only when read (``source_shards``), and equal the lists."""

from __future__ import annotations

import json
import pickle

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from prealign.loaders.index.merged import _names_text, _same_names, decode_names, encode_names
from prealign.loaders.index.sample_index import LazyList, SampleIndex
from prealign.loaders.policy import BadDataReport
from prealign.loaders.sources.webdataset import WebDatasetSource
from tests.conftest import examples

_NAME = st.text(st.sampled_from("ab0./\n-é"), min_size=1, max_size=4)


def _meta(names: list[str]) -> tuple[dict, np.ndarray]:
    arrays = encode_names(names)
    joined, starts_ends = _names_text(arrays["names"], arrays["name_bytes"])
    meta = {
        "names": LazyList(lambda: decode_names(arrays["names"], arrays["name_bytes"]), len(names)),
        "names_text": joined if starts_ends is None else None,
    }
    return meta, arrays["names"]


@examples(300)
@given(
    st.lists(
        st.sampled_from(["aa.tar", "ab.tar", "ba.tar", "a\n.tar", "a/.tar"]),
        min_size=1,
        max_size=6,
        unique=True,
    ),
    st.lists(_NAME, min_size=1, max_size=6),
)
def test_the_columns_answer_as_the_text_does(shards, names):
    """Fixed-width paths against any names (of other lengths, with newlines, slashes, non-ASCII)
    and against their own names: the column comparison and the text comparison agree."""
    source = WebDatasetSource(
        [f"/d/{s}" for s in shards if "\n" not in s and "/" not in s] or ["/d/aa.tar"]
    )
    for candidate in (names, [u.rsplit("/", 1)[1] for u in source.urls]):
        meta, encoded = _meta(candidate)
        by_columns = _same_names(meta, source, encoded)
        by_text = _same_names(meta, source)  # (no stored names: the text comparison)
        assert by_columns == by_text == (candidate == [u[3:] for u in source.urls])


def test_columns_used_at_one_length_and_one_differing_name_is_found():
    urls = [f"/data/s-{i:05d}.tar" for i in range(1000)]
    source = WebDatasetSource(urls)
    assert source.url_rows() is not None and source.folder == "/data/"
    names = [u[6:] for u in urls]
    meta, encoded = _meta(names)
    assert _same_names(meta, source, encoded)
    assert meta["names"]._items is None  # (no list of names made)
    names[517] = "s-00517.taR"
    meta, encoded = _meta(names)
    assert not _same_names(meta, source, encoded)


def test_lazy_source_shards_equal_the_lists_and_save_as_them(tmp_path):
    made = []
    names = LazyList(lambda: made.append(1) or ["a.tar", "b.tar"], 2)
    sizes = LazyList(lambda: [10, 20], 2)
    assert len(names) == 2 and not made
    index = SampleIndex(
        lengths=np.array([3, 4]),
        locations=np.array([[0, 0, 8, 0], [1, 0, 8, 0]]),
        shards=np.array([0, 1]),
        report=BadDataReport(),
        source_shards={"names": names, "sizes": sizes},
    )
    assert index.source_shards == {"names": ["a.tar", "b.tar"], "sizes": [10, 20]}
    index.save(str(tmp_path / "i.npz"))
    back = SampleIndex.load(str(tmp_path / "i.npz"))
    assert back.source_shards == {"names": ["a.tar", "b.tar"], "sizes": [10, 20]}
    assert json.loads(json.dumps(list(names))) == ["a.tar", "b.tar"] and made == [1]
    again = pickle.loads(pickle.dumps(index))  # (to a DataLoader worker: the lists)
    assert again.source_shards == {"names": ["a.tar", "b.tar"], "sizes": [10, 20]}
    assert type(again.source_shards["names"]) is list
