"""A hostile ``preprocessor_config.json`` under ``--processor DIR``: one ``prealign: error:`` line
and exit code 2 naming the file, never a RecursionError traceback, and never a file that is not a
JSON object silently ignored (its settings replaced by Qwen2-VL's defaults)."""

from __future__ import annotations

import pytest

from prealign.loaders.cli.main import main


@pytest.mark.parametrize(
    "text, words",
    [
        ("[" * 100_000, "RecursionError"),
        ("[1, 2]", "got list"),
        ('"min_pixels"', "got str"),
    ],
    ids=["deep", "list", "str"],
)
def test_a_hostile_processor_config_is_one_error_line(text, words, tmp_path, capsys):
    (tmp_path / "rows.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "preprocessor_config.json").write_text(text)
    argv = ["inspect", "--hf", str(tmp_path / "rows.jsonl"), "--processor", str(tmp_path / "proc")]
    argv += ["--tp", "1", "--cp", "1", "--workers", "0", "--out", str(tmp_path / "o.png")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("prealign: error: ")]
    assert len(lines) == 1 and "preprocessor_config.json" in lines[0], err
    assert words in lines[0] and "Traceback" not in err, err
