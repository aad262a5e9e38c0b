"""A sidecar built for another transform whose recorded ``transform`` (the fields of its key, named
in the error) is not an object is still a :class:`StaleIndexError` naming the shard and the command
that rebuilds it, read one by one or in bulk (a ``TypeError`` / ``AttributeError`` from naming
the field that differs before)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from prealign.loaders import WebDatasetSource
from prealign.loaders.errors import StaleIndexError
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.index.sidecar_bulk import sidecars_merged
from prealign.loaders.index.source_index import check_source
from prealign.loaders.sources.shard_files import SUFFIX
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import sample_lengths, write_shards

SCHEMA = causal_lm_schema()
N = 34  # (>= 32: read in bulk)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    paths = write_shards(
        str(tmp_path_factory.mktemp("t")), sample_lengths(10 * N, seed=6), num_shards=N
    )
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    return paths


@pytest.mark.parametrize("transform", [5, "abc", [1], [[1]], True])
@pytest.mark.parametrize("how", ["one by one", "bulk"])
def test_another_transform_recorded_as_no_object_is_a_stale_index(paths, transform, how):
    with open(paths[1] + SUFFIX, "rb") as f:
        good = f.read()
    with np.load(io.BytesIO(good)) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays["meta"].tobytes())
    meta.update(config="0" * 16, transform=transform)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    try:
        with open(paths[1] + SUFFIX, "wb") as f:
            f.write(buf.getvalue())
        source = WebDatasetSource(paths)
        with pytest.raises(StaleIndexError, match="shard-001.tar.*another transform.*index"):
            check_source(source, SCHEMA) if how == "one by one" else sidecars_merged(source, SCHEMA)
    finally:
        with open(paths[1] + SUFFIX, "wb") as f:
            f.write(good)
