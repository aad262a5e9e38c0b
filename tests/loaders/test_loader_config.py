"""Both loaders configured alike (issue #27): ``workers=WorkerConfig(...)`` or the flat rank
keywords, the stream's duplicate ``buffer_size=`` / ``oversize=`` keywords deprecated, sample
shaping below both loaders, and the worker's hand-off to its collate_fn a :class:`Fetched`."""

from __future__ import annotations

import ast
import pathlib
import warnings

import pytest

from prealign.loaders import (
    BadDataPolicy,
    HFSource,
    PackedLoader,
    PlannerConfig,
    StreamingPackedLoader,
    WorkerConfig,
)
from prealign.loaders.conformance import batches_equal
from prealign.loaders.errors import PlanError
from prealign.loaders.handoff.fetched import Fetched
from prealign.loaders.plan.schedule import Request
from prealign.schemas import ParallelLayout, causal_lm_schema
from tests import ROOT
from tests.loader_helpers import hf_rows, sample_lengths

SCHEMA, LAYOUT, BUDGET = causal_lm_schema(), ParallelLayout(), 128
STREAM = PlannerConfig(buffer_size=16)
KINDS = {"packed": (PackedLoader, {}), "streaming": (StreamingPackedLoader, {"planner": STREAM})}


@pytest.fixture(scope="module")
def source():
    import datasets

    return HFSource(datasets.Dataset.from_dict(hf_rows(sample_lengths(40, seed=5))))


def _make(kind, src, **kw):
    cls, extra = KINDS[kind]
    return cls(src, schema=SCHEMA, layout=LAYOUT, token_budget=BUDGET, seed=3, **{**extra, **kw})


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_worker_config_is_the_flat_keywords(kind, source):
    cfg = WorkerConfig(dp_rank=1, dp_size=2, cp_rank=None, num_workers=0)
    by_config = _make(kind, source, workers=cfg)
    flat = _make(kind, source, dp_rank=1, dp_size=2)
    assert by_config.workers == flat.workers == cfg
    assert (by_config.dp_rank, by_config.dp_size, by_config.num_workers) == (1, 2, 0)
    assert batches_equal(list(by_config), list(flat))
    assert by_config.state_dict() == flat.state_dict()
    assert _make(kind, source).workers == WorkerConfig()  # the defaults: rank 0 of 1, no workers


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_rank_keyword_beside_a_worker_config_is_given_twice(kind, source):
    for flat in ({"dp_rank": 0}, {"num_workers": 2}, {"dp_size": 1, "cp_rank": 0}):
        with pytest.raises(PlanError, match=f"{next(iter(flat))}.*given twice.*workers="):
            _make(kind, source, workers=WorkerConfig(), **flat)
    with pytest.raises(PlanError, match="workers: expected a WorkerConfig"):
        _make(kind, source, workers={"num_workers": 2})
    with pytest.raises(PlanError, match="dp_rank"):
        _make(kind, source, dp_rank=2, dp_size=2)  # the flat keywords are validated as before


def test_from_parallel_state_keeps_a_worker_configs_workers(source):
    loader = PackedLoader.from_parallel_state(
        source,
        schema=SCHEMA,
        token_budget=BUDGET,
        workers=WorkerConfig(num_workers=2, dp_size=8, dp_rank=7),
    )
    assert loader.workers == WorkerConfig(num_workers=2)  # ranks from the (absent) process groups


@pytest.mark.parametrize("keyword, value", [("buffer_size", 16), ("oversize", "truncate")])
def test_the_streams_duplicate_keywords_are_deprecated(keyword, value, source):
    with pytest.warns(DeprecationWarning, match=f"{keyword}=.*deprecated.*planner=PlannerConfig"):
        legacy = StreamingPackedLoader(
            source, schema=SCHEMA, layout=LAYOUT, token_budget=BUDGET, **{keyword: value}
        )
    assert getattr(legacy.planner, keyword) == getattr(PlannerConfig(**{keyword: value}), keyword)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StreamingPackedLoader(
            source,
            schema=SCHEMA,
            layout=LAYOUT,
            token_budget=BUDGET,
            planner=PlannerConfig(**{keyword: value}),
        )


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }


def test_sample_shaping_lives_below_both_loaders():
    for loader in ("loader.py", "streaming.py"):
        found = _imports(ROOT / "loaders" / loader)
        assert "prealign.loaders.shaping" in found, loader
    assert "prealign.loaders.loader" not in _imports(ROOT / "loaders" / "streaming.py")
    shaping = _imports(ROOT / "loaders" / "shaping.py")
    assert not {"prealign.loaders.loader", "prealign.loaders.streaming"} & shaping


@pytest.mark.parametrize("skip", [False, True])
def test_the_worker_hands_its_collate_fn_a_fetched(skip, source):
    policy = BadDataPolicy(on_error="skip" if skip else "raise", warn=False)
    loader = _make("packed", source, bad_data=policy).prepare()
    dataset, collate = loader._loader.dataset, loader._loader.collate_fn
    fetched = dataset.__getitems__(Request(epoch=0, position=0, indices=(0, 3)))
    assert (
        isinstance(fetched, Fetched)
        and fetched.request.indices == (0, 3)
        and len(fetched.samples) == 2
    )
    assert fetched.skipped == ([] if skip else None) and fetched.share is None
    batch = collate(fetched)
    assert batch["sample_index"].tolist() == [0, 3] and batch["is_filler"] is False
