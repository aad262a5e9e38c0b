"""Hostile RemoteOptions values: a ConfigError at construction naming the option, what was
expected and what came. ``block_size=0`` was a ZeroDivisionError at the first cached read, and an
endless loop appending empty blocks (unbounded memory) on a server that ignores Range; a negative
``retries`` never tried at all; a str ``timeout`` failed deep inside the socket layer."""

from __future__ import annotations

import math

import pytest

from prealign.loaders.sources.remote import RemoteOptions
from prealign.schemas.errors import ConfigError


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("block_size", 0, "an int >= 1"),
        ("block_size", -4096, "an int >= 1"),
        ("block_size", 4096.0, "an int >= 1"),
        ("cache_limit", -1, "an int >= 0"),
        ("cache_limit", "8G", "an int >= 0"),
        ("retries", -1, "an int >= 0"),
        ("retries", True, "an int >= 0"),
        ("stream_shards", 0, "an int >= 1"),
        ("backoff", -0.5, "seconds >= 0"),
        ("backoff", math.nan, "seconds >= 0"),
        ("timeout", "30", "seconds > 0"),
        ("timeout", 0, "seconds > 0"),
        ("timeout", math.inf, "seconds > 0"),
        ("request_deadline", -1.0, "seconds > 0"),
        ("min_rate", -1, "a number >= 0"),
        ("storage_options", "anon=true", "a dict or None"),
        ("cache_dir", 5, "a path or None"),
        ("private_dir", b"/tmp", "a path or None"),
    ],
    ids=lambda v: repr(v) if not isinstance(v, str) or "=" in v or v.isdigit() else v,
)
def test_a_bad_option_is_a_config_error(key, value, expected):
    with pytest.raises(ConfigError, match=f"RemoteOptions.{key}: expected ") as raised:
        RemoteOptions(**{key: value})
    assert expected.split()[-1] in str(raised.value)  # (the bound or kind expected is named)


def test_the_values_in_use_keep_working(tmp_path):
    opts = RemoteOptions(
        cache_dir=str(tmp_path),
        cache_limit=4096,
        block_size=1,
        retries=0,
        backoff=0,
        timeout=0.3,
        request_deadline=0.2,
        min_rate=1,
        stream_shards=1,
        storage_options={"anon": True},
    )
    assert opts.block_size == 1 and RemoteOptions(cache_dir=tmp_path).cache_dir == tmp_path
