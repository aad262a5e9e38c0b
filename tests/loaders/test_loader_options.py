"""PackedLoader's shape: the common call plus small frozen option objects that validate themselves,
and a constructor that does no I/O and no collective (the index pass runs on first use or at
``prepare()``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prealign.loaders import (
    IndexOptions,
    LoadingOptions,
    PackedLoader,
    PlanError,
    ShuffleOptions,
    build_index,
)
from prealign.loaders.sources.source import HFSource
from prealign.schemas import ConfigError, ParallelLayout, causal_lm_schema

datasets = pytest.importorskip("datasets")
SCHEMA = causal_lm_schema()


def _source(calls: list) -> HFSource:
    def transform(row):
        calls.append(1)
        return {"input_ids": torch.tensor(row["input_ids"])}

    rows = [{"input_ids": list(range(1, 2 + i))} for i in range(30)]
    return HFSource(datasets.Dataset.from_list(rows), transform=transform)


def test_the_constructor_reads_nothing_the_first_use_indexes_once(monkeypatch):
    calls: list = []
    loader = PackedLoader(
        _source(calls), schema=SCHEMA, layout=ParallelLayout(cp=2), token_budget=64, cp_rank=1
    )
    assert calls == []  # no sample read, no index pass (so no collective either)
    n = len(loader)
    indexed = len(calls)
    assert n > 1 and indexed >= 30
    assert loader.prepare() is loader and len(calls) == indexed  # idempotent
    assert sum(1 for _ in loader) == n


@pytest.mark.parametrize(
    "first_use", ["len", "iter", "state_dict", "plan", "report", "index", "prepare"]
)
def test_every_first_use_runs_the_index_pass(monkeypatch, first_use):
    import prealign.loaders.loader as loader_mod

    passes = []
    real = loader_mod.build_index
    monkeypatch.setattr(
        loader_mod, "build_index", lambda *a, **k: passes.append(k) or real(*a, **k)
    )
    loader = PackedLoader(
        _source([]),
        schema=SCHEMA,
        layout=ParallelLayout(),
        token_budget=64,
        num_workers=0,
        indexing=IndexOptions(workers=0, distributed=False),
    )
    assert passes == []
    {
        "len": len,
        "iter": lambda x: next(iter(x)),
        "state_dict": lambda x: x.state_dict(),
        "plan": lambda x: x.plan(),
        "report": lambda x: x.report,
        "index": lambda x: x.index,
        "prepare": lambda x: x.prepare(),
    }[first_use](loader)
    assert len(passes) == 1 and passes[0]["distributed"] is False and passes[0]["num_workers"] == 0


@pytest.mark.slow
def test_a_prebuilt_index_skips_the_pass_and_options_reach_the_dataloader():
    calls: list = []
    src = _source(calls)
    index = build_index(src, SCHEMA)
    before = len(calls)
    loader = PackedLoader(
        src,
        schema=SCHEMA,
        layout=ParallelLayout(),
        token_budget=64,
        num_workers=1,
        shuffle=ShuffleOptions(enabled=False),
        indexing=IndexOptions(prebuilt=index),
        loading=LoadingOptions(prefetch_factor=3, timeout=30),
    )
    assert loader.index is index and len(calls) == before
    assert loader._loader.prefetch_factor == 3 and loader._loader.timeout == 30
    assert [b["sample_index"].tolist() for b in loader] == [
        list(r) for r in loader.epoch_samples(0)
    ]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: LoadingOptions(prefetch_factor=0), "prefetch_factor: expected an int >= 1"),
        (lambda: LoadingOptions(timeout=-1), "timeout: expected seconds >= 0"),
        (lambda: LoadingOptions(multiprocessing_context="threads"), "multiprocessing_context"),
        (lambda: LoadingOptions(pin_memory="yes"), "pin_memory: expected True or False"),
        (lambda: ShuffleOptions(window=0), "window: expected an int >= 1"),
        (lambda: IndexOptions(workers=-1), "workers: expected an int >= 0"),
        (lambda: IndexOptions(prebuilt=[1, 2]), "prebuilt: expected a SampleIndex"),
        (
            lambda: PackedLoader(
                _source([]),
                schema=SCHEMA,
                layout=ParallelLayout(),
                token_budget=64,
                loading={"pin_memory": True},
            ),
            "loading: expected a LoadingOptions",
        ),
        (
            lambda: PackedLoader(
                _source([]), schema=SCHEMA, layout=ParallelLayout(cp=2), token_budget=2
            ),
            "token_budget 2 is below",
        ),
    ],
)
def test_options_validate_at_construction(make, message):
    with pytest.raises(PlanError, match=message) as err:
        make()
    assert isinstance(err.value, ConfigError)


def test_options_are_frozen_and_keyword_only():
    opts = LoadingOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.timeout = 5
    with pytest.raises(TypeError):
        ShuffleOptions(False)  # positional: the flag must be named
