"""``prealign inspect --hf FILE --split S``: a split the file's dataset lacks is a UsageError that
lists the splits it has and hints one (the split's check is ``hf_files.one_split``, shared with the
mixture file)."""

from __future__ import annotations

import datasets
import pytest

from prealign.loaders.cli.errors import UsageError
from prealign.loaders.cli.preflight import _split


def test_a_split_the_file_lacks_names_those_it_has():
    splits = datasets.DatasetDict(
        {name: datasets.Dataset.from_dict({"a": [1]}) for name in ("train", "val")}
    )
    with pytest.raises(UsageError, match=r"--hf d\.jsonl: .*\['train', 'val'\], got 'test'") as e:
        _split(splits, "test", "d.jsonl")
    assert e.value.hint == "pass --split train"
    assert _split(splits, "val", "d.jsonl") is splits["val"]
    plain = splits["train"]
    assert _split(plain, "anything", "d.jsonl") is plain
