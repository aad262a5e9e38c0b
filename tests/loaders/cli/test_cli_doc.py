"""docs/cli.md shows what the commands print: its sample outputs are the real commands' output,
normalised (timings vary). ``PREALIGN_WRITE_DOCS=1 python -m pytest
tests/loaders/cli/test_cli_doc.py`` rewrites the blocks from a
run instead of comparing them."""

from __future__ import annotations

import os
import pathlib
import re
import shlex

import numpy as np
import pytest

from prealign.loaders.cli import main
from tests import ROOT
from tests.loaders.cli.test_cli import _shard, _tokens

pytest.importorskip("transformers")

DOC = ROOT / "docs" / "cli.md"
WRITE = bool(os.environ.get("PREALIGN_WRITE_DOCS"))
ERRORS = ["prealign demo --tp 0", "prealign inspect data/f32.tar data/g.tar --text"]


def _blocks(text: str) -> list[tuple[int, int]]:
    """(start, end) of every fenced block's body in ``text``."""
    return [(m.start(1), m.end(1)) for m in re.finditer(r"^```\n(.*?)^```$", text, re.S | re.M)]


def _block_of(text: str, marker: str) -> tuple[int, int]:
    return next((a, b) for a, b in _blocks(text) if text[a:b].startswith(marker))


def _check_or_write(marker: str, produced: str, normalise=lambda s: s) -> None:
    text = DOC.read_text()
    a, b = _block_of(text, marker)
    if WRITE:
        DOC.write_text(text[:a] + produced + text[b:])
        return
    assert normalise(text[a:b]) == normalise(produced), (
        "docs/cli.md differs from what the command prints; rewrite it with PREALIGN_WRITE_DOCS=1 "
        "python -m pytest tests/loaders/cli/test_cli_doc.py"
    )


def test_the_error_examples_are_what_the_commands_print(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.makedirs("data")
    _shard("data/f32.tar", {k: v.astype(np.float32) for k, v in _tokens(3, np.int64).items()})
    pathlib.Path("data/g.tar").write_bytes(b"not a tar file " * 100)
    out = []
    for command in ERRORS:
        assert main(shlex.split(command)[1:]) == 2
        err = capsys.readouterr().err
        out += [f"$ {command}"] + [
            ln for ln in err.splitlines() if ln.startswith(("prealign: ", "  "))
        ]
    _check_or_write("$ prealign demo --tp 0", "\n".join(out) + "\n")


_TIMED = [
    (re.compile(r"^(throughput\s+).*$", re.M), r"\1<timed>"),
    (re.compile(r"^(picture\s+).*$", re.M), r"\1<the --out file>"),
]


def _demo_normalised(text: str) -> str:
    for pattern, repl in _TIMED:
        text = pattern.sub(repl, text)
    return text


def _demo_doc_block(out: str) -> str:
    """The demo's stdout as the doc shows it: its table's first two rows, ``...``, its last row."""
    lines = out.rstrip("\n").splitlines()
    rows = [i for i, ln in enumerate(lines) if re.match(r"^\s*\d+\s+\d+\s+\d+\s+\d+", ln)]
    if len(rows) <= 3:
        return "\n".join(lines) + "\n"
    table = [lines[i] for i in rows[:2]] + ["  ..."] + [lines[rows[-1]]]
    return "\n".join(lines[: rows[0]] + table + lines[rows[-1] + 1 :]) + "\n"


@pytest.mark.slow
def test_the_demo_output_is_what_the_demo_prints(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "demo.png")]) == 0
    produced = _demo_doc_block(capsys.readouterr().out)
    _check_or_write("prealign: 240 samples", produced, _demo_normalised)


INDEX = "prealign index --topk 4 'demo-{000000..000001}.tar'"


def _index_normalised(text: str) -> str:
    return re.sub(r"samples in [\d.]+ s\)", "samples in <timed> s)", text)


def test_the_index_example_is_what_the_command_prints(tmp_path, capsys, monkeypatch):
    from prealign.loaders.cli.demo_data import build_demo_dataset

    monkeypatch.chdir(tmp_path)
    build_demo_dataset(".", num_samples=26, samples_per_shard=13, topk=4)
    assert main(shlex.split(INDEX)[1:]) == 0
    err = capsys.readouterr().err.replace("\r", "\n")
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("prealign index [")]
    _check_or_write(f"$ {INDEX}", "\n".join([f"$ {INDEX}"] + lines) + "\n", _index_normalised)
