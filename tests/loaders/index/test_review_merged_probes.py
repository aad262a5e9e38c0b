"""Review: a version-2 merged index (probes as a JSON list) whose probes are not each at most 16
characters is refused, even when their lengths add up to 16 per shard (``["<32 characters>",
""]``: read as one buffer, each shard would be checked against another's probe bytes)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from prealign.loaders import WebDatasetSource
from prealign.loaders.errors import StaleIndexError
from prealign.loaders.index.merged import merge_sidecars, merged_path
from tests.loaders.index.old_sidecars import as_version_3
from tests.loaders.index.test_merged_v3 import _as_version_2
from tests.loaders.index.test_sidecar_lazy import _loader, _shards


def test_probes_that_only_add_up_to_16_characters_a_shard_are_refused(tmp_path):
    paths = _shards(tmp_path, n=3)
    as_version_3(WebDatasetSource(paths))  # (the older probe, as version 2 held)
    merge_sidecars(WebDatasetSource(paths), version=3)  # (made version 2 below)
    path = merged_path(WebDatasetSource(paths))
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    arrays, meta = _as_version_2(arrays, json.loads(arrays["meta"].tobytes().decode()))
    assert [len(p) for p in meta["probes"]] == [16, 16, 16]
    meta["probes"] = [meta["probes"][0] + meta["probes"][1], "", meta["probes"][2]]
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    with pytest.raises(StaleIndexError, match="probes"):
        _loader(paths).prepare()
