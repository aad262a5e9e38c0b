"""A merged index whose ``common`` meta (what every shard's sidecar shares) has no ``config`` (the
transform key a loader compares with its own), or one of another type, is a
:class:`StaleIndexError` naming the file, as a sidecar without it is (a ``KeyError`` from the
comparison before)."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

from prealign.loaders import WebDatasetSource
from prealign.loaders.errors import StaleIndexError
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.index.merged import NAME, merge_sidecars, read_merged
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import sample_lengths, write_shards

SCHEMA = causal_lm_schema()


@pytest.mark.parametrize("version", [3, 4, 5])
@pytest.mark.parametrize("config", ["missing", None, 7, ["k"]])
def test_a_merged_index_without_a_config_is_a_stale_index(tmp_path, version, config):
    paths = write_shards(str(tmp_path / "d"), sample_lengths(30, seed=4), num_shards=3)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    folder = str(tmp_path / "m")
    os.makedirs(folder)
    if version < 5:  # (sidecars of the older probe: what an older prealign merged)
        from tests.loaders.index.old_sidecars import as_version_3

        as_version_3(WebDatasetSource(paths))
    path = merge_sidecars(WebDatasetSource(paths), os.path.join(folder, NAME), version=version)
    with np.load(path["path"]) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays["meta"].tobytes())
    if config == "missing":
        del meta["common"]["config"]
    else:
        meta["common"]["config"] = config
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    with open(path["path"], "wb") as f:
        f.write(buf.getvalue())
    with pytest.raises(StaleIndexError, match=r"merged\.npz"):
        read_merged(WebDatasetSource(paths, index_dir=folder), SCHEMA)
