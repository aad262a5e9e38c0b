"""Hints that can be followed (issue #20, item 4): each test takes the advice an error gives,
applies it as a user would (the flag, the argument, the command it names) and checks that the run
then succeeds."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from prealign.loaders import HFSource, PackedLoader, WebDatasetSource
from prealign.loaders.cli.main import main
from prealign.loaders.errors import ChangedShardError, OversizeSampleError
from prealign.loaders.plan.planner import PlannerConfig
from prealign.schemas import ParallelLayout
from prealign.schemas.errors import ConfigError
from prealign.schemas.schema import causal_lm_schema

from .loader_helpers import sample_lengths, write_shards

LAYOUT = ParallelLayout(tp=2, cp=2)


def _cli(capsys, *argv) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().err


def _hint(err: str) -> str:
    match = re.search(r"\(hint: (.*)\)\s*$", err.strip().splitlines()[-1] if err.strip() else "")
    assert match, err
    return match.group(1)


def _inspect(tmp_path, *extra):
    return [
        "inspect",
        "--tp",
        "1",
        "--cp",
        "1",
        "--workers",
        "0",
        "--out",
        str(tmp_path / "p.png"),
        *extra,
    ]


def test_oversize_hint_is_a_budget_and_a_planner_config_that_work(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(20, low=30, high=200), num_shards=1)

    def loader(budget, **kw):
        return PackedLoader(
            WebDatasetSource(paths),
            schema=causal_lm_schema(),
            layout=LAYOUT,
            token_budget=budget,
            **kw,
        )

    with pytest.raises(OversizeSampleError) as exc:
        next(iter(loader(64)))
    hint = str(exc.value)
    budget = int(re.search(r"give token_budget=(\d+)", hint).group(1))
    assert next(iter(loader(budget)))["input_ids"].numel() > 0  # followed: the budget it names
    with pytest.raises(OversizeSampleError):
        next(iter(loader(budget - 1)))  # ... and no less would do
    config = re.search(r"planner=(PlannerConfig\(oversize='truncate'\))", hint).group(1)
    planner = eval(
        config, {"PlannerConfig": PlannerConfig}
    )  # the spelling the hint gives, as written
    assert next(iter(loader(64, planner=planner)))["input_ids"].shape[-1] <= 64


def test_oversize_hint_on_the_command_line_names_flags_that_work(tmp_path, capsys):
    paths = write_shards(str(tmp_path), sample_lengths(20, low=30, high=200), num_shards=1)
    rc, err = _cli(capsys, *_inspect(tmp_path, "--text", "--token-budget", "64", *paths))
    assert rc == 2
    hint = _hint(err)
    budget = re.search(r"--token-budget (\d+)", hint).group(1)
    assert _cli(capsys, *_inspect(tmp_path, "--text", "--token-budget", budget, *paths))[0] == 0
    assert "--oversize truncate" in hint
    assert (
        _cli(
            capsys,
            *_inspect(tmp_path, "--text", "--token-budget", "64", "--oversize", "truncate", *paths),
        )[0]
        == 0
    )


def test_forgotten_text_flag_is_suggested_and_adding_it_works(tmp_path, capsys):
    paths = write_shards(str(tmp_path), sample_lengths(10), num_shards=1)
    for command in (["index"], _inspect(tmp_path)):
        rc, err = _cli(capsys, *command, *paths)
        assert rc == 2 and "add --text" in _hint(err), err
        assert _cli(capsys, *command, "--text", *paths)[0] == 0


def test_misspelt_flag_and_command_get_a_did_you_mean_that_works(tmp_path, capsys):
    paths = write_shards(str(tmp_path), sample_lengths(10), num_shards=1)
    rc, err = _cli(capsys, "index", "--txt", *paths)
    assert rc == 2
    flag = re.search(r"did you mean (--[\w-]+)\?", _hint(err)).group(1)
    assert _cli(capsys, "index", flag, *paths)[0] == 0
    rc, err = _cli(capsys, "indx", "--text", *paths)
    assert rc == 2
    command = re.search(r"did you mean '(\w+)'\?", _hint(err)).group(1)
    assert _cli(capsys, command, "--text", "--force", *paths)[0] == 0


def test_untokenized_hf_rows_get_the_recipe_and_following_it_works():
    import datasets

    rows = datasets.Dataset.from_dict(
        {"prompt": ["the sky is", "two and two"], "response": ["blue", "four"]}
    )
    with pytest.raises(ConfigError, match="tokenize the rows first") as exc:
        HFSource(rows)
    assert "ds.map(tokenize, remove_columns=ds.column_names)" in str(exc.value)

    def tokenize(row):  # a stand-in tokenizer: byte ids; labels -100 on the prompt
        prompt, response = list(row["prompt"].encode()), list(row["response"].encode())
        return {"input_ids": prompt + response, "labels": [-100] * len(prompt) + response}

    ds = rows.map(tokenize, remove_columns=rows.column_names)  # the hint, followed
    batch = next(
        iter(
            PackedLoader(
                HFSource(ds), schema=causal_lm_schema(), layout=ParallelLayout(), token_budget=64
            )
        )
    )
    assert len(batch["sample_index"]) == 2  # each response token is a label, no prompt token is
    assert int(batch["loss_mask"].sum()) == len("blue") + len("four")


def test_changed_shard_hint_rerun_index_works(tmp_path, capsys):
    paths = write_shards(str(tmp_path), sample_lengths(20), num_shards=2)
    assert _cli(capsys, "index", "--text", *paths)[0] == 0
    write_shards(str(tmp_path), sample_lengths(24, seed=5), num_shards=2)  # the data changed since
    with pytest.raises(
        ChangedShardError, match="changed since it was indexed: run `prealign index"
    ) as exc:
        PackedLoader(
            WebDatasetSource(paths), schema=causal_lm_schema(), layout=LAYOUT, token_budget=4096
        ).prepare()
    assert "`prealign index --text --force " in str(
        exc.value
    )  # the command that rebuilds the sidecars
    assert _cli(capsys, "index", "--text", *paths)[0] == 0  # followed
    loader = PackedLoader(
        WebDatasetSource(paths), schema=causal_lm_schema(), layout=LAYOUT, token_budget=4096
    )
    assert len(loader.prepare().index) == 24


@pytest.mark.slow
def test_collators_and_packed_seq_params_print_no_megatron_warnings():
    code = (
        "import torch\nfrom prealign.collate import THDCollator, to_packed_seq_params\n"
        "from prealign.schemas import ParallelLayout\n"
        "from prealign.schemas.schema import causal_lm_schema\n"
        "b = THDCollator(schema=causal_lm_schema(), layout=ParallelLayout())([{'input_ids': "
        "torch.arange(1, 9)}])\nto_packed_seq_params(b)\n"
        "from prealign.schemas.parallel_state import megatron_parallel_sizes\n"
        "try:\n    megatron_parallel_sizes()\nexcept Exception as exc:\n    assert "
        "'initialize_model_parallel' in str(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "default", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "default"},
    )
    assert out.returncode == 0, out.stderr
    assert "Transformer Engine" not in out.stderr and "Warning" not in out.stderr, out.stderr


def test_packed_seq_params_touch_the_warnings_state_only_at_the_first_import(monkeypatch):
    import warnings

    import torch

    from prealign.collate import THDCollator, to_packed_seq_params

    batch = THDCollator(schema=causal_lm_schema(), layout=ParallelLayout())(
        [{"input_ids": torch.arange(1, 9)}]
    )
    to_packed_seq_params(batch)  # megatron-core imported (its import warnings filtered)

    def touched(*args, **kwargs):
        raise AssertionError(
            "warnings.catch_warnings on a training step (process-wide, not thread-safe)"
        )

    monkeypatch.setattr(warnings, "catch_warnings", touched)
    assert to_packed_seq_params(batch).cu_seqlens_q.tolist() == [0, 8]
