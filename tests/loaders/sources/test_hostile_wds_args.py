"""WebDatasetSource arguments of the wrong kind: a ConfigError naming the argument, never a raw
ValueError/TypeError, nor a silent reinterpretation (``required="input_ids"`` iterated into nine
one-letter members every sample then lacked; ``sidecars="no"`` read as True; 2.7 files cut to 2)."""

from __future__ import annotations

import re

import pytest

from prealign.loaders import ShardWriter, WebDatasetSource
from prealign.schemas.errors import ConfigError


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    import numpy as np

    folder = tmp_path_factory.mktemp("wds")
    with ShardWriter(str(folder / "s-%03d.tar"), sidecars=False) as w:
        w.write({"__key__": "a", "input_ids.npy": np.arange(1, 4, dtype=np.int64)})
    return str(folder / "s-000.tar")


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({"max_open_files": "x"}, "max_open_files: expected an int"),
        ({"max_open_files": 2.7}, "max_open_files: expected an int"),
        ({"max_open_files": True}, "max_open_files: expected an int"),
        ({"cache_limit": "8G"}, "cache_limit: expected an int"),
        ({"cache_limit": 2.5}, "cache_limit: expected an int"),
        ({"required": "input_ids"}, "required: expected (a list or tuple of )?member extensions"),
        ({"required": [1]}, "required: expected (a list or tuple of )?member extensions"),
        ({"decoders": [1]}, "decoders: expected a mapping extension"),
        ({"sidecars": "no"}, "sidecars: expected a bool"),
    ],
    ids=lambda v: re.sub(r"\W+", "-", str(v)),
)
def test_an_argument_of_the_wrong_kind_is_a_config_error(shard, kw, expected):
    with pytest.raises(ConfigError, match=expected):
        WebDatasetSource(shard, **kw)


def test_the_arguments_in_use_keep_working(shard):
    src = WebDatasetSource(
        shard, max_open_files=1, cache_limit=1 << 20, required=["input_ids.npy"], sidecars=False
    )
    assert src.max_open_files == 1 and src.required == ("input_ids.npy",)


def test_required_given_as_a_generator_is_read_once(shard):
    src = WebDatasetSource(shard, required=(m for m in ["input_ids.npy"]))
    assert src.required == ("input_ids.npy",)
