"""A start over many sidecars checks their values (dim ids, byte ranges, lengths, the tiling)
together, a few numpy calls for all of them (issue #28); a sidecar that fails is still named, with
the message its own parse gives (the start parses each again, in order, when the joint check
fails)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from prealign.loaders import PackedLoader, WebDatasetSource
from prealign.loaders.errors import StaleIndexError
from prealign.loaders.index.header_pass import write_sidecars
from prealign.loaders.index.sidecar import parse_sidecar
from prealign.schemas import ParallelLayout
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import sample_lengths, write_shards

SCHEMA = causal_lm_schema()


def _edit(path: str, edit) -> None:
    with np.load(path) as z:
        arrays = {k: z[k].copy() for k in z.files}
    meta = json.loads(arrays.pop("meta").tobytes())
    edit(arrays, meta)
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    with open(path, "wb") as f:
        f.write(buf.getvalue())


def _swap_rows(a, m):
    a["spans"][[0, 1]] = a["spans"][[1, 0]]


def _past_the_end(a, m):
    a["spans"][-1, 1] = m["size"] + 1


def _dim_id(a, m):
    a["dim_ids"][0] = len(m["dims"])


def _negative_length(a, m):
    a["lengths"][0] = -1


def _gap(a, m):
    a["spans"][1, 0] += 1


@pytest.mark.parametrize(
    "edit,what",
    [
        (_swap_rows, "overlap or are out of order"),
        (_past_the_end, "out of bounds"),
        (_dim_id, "dim_ids outside"),
        (_negative_length, "out of bounds"),
        (_gap, "a gap of"),
    ],
)
def test_a_bad_sidecar_among_many_is_named(tmp_path, edit, what):
    paths = write_shards(str(tmp_path), sample_lengths(60), num_shards=6)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    _edit(paths[4] + ".prealign-index.npz", edit)
    with open(paths[4] + ".prealign-index.npz", "rb") as f:
        with pytest.raises(StaleIndexError, match=what) as own:  # what its own parse says
            parse_sidecar(f.read(), shard=paths[4])
    with pytest.raises(StaleIndexError) as start:
        PackedLoader(
            WebDatasetSource(paths), schema=SCHEMA, layout=ParallelLayout(), token_budget=256
        ).prepare()
    said = (
        str(own.value).split(": ", 1)[1].split(" (re-run")[0]
    )  # its own words, less the fix command
    assert str(start.value).startswith(f"shard {paths[4]}: {said}"), (str(start.value), said)


def test_healthy_sidecars_pass_the_joint_check(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(60), num_shards=6)
    write_sidecars(WebDatasetSource(paths), SCHEMA)
    loader = PackedLoader(
        WebDatasetSource(paths), schema=SCHEMA, layout=ParallelLayout(), token_budget=256, seed=0
    )
    assert sum(len(b["sample_index"]) for b in loader) == 60
