"""`prealign inspect mix.json` and `prealign index mix.json` (issue #30): a mixture file's
components, paths relative to the file, the per-component shares and bad samples in the report."""

from __future__ import annotations

import json
import os

from prealign.loaders.cli.main import main
from prealign.loaders.sources.shard_files import sidecar_path
from tests.loader_helpers import sample_lengths, write_shards


def _mixture(tmp_path) -> str:
    write_shards(
        str(tmp_path / "data" / "web"), sample_lengths(60, seed=1, low=4, high=30), num_shards=2
    )
    write_shards(
        str(tmp_path / "data" / "code"), sample_lengths(20, seed=2, low=30, high=90), num_shards=1
    )
    spec = {
        "by": "tokens",
        "components": {
            "web": {"path": "data/web", "weight": 0.7},
            "code": {"path": "data/code/shard-000.tar", "weight": 0.3},
        },
    }
    path = tmp_path / "mix.json"
    path.write_text(json.dumps(spec))
    return str(path)


def test_inspect_a_mixture_file_reports_each_components_share(tmp_path, capsys, monkeypatch):
    path = _mixture(tmp_path)
    monkeypatch.chdir(
        tmp_path / "data"
    )  # relative paths resolve against the file, not the working folder
    rc = main(
        [
            "inspect",
            path,
            "--text",
            "--workers",
            "0",
            "--tp",
            "1",
            "--token-budget",
            "256",
            "--out",
            str(tmp_path / "x.png"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    table = out[out.index("mixture (shares of the tokens)") :]
    rows = {line.split()[0]: line.split() for line in table.splitlines()[2:4]}
    assert set(rows) == {"web", "code"}
    assert abs(float(rows["web"][2]) - 0.7) < 0.05 and abs(float(rows["code"][2]) - 0.3) < 0.05
    assert float(rows["web"][1]) == 0.7 and rows["web"][-1] == "-"


def test_index_a_mixture_file_writes_each_components_sidecars(tmp_path):
    path = _mixture(tmp_path)
    assert main(["index", path, "--workers", "1"]) == 0
    shards = [
        tmp_path / "data" / "web" / "shard-000.tar",
        tmp_path / "data" / "web" / "shard-001.tar",
        tmp_path / "data" / "code" / "shard-000.tar",
    ]
    assert all(os.path.exists(sidecar_path(str(s))) for s in shards)
