"""A hostile pass over the loaders' public surface: constructor arguments and options of every
public loader object, mixture weights and names, and the ``prealign`` command's ``--hf`` files, as
a careless user or a broken file would give them. Each case asserts a typed error (a
``ConfigError``, the argument it names, what was expected and what came), never an untyped
exception, a traceback or a silent coercion."""

from __future__ import annotations

import os

import datasets
import pytest

from prealign.loaders import HFSource, Mixture, PackedLoader
from prealign.loaders.cli.main import main
from prealign.loaders.errors import PlanError
from prealign.schemas import ParallelLayout, causal_lm_schema
from prealign.schemas.errors import ConfigError
from tests.loader_helpers import hf_rows, sample_lengths

SCHEMA, LAYOUT = causal_lm_schema(), ParallelLayout()


# ---- prealign inspect --hf FILE: a data file load_dataset cannot read ---------------------------
@pytest.mark.parametrize(
    "name,content",
    [
        ("empty.jsonl", b""),
        ("empty.json", b""),
        ("binary.jsonl", bytes(range(256)) * 8),
        ("binary.csv", bytes(range(256)) * 8),
        ("binary.parquet", bytes(range(256)) * 8),
        ("empty.parquet", b""),
        ("binary.arrow", bytes(range(256)) * 8),
    ],
)
def test_an_unreadable_hf_data_file_is_one_error_line(name, content, tmp_path, capsys):
    path = tmp_path / name
    path.write_bytes(content)
    argv = ["inspect", "--text", "--hf", str(path), "--workers", "0"]
    argv += ["--out", str(tmp_path / "o.png"), "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("prealign: error: ")]
    assert len(lines) == 1 and err.strip().splitlines()[-1] == lines[0], err  # (datasets logs)
    assert f"--hf {path}" in lines[0] and "(hint: " in lines[0], lines[0]
    assert os.path.splitext(name)[1][1:].replace("jsonl", "json") in lines[0]


# ---- Mixture: names and weights ----------------------------------------------------------------
def _hf(n: int = 10, seed: int = 0) -> HFSource:
    return HFSource(datasets.Dataset.from_dict(hf_rows(sample_lengths(n, seed=seed))))


def test_mixture_names_equal_as_str_are_refused_not_merged():
    with pytest.raises(ConfigError, match=r"components: expected distinct names, got \[1, '1'\]"):
        Mixture({1: (_hf(), 1.0), "1": (_hf(seed=1), 2.0)})


def test_mixture_weights_whose_sum_overflows_are_refused_not_an_empty_epoch():
    mix = {"a": (_hf(), 1e308), "b": (_hf(seed=1), 1e308)}
    with pytest.raises(PlanError, match=r"mixture weights: expected a finite sum .* got inf"):
        Mixture(mix)
    mix = Mixture({"a": (_hf(), 1e307), "b": (_hf(seed=1), 1e307)})  # (a finite sum: served)
    loader = PackedLoader(mix, schema=SCHEMA, layout=LAYOUT, token_budget=256)
    assert sum(len(b["sample_index"]) for b in loader) == 20
