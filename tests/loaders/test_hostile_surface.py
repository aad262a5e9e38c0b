"""A hostile pass over the loaders' public surface: constructor arguments and options of every
public loader object, mixture weights and names, and the ``prealign`` command's ``--hf`` files, as
a careless user or a broken file would give them. Each case asserts a typed error (a
``ConfigError``, the argument it names, what was expected and what came), never an untyped
exception, a traceback or a silent coercion."""

from __future__ import annotations

import os

import pytest

from prealign.loaders.cli.main import main


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
